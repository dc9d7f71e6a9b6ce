"""Localisation of a fail-slow (Falcon §4.3), the process-group-free parts.

* :func:`suspicious_groups` — profiling: a communication group whose data-transfer time exceeds
  1.1 × the median over groups is suspicious.
* :func:`ring_validation_passes` — communication validation: a ring of n ranks is split into
  non-overlapping P2P send/recv pairs that cover every ring link in O(1) passes (Fig. 9): even→odd
  (0→1, 2→3, …), odd→even (1→2, 3→4, …, n−1→0 for even n), and for odd n one more pass for the
  remaining link n−1→0. :func:`tree_validation_passes` — the same for a binary tree in four passes
  (children at even levels to their parents, left then right; then from odd levels).
* :func:`locate_slow_links` / :func:`locate_slow_devices` — read the validation timings (all
  transfers have the same size, so a slow link measures a longer time; GEMM probes likewise).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import numpy as np

from titan_ext.args import bool_arg, counts_arg, mapping_arg, real_arg

__all__ = [
    "suspicious_groups",
    "ring_validation_passes",
    "tree_validation_passes",
    "locate_slow_links",
    "locate_slow_devices",
]


def suspicious_groups(transfer_times_s: Mapping[Hashable, float], ratio: float = 1.1) -> list:
    """Groups with transfer time > ``ratio`` × median (Falcon §4.3, ratio 1.1), slowest first."""
    _times_arg(transfer_times_s, "transfer_times_s", minimum=None)  # a link delay estimate may read < 0
    real_arg(ratio, "ratio", minimum=1.0)
    if not transfer_times_s:
        return []
    med = float(np.median(list(transfer_times_s.values())))
    hits = [g for g, t in transfer_times_s.items() if t > ratio * med]
    return sorted(hits, key=lambda g: -transfer_times_s[g])


def ring_validation_passes(ring: Sequence[int]) -> list[list[tuple[int, int]]]:
    """P2P passes covering every link of the ring ``ring[0] → ring[1] → … → ring[-1] → ring[0]``.

    Every rank takes part in at most one pair per pass (sends and receives never overlap), so each
    pass runs in parallel in O(1) time regardless of the ring size (Falcon §4.3, Fig. 9). A ring of 2
    has one physical link validated in both directions; a ring of 1 has no links.
    """
    ring = _ranks_arg(ring, "ring")
    n = len(ring)
    if len(set(ring)) != n:
        raise ValueError(f"ring has repeated ranks: {list(ring)}")
    if n < 2:
        return []
    even_odd = [(ring[i], ring[i + 1]) for i in range(0, n - 1, 2)]
    odd_even = [(ring[i], ring[(i + 1) % n]) for i in range(1, n if n % 2 == 0 else n - 1, 2)]
    passes = [even_odd, odd_even]
    if n % 2 == 1:
        passes.append([(ring[n - 1], ring[0])])
    return [p for p in passes if p]


def tree_validation_passes(tree: Sequence[int], both_directions: bool = False) -> list[list[tuple[int, int]]]:
    """P2P passes covering every link of a binary tree (Falcon §4.3, Fig. 9 right): four passes.

    ``tree`` lists ranks in heap order (``tree[0]`` the root, ``tree[i]``'s parent ``tree[(i-1)//2]``;
    odd ``i`` a left child, even ``i`` a right child; level ``floor(log2(i+1))``). Pass 1: left
    children at even levels send to their parents; pass 2: right children at even levels; passes 3
    and 4: the same from odd levels. A parent has one left and one right child and sits one level
    above them, so no rank is in two pairs of a pass. ``both_directions``: four more passes with the
    roles reversed (parent → child), for trees whose collectives also send down (NCCL's tree
    all-reduce broadcasts the result). Empty passes (small trees) are dropped."""
    tree = _ranks_arg(tree, "tree")
    bool_arg(both_directions, "both_directions")
    n = len(tree)
    if len(set(tree)) != n:
        raise ValueError(f"tree has repeated ranks: {list(tree)}")
    passes = []
    for level_parity in (0, 1):
        for side in (1, 0):  # left children (odd heap index) first, then right (even)
            passes.append([(tree[i], tree[(i - 1) // 2]) for i in range(1, n)
                           if (i + 1).bit_length() % 2 == 1 - level_parity and i % 2 == side])
    if both_directions:
        passes += [[(dst, src) for src, dst in p] for p in passes]
    return [p for p in passes if p]


def _times_arg(values, name: str, pairs: bool = False, minimum: float | None = 0.0) -> None:
    """A mapping of finite times (seconds; >= ``minimum``) per group, link ``(src, dst)`` (``pairs``) or
    rank."""
    mapping_arg(values, name, "link (src, dst) -> seconds" if pairs else "-> seconds")
    for key, t in values.items():
        if pairs:
            counts_arg(key, f"{name} key {key!r}", 2, minimum=0)
        real_arg(t, f"{name}[{key!r}]", minimum=minimum)


def _ranks_arg(ranks, name: str) -> list[int]:
    return counts_arg(ranks.tolist() if isinstance(ranks, np.ndarray) else ranks, name, minimum=0)


def _slow(values: Mapping[Hashable, float], ratio: float, reference_s: float | None,
          min_excess_s: float = 0.0) -> list:
    real_arg(ratio, "ratio", minimum=1.0)
    real_arg(reference_s, "reference_s", minimum=0, optional=True)
    real_arg(min_excess_s, "min_excess_s", minimum=0)
    if not values:
        return []
    ref = float(np.median(list(values.values()))) if reference_s is None else float(reference_s)
    return sorted((k for k, t in values.items() if t > ratio * ref and t - ref > min_excess_s),
                  key=lambda k: -values[k])


def locate_slow_links(link_times_s: Mapping[tuple[int, int], float], ratio: float = 1.5,
                      reference_s: float | None = None,
                      min_excess_s: float = 0.002) -> list[tuple[int, int]]:
    """Directed links ``(src, dst)`` slower than ``ratio`` × reference (median of all measured links
    unless ``reference_s``, e.g. a healthy calibration, is given) *and* by more than
    ``min_excess_s`` (sub-millisecond differences of small transfers are scheduling noise on a
    shared host, not a slow link), slowest first."""
    _times_arg(link_times_s, "link_times_s", pairs=True)
    return _slow(link_times_s, ratio, reference_s, min_excess_s)


def locate_slow_devices(gemm_times_s: Mapping[int, float], ratio: float = 1.1,
                        reference_s: float | None = None) -> list[int]:
    """Ranks whose GEMM probe time exceeds ``ratio`` × reference (median unless given)."""
    _times_arg(gemm_times_s, "gemm_times_s")
    return _slow(gemm_times_s, ratio, reference_s)
