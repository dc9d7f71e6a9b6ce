"""CrossPipe (Alg.1 greedy schedules, CrossUD / CrossUDSub / CrossWave, §4.2) with our portfolio and
local search.  Modules import only downward:

``problem`` → ``greedy`` → ``model`` → ``search`` → ``_compiled`` → ``portfolio`` (``tuning``: the
constants).  The optimal solver (``titan_ext.plan.optimal``) sits above this package and the by-name
dispatch (``titan_ext.plan.schedules``) above both.  Pure Python (no torch at import time); the
compiled ``_greedy_c`` / ``_search_c`` only buy speed.
"""

from .greedy import GreedyResult, greedy_schedule
from .model import replay
from .portfolio import CrossPipePlan, Member, TimedMember, plan_crosspipe, plan_crosspipe_problem
from .problem import (
    CROSSPIPE_VARIANTS,
    CrossPipeProblem,
    Op,
    peak_memory,
    problem_from_profile,
    to_actions,
    wave_profile,
    wave_stage_to_rank,
)
from .tuning import DEFAULT_BUDGET, TUNING, CrossPipeTuning

__all__ = [
    "CROSSPIPE_VARIANTS", "CrossPipePlan", "CrossPipeProblem", "CrossPipeTuning", "DEFAULT_BUDGET",
    "GreedyResult", "Member", "Op", "TUNING", "greedy_schedule", "peak_memory", "plan_crosspipe",
    "TimedMember", "plan_crosspipe_problem", "problem_from_profile", "replay", "to_actions", "wave_profile",
    "wave_stage_to_rank",
]
