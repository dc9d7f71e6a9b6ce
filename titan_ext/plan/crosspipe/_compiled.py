"""The compiled CrossPipe engines: ``titan_ext.plan._greedy_c`` (Alg.1, from ``_greedy.c``) and
``titan_ext.plan._search_c`` (timing model, descent, annealing, from ``_search.c``), both built by
setup.py.

:func:`greedy_ids` returns what :func:`.greedy.greedy_schedule` computes — the per-rank whole-action
orders as operation ids (:class:`.model.Model`'s convention), the makespan and the number of lookahead
waits — bit-identically, about two orders of magnitude faster (tests/plan/test_crosspipe_greedy_c.py).  It
raises ValueError exactly where ``greedy_schedule`` does (bad arguments, same messages; a memory limit
that admits no schedule).  Inputs outside what the compiled code reproduces exactly (integers too large
for an IEEE double, non-numeric memory deltas, more than 2**31 sub-blocks) go through the Python
``greedy_schedule`` itself, so the result is the same in every case.

Importing this module never fails: without the compiled modules :func:`available` is False.
"""

from __future__ import annotations

import functools

from ..deps import table
from .greedy import check_greedy_args, greedy_schedule, trigger_hops
from .model import Model

try:
    from .. import _greedy_c as _C
except ImportError:  # not built (scripts/setup.sh builds it)
    _C = None

__all__ = ["available", "engine", "greedy_ids"]

_BIG = 2**53
_cache: dict[int, tuple] = {}  # id(problem) -> (problem, spec capsule or None, lim, need_f cache)
_specs: dict[tuple, object] = {}  # everything but the memory limit (by value) -> spec capsule or None
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


def _exact_number(x) -> bool:
    """x converts to the IEEE double Python's own arithmetic on it would use, with no rounding."""
    return isinstance(x, float) or (isinstance(x, int) and -_BIG <= x <= _BIG)


def _hop_arrays(problem):
    """The dependency table (``deps.table``) and, per op class c, the message that brings c's trigger:
    channel id (src·R + dst, −1 same rank), size·β and α (``greedy.trigger_hops``)."""
    R = problem.num_ranks
    hops = trigger_hops(problem)
    ch = [-1 if h is None else h.channel[0] * R + h.channel[1] for h in hops]
    tx = [0.0 if h is None else h.transfer_ms for h in hops]
    lat = [0.0 if h is None else h.latency_ms for h in hops]
    return table(problem.num_stages).spec(), ch, tx, lat


def _build(problem):
    """The spec capsule of one problem without its memory limit (passed per call), or None when the
    compiled path would not be exact."""
    for d in problem.memory_deltas:
        if not (isinstance(d, float) or (isinstance(d, int) and -(2**20) <= d <= 2**20)):
            return None
    if not all(_exact_number(x) for x in problem.w_ms):
        return None  # w / n_sub of a huge int is an exact rational division in Python
    try:
        return _C.make_spec(problem.num_ranks, problem.num_microbatches, tuple(problem.stage_to_rank), problem.f_ms,
                            problem.b_ms, problem.w_ms, *_hop_arrays(problem), tuple(problem.memory_deltas))
    except (OverflowError, TypeError):
        return None  # e.g. an int beyond the double range: let the Python reference decide


def _entry(problem):
    e = _cache.get(id(problem))
    if e is not None and e[0] is problem:
        return e
    # a new problem object: the planner derives many that differ only in memory_limit
    # (with_memory_limit), so the spec is shared by value of the other fields (Python's == on them is
    # exact, and equal values give the compiled code equal doubles)
    key = (problem.num_ranks, problem.num_microbatches, problem.stage_to_rank, problem.f_ms, problem.b_ms,
           problem.w_ms, problem.link_latency_ms, problem.link_transfer_ms, problem.memory_deltas)
    try:
        spec = _specs[key]
    except KeyError:
        spec = _build(problem)
        if len(_specs) >= _CACHE_MAX:
            _specs.clear()
        _specs[key] = spec
    except TypeError:  # unhashable field values: no sharing
        spec = _build(problem)
    limit = problem.memory_limit
    lim = None if limit is None else tuple(x + 1e-9 for x in limit)  # as greedy_schedule
    if len(_cache) >= _CACHE_MAX:
        _cache.clear()
    e = (problem, spec, lim, {})
    _cache[id(problem)] = e  # holds the problem: its id cannot be reused while cached
    return e


def _python(problem, n_sub, steady, reserve, tie, lookahead):
    res = greedy_schedule(problem, n_sub, steady, reserve, tie, lookahead)
    return Model(problem).ids(res.orders), res.makespan_ms, res.waits


def _big_need_f(problem, needs: dict, k_units: int) -> tuple | None:
    """need_f for a V-turn reserve beyond what the C code computes exactly (k > 2**20), cached per k."""
    if k_units <= 2**20:
        return None  # computed in C: mf + k·mf·#later, exact for these k
    need_f = needs.get(k_units)
    if need_f is None:
        mf = problem.memory_deltas[0]
        s2r = problem.stage_to_rank
        S = len(s2r)
        need_f = tuple(mf + k_units * mf * sum(1 for s2 in range(s + 1, S) if s2r[s2] == s2r[s]) for s in range(S))
        needs[k_units] = need_f
    return need_f


def greedy_ids(problem, n_sub=1, steady="interleave", reserve="one", tie="microbatch", lookahead=False):
    """``greedy_schedule(problem, n_sub, steady, reserve, tie, lookahead)`` compiled: returns
    ``(ids, makespan_ms, waits)``, ``ids[r]`` rank r's operation ids in execution order."""
    if _C is None:
        raise ImportError("titan_ext.plan._greedy_c is not built (run scripts/setup.sh)")
    reserve1 = check_greedy_args(n_sub, steady, reserve, tie)
    pending = reserve1 == "pending"
    k_units = 1 if pending else reserve1
    _, spec, lim, needs = _entry(problem)
    if spec is None or n_sub >= 2**31:
        return _python(problem, n_sub, steady, reserve, tie, lookahead)
    need_f = _big_need_f(problem, needs, k_units)
    ids, mk, waits = _C.run(spec, n_sub, steady == "backward_first", pending, float(k_units) if need_f is None else 1.0,
                            tie == "critical_path", bool(lookahead), None, need_f, lim)
    if ids is None:
        if mk == 1:
            raise ValueError(
                "CrossPipe greedy: no rank can proceed — the memory limit admits no schedule "
                f"(memory_limit={problem.memory_limit})"
            )
        raise TypeError("cannot unpack non-iterable NoneType object")
    return ids, mk, waits
