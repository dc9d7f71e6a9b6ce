"""Falcon's control-plane reduction: an element-wise MAX over a gloo group by recursive doubling.

Falcon's job agrees on every step's numbers (Falcon §4.2's iteration time, §4.3's per-group times)
through one small host vector a check (``runtime/falcon/measure.ObservationExchange``).  On gloo,
``dist.all_reduce`` is a ring (gloo's default algorithm): 2 (n − 1) messages in sequence, each a process
wake-up on a busy host — latency linear in the world, as the DP degree grows.  The vector is small (a
few kB: latency-bound, not bandwidth-bound), so :func:`max_all_reduce` exchanges the whole vector with
one partner a round instead: ⌊log2 n⌋ rounds (recursive doubling), plus a fold-in and a fold-out
message when n is not a power of two (the ranks beyond n' = 2^⌊log2 n⌋ hand their vector to a partner
below it and get the result back; Thakur, Rabenseifner and Gropp, "Optimization of collective
communication operations in MPICH", 2005).  A MAX is exact and order-free, so every rank ends with the
same bits whatever the pairing.

``ranks`` orders the group: with a DP × PP grid flattened row by row (a pipeline's ranks adjacent) and a
power-of-two PP degree S, the first log2 S rounds stay inside each pipeline and the remaining log2 D
pair the pipelines — a two-level exchange (within each PP group, then across the groups) without a
leader, and no round waits on more than one peer.

Point-to-point on the gloo group (host tensors; gloo connects every pair of the group when the group
is made, so a pair's first message creates nothing): a round's send and receive are an ``isend`` /
``irecv`` pair on the round's tag (:data:`TAG_BASE` + round), and every exchange completes before the
next starts, so messages match per peer in order.  :func:`exchange_rounds` is the number of rounds one rank waits in.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["max_all_reduce", "exchange_rounds", "TAG_BASE"]

TAG_BASE = 0x46A1
"""Tags of the exchange's messages (``TAG_BASE`` + round; the fold-in and fold-out above the rounds)."""


def exchange_rounds(n: int) -> int:
    """Sequential message rounds of :func:`max_all_reduce` over ``n`` ranks (a rank beyond the largest
    power of two waits for 2: its fold-in and fold-out; the others ⌊log2 n⌋, + 2 when n is not a power
    of two and they hold a folded rank)."""
    if n <= 1:
        return 0
    p = 1 << (n.bit_length() - 1)
    return (p.bit_length() - 1) + (2 if p != n else 0)


def max_all_reduce(vec: torch.Tensor, group, ranks: Sequence[int] | None = None) -> torch.Tensor:
    """``vec`` ← the element-wise MAX of every rank's ``vec`` over ``group`` (in place; returned).

    ``vec``: a contiguous host tensor (the control plane carries host data).  ``ranks``: the group's
    global ranks in the order that pairs them (None: the group's own order); the same list on every
    rank.  Recursive doubling: ⌊log2 n⌋ rounds of one send and one receive with the partner
    ``i XOR 2^r``; ranks ``i ≥ 2^⌊log2 n⌋`` first fold into ``i − 2^⌊log2 n⌋`` and receive the result
    from it at the end."""
    if vec.device.type != "cpu" or not vec.is_contiguous():
        raise ValueError("max_all_reduce carries contiguous host tensors (the gloo control plane)")
    ranks = list(dist.get_process_group_ranks(group)) if ranks is None else list(ranks)
    n = len(ranks)
    me = ranks.index(dist.get_rank())
    if n == 1:
        return vec
    p = 1 << (n.bit_length() - 1)
    fold_in, fold_out = TAG_BASE + 64, TAG_BASE + 65
    if me >= p:  # beyond the largest power of two: fold into a partner, receive the result from it
        _wait(dist.isend(vec, ranks[me - p], group=group, tag=fold_in))
        _wait(dist.irecv(vec, ranks[me - p], group=group, tag=fold_out))
        return vec
    other = torch.empty_like(vec)
    if me + p < n:
        _wait(dist.irecv(other, ranks[me + p], group=group, tag=fold_in))
        torch.maximum(vec, other, out=vec)
    r, d = 0, 1
    while d < p:
        peer = ranks[me ^ d]
        _wait(dist.isend(vec, peer, group=group, tag=TAG_BASE + r),
              dist.irecv(other, peer, group=group, tag=TAG_BASE + r))
        torch.maximum(vec, other, out=vec)  # after the send completed: it read vec
        r, d = r + 1, d << 1
    if me + p < n:
        _wait(dist.isend(vec, ranks[me + p], group=group, tag=fold_out))
    return vec


def _wait(*works) -> None:
    for work in works:
        work.wait()
