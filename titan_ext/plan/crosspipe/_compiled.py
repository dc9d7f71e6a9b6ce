"""The compiled CrossPipe engines: ``titan_ext.plan._greedy_c`` (Alg.1, from ``_greedy.c``) and
``titan_ext.plan._search_c`` (``simulate``'s timing model on flat arrays, descent, annealing, from
``_search.c``), both built by setup.py; both in integer nanoseconds (``_link.h``'s int64 send).

:func:`greedy_ids` returns what :func:`.greedy.greedy_schedule` computes — the per-rank whole-action
orders as operation ids (:class:`.retime.Retimer`'s convention), the makespan (ns) and the number of
lookahead waits — bit-identically, about two orders of magnitude faster (tests/plan/test_crosspipe_greedy_c.py).
It raises ValueError exactly where ``greedy_schedule`` does (bad arguments, same messages; a memory limit
that admits no schedule).  Inputs outside what the compiled code reproduces exactly (a total of times
beyond 2**62 ns, more than 2**31 sub-blocks) go through the Python ``greedy_schedule`` itself, so the
result is the same in every case.

Importing this module never fails: without the compiled modules :func:`available` is False.
"""

from __future__ import annotations

import functools

from ..deps import table
from .greedy import check_greedy_args, greedy_schedule, trigger_channels
from .retime import Retimer

try:
    from .. import _greedy_c as _C
except ImportError:  # not built (scripts/setup.sh builds it)
    _C = None

__all__ = ["available", "engine", "greedy_ids", "exact_in_c"]

_LIMIT_NS = 1 << 62
_cache: dict[int, tuple] = {}  # id(placed) -> (placed, spec capsule or None, lim, need_f cache)
_specs: dict[tuple, object] = {}  # the profile and placement (by value) -> spec capsule or None
_CACHE_MAX = 256


@functools.lru_cache(maxsize=1)
def engine():
    """The compiled search engine (``titan_ext.plan._search_c``), or None when it is not built."""
    try:
        from .. import _search_c
    except ImportError:
        return None
    return _search_c


def available() -> bool:
    """Whether the compiled planner path can run: both compiled modules are built.  Otherwise the
    pure-Python path runs (same members, fewer of them, descent only)."""
    return _C is not None and engine() is not None


def exact_in_c(placed) -> bool:
    """Whether every time the compiled code can reach fits its int64 ns: all operations and all messages
    of the plan one after the other stay below 2**62 ns."""
    N = placed.num_microbatches
    total = N * sum(sum(t) for t in placed.times_ns())
    total += N * 2 * sum(sum(placed.link_ns(b)) for b in range(placed.num_stages - 1))
    return total < _LIMIT_NS


def _hop_arrays(placed):
    """The dependency table (``deps.table``) and, per op class c, the message that brings c's trigger:
    channel id (src·R + dst, −1 same rank), size·β and α in ns (``greedy.trigger_channels``)."""
    R = placed.num_ranks
    hops = trigger_channels(placed)
    ch = [-1 if h is None else h[1][0] * R + h[1][1] for h in hops]
    tx = [0 if h is None else placed.link_ns(h[0])[1] for h in hops]
    lat = [0 if h is None else placed.link_ns(h[0])[0] for h in hops]
    return table(placed.num_stages).spec(), ch, tx, lat


def _build(placed):
    """The spec capsule of one placed profile without its memory limit (passed per call), or None when the
    compiled path would not be exact."""
    if not exact_in_c(placed):
        return None
    f, b, w = placed.times_ns()
    return _C.make_spec(placed.num_ranks, placed.num_microbatches, tuple(placed.stage_to_rank), f, b, w,
                        *_hop_arrays(placed), tuple(float(x) for x in placed.memory_deltas))


def _entry(placed):
    e = _cache.get(id(placed))
    if e is not None and e[0] is placed:
        return e
    # a new object: the planner derives many that differ only in memory_limit (with_memory_limit), so the
    # spec is shared by value of the profile and placement
    key = (placed.profile, placed.stage_to_rank)
    try:
        spec = _specs[key]
    except KeyError:
        spec = _build(placed)
        if len(_specs) >= _CACHE_MAX:
            _specs.clear()
        _specs[key] = spec
    limit = placed.memory_limit
    lim = None if limit is None else tuple(x + 1e-9 for x in limit)  # as greedy_schedule
    if len(_cache) >= _CACHE_MAX:
        _cache.clear()
    e = (placed, spec, lim, {})
    _cache[id(placed)] = e  # holds the object: its id cannot be reused while cached
    return e


def _python(placed, n_sub, steady, reserve, tie, lookahead):
    res = greedy_schedule(placed, n_sub, steady, reserve, tie, lookahead)
    return Retimer(placed).ids(res.orders), res.makespan_ns, res.waits


def _big_need_f(placed, needs: dict, k_units: int) -> tuple | None:
    """need_f for a V-turn reserve beyond what the C code computes exactly (k > 2**20), cached per k."""
    if k_units <= 2**20:
        return None  # computed in C: mf + k·mf·#later, exact for these k
    need_f = needs.get(k_units)
    if need_f is None:
        mf = placed.memory_deltas[0]
        s2r = placed.stage_to_rank
        S = len(s2r)
        need_f = tuple(mf + k_units * mf * sum(1 for s2 in range(s + 1, S) if s2r[s2] == s2r[s]) for s in range(S))
        needs[k_units] = need_f
    return need_f


def greedy_ids(placed, n_sub=1, steady="interleave", reserve="one", tie="microbatch", lookahead=False):
    """``greedy_schedule(placed, n_sub, steady, reserve, tie, lookahead)`` compiled: returns
    ``(ids, makespan_ns, waits)``, ``ids[r]`` rank r's operation ids in execution order."""
    if _C is None:
        raise ImportError("titan_ext.plan._greedy_c is not built (run scripts/setup.sh)")
    reserve1 = check_greedy_args(n_sub, steady, reserve, tie)
    pending = reserve1 == "pending"
    k_units = 1 if pending else reserve1
    _, spec, lim, needs = _entry(placed)
    if spec is None or n_sub >= 2**31:
        return _python(placed, n_sub, steady, reserve, tie, lookahead)
    need_f = _big_need_f(placed, needs, k_units)
    ids, mk, waits = _C.run(spec, n_sub, steady == "backward_first", pending, float(k_units) if need_f is None else 1.0,
                            tie == "critical_path", bool(lookahead), need_f, lim)
    if ids is None:
        if mk == 1:
            raise ValueError(
                "CrossPipe greedy: no rank can proceed — the memory limit admits no schedule "
                f"(memory_limit={placed.memory_limit})"
            )
        raise TypeError("cannot unpack non-iterable NoneType object")
    return ids, mk, waits
