"""``runtime/shared_gpu.HostStagedP2P``: PP messages of ranks that share one GPU, staged through the host.

On CPU the transport stages CPU tensors as it stages CUDA ones on the GPU machines (``staged=("cpu",)``):
torch's own schedules and ours train through it with the losses and parameters of torch's ScheduleGPipe
on plain gloo (the independent reference), on every supported torch — including torch 2.11's
ScheduleZBVZeroBubble, whose start-up handshake sends to the same rank (gloo refuses that; NCCL allows
it), matched in place here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as Fn

from titan_ext.testing import mlp_stages, run_ranks, seeded_batch

DIM, N_MB, STEPS = 16, 4, 2


def _train(rank: int, world: int, kind: str, staged: bool) -> tuple[list[float], list[torch.Tensor]]:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleZBVZeroBubble

    from titan_ext.runtime import PipeMorph
    from titan_ext.testing.shared_gpu import HostStagedP2P

    transport = HostStagedP2P(staged=("cpu",)).install() if staged else None
    try:
        n_stages = 2 * world if kind == "ZBV" else world
        mods = mlp_stages(n_stages, DIM)
        own = [rank, 2 * world - 1 - rank] if kind == "ZBV" else [rank]
        stages = [PipelineStage(mods[s], s, n_stages, torch.device("cpu")) for s in own]
        if kind == "GPipe":
            sched = ScheduleGPipe(stages[0], N_MB, loss_fn=Fn.mse_loss)
        elif kind == "ZBV":
            sched = ScheduleZBVZeroBubble(stages, N_MB, loss_fn=Fn.mse_loss)
        else:
            sched = PipeMorph(stages, N_MB, loss_fn=Fn.mse_loss)
        first = 0 in own
        last = (n_stages - 1) in own
        opt = torch.optim.SGD([p for s in own for p in mods[s].parameters()], lr=0.05)
        losses: list[float] = []
        for k in range(STEPS):
            x, y = seeded_batch(100 + k, 2 * N_MB, DIM)
            out: list = []
            opt.zero_grad()
            kw = {"target": y, "losses": out} if last else {}
            sched.step(x, **kw) if first else sched.step(**kw)
            opt.step()
            losses += [float(v.detach()) for v in out]
        return losses, [p.detach().clone() for s in own for p in mods[s].parameters()]
    finally:
        if transport is not None:
            transport.remove()


def _worker(rank: int, world: int, kind: str) -> dict:
    got_losses, got_params = _train(rank, world, kind, staged=True)
    if kind == "ZBV":  # checked against a single-process run (_v_reference)
        return {"losses": got_losses}
    ref_losses, ref_params = _train(rank, world, "GPipe", staged=False)
    return {"losses": got_losses, "ref_losses": ref_losses,
            "params_equal": all(torch.allclose(a, b, rtol=1e-9, atol=1e-12) for a, b in zip(got_params, ref_params))}


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["PipeMorph", "GPipe"])
def test_one_stage_per_rank_trains_through_host_staging_like_gpipe_on_gloo(kind):
    res = run_ranks(_worker, 2, kind, backend="gloo", timeout_s=120)
    assert all(r["params_equal"] for r in res), kind
    assert res[1]["losses"] == pytest.approx(res[1]["ref_losses"], rel=1e-9) and len(res[1]["losses"]) == STEPS * N_MB


def _v_reference(world: int) -> list[float]:
    """The losses of the same 2·world-stage model trained by one process, microbatch by microbatch
    (no pipelining: an independent reference)."""
    mods = mlp_stages(2 * world, DIM)
    params = [p for m in mods for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.05)
    losses = []
    for k in range(STEPS):
        x, y = seeded_batch(100 + k, 2 * N_MB, DIM)
        opt.zero_grad()
        for xm, ym in zip(x.chunk(N_MB), y.chunk(N_MB)):
            h = xm
            for m in mods:
                h = m(h)
            loss = Fn.mse_loss(h, ym)
            (loss / N_MB).backward()  # torch's schedules scale gradients by 1/microbatches (scale_grads)
            losses.append(float(loss.detach()))
        opt.step()
    return losses


@pytest.mark.multiprocess
def test_zbv_trains_through_host_staging_including_torch_2_11_self_sends():
    res = run_ranks(_worker, 2, "ZBV", backend="gloo", timeout_s=120)
    assert res[0]["losses"] == pytest.approx(_v_reference(2), rel=1e-9)
