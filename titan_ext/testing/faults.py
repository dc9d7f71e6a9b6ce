"""Primary-path faults for the delegate transport's tests: :class:`FaultInjector`, an object with
``fails(op, peer, direction, seq) -> bool`` that :class:`~titan_ext.runtime.comm.delegate.transport.P2PRouter`
(``faults=``) and ``DelegationConfig.faults`` take.  The runtime asks only for that method; the class is
test code."""

from __future__ import annotations

from typing import Callable, Mapping

from titan_ext.args import ArgumentTypeError, callable_arg, choice_arg, int_arg

__all__ = ["FaultInjector"]


class FaultInjector:
    """Injects primary-path faults: ``fails(op, peer, direction, seq) -> bool`` with op "send"/"recv".

    ``FaultInjector(broken={(peer, "F"): k})`` (or a set of channels plus ``from_seq=k``): every direct
    send to / receive from ``peer`` in direction ``F`` with sequence number >= k fails — a dead link: the
    send raises, the receive is never satisfied.  Inject it on both ends of the link (a real dead link
    is dead for both; a receive left posted on a Gloo pair that then times out closes that pair)."""

    def __init__(self, broken=(), from_seq: int = 0, predicate: Callable[..., bool] | None = None):
        int_arg(from_seq, "from_seq", 0)
        callable_arg(predicate, "predicate", "a callable (op, peer, direction, seq) -> bool", optional=True)
        if isinstance(broken, (str, bytes)) or not (isinstance(broken, Mapping) or hasattr(broken, "__iter__")):
            raise ArgumentTypeError(f"broken must be a mapping (peer, direction) -> first seq or an iterable of "
                                    f"(peer, direction), got {broken!r}")
        self.broken = dict(broken) if isinstance(broken, Mapping) else {c: from_seq for c in broken}
        for channel, start in self.broken.items():
            if not (isinstance(channel, tuple) and len(channel) == 2):
                raise ArgumentTypeError(f"broken: {channel!r} is not a (peer, direction) pair")
            int_arg(channel[0], f"broken {channel!r} peer", 0)
            choice_arg(channel[1], f"broken {channel!r} direction", ("F", "B"))
            int_arg(start, f"broken[{channel!r}]", 0)
        self.predicate = predicate
        self.injected = 0

    def fails(self, op: str, peer: int, direction: str, seq: int) -> bool:
        start = self.broken.get((peer, direction))
        hit = start is not None and seq >= start
        if self.predicate is not None:
            hit = hit or bool(self.predicate(op, peer, direction, seq))
        if hit:
            self.injected += 1
        return hit
