"""Run-time memory cap with several stages per rank: K_r per rank from the measured
activation bytes of the rank's chunks and its budget, the virtual planner spending it per rank. No process group: the pieces the schedule wires together."""

import math
from types import SimpleNamespace

import pytest
import torch

from titan_ext.plan import PipelineProfile
from titan_ext.plan.result import peak_memory_per_rank
from titan_ext.plan.virtual import virtual_profile, virtual_stage_to_rank
from titan_ext.runtime.execute.executor import Executor
from titan_ext.runtime.execute.memory import rank_memory_limits
from titan_ext.runtime.decide.placement import Layout, VirtualPlanner
from titan_ext.runtime.decide.planning import PlanningContext
from titan_ext.runtime.decide.policy import Decision


def test_rank_limits_closed_form():
    """K_r = ⌊budget_r / a_r⌋ / V within [1, N]; a rank without a budget gets N; none known: None."""
    got = rank_memory_limits([100.0, 100.0, 15.0, math.nan], [10.0, 12.0, 10.0, 10.0], 2, 16)
    assert got == (5.0, 4.0, 1.0, 16.0)  # 10 chunks, 8 chunks, 1 chunk → at least V = 2, no budget
    assert rank_memory_limits([math.nan] * 2, [10.0] * 2, 2, 8) is None


def _context(limits):
    return PlanningContext(backward="split", x_max=16, adaptive_limit=None, slack_floor=1,
                           headroom=lambda c: c, rank_memory_limit=limits)


def test_virtual_planner_spends_the_rank_cap():
    """The run-time planner holds ≤ K_r on every rank, and spending the ranks' caps by need beats the even
    split the runtime used before (⌊min_r K_r·V⌋ // V = 3 per stage)."""
    layout = Layout(4, 2, "v", virtual_stage_to_rank(4, 2, "v"))
    stage_profile, _ = virtual_profile(PipelineProfile.uniform(4, 16, 10, 10, 10, delays_ms={2: 60}), 2, "v")
    decision = Decision("adapt", "test", mode="adaptive")
    limits = (4.0, 4.0, 3.5, 4.0)
    plan = VirtualPlanner(layout).plan(stage_profile, decision, _context(limits))
    peaks = peak_memory_per_rank(plan.actions)
    assert all(peaks[r] <= limits[r] for r in range(4))
    even_context = PlanningContext(backward="split", x_max=16, adaptive_limit=3, slack_floor=1, headroom=lambda c: c)
    even = VirtualPlanner(layout).plan(stage_profile, decision, even_context)  # the old runtime: 3 per stage
    assert max(peak_memory_per_rank(even.actions).values()) <= 3.5
    assert plan.predicted_makespan_ms < even.predicted_makespan_ms
