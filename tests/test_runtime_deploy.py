"""runtime/deploy.py: validate + torch's lowering passes of a compute-only plan (moved from
test_runtime_parts.py)."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from titan_ext.plan import PlanValidationError
from titan_ext.plan.builtin import builtin_plan
from titan_ext.runtime.deploy import backward_of, plan_hash, prepare_candidate, warmup_counts_of

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
