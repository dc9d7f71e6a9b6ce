"""The one dependency rule: which operations an operation waits for (DESIGN.md "Timing model").

Like the ZeroBubble reference's ``ScheduledNode.get_prev_key``, the rule is a property of the operation
alone, for any placement (one or several stages per rank): F(s, m) needs F(s−1, m); a backward — I or
full B — of (s, m) needs its own F(s, m) and the gradient of stage s+1, I/B(s+1, m); W(s, m) needs
I(s, m). Whether a producer's result travels as a message is the placement's business (producer and
consumer on different ranks). A full B completes what an I would, so producers name it ``"I"`` (:func:`done_key`).

:func:`producers` is the rule; :func:`table` is the same rule as data, the form every evaluator walks.
An op of stage ``s`` and kind ``k`` (0 F, 1 I — or a full B —, 2 W: :data:`KINDS`) belongs to the
*class* ``q = 3·s + k``; the rule never relates different microbatches, so the table is per class
(flat int tuples over ``3·S`` classes, microbatch m of class q being op id ``q·N + m``, the convention of
CrossPipe's model and the C code). It holds the producers of each class (``needs``, what the validators
check), and the rule reduced for the event-driven evaluators: a producer that is an ancestor of another
producer of the same op is implied (I(s)'s F(s) is upstream of the gradient I(s+1)), and dropping it
changes no time (an arrival is never earlier than its producer's end), so every op waits for one
``trigger`` — the message or same-stage result whose arrival makes it ready. ``feeds`` lists, per class,
the classes its end makes ready (same-stage ones first), and ``link`` the stage boundary each trigger
message crosses.

Who walks the table: the reference ``simulate`` (its sends; its readiness calls :func:`producers`, as
the validator's Python checks do) and the validator's compiled checks (``needs``); ``replay_makespan_ns``, PipeMorph's generator and the
virtual-stage generator (Python ``_generate_py`` / ``_virtual_loop_py`` and ``_pipemorph.c``), CrossPipe's
greedy (``_Alg1`` and ``_greedy.c``), its model (``Model``'s edges, which ``_search.c`` reads from
``Model.spec()``) and search, and CP-SAT's arcs (``optimal``). The C modules get :meth:`DepTable.spec`
from Python and hard-code no rule (tests/plan/test_plan_deps_table.py feeds them a different rule). They are
checked bit-for-bit against ``simulate`` on random profiles by ``tests/plan/test_plan_reference.py``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from .ir import COMPUTE_KINDS, Op

KINDS = COMPUTE_KINDS[:3]
"""kind index k of class ``3·stage + k``: F, I, W (a full B is class I)."""

KIND_INDEX = {**{kind: k for k, kind in enumerate(KINDS)}, COMPUTE_KINDS[3]: 1}

ROOT = -1
"""``trigger`` of a class that needs nothing (stage 0's F): its ops are ready from the start."""

ABSENT = -2
"""``trigger`` of a class with no ops in the problem (W with full backwards)."""


def producers(op: Op, num_stages: int) -> tuple[Op, ...]:
    """The ops whose completion ``op`` needs, as :func:`done_key` names them."""
    stage, kind, mb = op
    if kind == "F":
        return () if stage == 0 else ((stage - 1, "F", mb),)
    if kind == "W":
        return ((stage, "I", mb),)
    if stage == num_stages - 1:
        return ((stage, "F", mb),)
    return ((stage, "F", mb), (stage + 1, "I", mb))


SAME_STAGE = {kind: p[1] for kind in COMPUTE_KINDS for p in producers((0, kind, 0), 2) if p[0] == 0}
"""kind → the kind of the same-stage, same-microbatch op it needs (local order): ``{"I": "F", "B": "F",
"W": "I"}``, read off :func:`producers`."""


def done_key(op: Op) -> Op:
    """The name under which a completed op satisfies its consumers (a full B as an I)."""
    stage, kind, mb = op
    return (stage, "I", mb) if kind == "B" else op


def class_of(stage: int, kind: str) -> int:
    """The class ``3·stage + k`` of an op of ``stage`` and ``kind`` (B: I's class)."""
    return 3 * stage + KIND_INDEX[kind]


def _csr(lists: list[list[int]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    off, flat = [0], []
    for row in lists:
        flat.extend(row)
        off.append(len(flat))
    return tuple(off), tuple(flat)


@dataclass(frozen=True)
class DepTable:
    """The dependency rule of one problem as flat int tuples (the module docstring); built by :func:`table`.

    Per class q (``3·S`` of them): ``needs[needs_off[q]:needs_off[q+1]]`` its producers' classes;
    ``trigger[q]`` the one producer class it waits for after the implied ones are dropped (:data:`ROOT`,
    :data:`ABSENT`); ``link[q]`` the stage boundary (link i joins stage i and i+1) the trigger's result
    crosses, −1 when it comes from q's own stage; ``feeds[feeds_off[q]:feeds_off[q+1]]`` the classes
    whose trigger is q (same stage first, then ascending); ``users[users_off[q]:users_off[q+1]]`` every
    class that needs q (the inverse of ``needs``). Microbatch m of class q is op id ``q·N + m``.
    """

    num_stages: int
    full_backward: bool
    needs_off: tuple[int, ...]
    needs: tuple[int, ...]
    trigger: tuple[int, ...]
    link: tuple[int, ...]
    feeds_off: tuple[int, ...]
    feeds: tuple[int, ...]
    users_off: tuple[int, ...]
    users: tuple[int, ...]

    def spec(self) -> tuple:
        """The table as the C modules read it (``_deps.h``):
        ``(S, trigger, link, feeds_off, feeds, needs_off, needs)``."""
        spec = self.__dict__.get("_spec")
        if spec is None:
            spec = (self.num_stages, self.trigger, self.link, self.feeds_off, self.feeds, self.needs_off, self.needs)
            object.__setattr__(self, "_spec", spec)
        return spec

    def feeds_of(self, q: int) -> tuple[int, ...]:
        return self.feeds[self.feeds_off[q]:self.feeds_off[q + 1]]

    def needs_of(self, q: int) -> tuple[int, ...]:
        return self.needs[self.needs_off[q]:self.needs_off[q + 1]]

    def users_of(self, q: int) -> tuple[int, ...]:
        return self.users[self.users_off[q]:self.users_off[q + 1]]

    def producer_op(self, op_id: int, num_microbatches: int) -> int | None:
        """The op id whose arrival makes op ``op_id`` ready (its trigger), None when it needs nothing."""
        t = self.trigger[op_id // num_microbatches]
        return None if t < 0 else t * num_microbatches + op_id % num_microbatches

    def edges(self) -> list[tuple[int, int]]:
        """Every ``(trigger class, class)`` pair, by consumer class."""
        return [(t, q) for q, t in enumerate(self.trigger) if t >= 0]


Rule = Callable[[Op, int], "tuple[Op, ...]"]


def table(num_stages: int, full_backward: bool = False, rule: Rule | None = None) -> DepTable:
    """The producer/consumer table of a problem with ``num_stages`` stages (any placement, any N: the
    rule relates ops of one microbatch only). ``full_backward``: the plan has full backwards B (class I)
    and no W. ``rule``: another ``producers`` (tests, a new op kind); default :func:`producers`.
    Raises ValueError when, after the implied producers are dropped, an op still waits for two (the
    event-driven evaluators take one trigger per op) or a cross-stage producer is not an adjacent stage."""
    if rule is None:
        return _table(num_stages, bool(full_backward))
    return _build(num_stages, bool(full_backward), rule)


@functools.lru_cache(maxsize=64)
def _table(num_stages: int, full_backward: bool) -> DepTable:
    return _build(num_stages, full_backward, producers)


def _build(S: int, full_backward: bool, rule: Rule) -> DepTable:
    n = 3 * S
    present = [not (full_backward and q % 3 == 2) for q in range(n)]
    needs: list[list[int]] = []
    for q in range(n):
        if not present[q]:
            needs.append([])
            continue
        kind = "B" if full_backward and q % 3 == 1 else KINDS[q % 3]
        row = []
        for p in rule((q // 3, kind, 0), S):
            pq = class_of(p[0], done_key(p)[1])
            if not 0 <= pq < n or not present[pq] or p[2] != 0:
                raise ValueError(f"rule: op {(q // 3, kind, 0)} needs {p}, which is not an op of the problem")
            if pq not in row:
                row.append(pq)
        needs.append(row)
    # ancestors of every class as a bit set, in topological order (the rule must be acyclic)
    anc = [-1] * n
    on_path = [False] * n
    for root in range(n):
        if anc[root] >= 0:
            continue
        stack = [(root, 0)]
        on_path[root] = True
        while stack:
            q, i = stack.pop()
            if i < len(needs[q]):
                stack.append((q, i + 1))
                p = needs[q][i]
                if anc[p] < 0:
                    if on_path[p]:
                        raise ValueError(f"rule: class {p} depends on itself")
                    on_path[p] = True
                    stack.append((p, 0))
                continue
            on_path[q] = False
            if anc[q] < 0:
                bits = 0
                for p in needs[q]:
                    bits |= anc[p] | (1 << p)
                anc[q] = bits

    trigger, link = [ABSENT] * n, [-1] * n
    for q in range(n):
        if not present[q]:
            continue
        direct = [p for p in needs[q] if not any(anc[o] >> p & 1 for o in needs[q] if o != p)]
        if len(direct) > 1:
            raise ValueError(f"rule: class {q} waits for {len(direct)} independent producers {direct}; "
                             f"the evaluators take one trigger per op")
        if not direct:
            trigger[q] = ROOT
            continue
        p = trigger[q] = direct[0]
        sp, sq = p // 3, q // 3
        if abs(sp - sq) > 1:
            raise ValueError(f"rule: class {q} needs class {p} of a non-adjacent stage (no link joins them)")
        link[q] = -1 if sp == sq else min(sp, sq)
    feeds: list[list[int]] = [[] for _ in range(n)]
    users: list[list[int]] = [[] for _ in range(n)]
    for q in range(n):
        if trigger[q] >= 0:
            feeds[trigger[q]].append(q)
        for p in needs[q]:
            users[p].append(q)
    for p in range(n):
        feeds[p].sort(key=lambda q: (q // 3 != p // 3, q))
    needs_off, needs_flat = _csr(needs)
    feeds_off, feeds_flat = _csr(feeds)
    users_off, users_flat = _csr(users)
    return DepTable(S, full_backward, needs_off, needs_flat, tuple(trigger), tuple(link), feeds_off, feeds_flat,
                    users_off, users_flat)
