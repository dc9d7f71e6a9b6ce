"""Run-time CrossPipe schedule: the adaptive runtime (profiling, re-planning policy, validated swap at
iteration boundaries, any transport) with CrossPipe's greedy generator (CrossPipe §4.2, Alg.1) as the
planner (:class:`~titan_ext.runtime.planning.CrossPipePlanner`).

Every (re-)plan is generated from the live profile — per-stage F/I/W times and per-link one-way delay
— split, when the message size and link bandwidth are known, into the latency α and bandwidth time
size·β of CrossPipe's α-β model (§2.2).  The memory limit on in-flight activations per rank is the
runtime's x_max (and its adaptive cap for re-plans), so CrossPipe never trades memory for speed
behind the user's back (§4.2 inputs: M_L).  Delegation (``delegation="always"|"auto"``) works as for
PipeMorph: it is a transport choice.
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

from .pipemorph import PipeMorph
from .placement import VirtualPlanner
from .planning import CrossPipePlanner, Planner

__all__ = ["CrossPipe"]


class CrossPipe(PipeMorph):
    """The adaptive runtime re-planning with CrossPipe's greedy generator (one stage per rank) or, with
    several stages per rank, CrossWave (V-shape) / the split-backward virtual portfolio (loop).

    Extra args (beyond :class:`PipeMorph`'s):
        variant: ``"udsub"`` (CrossUDSub, default) or ``"ud"`` (CrossUD).
        message_bytes: size of one activation/gradient message (bytes), for the α-β split.
        link_bandwidth_bytes_per_s: bandwidth of each link (one value, or one per link), for the split.
    """

    backward_choices = CrossPipePlanner.backward_choices

    def __init__(
        self,
        *args: Any,
        variant: str = "udsub",
        message_bytes: float | None = None,
        link_bandwidth_bytes_per_s: float | Sequence[float] | None = None,
        **kwargs: Any,
    ):
        kwargs.setdefault("backward", "split")
        self._crosspipe_options = (variant, message_bytes, link_bandwidth_bytes_per_s)
        super().__init__(*args, **kwargs)

    def _default_planner(self, backward: str) -> Planner:
        """CrossPipe §4.2 greedy (one stage per rank); with several stages per rank CrossWave ("v",
        V = 2) or the split-backward portfolio of ``plan_virtual`` (loop), planned from the measured
        per-stage times and per-rank-link delays (the whole delay as latency)."""
        if not self.layout.virtual:
            return CrossPipePlanner(*self._crosspipe_options)
        if self._crosspipe_options[1:] != (None, None):
            raise ValueError("CrossPipe: message_bytes / link_bandwidth_bytes_per_s apply to one stage per rank only")
        wave = self.layout.placement == "v" and self.layout.stages_per_rank == 2
        return VirtualPlanner(self.layout, "crosspipe-wave" if wave else "pipemorph", backward="split")


def _merged_signature() -> inspect.Signature:
    """PipeMorph's constructor signature plus CrossPipe's keywords, so that callers that pass options by
    introspection (titan_ext.titan's [titan_ext] → constructor keywords) see every knob."""
    base = inspect.signature(PipeMorph.__init__)
    own = [p for name, p in inspect.signature(CrossPipe.__init__).parameters.items()
           if p.kind is inspect.Parameter.KEYWORD_ONLY]
    return base.replace(parameters=list(base.parameters.values()) + own)


CrossPipe.__init__.__signature__ = _merged_signature()  # type: ignore[attr-defined]
