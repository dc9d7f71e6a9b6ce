"""The memory rule of torch's runtime (``plan.profile.RELEASES["W"]``) and the meter that measures it.

References independent of the code under test: torch's own split backward (what its
``stage_backward_input`` leaves alive, read through autograd's saved-tensor hooks), closed-form byte
counts of tensors we create, a brute-force count of in-flight microbatches over a plan, and the CP-SAT
optimum (where OR-Tools is installed) as a lower bound for the generator under the same rule.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as Fn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from titan_ext.plan import LinkProfile, PipelineProfile, validate_plan
from titan_ext.plan.result import peak_inflight
from titan_ext.plan.schedules import plan_by_name
from titan_ext.runtime.execute.memory import ActivationMeter


def _brute_peak(ops, frees) -> dict[int, int]:
    peak: dict[int, int] = {}
    for rank_ops in ops.values():
        for j, (s, k, m) in enumerate(rank_ops):
            done = rank_ops[: j + 1]
            held = sum(1 for st, kk, _ in done if st == s and kk == "F") - sum(
                1 for st, kk, _ in done if st == s and kk in frees)
            peak[s] = max(peak.get(s, 0), held)
    return dict(sorted(peak.items()))


def test_torch_split_backward_frees_nothing_at_i_and_everything_at_w():
    """Why the runtime plans with release "W": measured on torch's own split backward."""
    mod = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 32))
    x = torch.randn(4, 32, requires_grad=True)
    meter = ActivationMeter(mod.parameters())
    with meter:
        y = mod(x)
        after_f = meter.bytes
        _, groups = stage_backward_input([y], [torch.ones_like(y)], [x], mod.parameters())
        after_i = meter.bytes
        stage_backward_weight(mod.parameters(), groups)
        after_w = meter.bytes
    # Linear saves its input (4×32 floats; the first is x itself), GELU its input: 3 tensors of 512 B
    assert after_f == 3 * 4 * 32 * 4 and after_i == after_f and after_w == 0


def test_the_meter_counts_views_once_and_parameters_never_and_follows_release():
    lin = torch.nn.Linear(16, 16)
    meter = ActivationMeter(lin.parameters())
    batch = torch.randn(8, 16)
    with meter:
        outs = [torch.tanh(lin(mb.requires_grad_())) for mb in batch.clone().chunk(4)]  # 4 microbatches of 2
        assert meter.bytes == 4 * (2 * 16 * 4 + 2 * 16 * 4)  # each: its input view and tanh's output
        outs[0].sum().backward()
        assert meter.bytes == 3 * (2 * 16 * 4 + 2 * 16 * 4)
        meter.reset_peak()
        del outs
    assert meter.bytes == 0 and meter.peak_bytes == 3 * 256


class _Stage:
    """What the meter reads of torch's ``PipelineStage``: ``forward_one_chunk`` keeps the output in
    ``fwd_cache`` until ``backward_one_chunk`` pops it."""

    def __init__(self, mod):
        self.mod, self.stage_index, self.fwd_cache = mod, 0, {}

    def forward_one_chunk(self, chunk, x):
        out = self.mod(x)
        self.fwd_cache[chunk] = ((out,), [x])
        return out

    def backward_one_chunk(self, chunk):
        (out,), _ = self.fwd_cache.pop(chunk)
        out.sum().backward()


def test_with_stages_the_meter_counts_the_kept_outputs_until_their_backward():
    """M^F's unit: a microbatch's saved tensors and the stage output kept beside them, measured the same way
    whichever schedule drives the stage; the stage's methods are its own again afterwards."""
    lin = torch.nn.Linear(16, 16)
    stage = _Stage(lin)
    meter = ActivationMeter(lin.parameters(), [stage])
    x = [torch.randn(2, 16, requires_grad=True) for _ in range(3)]
    with meter:
        stage.forward_one_chunk(0, x[0])
        stage.forward_one_chunk(1, x[1])
        # each: Linear's saved input (2×16 floats) and the kept output (2×16 floats), nothing else
        assert meter.bytes == 2 * (2 * 16 * 4 + 2 * 16 * 4)
        stage.backward_one_chunk(0)
        assert meter.bytes == 1 * (2 * 16 * 4 + 2 * 16 * 4)
        stage.backward_one_chunk(1)
        assert meter.bytes == 0
    assert meter.peak_bytes == 2 * 256
    assert "forward_one_chunk" not in stage.__dict__ and "backward_one_chunk" not in stage.__dict__


@pytest.mark.parametrize("seed", range(6))
def test_plans_under_release_w_hold_their_limit_by_a_brute_force_count(seed):
    rng = random.Random(seed)
    S = rng.randint(2, 6)
    N = rng.randint(S, 4 * S)
    links = tuple(LinkProfile(latency_ms=rng.choice([0.0, rng.uniform(5, 60)])) for _ in range(S - 1))
    prof = PipelineProfile(S, N, [rng.uniform(1, 4) for _ in range(S)], [rng.uniform(1, 4) for _ in range(S)],
                           [rng.uniform(0.5, 4) for _ in range(S)], links, release="W")
    K = [rng.randint(S - s, N) for s in range(S)]  # at least 1F1B's memory on every stage
    plan = plan_by_name(prof, "pipemorph", memory_limit=K)
    brute = _brute_peak(plan.ops, {"W", "B"})
    assert all(brute[s] <= K[s] for s in range(S)), (brute, K)
    assert plan.peak_inflight == brute == peak_inflight(plan.ops, "W")
    validate_plan(plan.ops, S, N, inflight_limit=K, release="W")
    # the papers' rule counts less on the same plan wherever a W trails its I
    assert all(a <= b for a, b in zip(_brute_peak(plan.ops, {"I", "B"}).values(), brute.values()))


def test_a_plan_that_defers_its_ws_fits_the_papers_rule_but_not_torchs():
    ops = {0: [op for m in range(4) for op in ((0, "F", m), (0, "I", m))] + [(0, "W", m) for m in range(4)]}
    validate_plan(ops, 1, 4, inflight_limit=1)  # freed at I: 1 in flight
    with pytest.raises(Exception, match="holds 4 in-flight"):
        validate_plan(ops, 1, 4, inflight_limit=1, release="W")


def test_generator_is_within_the_cp_sat_optimum_under_release_w():
    pytest.importorskip("ortools")
    prof = PipelineProfile(4, 12, 2.0, 2.0, 2.0, (LinkProfile(), LinkProfile(), LinkProfile(latency_ms=30.0)),
                           release="W")
    for K in (4, 8):
        ours = plan_by_name(prof, "pipemorph", memory_limit=K)
        best = plan_by_name(prof, "optimal", memory_limit=K, time_limit_s=30)
        assert max(peak_inflight(best.ops, "W").values()) <= K  # the solver holds torch's rule too
        assert best.predicted_makespan_ms <= ours.predicted_makespan_ms + 1e-6
        assert ours.predicted_makespan_ms <= 1.05 * best.predicted_makespan_ms


def _budget_worker(rank: int, world: int, budget_acts: int) -> dict:
    from torch.distributed.pipelining import PipelineStage

    from titan_ext.runtime import PipeMorph, inject_link_delays
    from titan_ext.testing import SleepComputeStage

    inject_link_delays("0:20")
    mod = SleepComputeStage(16, 1.0, 1.0, 1.0, seed=rank)
    # M^F of the last stage: its input (2×16 floats), the weight's clone (16×16), tanh's output, and the
    # loss's output and target (2×16 each) — SleepComputeStage and mse_loss save exactly these
    last_mf = 2 * 16 * 4 + 16 * 16 * 4 + 2 * 16 * 4 + 2 * (2 * 16 * 4)
    sched = PipeMorph(PipelineStage(mod, rank, world, torch.device("cpu")), 8, loss_fn=Fn.mse_loss,
                      memory_budget_bytes=float(budget_acts * last_mf), backward="split")
    meter = ActivationMeter(mod.parameters())
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g)
    peaks = []
    for _ in range(6):
        meter.reset_peak()
        with meter:
            sched.step(*((x,) if rank == 0 else ()), **({"target": y} if rank == world - 1 else {}))
        peaks.append(meter.peak_bytes)
    return {"peaks": peaks, "budget": sched.memory_budget_bytes, "versions": sched.plan_version, "last_mf": last_mf,
            "measured_mf": sched.executor.activation_bytes}


@pytest.mark.slow
def test_pipemorph_stays_within_its_byte_budget_as_measured():
    """End to end: a 2-rank PipeMorph with a 20 ms link and a budget of 2 activations: the bytes autograd
    holds (the meter, not the planner's count) never exceed the budget after the first iteration."""
    from titan_ext.testing import run_ranks

    res = run_ranks(_budget_worker, 2, 2, backend="gloo")
    assert res[1]["measured_mf"] == res[1]["last_mf"]  # M^F counts the loss's saved tensors too
    for r in res:
        assert max(r["peaks"][1:]) <= r["budget"], r
    assert max(res[1]["peaks"][1:]) > res[1]["budget"] / 2  # the budget binds: 2 activations, not fewer
