"""The PP groups of one job decide as one: every check's profiles are agreed with the *peers*, the ranks
at this rank's PP position in the other PP groups (DP replicas, FSDP shards, TP and CP peers), so every
PP group deploys the same plan at the same iteration.

Why: each PP group runs its own schedule and control plane (``control_plane.py``).  Deciding alone,
groups that measure differently deploy different plans, or the same plan at different iterations: then
the peers run their actions in different orders, and whatever pairs them — FSDP's all-gathers and
reduce-scatters on a rank holding several stages, TP's collectives inside every F and B, the DP
gradient reduction waiting for the slowest replica — is paired wrong, deadlocks, or waits.

How (one merge per check, on a gloo group over the peers, never on a data group): every PP group has
gathered its ranks' profiles (the same matrix on each of its ranks); the peers all-reduce (MAX) one small
vector — each group's timeline span in its own slot, each rank row's candidate plan hash and its
negation (their largest and smallest over the groups), and "not delegating" — and then take the
gathered matrix of the slowest group (the largest span, ties to the lowest group), broadcast by it.
Every rank of every group then decides on the same matrix: the slowest group's, whose pipeline the
synchronous step waits for.  A background plan is swapped only where every group offered the same one
(the smallest and largest hashes of every row are handed to the swap's agreement), and the memory cap
is lifted for delegation only where every group delegates.  Cost per check: two collectives over the
peer group (a vector of groups + 2 · S + 1 floats; the S × profile-length matrix).

Pure derivation of the peers from the PP group's ranks (:func:`peer_ranks`); the group and the merge
(:class:`Peers`; :class:`Alone` without peers) are the runtime's.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..measure.profiler import RankProfile, decode_profiles, timeline_bubble_rate
from .control_plane import new_control_group
from .timeouts import named_collective

__all__ = ["Alone", "Peers", "connect_peers", "peer_ranks", "resolve_peers"]


def peer_ranks(pp_ranks: Sequence[int], world: int, rank: int) -> list[int] | None:
    """The global ranks at ``rank``'s PP position in every PP group of a ``world`` laid out as a row-major
    device mesh (``init_device_mesh``, TorchTitan's): the PP group is then an arithmetic progression of
    stride ``s`` (the product of the sizes of the mesh dimensions after PP), and a rank's PP coordinate is
    ``(r // s) % P``.  None when the PP group is not such a dimension of ``range(world)`` (ranks not evenly
    spaced, or ``s · P`` not dividing ``world``): the peers cannot be known without asking every rank."""
    ranks = list(pp_ranks)
    P = len(ranks)
    if rank not in ranks or P < 2:  # one stage: no plan to agree on
        return None
    s = ranks[1] - ranks[0]
    if s < 1 or any(b - a != s for a, b in zip(ranks, ranks[1:])) or world % (s * P) or ranks[-1] >= world:
        return None
    if (ranks[0] // s) % P:  # PP rank 0 at PP coordinate 0: the group is one line of the mesh
        return None
    p = ranks.index(rank)
    return [r for r in range(world) if (r // s) % P == p]


def resolve_peers(setting: Any, pp_ranks: Sequence[int], world: int, rank: int) -> list[int] | None:
    """The peer ranks of an ``AdaptiveConfig.peers`` setting (None: decide alone).  ``"auto"``:
    :func:`peer_ranks` (None when the world is one PP group or the layout is not a device mesh's);
    ``"off"``: none; a sequence of global ranks: those (this rank included; sorted)."""
    if setting == "off":
        return None
    if setting == "auto":
        peers = peer_ranks(pp_ranks, world, rank)
        return peers if peers is not None and len(peers) > 1 else None
    peers = sorted(int(r) for r in setting)
    if rank not in peers or len(set(peers)) != len(peers) or not all(0 <= r < world for r in peers):
        raise ValueError(f"peers={list(setting)!r}: distinct global ranks of the world (0..{world - 1}) "
                         f"including this rank ({rank})")
    if set(peers) & (set(pp_ranks) - {rank}):
        raise ValueError(f"peers={list(setting)!r}: a peer runs another position of this PP group "
                         f"{list(pp_ranks)}; peers are the ranks at this position in the other PP groups")
    return peers if len(peers) > 1 else None


class Alone:
    """A PP group without peers: it decides on its own profiles."""

    everywhere = True  # delegating where this group does

    def decided(self, rows: Sequence[torch.Tensor], slots: int, local_stages: int = 0) -> tuple[list[RankProfile], list[int]]:
        """A check's profiles to decide on (``decode_profiles`` of the gathered ``rows``) and the candidate
        hashes a swap must agree on (theirs)."""
        ranks = decode_profiles(rows, slots, local_stages)
        return ranks, [r.candidate_hash for r in ranks]


class Peers(Alone):
    """The merge of a check's gathered profiles with the other PP groups (module docstring).
    ``delegating``: this group delegates now (read at each merge); :attr:`everywhere`: every group did at
    the last merge (before one: as this group)."""

    def __init__(self, ranks: list[int], group: Any, delegating: Callable[[], bool] = lambda: False):
        self.ranks, self.group, self._delegating = ranks, group, delegating
        self.index = ranks.index(dist.get_rank())  # this PP group's slot among the groups

    def decided(self, rows: Sequence[torch.Tensor], slots: int, local_stages: int = 0) -> tuple[list[RankProfile], list[int]]:
        """The slowest group's profiles and every group's offers (:meth:`merge`)."""
        ranks, offers = super().decided(rows, slots, local_stages)
        matrix, offers = self.merge(rows, timeline_bubble_rate(ranks)[1], offers)
        return (ranks if matrix is None else decode_profiles(list(matrix), slots, local_stages)), offers

    def merge(self, rows: Sequence[torch.Tensor], span_ms: float,
              candidate_hashes: Sequence[int]) -> tuple[torch.Tensor | None, list[int]]:
        """(the slowest group's gathered matrix, None where it is this group's; the candidate hashes every
        group offered: each row's smallest, then each row's largest — the swap agrees only if all match).
        ``rows``: this group's gathered profiles; ``span_ms``: its timeline span (NaN: none);
        ``candidate_hashes``: its rows' offers (52-bit: exact in a float64)."""
        G, S = len(self.ranks), len(candidate_hashes)
        vec = torch.full((G + 2 * S + 1,), -math.inf, dtype=torch.float64)
        vec[self.index] = span_ms if math.isfinite(span_ms) else -1.0
        hashes = torch.tensor([float(h) for h in candidate_hashes], dtype=torch.float64)
        vec[G:G + S], vec[G + S:G + 2 * S] = hashes, -hashes
        vec[-1] = 0.0 if self._delegating() else 1.0
        name = f"control/peers/{min(self.ranks)}"
        named_collective(self.group, self.ranks, f"{name}/reduce",
                         lambda: dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=self.group))
        values = vec.tolist()
        source = max(range(G), key=lambda g: (values[g], -g))  # the slowest group; ties to the lowest
        matrix = torch.stack(list(rows)) if source == self.index else torch.empty(
            (len(rows), rows[0].numel()), dtype=rows[0].dtype)
        named_collective(self.group, self.ranks, f"{name}/broadcast",
                         lambda: dist.broadcast(matrix, src=self.ranks[source], group=self.group))
        self.everywhere = values[-1] == 0.0
        low, high = [-int(v) for v in values[G + S:G + 2 * S]], [int(v) for v in values[G:G + S]]
        return (None if source == self.index else matrix), low + high


def connect_peers(setting: Any, pp_ranks: Sequence[int], owner: str,
                  delegating: Callable[[], bool] = lambda: False) -> Alone:
    """The :class:`Peers` of a schedule whose PP group has ``pp_ranks`` (global), with a gloo group over
    them entered by the peers only (``control_plane.new_control_group``); :class:`Alone` where there are
    none.  ``"auto"`` in a world of several PP groups whose layout is not a device mesh's warns that this
    PP group decides alone.  ``delegating``: whether this group delegates now (:class:`Peers`)."""
    if not (dist.is_available() and dist.is_initialized()):
        return Alone()
    world, rank = dist.get_world_size(), dist.get_rank()
    peers = resolve_peers(setting, pp_ranks, world, rank)
    if peers is None:
        if setting == "auto" and world > len(pp_ranks) > 1:
            logging.getLogger(__name__).warning(
                "%s: the PP group %s is not a dimension of a device mesh over the %d ranks: it decides its plans "
                "alone (pass peers=[...] to agree them with the other PP groups)", owner, list(pp_ranks), world)
        return Alone()
    return Peers(peers, new_control_group(peers), delegating)
