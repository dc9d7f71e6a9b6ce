"""Host syncs per steady-state iteration (docs/runtime.md "Host syncs per step").

On a GPU a call that blocks the host on the device (a read of a device tensor, a blocking copy,
``synchronize``, ``Work.wait(timeout)``) drains the host's run-ahead.  The budget: **zero per
steady-state iteration** beyond the once-per-step reads the user's loop makes (the loss, the metrics).
Each schedule runs on two ranks under the ``nccl_rules`` backend, whose placement rules decide which
CPU tensors stand for device tensors; :mod:`titan_ext.testing.host_syncs` counts every host sync
``schedule.step`` + ``optimizer.step`` make on the training thread, by call site.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as Fn

from titan_ext.testing import host_syncs
from titan_ext.testing import counted_sgd_step, mlp_stages, run_ranks, seeded_batch

pytestmark = pytest.mark.timeout(240)

N_MB, DIM, STEPS, WARMUP = 4, 16, 6, 2  # steps 0..1 are start-up (shape inference, first plan)
# PipeMorph with delegation="always" runs in tests/runtime/test_host_runahead.py's module run (the same two ranks
# under nccl_rules, on the lagging device, which also holds the device behind): its steady iterations make
# no host sync, its exchanges at most the device layer's documented wait, which a CPU run never makes.
# Here it cost a third of this module's run (four delegate processes, each importing torch).
SCHEDULES = ("pipemorph", "crosspipe", "torch-1f1b")


def _make(name: str, stage):
    from torch.distributed.pipelining import Schedule1F1B

    from titan_ext.runtime import CrossPipe, PipeMorph

    if name == "pipemorph":
        return PipeMorph(stage, N_MB, loss_fn=Fn.mse_loss)
    if name == "crosspipe":
        return CrossPipe(stage, N_MB, loss_fn=Fn.mse_loss)
    if name == "pipemorph+delegation":
        return PipeMorph(stage, N_MB, delegation="always", loss_fn=Fn.mse_loss)
    return Schedule1F1B(stage, N_MB, loss_fn=Fn.mse_loss)


def _train(rank: int, world: int, name: str) -> dict:
    """STEPS steps; the host syncs of each steady-state step, and of the loop's loss read."""
    from torch.distributed.pipelining import PipelineStage

    mods = mlp_stages(world, DIM)
    schedule = _make(name, PipelineStage(mods[rank], rank, world, torch.device("cpu")))
    opt = torch.optim.SGD(mods[rank].parameters(), lr=0.05)
    steady, loss_reads, losses = [], 0, []
    for k in range(STEPS):
        out, syncs = counted_sgd_step(schedule, opt, rank, world, *seeded_batch(k, 2 * N_MB, DIM))
        with host_syncs.counting() as read:  # the user's once-per-step read of the loss
            losses.append(sum(float(v) for v in out))
        loss_reads = read.total
        if k >= WARMUP:
            steady.append(syncs.sites())
    if getattr(schedule, "delegation", None) is not None:  # an adaptive schedule's transport
        schedule.delegation.close()
    return {"steady": steady, "loss_reads": loss_reads, "losses": losses}


def _budget_worker(rank: int, world: int) -> dict:
    from titan_ext.runtime.comm import timeouts

    out = {name: _train(rank, world, name) for name in SCHEDULES}
    # as every TorchTitan job installs them (titan/registry.py): PP message waits with the job's timeout
    timeouts.install_p2p_timeout()
    timeouts.set_timeout(60.0)
    out["titan-timeouts"] = {name: _train(rank, world, name) for name in ("pipemorph", "torch-1f1b")}
    return out


@pytest.fixture(scope="module")
def budget() -> list[dict]:
    return run_ranks(_budget_worker, 2, backend="nccl_rules", timeout_s=200)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", SCHEDULES)
def test_no_host_sync_in_a_steady_state_iteration(budget, name):
    for rank in (0, 1):
        r = budget[rank][name]
        assert r["steady"] == [[]] * (STEPS - WARMUP), (rank, name, r["steady"])
        assert all(math.isfinite(v) for v in r["losses"])
    # the counter sees device reads: the loop's loss read on the last stage is one per microbatch
    assert budget[1][name]["loss_reads"] == N_MB and budget[0][name]["loss_reads"] == 0


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ("pipemorph", "torch-1f1b"))
def test_pp_message_waits_of_a_titan_job_make_no_host_sync(budget, name):
    """With the p2p timeout every TorchTitan job installs (runtime/comm/timeouts.py): an explicit wait timeout
    busy-waits the host on ProcessGroupNCCL, so on the NCCL-like backend no PP wait may pass one (the
    group timeout and the watchdog bound a frozen peer there), and nothing else may sync either."""
    for rank in (0, 1):
        assert budget[rank]["titan-timeouts"][name]["steady"] == [[]] * (STEPS - WARMUP), (rank, name)


# -- the accounting itself, on the fake CUDA and without processes -----------------------------------
def test_counting_names_each_kind_and_call_site(monkeypatch):
    from _fake_cuda import FakeGPU, install

    from titan_ext.runtime.execute.device import CudaDevice

    gpu = FakeGPU(index=0)
    install(monkeypatch, gpu)
    layer = CudaDevice(torch.device("cuda", 0))
    timer = layer.timer()
    with layer.context():
        timer.begin_iteration()  # start-up: the anchor waits on its own event once
        timer.end_iteration()
        gpu.host_work(1e3)
        with host_syncs.counting() as steady:
            for _ in range(3):  # steady state: events read once complete, no wait
                timer.begin_iteration()
                timer.end_iteration()
                gpu.host_work(1e3)
                assert timer.resolve(block=False)
        with host_syncs.counting() as blocking:
            timer.begin_iteration()
            gpu.kernel(10.0)
            timer.end_iteration()
            timer.resolve(block=True)  # the device is behind: waits on the last event
            torch.cuda.synchronize()
    assert steady.total == 0, steady.sites()
    assert blocking.of_kind("Event.synchronize") == 1 and blocking.of_kind("torch.cuda.synchronize") == 1
    ((_, site),) = [key for key in blocking.by_site if key[0] == "Event.synchronize"]
    assert site.startswith("titan_ext/runtime/execute/device.py:"), site
    # outside a counting block nothing is recorded, and on plain CPU (no nccl_rules) a tensor is the host's
    with host_syncs.counting() as cpu:
        torch.ones(2).sum().item()
    assert cpu.total == 0
