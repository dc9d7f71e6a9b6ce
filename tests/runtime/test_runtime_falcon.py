"""Falcon inside the PipeMorph schedule: detection on the agreed iteration time, the slow PP link
localised from the exchanged per-link delays, identical decisions on every rank, and the mitigation
(PipeMorph re-planning) switched on by the ski-rental planner and measured."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as Fn
from torch.distributed.pipelining import PipelineStage

from titan_ext.runtime import PipeMorph
from titan_ext.runtime.falcon import FalconConfig, FalconMonitor, StrategyCosts
from titan_ext.testing import run_ranks, step_rank

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DIM, BATCH = 8, 16


def _worker(rank: int, world: int, n_mb: int, t_ms: float, delay_ms: float, on: int, steps: int):
    from titan_ext.runtime import inject_link_delays
    from titan_ext.testing import SleepComputeStage

    injector = inject_link_delays("")
    # re-planning starts off: the slowdown persists until Falcon's planner switches it on.
    falcon = FalconMonitor(
        FalconConfig(num_microbatches=n_mb, validation_wait_iters=1,
                     costs=StrategyCosts(pipemorph_replan=0.3)),
        pp_groups={f"pp_link{i}": i for i in range(world - 1)},
    )
    mod = SleepComputeStage(DIM, t_ms, t_ms, t_ms, seed=rank)
    sched = PipeMorph(PipelineStage(mod, rank, world, torch.device("cpu")), n_mb, loss_fn=Fn.mse_loss,
                      adaptive=False, falcon=falcon, backward="split")  # no backward probes here
    for k in range(steps):
        if k == on:
            injector.update(f"{world - 2}:{delay_ms:g}")
        g = torch.Generator().manual_seed(k)
        step_rank(sched, rank, world, torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, DIM, generator=g))
    keep = lambda m: {k: v for k, v in m.items() if k.startswith("falcon/") and k != "falcon/detector_us"}  # noqa: E731
    return {"falcon": [keep(m) for m in sched.metrics_history],
            "log": list(sched.decision_log), "adaptive": sched.adaptive}


def test_falcon_in_schedule_detects_localises_and_mitigates():
    world, n_mb, t_ms, delay, on, steps = 4, 16, 5.0, 40.0, 12, 28
    results = run_ranks(_worker, world, n_mb, t_ms, delay, on, steps)
    falcon = results[0]["falcon"]
    # every rank fed identical numbers and took identical decisions
    for r in results[1:]:
        assert r["falcon"] == falcon
    onsets = [i for i, m in enumerate(falcon) if m.get("falcon/event") == "onset"]
    assert onsets and on <= onsets[0] <= on + 6, [(i, m.get("falcon/event")) for i, m in enumerate(falcon)]
    suspicious = [m["falcon/suspicious_groups"] for m in falcon if "falcon/suspicious_groups" in m]
    assert suspicious and f"pp_link{world - 2}" in suspicious[0].split(",")
    causes = [m["falcon/root_cause"] for m in falcon if "falcon/root_cause" in m]
    assert causes and causes[0] == "pp_link"
    applied = [(i, m) for i, m in enumerate(falcon) if "pipemorph_replan" in m.get("falcon/apply", "")]
    assert applied, [sorted(m) for m in falcon[on:]]
    i, m = applied[0]
    assert m["falcon/plan/pp_link"] == world - 2
    # the mitigation was applied: re-planning switched on and an adapted plan deployed afterwards
    assert all(r["adaptive"] for r in results)
    assert any(e["decision"] == "deploy" and e["kind"] == "adaptive" and e["iteration"] >= i
               for e in results[0]["log"]), results[0]["log"]
    effects = [m["falcon/effect/pipemorph_replan"] for m in falcon if "falcon/effect/pipemorph_replan" in m]
    assert effects and effects[0] > 0.1, effects
