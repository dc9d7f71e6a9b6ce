"""The runtime on a real CUDA GPU (marker ``gpu``; skipped without CUDA).

What only a GPU shows, each against an independent reference:

* the device layer's event timer books a kernel's *device* time — not its host enqueue time and not
  the backlog queued ahead of it (a ``torch.cuda._sleep`` kernel timed alone with two CUDA events is
  the reference), and a non-blocking resolve never waits for the device;
* Falcon's GEMM probe is device-timed (reference: CUDA events around the same matmuls) and its
  emulated slow device (``slowdown``) stretches the device timeline by the asked factor;
* PipeMorph with ``delegation="always"`` trains two pipeline stages on one shared GPU with
  every activation and gradient through the host-staged delegates (real D2H/H2D copies with signal
  flags), with the same losses and parameters as the same plan run on CPU (float64).

Run them with ``bash scripts/check_gpu.sh`` (builds the extension with CUDA first).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as Fn

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def _cuda0() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from titan_ext.runtime._torch_compat import TESTED, missing_internals

    if missing_internals():  # e.g. a GPU image's older torch: the runtime refuses it at import
        pytest.skip(f"torch {torch.__version__} is outside titan_ext's torch{TESTED}: lacks {missing_internals()}")
    return torch.device("cuda", 0)


def _cycles_per_ms(dev: torch.device) -> float:
    """torch.cuda._sleep's cycles per ms on this GPU (timed with CUDA events, fastest of 3)."""
    best = float("inf")
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(10_000_000)
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b))
    return 10_000_000 / best


def test_event_timer_books_device_time_not_enqueue_time_or_backlog():
    from titan_ext.runtime.execute.device import CudaDevice
    from titan_ext.runtime.measure.profiler import ActionRecord

    dev = _cuda0()
    torch.cuda.set_device(dev)
    cpm = _cycles_per_ms(dev)
    backlog_ms, kernel_ms = 150.0, 20.0
    timer = CudaDevice(dev).timer()
    timer.begin_iteration()
    torch.cuda._sleep(int(backlog_ms * cpm))          # the optimizer's backlog, ahead of the action
    rec = ActionRecord("F", 0, 0)
    token = timer.start(rec)
    torch.cuda._sleep(int(kernel_ms * cpm))           # the action's kernel
    timer.stop(rec, token)
    timer.end_iteration()
    assert timer.resolve(block=False) is False        # the device is still busy: no waiting
    assert timer.resolve(block=True)
    booked = 1e3 * (rec.end - rec.start)
    assert abs(booked - kernel_ms) <= 0.1 * kernel_ms, booked
    assert abs(timer.wall_ms - (backlog_ms + kernel_ms)) <= 0.1 * (backlog_ms + kernel_ms), timer.wall_ms


def _probe_worker(rank, world):
    from titan_ext.runtime.falcon.validation import gemm_probe

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    n = 4096
    healthy = gemm_probe(n=n, repeats=5, device=dev)[rank]
    slow = gemm_probe(n=n, repeats=5, device=dev, slowdown=lambda: 3.0)[rank]
    a, b = torch.randn(n, n, device=dev), torch.randn(n, n, device=dev)
    torch.mm(a, b)
    ref = float("inf")
    for _ in range(5):  # the reference: CUDA events around the same matmul
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        torch.mm(a, b)
        e1.record()
        e1.synchronize()
        ref = min(ref, e0.elapsed_time(e1) / 1e3)
    return {"healthy": healthy, "slow": slow, "ref": ref}


def test_gemm_probe_is_device_timed_and_its_slow_device_emulation_stretches_the_device():
    _cuda0()
    from titan_ext.testing import run_ranks

    (r,) = run_ranks(_probe_worker, 1, backend="gloo")
    assert abs(r["healthy"] - r["ref"]) <= 0.25 * r["ref"], r
    assert 2.5 <= r["slow"] / r["healthy"] <= 3.5, r


DIM, BATCH, N_MB, STEPS = 64, 32, 4, 4


def _train(rank, world, device, make):
    from torch.distributed.pipelining import PipelineStage

    from titan_ext.testing import mlp_stages, seeded_batch, sgd_step, static_stage_shapes

    mods = mlp_stages(world, DIM)
    mod = mods[rank].to(device)
    example = torch.zeros(BATCH // N_MB, DIM, dtype=torch.float64, device=device)
    sched = make(PipelineStage(mod, rank, world, device, **static_stage_shapes(example)))
    opt = torch.optim.SGD(mod.parameters(), lr=0.05)
    losses = []
    for k in range(STEPS):
        x, y = (t.to(device) for t in seeded_batch(500 + k, BATCH, DIM))
        losses.append(sgd_step(sched, opt, rank, world, x, y))
    return sched, losses, [p.detach().cpu() for p in mod.parameters()]


def _delegated_worker(rank, world, device="cuda:0"):
    from titan_ext.runtime import PipeMorph

    kw = dict(loss_fn=Fn.mse_loss, adaptive=False)
    _, ref_losses, ref_params = _train(rank, world, torch.device("cpu"), lambda st: PipeMorph(st, N_MB, **kw))
    from titan_ext.testing.shared_gpu import HostStagedP2P

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # every rank shares the one GPU
    # the plan's messages go through the delegates; torch's own start-up handshake (torch < 2.13: CUDA
    # tensors through _batch_p2p) through host staging, as gloo cannot send device memory
    with HostStagedP2P():
        sched, losses, params = _train(rank, world, device, lambda st: PipeMorph(
            st, N_MB, delegation="always", **kw))
    try:
        close = all(torch.allclose(a, b, rtol=1e-9, atol=1e-12) for a, b in zip(params, ref_params))
        flat, ref_flat = sum(losses, []), sum(ref_losses, [])
        return {"counts": dict(sched.delegation.router.counts), "params_close": close,
                "losses_close": len(flat) == len(ref_flat) and all(
                    abs(a - b) <= 1e-9 * max(1.0, abs(b)) for a, b in zip(flat, ref_flat)),
                "losses": flat, "ref": ref_flat}
    finally:
        sched.delegation.close()


def test_delegated_pipemorph_on_one_shared_gpu_trains_like_cpu():
    _cuda0()
    from titan_ext.testing import run_ranks

    for rank, r in enumerate(run_ranks(_delegated_worker, 2, backend="gloo")):
        assert r["counts"] == {"direct": 0, "delegate": 2 * N_MB * STEPS}, (rank, r)
        assert r["params_close"], (rank, r)
        if rank == 1:
            assert r["losses_close"], r
