"""Run time with several stages per rank: 4 gloo ranks × 2 stages, float64, loopback.

One process-group setup (a module fixture) runs every part; the tests assert on its results:

* equivalence: PipeMorph swaps in a different plan every iteration (torch's built-ins for the
  placement, our virtual generator's plans, CrossWave) and its losses and trained parameters equal
  torch's own ScheduleInterleaved1F1B ("loop") / ScheduleZBVZeroBubble ("v") on the same stages
  (rtol 1e-9); so do CrossPipe's (its own planner: CrossWave / the split-backward portfolio);
* adaptation: +200 ms injected on rank link 1 → a re-plan is deployed within 3 iterations, for the
  measured delay, and the new plan is faster than the old one under it (torch-independent simulation
  of both plans, and the measured iteration times);
* the placement is read from the stage indices; any other layout is a one-line error.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as Fn

from titan_ext.plan import PipelineProfile
from titan_ext.plan.builtin import builtin_plan
from titan_ext.plan.ir import as_ops
from titan_ext.plan.virtual import generate_virtual_order, virtual_profile, virtual_stage_to_rank
from titan_ext.runtime.decide.placement import read_layout
from titan_ext.runtime.decide.policy import Decision
from titan_ext.testing import mlp_stages, run_ranks, seeded_batch

# with the 2 cores shared by other jobs (load average 30-40) the adaptation part alone took 180-280 s
pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

R, V, N, DIM, BATCH, STEPS = 4, 2, 8, 8, 16, 7
# The injected delay must stand out of what a busy 2-core host adds to every link reading: with 4 ranks
# and other jobs on the two cores the readings of the healthy links reached 50-160 ms, so at 60 ms the
# policy re-planned for noise (plans already tolerant of ~90 ms on link 1 before the delay came) and the
# plan for the real delay was only 1-2 % faster in the simulator.  At 200 ms the delay dominates.
DELAY_MS, T_MS, ON, ADAPT_STEPS = 200.0, 4.0, 3, 9


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return seeded_batch(1000 + step, BATCH, DIM)


def _step(sched, local: list[int], step: int, dtype=torch.float64) -> list[float]:
    """One step with this rank's share: inputs where stage 0 lives, targets where the last stage does."""
    x, y = (t.to(dtype) for t in _batch(step))
    losses: list = []
    args = (x,) if 0 in local else ()
    kwargs = {"target": y, "losses": losses} if R * V - 1 in local else {}
    sched.step(*args, **kwargs)
    return [float(v.detach()) for v in losses]


def _generator_plan(placement: str, delays: tuple[float, float, float], floor_shift: int) -> dict:
    """Our virtual Alg.3/4 generator's plan for a profile with ``delays`` on the rank links."""
    from titan_ext.plan import LinkProfile
    from titan_ext.plan.virtual import virtual_warmup_counts

    prof = PipelineProfile(R, N, (3.0,) * R, (3.0,) * R, (2.0,) * R, tuple(LinkProfile(latency_ms=d) for d in delays))
    stage_prof, s2r = virtual_profile(prof, V, placement)
    x = [min(N, c + floor_shift) for c in virtual_warmup_counts(stage_prof, s2r)]
    x[-1] = 1
    return generate_virtual_order(stage_prof, s2r, x, [N] * len(x)).order


def _cycle(placement: str) -> list[Decision]:
    """Distinct valid plans for the placement, forced in turn (consecutive ones always differ)."""
    from titan_ext.plan import LinkProfile
    from titan_ext.plan.crosspipe import plan_crosspipe

    names = ("Interleaved1F1B", "InterleavedZeroBubble") if placement == "loop" else ("ZBVZeroBubble", "DualPipeV")
    plans = [("torch " + n, builtin_plan(n, R, N)[0]) for n in names]
    plans += [("ours, no delay", _generator_plan(placement, (0, 0, 0), 0)),
              ("ours, 40 ms on link 1", _generator_plan(placement, (0, 40, 0), 0)),
              ("ours, wide warm-up", _generator_plan(placement, (0, 0, 0), 3))]
    if placement == "v":
        links = (LinkProfile(latency_ms=30), LinkProfile(), LinkProfile())
        prof = PipelineProfile(R, N, (3.0,) * R, (3.0,) * R, (2.0,) * R, links)
        stage_prof, _ = virtual_profile(prof, V, "v")
        plans.append(("CrossWave, 30 ms on link 0", plan_crosspipe(stage_prof, "wave", validate=False).actions))
    return [Decision("force", name, actions=plan) for name, plan in plans]


class CyclePolicy:
    window = 1
    forces = True

    def __init__(self, placement: str):
        self.cycle, self.k, self.schedule = _cycle(placement), 0, None

    def decide(self, estimate, deployed_counts, initial_counts, since, slack_floor=2):
        from titan_ext.runtime.control.deploy import plan_hash

        self.k += 1
        decision = self.cycle[(self.k - 1) % len(self.cycle)]
        if self.schedule is not None and plan_hash(decision.actions) == self.schedule.deployed.hash:
            self.k += 1  # the initial plan may be one of the cycle's (torch's own under torch's memory rule)
            decision = self.cycle[(self.k - 1) % len(self.cycle)]
        return decision


def _cycling(stages, placement: str) -> object:
    from titan_ext.runtime import PipeMorph

    policy = CyclePolicy(placement)
    sched = PipeMorph(stages, N, loss_fn=Fn.mse_loss, policy=policy)
    policy.schedule = sched
    return sched


def _equivalence(rank: int, placement: str) -> dict:
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble

    from titan_ext.runtime import CrossPipe

    S = R * V
    s2r = virtual_stage_to_rank(R, V, placement)
    local = [s for s in range(S) if s2r[s] == rank]

    def train(make, steps):
        mods = mlp_stages(S, DIM)
        stages = [PipelineStage(mods[s], s, S, torch.device("cpu")) for s in local]
        sched = make(stages)
        params = [p for s in local for p in mods[s].parameters()]
        opt = torch.optim.SGD(params, lr=0.05)
        losses, versions, hashes = [], [], []
        for k in range(steps):
            versions.append(getattr(sched, "plan_version", 0))
            hashes.append(sched.deployed.hash if hasattr(sched, "deployed") else 0)
            opt.zero_grad()
            losses.append(_step(sched, local, k))
            opt.step()
        log = list(getattr(sched, "decision_log", []))
        return losses, [p.detach().clone() for p in params], versions, hashes, log

    torch_cls = ScheduleInterleaved1F1B if placement == "loop" else ScheduleZBVZeroBubble
    ref = train(lambda st: torch_cls(st, N, loss_fn=Fn.mse_loss), STEPS)
    ours = train(lambda st: _cycling(st, placement), STEPS)
    # CrossPipe with its own planner (CrossWave for "v", the split-backward portfolio for "loop")
    crosspipe = train(lambda st: CrossPipe(st, N, loss_fn=Fn.mse_loss), STEPS)
    init = [p.detach().clone() for s in local for p in mlp_stages(S, DIM)[s].parameters()]
    return {"ref": ref, "ours": ours, "crosspipe": crosspipe, "init": init, "local": local}


def _adaptation(rank: int) -> dict:
    from torch.distributed.pipelining import PipelineStage

    from titan_ext.runtime import PipeMorph, inject_link_delays
    from titan_ext.testing import SleepComputeStage

    S = R * V
    s2r = virtual_stage_to_rank(R, V, "v")
    local = [s for s in range(S) if s2r[s] == rank]
    injector = inject_link_delays("")
    stages = [PipelineStage(SleepComputeStage(DIM, T_MS, T_MS, T_MS, seed=s), s, S, torch.device("cpu"))
              for s in local]
    sched = PipeMorph(stages, N, loss_fn=Fn.mse_loss)
    plans = []
    for k in range(ADAPT_STEPS):
        if k == ON:
            injector.update(f"1:{DELAY_MS:g}")
        plans.append({r: list(a) for r, a in sched.pipeline_order.items()})
        _step(sched, local, k, torch.float32)
    injector.update("")
    return {"log": list(sched.decision_log), "metrics": list(sched.metrics_history), "plans": plans,
            "layout": sched.layout}


def _worker(rank: int, world: int) -> dict:
    return {"loop": _equivalence(rank, "loop"), "v": _equivalence(rank, "v"), "adapt": _adaptation(rank)}


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, R)


@pytest.mark.parametrize("placement", ["loop", "v"])
def test_equivalence_with_torch_multi_stage_schedule_under_a_new_plan_every_iteration(results, placement):
    for rank, res in enumerate(results):
        part = res[placement]
        ref_losses, ref_params = part["ref"][0], part["ref"][1]
        losses, params, versions, hashes, log = part["ours"]
        # a different plan ran in every iteration from the second on, the same one on every rank
        assert len(set(versions[1:])) == STEPS - 1, versions
        assert all(a != b for a, b in zip(hashes[1:], hashes[2:])), hashes
        assert hashes == results[0][placement]["ours"][3]
        assert not [e for e in log if e["decision"] == "reject"]
        for p, q in zip(params, ref_params):
            torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)
        assert max((p - q).abs().max().item() for p, q in zip(params, part["init"])) > 1e-3  # training moved them
        for got, want in zip(losses, ref_losses):
            assert got == pytest.approx(want, rel=1e-9, abs=0)
        if R * V - 1 in part["local"]:
            assert len(losses) == STEPS and all(len(x) == N for x in losses)
        # CrossPipe: same numbers, its plans deployed (calibrated from measurements), none rejected
        cp_losses, cp_params, cp_versions, _, cp_log = part["crosspipe"]
        assert cp_versions[-1] >= 2 and not [e for e in cp_log if e["decision"] == "reject"], cp_log
        for p, q in zip(cp_params, ref_params):
            torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)
        for got, want in zip(cp_losses, ref_losses):
            assert got == pytest.approx(want, rel=1e-9, abs=0)


def _planned_link1_ms(reason: str) -> float:
    """The delay a re-plan's reason says it planned for on rank link 1 ("rank link 1: c 13.0 -> 200.2 ms"),
    0 where it does not name that link."""
    import re

    found = re.search(r"rank link 1: c -?[0-9.]+ -> (-?[0-9.]+) ms", reason)  # placement.py: "{a:.1f} -> {b:.1f}"
    return float(found.group(1)) if found else 0.0


def test_adapts_to_200ms_on_a_rank_link_within_3_iterations(results):
    """The re-plan *for the delay* is the first adaptive deploy from the onset whose estimate of link 1
    reaches the delay: under host load the policy also re-plans for noise (a link reading of 13 ms where
    5 were), and such a plan, deployed between the onset and the estimate catching up, is no answer to
    the delay."""
    from titan_ext.plan.simulate import simulate

    res = results[0]["adapt"]
    layout = res["layout"]
    assert (layout.placement, layout.stages_per_rank) == ("v", 2)
    deploys = [e for e in res["log"] if e["decision"] == "deploy" and e["kind"] == "adaptive"
               and e["iteration"] >= ON and _planned_link1_ms(e["reason"]) >= 0.9 * DELAY_MS]
    assert deploys, [(e["iteration"], e["decision"], e["reason"]) for e in res["log"]]
    first = deploys[0]["iteration"]
    # the plan deployed at the end of iteration `first` runs from iteration first+1 on: at most 3
    # iterations (ON, ON+1, ON+2) ran the old plan under the delay
    assert first + 1 <= ON + 3, (first, [(e["iteration"], e["decision"], e["reason"]) for e in res["log"]])
    m = res["metrics"][first]
    assert 0.9 * DELAY_MS <= m["link_delay_ms"][1] <= DELAY_MS + 20.0, m["link_delay_ms"]
    assert all(m["link_delay_ms"][i] < 0.5 * DELAY_MS for i in (0, 2)), m["link_delay_ms"]
    # every rank deployed the same plans at the same iterations
    for other in results[1:]:
        assert [e.get("plan_hash") for e in other["adapt"]["log"] if e["decision"] == "deploy"] == \
            [e.get("plan_hash") for e in res["log"] if e["decision"] == "deploy"]
    # the new plan is faster than the old one under the delay: simulate both (plan/simulate.py)
    from titan_ext.plan import LinkProfile

    prof = PipelineProfile(R, N, (2 * T_MS,) * R, (2 * T_MS,) * R, (2 * T_MS,) * R,
                           (LinkProfile(), LinkProfile(latency_ms=DELAY_MS), LinkProfile()))
    stage_prof, s2r = virtual_profile(prof, V, "v")
    old, new = res["plans"][ON], res["plans"][first + 1]
    t_old = simulate(as_ops(old), stage_prof, stage_to_rank=dict(enumerate(s2r))).makespan_ms
    t_new = simulate(as_ops(new), stage_prof, stage_to_rank=dict(enumerate(s2r))).makespan_ms
    assert t_new < 0.8 * t_old, (t_old, t_new)
    # and measured: fastest iteration after the swap vs fastest delayed one under the old plan
    its = [x["iteration_time_ms"] for x in res["metrics"]]
    before = min(its[ON + 1: first + 1]) if first + 1 > ON + 1 else its[ON]
    assert min(its[first + 1:]) < 0.85 * before, its


@pytest.mark.parametrize("local,expect", [([0, 4], "loop"), ([0, 7], "v"), ([3, 4], "v"), ([3, 7], "loop")])
def test_placement_is_read_from_the_stage_indices(local, expect):
    rank = local[0]
    assert read_layout(local, rank, R, R * V).placement == expect


@pytest.mark.parametrize("local", [[0, 5], [0], [0, 4, 7]])
def test_other_layouts_are_refused(local):
    with pytest.raises(ValueError, match="rank 0 holds"):
        read_layout(local, 0, R, R * V)
