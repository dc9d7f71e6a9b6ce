"""runtime/control/deploy.py: validate + torch's lowering passes of a compute-only plan (moved from
test_runtime_parts.py)."""

from __future__ import annotations

from unittest import mock

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from titan_ext.plan import PlanValidationError
from titan_ext.plan.builtin import builtin_plan
from titan_ext.runtime.control.deploy import backward_of, plan_hash, prepare_candidate, warmup_counts_of

S, N = 4, 8


def test_prepare_candidate_lowers_exactly_like_torch():
    plan = builtin_plan("1F1B", S, N)[0]
    cand = prepare_candidate(plan, None, "external", "test", num_stages=S, n_microbatches=N, num_ranks=S)
    # torch's own lowering of the same plan (what _prepare_schedule_with_comms would produce)
    mapping = {s: s for s in range(S)}
    want = {r: torch_schedules._add_reduce_grad(list(a), N) for r, a in plan.items()}
    want = torch_schedules._add_send_recv(want, stage_to_rank=lambda s: mapping[s], num_stages=S)
    want = getattr(torch_schedules, "_add_wait_send", lambda w: w)(want)  # torch >= 2.15's send waits
    assert {r: [str(a) for a in acts] for r, acts in cand.lowered.items()} == \
        {r: [str(a) for a in acts] for r, acts in want.items()}
    assert cand.counts == [S - i for i in range(S)] == warmup_counts_of(plan)
    assert cand.backward == backward_of(plan) == "full"
    assert cand.hash == plan_hash(plan) != plan_hash(builtin_plan("GPipe", S, N)[0])


@pytest.mark.parametrize("damage,match", [("drop", "has no F"), ("swap_rank", "expected 0..")])
def test_prepare_candidate_refuses_bad_plans(damage, match):
    plan = {r: list(a) for r, a in builtin_plan("1F1B", S, N)[0].items()}
    if damage == "drop":
        plan[1] = [a for a in plan[1] if a.microbatch_index != N - 1]
    else:
        del plan[3]
    with pytest.raises(PlanValidationError, match=match):
        prepare_candidate(plan, None, "external", "bad", num_stages=S, n_microbatches=N, num_ranks=S)


def test_planresult_holds_one_ir_and_derives_torch_actions():
    """A PlanResult stores its plan once (``ops``); ``actions`` is derived from it on first read."""
    import dataclasses

    from titan_ext.plan import PipelineProfile, PlanResult, to_torch_plan
    from titan_ext.plan.schedules import plan_by_name

    assert "actions" not in {f.name for f in dataclasses.fields(PlanResult)}
    plan = plan_by_name(PipelineProfile.uniform(S, N, 10, 10, 10, delays_ms={1: 25}), "pipemorph")
    assert "actions" not in vars(plan)  # the planner made no torch copy
    assert plan.actions is plan.actions and [str(a) for a in plan.actions[2]] == \
        [str(a) for a in to_torch_plan(plan.ops)[2]]


def test_the_runtime_converts_the_plan_ir_to_torch_actions_in_one_pass(monkeypatch):
    """prepare_candidate lowers a PlanResult's ``ops``: one call of the conversion pass (which is
    ``plan.ir.to_torch_plan``), none of the planner's torch copy, and the candidate's actions are that
    pass's output."""
    import titan_ext.plan.ir as ir
    import titan_ext.runtime.control.deploy as deploy
    from titan_ext.plan import PipelineProfile, to_torch_plan
    from titan_ext.plan.schedules import plan_by_name

    plans = [plan_by_name(PipelineProfile.uniform(S, N, 10, 10, 10, delays_ms={1: 25}), name)
             for name in ("pipemorph", "crosspipe-ud", "1F1B")]
    spies = {"pass": mock.Mock(wraps=deploy.to_torch_actions), "ir": mock.Mock(wraps=ir.to_torch_plan)}
    monkeypatch.setattr(ir, "to_torch_plan", spies["ir"])
    monkeypatch.setattr(deploy, "to_torch_actions", spies["pass"])
    for k, plan in enumerate(plans, 1):
        cand = prepare_candidate(plan.ops, plan.warmup_counts, "external", "t", num_stages=S, n_microbatches=N,
                                 num_ranks=S, inflight_limit=plan.inflight_limit)
        assert (spies["pass"].call_count, spies["ir"].call_count) == (k, k)
        assert "actions" not in vars(plan)
        assert {r: [str(a) for a in acts] for r, acts in cand.actions.items()} == \
            {r: [str(a) for a in acts] for r, acts in to_torch_plan(plan.ops).items()}
        assert cand.hash == plan_hash(plan.ops) and cand.counts == plan.warmup_counts
