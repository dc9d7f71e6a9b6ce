"""The one placement model: which rank holds which stage, which rank link a stage boundary uses, and
per-rank ↔ per-stage profiles (docs/multistage.md).

R ranks each hold V model chunks ("stages"), S = R·V in data-flow order:

* ``"loop"`` — rank r holds stages r, r+R, r+2R, … (torch's Interleaved1F1B / InterleavedZeroBubble,
  torch's ``generate_stage_to_rank_mapping(style="loop")``); V = 1 is one stage per rank (stage r on
  rank r), whatever the placement's name;
* ``"v"`` — zig-zag: rank r holds r and 2R−1−r (and so on for larger V), torch's ZBV / DualPipeV and
  CrossPipe's CrossWave (its Wave traversal, §3.3 Fig.5; greedy §4.2).

Rank link ℓ joins ranks ℓ and ℓ+1 (:func:`rank_link`, the one rank-pair → link rule: the planners, the
simulator, the runtime's estimator and the delay injector all call it). A stage boundary s → s+1 between
adjacent ranks travels on rank link min(ρ(s), ρ(s+1)); a boundary inside one rank is free, and so is the
wrap-around boundary of a looped placement with R ≥ 3 ranks (rank R−1 → rank 0): no rank link of the
model joins those ranks, so nothing times, measures or injects a delay there (docs/ARCHITECTURE.md
"Decisions recorded here"). With R = 2 the wrap-around pair is ranks 1 and 0: link 0, the same channel as
the gradients from rank 1.

Profiles: a *rank-level* profile has one entry per rank and R−1 rank links (what a user or the CLI
gives); a *stage-level* profile has one entry per stage and S−1 stage-boundary links (what the
generators and ``simulate`` time). :func:`stage_profile` and :func:`rank_profile` convert.
Pure: no torch.
"""

from __future__ import annotations

from typing import Sequence

from ..args import counts_arg, int_arg
from .profile import profile_arg
from .profile import LinkProfile, PipelineProfile

__all__ = ["PLACEMENTS", "boundary_link", "rank_link", "rank_profile", "rank_stages", "read_placement", "stage_profile",
           "stage_to_rank", "stages_per_rank"]

PLACEMENTS = ("loop", "v")


def _s2r_arg(s2r, name: str = "s2r") -> tuple[int, ...]:
    """A stage → rank map: a non-empty sequence of ranks >= 0 that uses every rank 0..R-1."""
    out = tuple(counts_arg(s2r, name, minimum=0))
    if not out:
        raise ValueError(f"{name} must map at least one stage to a rank, got an empty map")
    missing = sorted(set(range(max(out) + 1)) - set(out))
    if missing:
        raise ValueError(f"{name} uses ranks 0..{max(out)} but no stage is on rank {missing[0]}")
    return out


def stage_to_rank(num_ranks: int, stages_per_rank: int = 1, placement: str = "loop") -> tuple[int, ...]:
    """ρ: stage → rank for R ranks × V stages per rank, "loop" (s mod R) or "v" (zig-zag, torch's
    style "v"); V = 1 gives the identity."""
    if isinstance(placement, (list, dict, set)) or placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    int_arg(num_ranks, "num_ranks")
    int_arg(stages_per_rank, "stages_per_rank")
    if num_ranks < 1 or stages_per_rank < 1:
        raise ValueError(f"need >= 1 rank and >= 1 stage per rank, got {num_ranks} × {stages_per_rank}")
    R = num_ranks
    if placement == "loop":
        return tuple(s % R for s in range(R * stages_per_rank))
    return tuple(s % R if (s // R) % 2 == 0 else R - 1 - s % R for s in range(R * stages_per_rank))


def stages_per_rank(s2r: Sequence[int]) -> int:
    """V of a placement (every rank holds the same number of stages)."""
    s2r = _s2r_arg(s2r)
    return len(s2r) // (max(s2r) + 1)


def rank_stages(s2r: Sequence[int], rank: int) -> list[int]:
    """The stages ``rank`` holds, in data-flow order."""
    s2r = _s2r_arg(s2r)
    int_arg(rank, "rank", 0)
    return [s for s, r in enumerate(s2r) if r == rank]


def read_placement(s2r: Sequence[int]) -> str:
    """The name ("loop" or "v") of a stage → rank map; ValueError when it is neither."""
    s2r = _s2r_arg(s2r)
    R = max(s2r) + 1
    if len(s2r) % R == 0:
        for placement in PLACEMENTS:
            if tuple(s2r) == stage_to_rank(R, len(s2r) // R, placement):
                return placement
    raise ValueError(f"stage → rank map {tuple(s2r)} is neither looped nor V-shaped")


def rank_link(a: int, b: int) -> int | None:
    """The rank link joining PP ranks ``a`` and ``b``: link min(a, b) for neighbours (|a − b| = 1), None
    for one rank or two ranks no link of the model joins (the loop wrap-around R−1 → 0 with R ≥ 3). The
    one rule from a rank pair to a link: :func:`boundary_link`, hence ``simulate``, the generators and
    the runtime's estimator, and the delay injector (``runtime/emulate/delay_injection.py``) use it."""
    return min(a, b) if a - b in (1, -1) else None


def boundary_link(s2r: Sequence[int], boundary: int) -> int | None:
    """The rank link carrying stage boundary ``boundary`` → ``boundary``+1: :func:`rank_link` of the two
    stages' ranks (None: both stages on one rank, or the loop wrap-around)."""
    s2r = _s2r_arg(s2r)
    int_arg(boundary, "boundary", 0)
    if boundary >= len(s2r) - 1:
        raise ValueError(f"boundary {boundary} does not exist (boundaries are 0..{len(s2r) - 2})")
    return rank_link(s2r[boundary], s2r[boundary + 1])


def stage_profile(profile: PipelineProfile, s2r: Sequence[int],
                  stage_times_ms: tuple[Sequence[float], Sequence[float], Sequence[float]] | None = None
                  ) -> PipelineProfile:
    """The stage-level profile of a rank-level ``profile`` under placement ``s2r``.

    Each of rank r's V stages takes 1/V of the rank's F/B/W time (and activation memory and budget),
    unless ``stage_times_ms = (f, b, w)`` gives one value per stage. Boundary s gets the rank link
    :func:`boundary_link` names, or a free link. V = 1 returns ``profile`` itself.
    """
    profile_arg(profile)
    s2r = _s2r_arg(s2r)
    R, S = profile.num_stages, len(s2r)
    if max(s2r) + 1 != R:
        raise ValueError(f"the profile has {R} ranks; the placement uses {max(s2r) + 1}")
    V = S // R
    if V == 1 and stage_times_ms is None:
        return profile
    if stage_times_ms is None:
        f, b, w = ([getattr(profile, k)[s2r[s]] / V for s in range(S)] for k in ("f_ms", "b_ms", "w_ms"))
    else:
        f, b, w = (list(v) for v in stage_times_ms)
    links = tuple(LinkProfile() if (lk := boundary_link(s2r, s)) is None else profile.links[lk]
                  for s in range(S - 1))
    memory = {}
    if profile.activation_bytes is not None:
        memory = {"activation_bytes": tuple(profile.activation_bytes[r] / V for r in s2r),
                  "memory_budget_bytes": tuple(profile.memory_budget_bytes[r] / V for r in s2r)}
    return PipelineProfile(S, profile.num_microbatches, f, b, w, links, release=profile.release, **memory)


def rank_profile(profile: PipelineProfile, s2r: Sequence[int]) -> PipelineProfile:
    """The rank-level profile of a stage-level ``profile``: a rank's times are the sums over its stages,
    a rank link's parameters are read from a stage boundary that crosses it (free if none does)."""
    profile_arg(profile)
    s2r = _s2r_arg(s2r)
    if len(s2r) != profile.num_stages:
        raise ValueError(f"s2r maps {len(s2r)} stages; the profile has {profile.num_stages}")
    R = max(s2r) + 1
    links = [LinkProfile()] * (R - 1)
    for s in range(profile.num_stages - 1):
        lk = boundary_link(s2r, s)
        if lk is not None:
            links[lk] = profile.links[s]
    sums = [[0.0] * R for _ in range(3)]
    for s, r in enumerate(s2r):
        for k, times in enumerate((profile.f_ms, profile.b_ms, profile.w_ms)):
            sums[k][r] += times[s]
    return PipelineProfile(R, profile.num_microbatches, *(tuple(x) for x in sums), tuple(links), release=profile.release)
