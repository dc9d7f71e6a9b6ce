"""CrossPipe's variants and their placements (CrossPipe §3.3, §4.2): CrossUD / CrossUDSub plan one stage per
rank, CrossWave the 2R chunks of a V-shape placement (its Wave traversal, §3.3 Fig.5).  The profile →
:class:`~titan_ext.plan.placed.PlacedProfile` boundary of the package (:func:`placed_from_profile`).

Bottom of the ``crosspipe`` package: imports nothing of it.  Operations are plain tuples
``(stage, kind, microbatch)`` inside plan/; torch's ``_Action`` only at the boundary (:func:`to_actions`
through ``titan_ext.plan.ir``, imported lazily, so importing this module imports no torch).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from ..ir import COMPUTE_KINDS, Op
from ..placed import PlacedProfile
from ..placement import stage_profile, stage_to_rank

__all__ = ["CROSSPIPE_VARIANTS", "KINDS", "Op", "placed_from_profile", "to_actions", "wave_profile",
           "wave_stage_to_rank"]

CROSSPIPE_VARIANTS = ("ud", "udsub", "wave")

KINDS = COMPUTE_KINDS[:3]
"""the kinds CrossPipe schedules, in operation-id order: 0 F, 1 I (the paper's D), 2 W."""
F, I, W = KINDS


def wave_stage_to_rank(num_ranks: int) -> tuple[int, ...]:
    """V-shape placement used by CrossWave and torch's ZBV: stages s and 2R−1−s on rank s
    (``plan.placement.stage_to_rank(R, 2, "v")``)."""
    return stage_to_rank(num_ranks, 2, "v")


def variant_placement(num_stages: int, variant: str) -> tuple[int, ...]:
    """The stage → rank map of ``variant`` for a stage-level profile of ``num_stages`` stages."""
    if variant == "wave":
        if num_stages % 2:
            raise ValueError(f"crosspipe-wave needs an even number of stages (two chunks per rank), got {num_stages}")
        return wave_stage_to_rank(num_stages // 2)
    if variant in ("ud", "udsub"):
        return tuple(range(num_stages))
    raise ValueError(f"variant must be one of {CROSSPIPE_VARIANTS}, got {variant!r}")


def placed_from_profile(profile, variant: str = "ud",
                        memory_limit: int | float | Sequence[float] | None = None) -> PlacedProfile:
    """The planners' description of a stage-level :class:`titan_ext.plan.PipelineProfile`: ``variant``
    "ud"/"udsub" — one stage per rank; "wave" — the profile describes the 2R model chunks
    (``num_stages`` even), placed V-shape (stages s and 2R−1−s on rank s, as torch's ZBV).
    ``memory_limit``: per-rank limit on the activations held (one number for all ranks or one per rank;
    None → the profile's memory budget summed over a rank's stages, or unlimited when it has none); the
    memory rule is the profile's ``release``."""
    from ..profile import profile_arg

    S = profile_arg(profile).num_stages
    return PlacedProfile.of(profile, variant_placement(S, variant), memory_limit)


def to_actions(orders: Mapping[int, Sequence[Op]]) -> dict:
    """Plain tuples → torch IR ``dict[rank, list[_Action]]`` through the planning core's single
    conversion point (``titan_ext.plan.ir``, which imports torch lazily)."""
    from ..ir import to_torch_plan

    return to_torch_plan({r: list(ops) for r, ops in sorted(orders.items())})


def wave_profile(profile):
    """The V-shape (CrossWave / ZBV) version of a one-stage-per-rank profile: each rank's stage is cut
    into two chunks of half its F/B/W time (and activation size), chunk s and 2R−1−s on rank s; the
    link between rank i and i+1 (``profile.links[i]``) carries both stage boundaries that cross it
    (``plan.placement.stage_profile``)."""
    return stage_profile(profile, wave_stage_to_rank(profile.num_stages))
