"""Falcon and delegation built outside the schedule, from its config, as observers and a transport.

The schedule's coordinator (``runtime/adaptive.py``) never constructs them; it receives
:class:`Extensions` — the transport its executor talks through and the boundary observers it calls —
and attaches each to a narrow :class:`~titan_ext.runtime.control.observers.ScheduleContext`:

* ``config.falcon`` → a :class:`~titan_ext.runtime.control.observers.FalconObserver` (Falcon §4–§5);
* ``config.delegation`` (mode other than "off", or failover) → a
  :class:`~titan_ext.runtime.comm.delegate.schedule.Delegation`: the executor's transport and an observer
  (its slow-link switch; PipeMorph §5.2);
* ``config.observers`` → as given.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ..comm.transport import TorchP2P, Transport
from .config import AdaptiveConfig
from .observers import BoundaryObserver, FalconObserver

__all__ = ["Extensions", "build_extensions"]

logger = logging.getLogger(__name__)


@dataclass
class Extensions:
    """What a schedule talks through and who watches its boundaries."""

    transport: Transport = field(default_factory=TorchP2P)
    observers: list[BoundaryObserver] = field(default_factory=list)
    delegation: Any = None  # the Delegation among the observers (the schedule's ``delegation``), or None
    falcon_observer: FalconObserver | None = None  # Falcon among the observers, or None

    @property
    def falcon(self) -> Any:
        """The FalconMonitor, or None."""
        return self.falcon_observer.monitor if self.falcon_observer is not None else None

    def set_falcon(self, value: None, owner: str, cadence: Any, profile_every_max: int) -> None:
        """The schedule's ``falcon = None``: Falcon off (a job-level monitor decides instead); the check
        period may grow again when no other observer needs every iteration."""
        if value is not None:
            raise ValueError(f"{owner}.falcon can only be set to None (off); pass falcon= at construction")
        self.drop_falcon()
        if not self.every_iteration:
            cadence.adaptive(profile_every_max)

    def drop_falcon(self) -> None:
        """Take Falcon off (a job-level monitor decides instead)."""
        self.observers[:] = [o for o in self.observers if o is not self.falcon_observer]
        self.falcon_observer = None

    @property
    def every_iteration(self) -> bool:
        return any(o.every_iteration for o in self.observers)


def build_extensions(config: AdaptiveConfig, name: str, num_stages: int, n_microbatches: int,
                     refused: str | None = None) -> Extensions:
    """Falcon, delegation and the user's observers for a schedule with ``config``.  ``refused``: why
    Falcon and delegation do not run with this layout (``Parts.extensions_refused``, decided by
    ``build_parts``; None: they do): an explicit request is then an error, and ``falcon=True`` (the
    ``[titan_ext]`` default) is switched off with a warning."""
    falcon = config.falcon
    if refused is not None:
        if falcon not in (False, True, None) or config.delegation.enabled:
            raise ValueError(f"{name}: {refused}")
        if falcon is True:
            logger.warning("%s: Falcon is off: %s", name, refused)
            falcon = False
    out = Extensions()
    falcon_observer = FalconObserver.create(falcon, num_stages, n_microbatches)
    if falcon_observer is not None:
        out.observers.append(falcon_observer)
        out.falcon_observer = falcon_observer
    out.observers.extend(config.observers)
    if config.delegation.enabled:
        from ..comm.delegate.schedule import Delegation

        out.delegation = Delegation(config.delegation)
        out.transport = out.delegation.transport
        out.observers.append(out.delegation)
        if out.falcon is not None:  # Falcon's re-plan strategy may now come with delegation (§5)
            out.falcon.config.delegation_available = config.delegation.mode != "off"
    return out
