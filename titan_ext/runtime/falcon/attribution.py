"""Validation's findings → components and their causes → the root cause Alg. 1 acts on (Falcon
§4.3 validation; ``event.root_cause`` of Alg. 1 line 4, §5.2; §7.3's compound case). Process-group free.

Every slow link and slow device is a *component*. A slow link with a slow device at one end is the
device's (a slow device also delays the messages it sends and receives); any other slow link is
the link's own fault: ``pp_link`` when it joins adjacent stages of one pipeline of the grid,
``dp_link`` otherwise. The root cause is that of the first component the event has not handled yet
(a strategy of its ladder was decided for it) — independent links first, then devices — so that in
Falcon §7.3's compound case (Fig. 17: a slow link → S3, then a slow GPU → S2, then S4) the slow
device that appears after the link was moved is attributed to the device although the link is
still slow. With every component handled, the first one's.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Component", "Attribution", "attribute", "link_cause"]


@dataclass(frozen=True)
class Component:
    """``kind`` "link" (``key`` = the two ranks, sorted: both directions are one link) or "device"
    (``key`` = the rank); ``cause``: ``pp_link`` / ``dp_link`` / ``compute`` / ``unknown``;
    ``measure``: the link's excess time over the reference (s) or the device's probe slowdown
    (× median); ``handled``: a strategy was already decided for it in this event."""

    kind: str
    key: tuple[int, ...]
    cause: str
    measure: float | None = None
    handled: bool = False

    def label(self) -> str:
        return f"link {self.key[0]}-{self.key[1]}" if self.kind == "link" else f"device {self.key[0]}"

    def as_row(self) -> dict:
        return {"component": self.label(), "cause": self.cause, "measure": self.measure, "handled": self.handled}


@dataclass(frozen=True)
class Attribution:
    components: tuple[Component, ...]
    root: Component | None
    """The component the root cause is taken from (None: no slow link or device)."""

    @property
    def root_cause(self) -> str | None:
        return None if self.root is None else self.root.cause


def link_cause(link: tuple[int, int], grid) -> str:
    """``pp_link`` if the two ranks are adjacent stages of one pipeline (``grid[dp][pp]``), else
    ``dp_link``; ``unknown`` without a grid."""
    if grid is None:
        return "unknown"
    pos = {r: (d, s) for d, row in enumerate(grid) for s, r in enumerate(row)}
    a, b = link
    if a not in pos or b not in pos:
        return "unknown"
    (da, sa), (db, sb) = pos[a], pos[b]
    return "pp_link" if da == db and abs(sa - sb) == 1 else "dp_link"


def attribute(slow_links, slow_devices, grid=None, handled=frozenset(), link_excess_s=None,
              device_slowdown=None) -> Attribution:
    """The components of validation's ``slow_links`` (``(a, b)`` pairs) and ``slow_devices``, each
    with its cause, and the root component (module docstring). ``handled``: keys of components a
    strategy was decided for in this event."""
    devices = [int(d) for d in slow_devices]
    link_excess_s = link_excess_s or {}
    device_slowdown = device_slowdown or {}
    links: dict[tuple[int, ...], Component] = {}
    for a, b in slow_links:
        if a in devices or b in devices:
            continue  # the device's
        key = tuple(sorted((int(a), int(b))))
        excess = max([v for k, v in link_excess_s.items() if tuple(sorted(k)) == key] or [float("nan")])
        if key not in links:
            links[key] = Component("link", key, link_cause((a, b), grid), excess if excess == excess else None,
                                   key in handled)
    comps = list(links.values()) + [
        Component("device", (d,), "compute", device_slowdown.get(d), (d,) in handled) for d in devices]
    root = next((c for c in comps if not c.handled), comps[0] if comps else None)
    return Attribution(tuple(comps), root)
