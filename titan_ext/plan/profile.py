"""Profiles: what the planners know about the pipeline (PipeMorph Table 1; CrossPipe §2.2).

Per stage: t_F, t_B (backward-input, torch's ``I``), t_W in milliseconds; per-microbatch activation
memory and a per-stage memory budget (bytes). Per link ``i`` (joining stage ``i`` and ``i + 1``): one-way
latency (ms), bandwidth (bytes/s) and the size of the message it carries (bytes) — the α-β model of
CrossPipe §2.2, whose one-way delay ``c_i = α_i + size·β_i`` is the ``c_i`` of PipeMorph Eq.1.

Every field is validated on construction; a bad value raises ``ValueError`` naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence


def _check_number(name: str, value: float, *, positive: bool = False, allow_inf: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name} is NaN")
    if math.isinf(value) and not allow_inf:
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


@dataclass(frozen=True)
class LinkProfile:
    """One PP link (both directions alike). ``delay_ms`` is the one-way delay of one message."""

    latency_ms: float = 0.0
    bandwidth_bytes_per_s: float = math.inf
    message_bytes: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "latency_ms", _check_number("latency_ms", self.latency_ms))
        object.__setattr__(
            self,
            "bandwidth_bytes_per_s",
            _check_number("bandwidth_bytes_per_s", self.bandwidth_bytes_per_s, positive=True, allow_inf=True),
        )
        object.__setattr__(self, "message_bytes", _check_number("message_bytes", self.message_bytes))

    @property
    def transfer_ms(self) -> float:
        """Time the message occupies the link (size · β): the bandwidth part of the delay."""
        if math.isinf(self.bandwidth_bytes_per_s):
            return 0.0
        return self.message_bytes / self.bandwidth_bytes_per_s * 1e3

    @property
    def delay_ms(self) -> float:
        """One-way delay of a lone message: α + size · β."""
        return self.latency_ms + self.transfer_ms


def _stage_tuple(name: str, values: float | Sequence[float], n: int, *, positive: bool) -> tuple[float, ...]:
    if isinstance(values, (int, float)) and not isinstance(values, bool):
        values = [values] * n
    values = tuple(values)
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries, expected one per stage ({n})")
    return tuple(_check_number(f"{name}[{i}]", v, positive=positive) for i, v in enumerate(values))


@dataclass(frozen=True)
class PipelineProfile:
    """Measured (or assumed) per-stage times, memory and per-link delays of one pipeline.

    ``f_ms``, ``b_ms``, ``w_ms``: per-stage F / backward-input / backward-weight times (ms). F and B
    must be > 0; W may be 0. ``links``: ``num_stages - 1`` LinkProfiles (empty means no delay anywhere).
    ``activation_bytes`` / ``memory_budget_bytes``: per-stage memory of one microbatch's activations and
    the per-stage budget for them; both or neither.
    """

    num_stages: int
    num_microbatches: int
    f_ms: tuple[float, ...]
    b_ms: tuple[float, ...]
    w_ms: tuple[float, ...]
    links: tuple[LinkProfile, ...] = field(default=())
    activation_bytes: tuple[float, ...] | None = None
    memory_budget_bytes: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("num_stages", "num_microbatches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name} must be an integer, got {v!r}")
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        S = self.num_stages
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        set_("f_ms", _stage_tuple("f_ms", self.f_ms, S, positive=True))
        set_("b_ms", _stage_tuple("b_ms", self.b_ms, S, positive=True))
        set_("w_ms", _stage_tuple("w_ms", self.w_ms, S, positive=False))
        links = tuple(self.links) if self.links else tuple(LinkProfile() for _ in range(S - 1))
        if len(links) != S - 1:
            raise ValueError(f"links has {len(links)} entries, expected num_stages - 1 = {S - 1}")
        for i, link in enumerate(links):
            if not isinstance(link, LinkProfile):
                raise ValueError(f"links[{i}] must be a LinkProfile, got {type(link).__name__}")
        set_("links", links)
        if (self.activation_bytes is None) != (self.memory_budget_bytes is None):
            raise ValueError("activation_bytes and memory_budget_bytes must be given together")
        if self.activation_bytes is not None:
            act = _stage_tuple("activation_bytes", self.activation_bytes, S, positive=True)
            budget = _stage_tuple("memory_budget_bytes", self.memory_budget_bytes, S, positive=False)
            for i, (a, m) in enumerate(zip(act, budget)):
                if m < a:
                    raise ValueError(
                        f"memory_budget_bytes[{i}] = {m:g} is too small for one microbatch "
                        f"(activation_bytes[{i}] = {a:g})"
                    )
            set_("activation_bytes", act)
            set_("memory_budget_bytes", budget)

    @classmethod
    def uniform(
        cls,
        num_stages: int,
        num_microbatches: int,
        f_ms: float,
        b_ms: float,
        w_ms: float,
        delays_ms: Mapping[int, float] | None = None,
        **kwargs,
    ) -> "PipelineProfile":
        """Same times on every stage; ``delays_ms = {link: one-way latency in ms}``."""
        links = [LinkProfile() for _ in range(max(num_stages - 1, 0))]
        for link, ms in (delays_ms or {}).items():
            if not 0 <= link < num_stages - 1:
                raise ValueError(f"delays_ms: link {link} does not exist (links are 0..{num_stages - 2})")
            links[link] = LinkProfile(latency_ms=ms)
        return cls(num_stages, num_microbatches, f_ms, b_ms, w_ms, tuple(links), **kwargs)

    @property
    def delays_ms(self) -> tuple[float, ...]:
        """c_i of every link: α_i + size·β_i (PipeMorph Table 1)."""
        return tuple(link.delay_ms for link in self.links)

    def max_inflight(self) -> tuple[int, ...] | None:
        """Per stage, how many microbatches' activations fit in the budget (Alg.1 line 2), or None."""
        if self.activation_bytes is None:
            return None
        return tuple(int(m // a) for a, m in zip(self.activation_bytes, self.memory_budget_bytes))

    def fused(self) -> "PipelineProfile":
        """The same pipeline with the backward not split: ``b_ms`` = B + W of each stage, ``w_ms`` = 0
        (the profile a full-backward, 1F1B-style plan is planned and checked with)."""
        return replace(self, b_ms=tuple(b + w for b, w in zip(self.b_ms, self.w_ms)), w_ms=(0.0,) * self.num_stages)

    def with_links(self, links: Sequence[LinkProfile]) -> "PipelineProfile":
        return replace(self, links=tuple(links))

    def with_delays(self, delays_ms: Mapping[int, float]) -> "PipelineProfile":
        """A copy whose link ``i`` latency is replaced by ``delays_ms[i]`` (other fields kept)."""
        links = list(self.links)
        for i, ms in delays_ms.items():
            if not 0 <= i < len(links):
                raise ValueError(f"delays_ms: link {i} does not exist (links are 0..{len(links) - 1})")
            links[i] = replace(links[i], latency_ms=ms)
        return self.with_links(links)
