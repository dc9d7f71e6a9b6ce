"""What Falcon's DP x PP job (:mod:`~titan_ext.titan.falcon_job`) and its S4 relaunch (:mod:`~titan_ext.titan.falcon_s4`) both read:
the files it writes under ``job.dump_folder`` and where the emulated faults come from.  Its own module
so the two need not import each other."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["ENV_SLOW_DEVICE", "ENV_SLOW_LINK", "FALCON_EVENTS", "FALCON_LOG", "emulation_specs"]

ENV_SLOW_DEVICE = "TITAN_EXT_SLOW_DEVICE"
ENV_SLOW_LINK = "TITAN_EXT_SLOW_LINK"
FALCON_LOG = "falcon.jsonl"
"""Rank 0 appends one JSON line per step under ``job.dump_folder``: the step and its ``falcon/*``
decision dict (plus ``falcon/split``, the micro-batch split in force)."""
FALCON_EVENTS = "falcon_events.jsonl"
"""Rank 0 appends one row per Falcon event: ``kind`` "event" (a change-point),
"localised" (validation's root cause), "decision" (one strategy of Alg. 1: strategy S1-S4 or
PipeMorph, applied or not, estimated and measured cost) and "outcome" (median iteration time
before / after an applied strategy). An "event" row's ``located_by`` names the series whose
change-point was verified: ``iteration_time`` or a profiled group (group tracking). Every row but
"outcome" carries its ``evidence``: the change-point's relative change, latency and probability;
validation's components (each slow link / device, its cause, its measure, handled or not); the
impact that reached a decision's cost. See :func:`~titan_ext.titan.falcon_events.event_rows`."""


def emulation_specs(section: Any) -> tuple[str, str]:
    """(slow device, slow link) specs: the ``[titan_ext]`` keys, else the environment."""
    return (section.emulate_slow_device.strip() or os.environ.get(ENV_SLOW_DEVICE, "").strip(),
            section.emulate_slow_link.strip() or os.environ.get(ENV_SLOW_LINK, "").strip())
