"""The one dependency rule: which operations an operation waits for (DESIGN.md "Timing model").

Like the ZeroBubble reference's ``ScheduledNode.get_prev_key``, the rule is a property of the operation
alone, for any placement (one or several stages per rank): F(s, m) needs F(s−1, m); a backward — I or
full B — of (s, m) needs its own F(s, m) and the gradient of stage s+1, I/B(s+1, m); W(s, m) needs
I(s, m). Whether a producer's result travels as a message is the placement's business (producer and
consumer on different ranks). A full B completes what an I would, so producers name it ``"I"`` (:func:`done_key`).

The reference evaluator (``simulate``) and the validator use this module; the fast evaluators inline
the same rule for speed (PipeMorph's generator and ``replay_makespan_ns``, the virtual-stage generator,
CrossPipe's greedy, model and search in Python and C) and are checked bit-for-bit against ``simulate``
on random profiles by ``tests/test_plan_reference.py``; CP-SAT's arcs (``optimal``) are checked there to
be no weaker than this rule.
"""

from __future__ import annotations

from .ir import Op

SAME_STAGE = {"I": "F", "B": "F", "W": "I"}
"""kind → the kind of the same-stage, same-microbatch op it needs (local order)."""


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


def done_key(op: Op) -> Op:
    """The name under which a completed op satisfies its consumers (a full B as an I)."""
    stage, kind, mb = op
    return (stage, "I", mb) if kind == "B" else op

