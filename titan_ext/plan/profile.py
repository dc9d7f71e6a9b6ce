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
from typing import Any, Mapping, Sequence

from ..args import ArgumentTypeError, int_arg, instance_arg

# Bounds of the timing model (integer nanoseconds, plan/timing.py): any time, latency or transfer time is
# at most MAX_MS (11.6 days), and a time that must be > 0 is at least MIN_POSITIVE_MS (1 ns, the
# simulator's resolution: below it, it would round to nothing).
MAX_MS = 1e9
MIN_POSITIVE_MS = 1e-6
# Bound on num_stages and num_microbatches (a 5,000-digit count is a typo, not a pipeline)
MAX_COUNT = 1 << 24


def _check_number(
    name: str, value: float, *, positive: bool = False, allow_inf: bool = False, max_value: float = math.inf
) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name} is NaN")
    if math.isinf(value) and not allow_inf:
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    if value > max_value:
        raise ValueError(f"{name} must be at most {max_value:g}, got {value:g}")
    return value


def _check_ms(name: str, value: float, *, positive: bool) -> float:
    """A time in ms within the timing model's bounds (MAX_MS; MIN_POSITIVE_MS when it must be > 0)."""
    value = _check_number(name, value, positive=positive, max_value=MAX_MS)
    if positive and value < MIN_POSITIVE_MS:
        raise ValueError(f"{name} must be at least {MIN_POSITIVE_MS:g} ms (1 ns), got {value:g}")
    return value


@dataclass(frozen=True)
class LinkProfile:
    """One PP link (both directions alike). ``delay_ms`` is the one-way delay of one message."""

    latency_ms: float = 0.0
    bandwidth_bytes_per_s: float = math.inf
    message_bytes: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "latency_ms", _check_ms("latency_ms", self.latency_ms, positive=False))
        object.__setattr__(
            self,
            "bandwidth_bytes_per_s",
            _check_number("bandwidth_bytes_per_s", self.bandwidth_bytes_per_s, positive=True, allow_inf=True),
        )
        object.__setattr__(self, "message_bytes", _check_number("message_bytes", self.message_bytes))
        if self.transfer_ms > MAX_MS:
            raise ValueError(
                f"message_bytes / bandwidth_bytes_per_s = {self.transfer_ms:g} ms per message, beyond "
                f"{MAX_MS:g} ms (message_bytes {self.message_bytes:g}, bandwidth {self.bandwidth_bytes_per_s:g} B/s)"
            )

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


def _stage_tuple(
    name: str, values: float | Sequence[float], n: int, *, positive: bool, ms: bool = True
) -> tuple[float, ...]:
    if isinstance(values, (int, float)) and not isinstance(values, bool):
        values = [values] * n
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ArgumentTypeError(f"{name} must be a number or one number per stage, got {type(values).__name__}")
    values = tuple(values)
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries, expected one per stage ({n})")
    if values and all(type(v) is float for v in values) and not any(v != v for v in values):
        # the usual case (a profile derived from another): the bounds of _check_ms / _check_number in one
        # pass of builtins; each value's own check (and its error) only where one fails
        lo, hi = min(values), max(values)
        if (lo >= (MIN_POSITIVE_MS if positive else 0.0) and hi <= MAX_MS if ms
                else (lo > 0.0 if positive else lo >= 0.0) and hi < math.inf):
            return values
    if ms:
        return tuple(_check_ms(f"{name}[{i}]", v, positive=positive) for i, v in enumerate(values))
    return tuple(_check_number(f"{name}[{i}]", v, positive=positive) for i, v in enumerate(values))


RELEASES = {"I": frozenset({"I", "B"}), "W": frozenset({"W", "B"})}
"""The memory rule: ``profile.release`` → the kinds whose end frees a microbatch's activation on its stage.
``"I"``: the papers' model (PipeMorph §4, CrossPipe's default deltas: what W needs is taken as free).
``"W"``: torch's runtime — its split backward keeps the whole autograd graph from I until W
(``stage_backward_input`` retains it for ``stage_backward_weight``; ``runtime.execute.memory.ActivationMeter``
measures an I freeing nothing), so an activation is held from its F until its W or full B.  What
titan_ext's runtime plans with.  Every in-flight count takes its kinds from here."""


def released_by(release: str) -> frozenset:
    """The kinds that free an activation under ``release`` ("I" or "W")."""
    try:
        return RELEASES[release]
    except KeyError:
        raise ValueError(f"release must be one of {sorted(RELEASES)}, got {release!r}") from None



@dataclass(frozen=True)
class PipelineProfile:
    """Measured (or assumed) per-stage times, memory and per-link delays of one pipeline.

    ``f_ms``, ``b_ms``, ``w_ms``: per-stage F / backward-input / backward-weight times (ms). F and B
    must be > 0; W may be 0. ``links``: ``num_stages - 1`` LinkProfiles (empty means no delay anywhere).
    ``activation_bytes`` / ``memory_budget_bytes``: per-stage memory of one microbatch's activations and
    the per-stage budget for them; both or neither.  ``release``: when an activation is freed, "I" (the
    papers' model) or "W" (torch's runtime: its split backward holds the graph until W) — ``profile.RELEASES``.
    """

    num_stages: int
    num_microbatches: int
    f_ms: tuple[float, ...]
    b_ms: tuple[float, ...]
    w_ms: tuple[float, ...]
    links: tuple[LinkProfile, ...] = field(default=())
    activation_bytes: tuple[float, ...] | None = None
    memory_budget_bytes: tuple[float, ...] | None = None
    release: str = "I"

    def __post_init__(self) -> None:
        released_by(self.release)  # ValueError naming the field
        for name in ("num_stages", "num_microbatches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ArgumentTypeError(f"{name} must be an integer, got {v!r}")
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
            if v > MAX_COUNT:
                raise ValueError(f"{name} must be <= {MAX_COUNT}, got {str(v)[:20]}{'...' if len(str(v)) > 20 else ''}")
        S = self.num_stages
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        set_("f_ms", _stage_tuple("f_ms", self.f_ms, S, positive=True))
        set_("b_ms", _stage_tuple("b_ms", self.b_ms, S, positive=True))
        set_("w_ms", _stage_tuple("w_ms", self.w_ms, S, positive=False))
        if self.links is not None and not isinstance(self.links, Sequence):
            raise ArgumentTypeError(f"links must be a sequence of LinkProfile, got {type(self.links).__name__}")
        links = tuple(self.links) if self.links else tuple(LinkProfile() for _ in range(S - 1))
        if len(links) != S - 1:
            raise ValueError(f"links has {len(links)} entries, expected num_stages - 1 = {S - 1}")
        for i, link in enumerate(links):
            if not isinstance(link, LinkProfile):
                raise ArgumentTypeError(f"links[{i}] must be a LinkProfile, got {type(link).__name__}")
        set_("links", links)
        if (self.activation_bytes is None) != (self.memory_budget_bytes is None):
            raise ValueError("activation_bytes and memory_budget_bytes must be given together")
        if self.activation_bytes is not None:
            act = _stage_tuple("activation_bytes", self.activation_bytes, S, positive=True, ms=False)
            budget = _stage_tuple("memory_budget_bytes", self.memory_budget_bytes, S, positive=False, ms=False)
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
        for name, v in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if delays_ms is not None and not isinstance(delays_ms, Mapping):
            raise ValueError(f"delays_ms must be a mapping link → ms, got {type(delays_ms).__name__}")
        links = [LinkProfile() for _ in range(max(num_stages - 1, 0))]
        for link, ms in (delays_ms or {}).items():
            if isinstance(link, bool) or not isinstance(link, int) or not 0 <= link < num_stages - 1:
                raise ValueError(f"delays_ms: link {link} does not exist (links are 0..{num_stages - 2})")
            links[link] = LinkProfile(latency_ms=_check_ms(f"delays_ms[{link}]", ms, positive=False))
        return cls(num_stages, num_microbatches, f_ms, b_ms, w_ms, tuple(links), **kwargs)

    @property
    def delays_ms(self) -> tuple[float, ...]:
        """c_i of every link (PipeMorph Table 1): α_i + size·β_i (CrossPipe §2.2)."""
        return tuple(link.delay_ms for link in self.links)

    def max_inflight(self) -> tuple[int, ...] | None:
        """Per stage, how many microbatches' activations fit in the budget (Alg.1 line 2), or None."""
        if self.activation_bytes is None:
            return None
        N = self.num_microbatches  # more never matters (and a huge budget / activation ratio stays an int)
        return tuple(int(min(m // a, N)) for a, m in zip(self.activation_bytes, self.memory_budget_bytes))

    def fused(self) -> "PipelineProfile":
        """The same pipeline with the backward not split: ``b_ms`` = B + W of each stage, ``w_ms`` = 0
        (the profile a full-backward, 1F1B-style plan is planned and checked with)."""
        return replace(self, b_ms=tuple(b + w for b, w in zip(self.b_ms, self.w_ms)), w_ms=(0.0,) * self.num_stages)

    def with_action_cost(self, per_stage_ms: Sequence[float], *, full_backward: bool = False) -> "PipelineProfile":
        """A copy in which every compute action of stage s takes ``per_stage_ms[s]`` longer: the measured
        per-action cost of the executor (``runtime.measure.profiler.IterationProfile.gap_ms``), which makes a plan
        with more actions (split I + W against one B) pay for them.  The simulator times a full B as
        ``b_ms + w_ms``, so ``full_backward=True`` (a full-backward plan, e.g. on ``fused()``) adds the cost
        to F and B only; otherwise to F, I and W, one each."""
        extra = _stage_tuple("per_stage_ms", per_stage_ms, self.num_stages, positive=False)
        return replace(self, f_ms=tuple(v + x for v, x in zip(self.f_ms, extra)),
                       b_ms=tuple(v + x for v, x in zip(self.b_ms, extra)),
                       w_ms=self.w_ms if full_backward else tuple(v + x for v, x in zip(self.w_ms, extra)))

    def with_links(self, links: Sequence[LinkProfile]) -> "PipelineProfile":
        if isinstance(links, (str, bytes)) or not isinstance(links, Sequence):
            raise ArgumentTypeError(f"links must be a sequence of LinkProfile, got {type(links).__name__}")
        return replace(self, links=tuple(links))

    def with_delays(self, delays_ms: Mapping[int, float]) -> "PipelineProfile":
        """A copy whose link ``i`` latency is replaced by ``delays_ms[i]`` (other fields kept)."""
        if not isinstance(delays_ms, Mapping):
            raise ArgumentTypeError(f"delays_ms must be a mapping link → ms, got {type(delays_ms).__name__}")
        links = list(self.links)
        for i, ms in delays_ms.items():
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(links):
                raise ValueError(f"delays_ms: link {i} does not exist (links are 0..{len(links) - 1})")
            links[i] = replace(links[i], latency_ms=_check_ms(f"delays_ms[{i}]", ms, positive=False))
        return self.with_links(links)

    # ------------------------------------------------------------------ JSON format (the CLI's --profile)
    def to_json(self) -> dict:
        """The profile as a JSON object of :data:`PROFILE_FIELDS` (:meth:`from_json` reads it back; an
        infinite bandwidth is left out, which means the same)."""
        doc = {"num_stages": self.num_stages, "num_microbatches": self.num_microbatches,
               "f_ms": list(self.f_ms), "b_ms": list(self.b_ms), "w_ms": list(self.w_ms),
               "links": [link_to_json(link) for link in self.links]}
        if self.activation_bytes is not None:
            doc.update(activation_bytes=list(self.activation_bytes),
                       memory_budget_bytes=list(self.memory_budget_bytes))
        if self.release != "I":
            doc["release"] = self.release
        return doc

    @classmethod
    def from_json(cls, doc: Mapping) -> "PipelineProfile":
        """A profile from its JSON object (:data:`PROFILE_FIELDS`; ``links`` optional: no delay).
        ValueError names a missing, unknown or bad field."""
        check_profile_fields(doc)
        missing = [k for k in PROFILE_FIELDS[:5] if k not in doc]
        if missing:
            raise ValueError(f"profile: missing field(s) {', '.join(missing)}")
        S = doc["num_stages"]
        links = links_from_json(doc.get("links") or [], S) if doc.get("links") else ()
        return cls(S, doc["num_microbatches"], doc["f_ms"], doc["b_ms"], doc["w_ms"], links,
                   activation_bytes=doc.get("activation_bytes"), memory_budget_bytes=doc.get("memory_budget_bytes"),
                   release=doc.get("release", "I"))


PROFILE_FIELDS = ("num_stages", "num_microbatches", "f_ms", "b_ms", "w_ms", "links",
                  "activation_bytes", "memory_budget_bytes", "release")
"""The fields of a profile's JSON object: PipelineProfile's, times in ms (a number for every stage or a
list with one per stage), ``links`` one object per link with LinkProfile's fields (link i joins stage i
and i+1), memory in bytes."""

LINK_FIELDS = ("latency_ms", "bandwidth_bytes_per_s", "message_bytes")


def check_profile_fields(doc: object) -> None:
    """ValueError unless ``doc`` is a JSON object with only :data:`PROFILE_FIELDS`."""
    if not isinstance(doc, Mapping):
        raise ValueError(f"profile: expected a JSON object, got {type(doc).__name__}")
    _known_fields_only(doc, PROFILE_FIELDS, "profile")


def _known_fields_only(doc: Mapping, known: Sequence[str], where: str) -> None:
    unknown = sorted(set(doc) - set(known))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(map(str, unknown))} (known: {', '.join(known)})")


def link_to_json(link: LinkProfile) -> dict:
    doc = {"latency_ms": link.latency_ms, "message_bytes": link.message_bytes}
    if not math.isinf(link.bandwidth_bytes_per_s):
        doc["bandwidth_bytes_per_s"] = link.bandwidth_bytes_per_s
    return doc


def links_from_json(items: object, num_stages: int) -> list[LinkProfile]:
    """``num_stages − 1`` LinkProfiles from a JSON list of link objects (LINK_FIELDS, each optional)."""
    if not isinstance(items, Sequence) or isinstance(items, (str, bytes)):
        raise ValueError(f"profile links: expected a list of link objects, got {type(items).__name__}")
    links = []
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise ValueError(f"profile links[{i}]: expected an object with {', '.join(LINK_FIELDS)}")
        _known_fields_only(item, LINK_FIELDS, f"profile links[{i}]")
        links.append(LinkProfile(**item))
    if len(links) != num_stages - 1:
        raise ValueError(f"profile links: {len(links)} entries for {num_stages} stages "
                         f"(expected {num_stages - 1}, one per link)")
    return links

def profile_arg(value: Any, name: str = "profile") -> PipelineProfile:
    return instance_arg(value, name, PipelineProfile)


def link_arg(profile: PipelineProfile, link: Any, name: str = "link") -> int:
    link = int_arg(link, name, 0)
    if link >= profile.num_stages - 1:
        raise ValueError(f"{name} {link} does not exist (links are 0..{profile.num_stages - 2})")
    return link
