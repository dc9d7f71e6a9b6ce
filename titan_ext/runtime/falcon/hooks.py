"""Call-timestamp hooks on torch.distributed (Falcon §4.2 "Monitor", framework-agnostic tracking).

Falcon intercepts NCCL calls with LD_PRELOAD and logs each call's type and timestamp. Here the same
record is taken one level up, by wrapping the Python entry points of ``torch.distributed`` (the
names are looked up at call time by torch's own code — e.g. ``torch.distributed.pipelining`` calls
``dist.batch_isend_irecv`` / ``P2POp.op`` — so the trainer needs no change). Every call records
``(op, group, nbytes, t_start, t_end)``; a re-entrancy guard records only the outermost call
(``batch_isend_irecv`` → ``isend`` is one record). ``t_end - t_start`` is the blocking duration of
synchronous calls (for async calls it is the launch time only).

The record feeds :func:`titan_ext.runtime.falcon.period.estimate_period` (iteration time without the
trainer's help) and per-group transfer times for profiling (Falcon §4.3).
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["CallRecord", "CallRecorder", "HOOKED_FUNCTIONS"]

HOOKED_FUNCTIONS = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter",
    "barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
)


@dataclass(frozen=True)
class CallRecord:
    op: str
    group: str
    nbytes: int
    t_start: float
    t_end: float

    @property
    def signature(self) -> tuple:
        return (self.op, self.group, self.nbytes)


def _nbytes(args, kwargs) -> int:
    total = 0
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            total += a.numel() * a.element_size()
        elif isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, torch.Tensor):
                    total += x.numel() * x.element_size()
                elif isinstance(x, dist.P2POp):
                    total += x.tensor.numel() * x.tensor.element_size()
    return total


def _group_name(args, kwargs) -> str:
    g = kwargs.get("group")
    if g is None:
        for a in args:
            if isinstance(a, dist.ProcessGroup):
                g = a
                break
            if isinstance(a, (list, tuple)) and a and isinstance(a[0], dist.P2POp):
                g = a[0].group
                break
    if g is None or g is c10d.GroupMember.WORLD:
        return "world"
    try:
        return c10d._get_process_group_name(g)
    except Exception:  # noqa: BLE001 - unnamed groups: identity is enough
        return f"pg{id(g):x}"


class CallRecorder:
    """Install with ``start()`` (or as a context manager); ``records`` is a bounded deque."""

    def __init__(self, capacity: int = 65536, clock=time.perf_counter):
        self.records: deque[CallRecord] = deque(maxlen=capacity)
        self.total_recorded = 0
        """Calls recorded since creation (record i is at ``records[i - (total_recorded - len(records))]``)."""
        self._clock = clock
        self._originals: dict[tuple[object, str], object] = {}
        self._local = threading.local()

    def _wrap(self, name: str, fn):
        recorder = self

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            depth = getattr(recorder._local, "depth", 0)
            if depth:
                return fn(*args, **kwargs)
            recorder._local.depth = 1
            t0 = recorder._clock()
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = recorder._clock()
                recorder._local.depth = 0
                recorder.total_recorded += 1
                recorder.records.append(
                    CallRecord(name, _group_name(args, kwargs), _nbytes(args, kwargs), t0, t1)
                )

        wrapper.__falcon_original__ = fn
        return wrapper

    def start(self) -> "CallRecorder":
        if self._originals:
            return self
        for name in HOOKED_FUNCTIONS:
            fn = getattr(c10d, name, None)
            if fn is None:
                continue
            wrapped = self._wrap(name, fn)
            for mod in (c10d, dist):
                if getattr(mod, name, None) is fn:
                    self._originals[(mod, name)] = fn
                    setattr(mod, name, wrapped)
        return self

    def stop(self) -> None:
        for (mod, name), fn in self._originals.items():
            setattr(mod, name, fn)
        self._originals.clear()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def clear(self) -> None:
        self.records.clear()
        self.total_recorded = 0

    def signatures(self) -> list[tuple]:
        return [r.signature for r in self.records]

    def timestamps(self) -> list[float]:
        return [r.t_start for r in self.records]

    def per_group_times(self, since: float = float("-inf")) -> dict[str, float]:
        """Sum of blocking call durations per group (profiling input, Falcon §4.3)."""
        out: dict[str, float] = {}
        for r in self.records:
            if r.t_start >= since:
                out[r.group] = out.get(r.group, 0.0) + (r.t_end - r.t_start)
        return out
