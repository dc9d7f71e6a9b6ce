"""Run-time CrossPipe schedule: PipeMorph's runtime (profiling, re-planning policy, validated swap at
iteration boundaries) with CrossPipe's greedy generator (CrossPipe §4.2, Alg.1) as the planner.

Every (re-)plan is generated from the live profile — per-stage F/I/W times and per-link one-way delay
measured by PipeMorph's profiler — split, when the message size and link bandwidth are known, into the
latency α and bandwidth time size·β of CrossPipe's α-β model (§2.2): ``transfer = size / bandwidth``,
``latency = measured delay − transfer`` (never negative).  Without them the whole measured delay is
treated as latency.  The memory limit on in-flight activations per rank is PipeMorph's x_max (the same
budget PipeMorph's initial plan respects; ``adaptive_memory_limit`` overrides it for re-plans), so
CrossPipe never trades memory for speed behind the user's back (§4.2 inputs: M_L).
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Sequence

from titan_ext.plan import LinkProfile, PipelineProfile
from titan_ext.plan.crosspipe import plan_crosspipe

from .pipemorph import PipeMorph
from .policy import Decision, ReplanPolicy

__all__ = ["CrossPipe"]


class CrossPipe(PipeMorph):
    """PipeMorph's run-time machinery re-planning with CrossPipe's greedy generator (one stage per rank).

    Extra args (beyond :class:`PipeMorph`'s):
        variant: ``"udsub"`` (CrossUDSub, default) or ``"ud"`` (CrossUD).
        message_bytes: size of one activation/gradient message (bytes), for the α-β split.
        link_bandwidth_bytes_per_s: bandwidth of each link (one value, or one per link), for the split.
    """

    #: CrossPipe's greedy generator plans split backwards only (I and W are separate operations, §4.1)
    backward_choices = ("split",)

    def __init__(
        self,
        *args: Any,
        variant: str = "udsub",
        message_bytes: float | None = None,
        link_bandwidth_bytes_per_s: float | Sequence[float] | None = None,
        **kwargs: Any,
    ):
        if variant not in ("ud", "udsub"):
            raise ValueError(f"CrossPipe run-time variant must be 'ud' or 'udsub' (one stage per rank), got {variant!r}")
        if message_bytes is not None and not message_bytes >= 0:
            raise ValueError(f"message_bytes must be >= 0, got {message_bytes}")
        kwargs.setdefault("backward", "split")
        self.variant = variant
        self.message_bytes = message_bytes
        self.link_bandwidth_bytes_per_s = link_bandwidth_bytes_per_s
        super().__init__(*args, **kwargs)

    # -------------------------------------------------------------------------------- planning
    def _alpha_beta(self, profile: PipelineProfile) -> PipelineProfile:
        """Split each measured one-way delay c into latency α and size·β (CrossPipe §2.2)."""
        if self.message_bytes is None or self.link_bandwidth_bytes_per_s is None:
            return profile
        bw = self.link_bandwidth_bytes_per_s
        bws = [float(bw)] * len(profile.links) if isinstance(bw, (int, float)) else [float(x) for x in bw]
        if len(bws) != len(profile.links):
            raise ValueError(f"link_bandwidth_bytes_per_s has {len(bws)} entries, expected {len(profile.links)}")
        links = []
        for link, b in zip(profile.links, bws):
            transfer_ms = 0.0 if math.isinf(b) else self.message_bytes / b * 1e3
            links.append(LinkProfile(latency_ms=max(0.0, link.delay_ms - transfer_ms),
                                     bandwidth_bytes_per_s=b, message_bytes=self.message_bytes))
        return profile.with_links(links)

    def _plan(self, profile: PipelineProfile, decision: Decision) -> Any:
        """CrossPipe greedy plan for the measured profile (explicit plans/counts: PipeMorph's path)."""
        if decision.actions is not None or decision.warmup_counts is not None:
            return super()._plan(profile, decision)
        planning = profile
        if decision.mode != "initial" and isinstance(self.policy, ReplanPolicy):
            # the same head-room on measured delays as PipeMorph's adaptive plans
            planning = profile.with_delays(
                {k: self.policy.headroom_delay(c) for k, c in enumerate(profile.delays_ms)}
            )
        planning = self._alpha_beta(planning)
        limit = self._x_max
        if decision.mode != "initial" and self.adaptive_memory_limit is not None:
            limit = self.adaptive_memory_limit
        plan = plan_crosspipe(planning, self.variant, memory_limit=limit)
        return {"actions": plan.actions, "warmup_counts": None}


def _merged_signature() -> inspect.Signature:
    """PipeMorph's constructor signature plus CrossPipe's keywords, so that callers that pass options by
    introspection (titan_ext.titan's [titan_ext] → constructor keywords) see every knob."""
    base = inspect.signature(PipeMorph.__init__)
    own = [p for name, p in inspect.signature(CrossPipe.__init__).parameters.items()
           if p.kind is inspect.Parameter.KEYWORD_ONLY]
    return base.replace(parameters=list(base.parameters.values()) + own)


CrossPipe.__init__.__signature__ = _merged_signature()  # type: ignore[attr-defined]
