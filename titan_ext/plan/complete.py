"""Check 1 of the validator (completeness), shared by ``validate_plan`` and ``simulate``: a plan that
misses an action, repeats one or names a stage or microbatch its profile does not have is refused
before anything is timed (a half plan has no makespan)."""

from __future__ import annotations

from collections import Counter
from typing import Mapping


class PlanValidationError(ValueError):
    """The plan is not safe to run."""


def check_complete(ops: Mapping[int, list], num_stages: int, num_microbatches: int) -> None:
    """Check 1 (completeness) on a normalised plan: every (stage, microbatch) of ``num_stages`` ×
    ``num_microbatches`` has exactly one F and either one I and one W, or one full B; nothing else."""
    counts = Counter((s, k, m) for rank_ops in ops.values() for s, k, m in rank_ops)
    for (s, k, m), n in counts.items():
        if not 0 <= s < num_stages:
            raise PlanValidationError(f"action {s}{k}{m}: stage out of range 0..{num_stages - 1}")
        if not 0 <= m < num_microbatches:
            raise PlanValidationError(f"action {s}{k}{m}: microbatch out of range 0..{num_microbatches - 1}")
        if n != 1:
            raise PlanValidationError(f"action {s}{k}{m} appears {n} times")
    for s in range(num_stages):
        for m in range(num_microbatches):
            if (s, "F", m) not in counts:
                raise PlanValidationError(f"stage {s} microbatch {m} has no F")
            split = (s, "I", m) in counts, (s, "W", m) in counts
            full = (s, "B", m) in counts
            if full and any(split):
                raise PlanValidationError(f"stage {s} microbatch {m} has both a full B and I/W")
            if not full and split != (True, True):
                missing = "I" if not split[0] else "W"
                raise PlanValidationError(f"stage {s} microbatch {m} has no {missing}")
