"""titan_ext.plan — pure planning: profiles, warm-up planning, schedule generation, validation,
simulation and exporters. Importing this package imports no torch (see ir.py)."""

from .profile import LinkProfile, PipelineProfile
from .warmup import (
    absorbs_delay,
    adapted_warmup_counts,
    initial_warmup_counts,
    initial_warmup_counts_for,
    link_tolerance_ms,
    link_tolerances_ms,
    required_slackness,
    slackness,
    zb_h1_warmup_counts,
    zb_warmup_counts,
)
from .pipemorph import Plan, generate_order, plan_pipemorph
from .result import PlanResult
from .simulate import ActionEvent, DeadlockError, Timeline, simulate
from .validate import PlanValidationError, validate_plan
from .ir import as_ops, to_torch_plan
from .crosspipe import CrossPipePlan, plan_crosspipe  # CrossPipe §4.2 (optimum: .optimal)
from .placed import PlacedProfile  # the one description CrossPipe's planners read

__all__ = [
    "ActionEvent", "DeadlockError", "LinkProfile", "PipelineProfile", "Plan", "PlanResult", "PlanValidationError",
    "Timeline", "absorbs_delay", "adapted_warmup_counts", "as_ops", "generate_order",
    "initial_warmup_counts", "initial_warmup_counts_for", "link_tolerance_ms", "link_tolerances_ms", "plan_pipemorph",
    "required_slackness", "simulate", "slackness", "to_torch_plan", "validate_plan", "zb_h1_warmup_counts", "zb_warmup_counts",
]
