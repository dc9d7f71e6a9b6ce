"""CrossPipe (Alg.1 greedy schedules, CrossUD / CrossUDSub / CrossWave, §4.2) with our portfolio and
local search.  Modules import only downward:

``variants`` → ``greedy`` → ``retime`` → ``search`` → ``_compiled`` → ``portfolio`` (``tuning``: the
constants).  Every planner reads the one description of plan/ — a stage-level ``PipelineProfile`` on a
placement with a per-rank memory limit (``titan_ext.plan.placed.PlacedProfile``) — and times plans in
integer nanoseconds with ``simulate``'s model.  The optimal solver (``titan_ext.plan.optimal``) sits above
this package and the by-name dispatch (``titan_ext.plan.schedules``) above both.  Pure Python (no torch
at import time); the compiled ``_greedy_c`` / ``_search_c`` only buy speed.
"""

from ..placed import PlacedProfile
from .greedy import GreedyResult, greedy_schedule
from .portfolio import CrossPipePlan, Member, TimedMember, plan_crosspipe, plan_crosspipe_placed
from .retime import Retimer
from .tuning import DEFAULT_BUDGET, TUNING, CrossPipeTuning
from .variants import CROSSPIPE_VARIANTS, Op, placed_from_profile, to_actions, wave_profile, wave_stage_to_rank

__all__ = [
    "CROSSPIPE_VARIANTS", "CrossPipePlan", "CrossPipeTuning", "DEFAULT_BUDGET", "GreedyResult", "Member", "Op",
    "PlacedProfile", "Retimer", "TUNING", "TimedMember", "greedy_schedule", "placed_from_profile", "plan_crosspipe",
    "plan_crosspipe_placed", "to_actions", "wave_profile", "wave_stage_to_rank",
]
