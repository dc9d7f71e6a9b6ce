"""runtime/decide/budget.py: Alg.1's x_max and the caps of later plans, per stage or per rank."""

import math

from titan_ext.runtime.decide.budget import RankMemoryBudget, StageMemoryBudget
from titan_ext.runtime.execute.memory import PENDING


def _stage(S=4, N=16, budget=None, max_inflight=None, limit=None, act=None):
    return StageMemoryBudget("T", S, N, 1, budget, max_inflight, limit, None, lambda: act)


def test_x_max_follows_alg1_within_s_and_n():
    assert _stage().x_max == 2 * 4 - 1  # no budget: 2S − 1
    assert _stage(max_inflight=12).x_max == 12 and _stage(max_inflight=40).x_max == 16 and _stage(max_inflight=2).x_max == 4
    assert _stage(budget=10_000.0, act=1000.0).x_max == 10  # ⌊M / M^F⌋
    assert _stage(budget=10_000.0).x_max == 4  # M^F not measured yet: 1F1B's memory
    assert _stage(budget=1_000.0, act=1000.0).x_max == 4  # below S: S


def test_caps_from_exchanged_budgets_and_the_lift_while_delegating():
    b = _stage(limit=5)
    # each stage its own rank's ⌊budget / M^F⌋ (a rank without a budget: N); the smallest is inflight_cap
    b.absorb([9000.0, 20_000.0, math.nan, 12_000.0], [1000.0, 2000.0, 1000.0, 1000.0], rank=1)
    assert b.inflight_cap == 9 and b.stage_caps == [9, 10, 16, 12]
    assert b.adaptive_limit() == [5, 5, 5, 5] and b.adaptive_limit(lifted=True) == [9, 10, 16, 12]
    assert b.planning_x_max() == [min(7, 9), 10, 16, 12]  # Alg.1's x_max on stage 0, the caps elsewhere
    six = {r: [(r, "F", m) for m in range(6)] + [(r, "B", m) for m in range(6)] for r in range(4)}
    assert "above the current memory cap of [5, 5, 5, 5]" in b.over_cap("adaptive", 6, six)
    assert b.over_cap("adaptive", 6, six, lifted=True) == "" and b.over_cap("forced", 99, six) == ""
    # torch's rule: a split microbatch is held until its W, not its I
    held = {r: [op for m in range(6) for op in ((r, "F", m), (r, "I", m))] + [(r, "W", m) for m in range(6)]
            for r in range(4)}  # 1 in flight by the papers' rule (released at I), 6 by torch's
    assert "holds 6" in b.over_cap("adaptive", 0, held)


def test_several_stages_per_rank_cap_per_rank_once_every_budget_is_known():
    b = RankMemoryBudget("T", 4, 8, 2, None, None, None, None, lambda: None)
    b.absorb([PENDING, 100.0], [10.0, 10.0], rank=0)  # a device budget not readable yet
    assert b.rank_memory_limit is None and b.inflight_cap == b.x_max // 2
    b.absorb([100.0, 30.0], [10.0, 10.0], rank=0)
    assert b.inflight_cap is None and b.rank_memory_limit == (5.0, 1.5)  # ⌊budget / a⌋ / V
    plan = {0: [(0, "F", m) for m in range(8)] + [(0, "B", m) for m in range(8)], 1: [], }
    assert "on rank 0" in b.over_cap("adaptive", 0, plan)
