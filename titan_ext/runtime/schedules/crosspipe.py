"""Run-time CrossPipe schedule: the adaptive runtime (profiling, re-planning policy, validated swap at
iteration boundaries, any transport) with CrossPipe's greedy generator (CrossPipe §4.2, Alg.1) as the
planner (:class:`~titan_ext.runtime.decide.planning.CrossPipePlanner`).

Every (re-)plan is generated from the live profile — per-stage F/I/W times and per-link one-way delay
— split, when the message size and link bandwidth are known, into the latency α and bandwidth time
size·β of CrossPipe's α-β model (§2.2).  The memory limit on in-flight activations per rank is the
runtime's x_max (and its adaptive cap for re-plans), so CrossPipe never trades memory for speed
behind the user's back (§4.2 inputs: M_L).  Delegation (``delegation="always"|"auto"``) works as for
PipeMorph: it is a transport choice.

This module is the whole schedule: a config with CrossPipe's own settings, the planner choice, and the
registry entry, registered (and made a class) by :func:`~titan_ext.runtime.control.registry.register_schedule`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from titan_ext.args import real_arg
from ..control.config import AdaptiveConfig
from ..control.parts import ScheduleSpec
from ..control.registry import register_schedule
from ..decide.placement import Layout, VirtualPlanner
from ..decide.planning import CrossPipePlanner, Planner

__all__ = ["CROSSPIPE", "CrossPipe", "CrossPipeConfig"]


@dataclass(frozen=True)
class CrossPipeConfig(AdaptiveConfig):
    """:class:`AdaptiveConfig` plus CrossPipe's planner settings (its backward is split: I and W are
    separate operations of the greedy generator, CrossPipe §3.1)."""

    backward: str = "split"
    variant: str = "udsub"
    """``"udsub"`` (CrossUDSub, default) or ``"ud"`` (CrossUD); one stage per rank."""
    message_bytes: float | None = None
    """Size of one activation/gradient message (bytes), for the α-β split (one stage per rank)."""
    link_bandwidth_bytes_per_s: float | Sequence[float] | None = None
    """Bandwidth of each link (one value, or one per link), for the α-β split (one stage per rank)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.variant not in ("ud", "udsub"):
            raise ValueError(f"CrossPipe run-time variant must be 'ud' or 'udsub' (one stage per rank), "
                             f"got {self.variant!r}")
        real_arg(self.message_bytes, "message_bytes", minimum=0, optional=True)
        bw = self.link_bandwidth_bytes_per_s
        if isinstance(bw, (list, tuple)):
            if not bw:
                raise ValueError("link_bandwidth_bytes_per_s is empty: one value, one per link, or None")
            for i, v in enumerate(bw):
                real_arg(v, f"link_bandwidth_bytes_per_s[{i}]", positive=True, allow_inf=True)
        else:
            real_arg(bw, "link_bandwidth_bytes_per_s", positive=True, optional=True, allow_inf=True)


def _one_stage(config: CrossPipeConfig) -> Planner:
    """CrossPipe §4.2 greedy on the measured profile."""
    return CrossPipePlanner(config.variant, config.message_bytes, config.link_bandwidth_bytes_per_s)


def _virtual(schedule: str) -> Callable[[Layout, CrossPipeConfig], Planner]:
    """``schedule`` of ``plan_virtual`` from the measured per-stage times and per-rank-link delays (the
    whole delay as latency), split backward."""
    def planner(layout: Layout, config: CrossPipeConfig) -> Planner:
        if (config.message_bytes, config.link_bandwidth_bytes_per_s) != (None, None):
            raise ValueError("CrossPipe: message_bytes / link_bandwidth_bytes_per_s apply to one stage per rank only")
        return VirtualPlanner(layout, schedule, backward="split")
    return planner


_multi_stage = _virtual("pipemorph")
"""Several stages per rank: the split-backward portfolio of ``plan_virtual``."""
_v_pair = _virtual("crosspipe-wave")
"""Two stages per rank placed "v": CrossWave (``build_parts`` chooses it for that layout)."""


#: the registry entry: CrossPipe's planners, the default policies (Eq.1 per link / rank link), CrossPipe's config
CROSSPIPE = ScheduleSpec("CrossPipe", one_stage_planner=_one_stage, multi_stage_planner=_multi_stage,
                         v_pair_planner=_v_pair, config_class=CrossPipeConfig, backward_choices=CrossPipePlanner.backward_choices)

CrossPipe = register_schedule(CROSSPIPE, module=__name__, doc="""The adaptive runtime re-planning with
CrossPipe's greedy generator (one stage per rank) or, with several stages per rank, CrossWave (V-shape) /
the split-backward virtual portfolio (loop).  Settings: :class:`CrossPipeConfig` (``config=``, or its fields
as keywords: ``variant``, ``message_bytes``, ``link_bandwidth_bytes_per_s`` beyond the adaptive ones).""")
