"""Run-time PipeMorph schedule: the adaptive runtime re-planning with PipeMorph's slackness planner
(PipeMorph §4.2: Alg.1's initial plan, Alg.2's re-plan with one stage per rank; the ``plan_virtual``
portfolio with several) and its Eq.1 re-planning policy (§4.2, §6).

This module is the whole schedule, as ``crosspipe.py`` is CrossPipe's: a config (PipeMorph adds no
setting to :class:`~titan_ext.runtime.control.config.AdaptiveConfig`), the planner choice, and the registry
entry, made a class by :func:`~titan_ext.runtime.control.registry.register_schedule`::

    schedule = PipeMorph([stage], n_microbatches, loss_fn=loss_fn, config=PipeMorphConfig(adaptive=False))
    schedule = PipeMorph([stage], n_microbatches, loss_fn=loss_fn, adaptive=False)   # the same
"""

from __future__ import annotations

from dataclasses import dataclass

from ..control.config import AdaptiveConfig
from ..control.parts import ScheduleSpec
from ..control.registry import register_schedule
from ..decide.placement import VirtualPlanner
from ..decide.planning import PipeMorphPlanner

__all__ = ["PIPEMORPH", "PipeMorph", "PipeMorphConfig"]


@dataclass(frozen=True)
class PipeMorphConfig(AdaptiveConfig):
    """PipeMorph's settings: those of every adaptive schedule (:class:`AdaptiveConfig`)."""


#: the registry entry: Alg.1/2 with one stage per rank, the ``plan_virtual`` portfolio with several;
#: the default policies (Eq.1 per link / per rank link)
PIPEMORPH = ScheduleSpec(
    "PipeMorph",
    one_stage_planner=lambda config: PipeMorphPlanner(),
    multi_stage_planner=lambda layout, config: VirtualPlanner(layout, backward=config.backward),
    config_class=PipeMorphConfig,
    backward_choices=PipeMorphPlanner.backward_choices,
)

PipeMorph = register_schedule(PIPEMORPH, module=__name__, doc="""Straggler-resilient adaptive pipeline schedule
(PipeMorph §4 planning, §6 runtime): the adaptive runtime with PipeMorph's planner and policy.  Settings:
:class:`PipeMorphConfig` (``config=``, or its fields as keywords, and the delegation keywords of earlier
releases: ``delegation``, ``failover``, ``slow_link_ms``, ``detector``, ``delegate_lanes``, ``delegate_slots``,
``delegate_slot_bytes``, ``recv_timeout_s``, ``delegate_timeout_s``, ``faults``).""")
