"""Run-time CrossPipe on gloo/loopback: its initial plan is CrossPipe's greedy plan
for the assumed profile, it re-plans from measured times every check, every plan validates, and
training is numerically identical to torch's ScheduleGPipe."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as Fn
from torch.distributed.pipelining import PipelineStage

from titan_ext.plan import LinkProfile, PipelineProfile, plan_crosspipe
from titan_ext.plan.ir import as_ops
from titan_ext.runtime import CrossPipe, Decision
from titan_ext.testing import gpipe_reference, mlp_stages, run_ranks, seeded_batch

# In the default tier: the core runtime contract (GPipe equivalence, agreement, control plane), ~1 min.
pytestmark = pytest.mark.timeout(300)

DIM, BATCH = 8, 12


def _batch(step: int):
    return seeded_batch(500 + step, BATCH, DIM)


def _step(sched, rank, world, step):
    x, y = _batch(step)
    losses: list = []
    if rank == 0:
        sched.step(x, losses=losses)
    elif rank == world - 1:
        sched.step(target=y, losses=losses)
    else:
        sched.step()
    return [float(v) for v in losses]


class ReplanEveryCheck:
    """Ask for an adaptive re-plan (planner decides) at every check."""

    window = 1
    forces = True

    def decide(self, estimate, deployed_counts, initial_counts, since, slack_floor=2):
        return Decision("force", "re-plan from measurements", mode="adaptive")


def _worker(rank, world, n_mb, steps):
    ref_losses, ref_params = gpipe_reference(rank, world, n_mb, steps, lambda s, k: _step(s, rank, world, k), DIM)
    mods = mlp_stages(world, DIM)
    sched = CrossPipe(PipelineStage(mods[rank], rank, world, torch.device("cpu")), n_mb, loss_fn=Fn.mse_loss,
                      policy=ReplanEveryCheck(), message_bytes=1e6, link_bandwidth_bytes_per_s=1e9)
    initial = {r: [(a.stage_index, a.computation_type.value, a.microbatch_index) for a in acts]
               for r, acts in sched.deployed.actions.items()}
    opt = torch.optim.SGD(mods[rank].parameters(), lr=0.05)
    losses = []
    for k in range(steps):
        opt.zero_grad()
        losses.append(_step(sched, rank, world, k))
        opt.step()
    return {"initial": initial, "losses": losses, "ref_losses": ref_losses, "log": list(sched.decision_log),
            "params": [p.detach().clone() for p in mods[rank].parameters()],
            "ref_params": ref_params}


@pytest.mark.multiprocess
def test_crosspipe_runtime_trains_like_gpipe_and_replans():
    world, n_mb, steps = 3, 6, 5
    results = run_ranks(_worker, world, n_mb, steps)
    # the initial plan is CrossUDSub's greedy plan for the assumed profile (F = I = W = 1 ms, no measured
    # delay; 1 MB messages on 1 GB/s links = 1 ms of bandwidth time each) at PipeMorph's default
    # x_max = 2S − 1 in-flight activations, counted by torch's runtime's rule (held until W)
    links = tuple(LinkProfile(bandwidth_bytes_per_s=1e9, message_bytes=1e6) for _ in range(world - 1))
    expected = plan_crosspipe(PipelineProfile(world, n_mb, 1.0, 1.0, 1.0, links, release="W"), "udsub",
                              memory_limit=2 * world - 1)
    assert results[0]["initial"] == as_ops(expected.actions)
    for res in results:
        assert not [e for e in res["log"] if e["decision"] == "reject"], res["log"]
        assert res["initial"] == results[0]["initial"]
        for p, q in zip(res["params"], res["ref_params"]):
            torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)
    for got, want in zip(results[-1]["losses"], results[-1]["ref_losses"]):
        assert got == pytest.approx(want, rel=1e-9, abs=0)
    # after the first measurements the planner made and deployed a new plan; later checks re-planned
    # (the measured profile is steady, so the greedy plan is the same: "unchanged")
    log = results[0]["log"]
    assert any(e["decision"] == "deploy" and e["kind"] == "forced" for e in log), log
    assert sum(e["kind"] == "forced" for e in log) >= steps - 1, log


def test_selectable_in_torchtitan_as_crosspipe():
    """`pipeline_parallel_schedule = "CrossPipe"` resolves (case-insensitively) to our run-time class, and
    the [titan_ext] knobs reach its constructor as its config (a CrossPipeConfig)."""
    from types import SimpleNamespace

    from titan_ext.runtime import CrossPipe as Runtime
    from titan_ext.runtime.schedules.crosspipe import CrossPipeConfig
    from titan_ext.titan.config import TitanExt
    from titan_ext.titan.options import schedule_kwargs
    from titan_ext.titan.registry import get_schedule_class

    cls = get_schedule_class("crosspipe")
    assert issubclass(cls, Runtime)
    config = schedule_kwargs(Runtime, SimpleNamespace(titan_ext=TitanExt(profile_window=7)))["config"]
    assert isinstance(config, CrossPipeConfig) and config.backward == "split" and config.variant == "udsub"
    assert config.policy_settings.window == 7 and config.adaptive is True
