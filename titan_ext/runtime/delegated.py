"""``DelegatedPipeMorph``: PipeMorph with the delegation API on the schedule object (docs/delegate.md).

It sits above both the schedule (runtime/pipemorph.py) and the delegate package (runtime/delegate/),
so neither imports the other's module at load (the delegate package's ``Delegation`` is a transport
choice that PipeMorph builds when asked for; it does not know the schedule class).
"""

from __future__ import annotations

from .delegate.pool import DelegatePool
from .delegate.transport import P2PRouter
from .pipemorph import PipeMorph

__all__ = ["DelegatedPipeMorph"]


class DelegatedPipeMorph(PipeMorph):
    """PipeMorph with the delegation API on the schedule (the transport is PipeMorph's own choice)."""

    @property
    def router(self) -> P2PRouter | None:
        return self.delegation.router if self.delegation else None

    @property
    def pool(self) -> DelegatePool | None:
        return self.delegation.pool if self.delegation else None

    @property
    def delegation_log(self) -> list[dict]:
        return self.delegation.log if self.delegation else []

    @property
    def delegating(self) -> bool:
        return bool(self.delegation and self.delegation.delegating)

    def set_delegation(self, on: bool, reason: str = "external") -> None:
        if self.delegation is None:
            raise RuntimeError("delegation='off' without failover has no delegates; construct with "
                               "delegation='auto' or 'always'")
        self.delegation.set(on, reason)

    def close_delegation(self) -> None:
        if self.delegation is not None:
            self.delegation.close()
