"""Where Falcon's data lives and how it times the device.

Falcon measures the *device*: a GEMM probe on the stage's device timed with device events, ring and
DP-sync times as completion times (not the host's enqueue times), and an emulated slow device that
stretches device work. Host data (timings, probe results, data-loader chunks, decisions) travels on
gloo *control* groups; only device data (gradients, ring-validation buffers) uses the data groups
(NCCL on a GPU job). This module is the one place that knows the difference:

* :func:`control_group` — a gloo group over ``ranks`` (every rank of the world calls it, in the same
  order, as ``dist.new_group`` requires); :func:`is_control_group` tells them apart.
* :func:`device_buffer` / :func:`to_device` — tensors Falcon makes for a data group, on the device;
  :func:`made_for_device` is the mark a rule-checking backend can test.
* :class:`DeviceTimer` — ``start()`` / ``stop()`` marks on the device's current stream (CUDA events;
  ``perf_counter`` on CPU, where every op has completed when it returns) and ``elapsed_s`` read later,
  when the end has completed.
* :func:`device_sleep` — device-side delay (``torch.cuda._sleep`` on the current stream, calibrated
  once per device; a busy wait on CPU).

On CPU (gloo) every path here is today's behaviour; the CUDA paths follow torch's event API and were
not run in this repository's CI (no GPU; see docs/falcon.md).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["control_group", "is_control_group", "device_buffer", "to_device", "made_for_device",
           "DeviceTimer", "device_sleep", "is_cuda", "PROBE_BYTES", "probe_numel"]

PROBE_BYTES = 64 << 20
"""Falcon's start-up measurements (the DP all-reduce's healthy time, S3's state move and load, S4's
save and load; Falcon §5.2's ski-rental inputs) time at most this many bytes per buffer and scale the
time to the stage's size: 64 MB is far into the bandwidth-bound regime of NVLink, InfiniBand and
PCIe, so the scaling is linear, and start-up memory no longer grows with the stage (docs/falcon.md
"Start-up memory" — a buffer of the full state was tens of GB for an 8B stage)."""


def probe_numel(numel: int, element_size: int = 4) -> int:
    """Elements of a start-up probe for a transfer of ``numel`` elements: all of them up to
    :data:`PROBE_BYTES`, else as many as fit (at least one)."""
    return max(1, min(int(numel), PROBE_BYTES // element_size))

_CONTROL_GROUPS: list[Any] = []
_MARK = "_titan_ext_device_data"


def control_group(ranks=None):
    """A gloo group over ``ranks`` (None: the world) for host data. Collective over the world. It takes
    the job's timeout (``runtime.timeouts``)."""
    from ..timeouts import new_group

    group = new_group(None if ranks is None else sorted(ranks), None, backend="gloo")
    _CONTROL_GROUPS.append(group)
    return group


def is_control_group(group) -> bool:
    """True for groups made by :func:`control_group` (False for the world and the mesh's groups)."""
    return group is not None and any(group is g for g in _CONTROL_GROUPS)


def is_cuda(device: torch.device | str | None) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def _mark(t: torch.Tensor) -> torch.Tensor:
    setattr(t, _MARK, True)
    return t


def _device(device) -> torch.device:
    return torch.device(device) if device is not None else torch.device("cpu")


def device_buffer(numel: int, device, dtype=torch.float32) -> torch.Tensor:
    """A zeroed buffer on ``device`` (None: the CPU, named explicitly) for a data-group message."""
    return _mark(torch.zeros(numel, dtype=dtype, device=_device(device)))


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device`` (the same tensor when already there), marked as device data."""
    device = _device(device)
    same = t.device.type == device.type and (device.index is None or t.device.index == device.index)
    return _mark(t if same else t.to(device))


def made_for_device(t: torch.Tensor) -> bool:
    """Whether ``t`` was made by :func:`device_buffer` / :func:`to_device`."""
    return bool(getattr(t, _MARK, False))


class DeviceTimer:
    """Completion times of device work on ``device``'s current stream."""

    def __init__(self, device):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.cuda = is_cuda(self.device)

    def mark(self) -> Any:
        if self.cuda:
            with torch.cuda.device(self.device):
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
            return ev
        return time.perf_counter()

    def elapsed_s(self, start: Any, end: Any, wait: bool = True) -> float | None:
        """Seconds from mark ``start`` to mark ``end``; on CUDA waits for ``end`` (or, with
        ``wait=False``, returns None while it is still pending)."""
        if not self.cuda:
            return end - start
        if not wait and not end.query():
            return None
        end.synchronize()
        return start.elapsed_time(end) / 1e3


    def completion_s(self, start: Any, works: list) -> float:
        """Seconds from mark ``start`` until the communication ``works`` have *landed*: on CUDA an
        event recorded after ``wait()`` (which makes the stream wait) read once it completes; on
        CPU polling ``is_completed()`` after ``wait()`` (NCCL's ``wait()`` — and the nccl_rules
        test backend's — returns before the data has landed)."""
        for work in works:
            work.wait()
        if self.cuda:
            return self.elapsed_s(start, self.mark())
        while not all(work.is_completed() for work in works):
            time.sleep(0)
        return time.perf_counter() - start


_CYCLES_PER_S: dict[int, float] = {}


def _cycles_per_second(device: torch.device) -> float:
    """Calibrate ``torch.cuda._sleep`` (GPU clock cycles) against CUDA events, once per device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CYCLES_PER_S:
        timer, cycles = DeviceTimer(device), 10_000_000
        with torch.cuda.device(device):
            start = timer.mark()
            torch.cuda._sleep(cycles)
            end = timer.mark()
        _CYCLES_PER_S[index] = cycles / max(timer.elapsed_s(start, end), 1e-6)
    return _CYCLES_PER_S[index]


def device_sleep(seconds: float, device=None) -> None:
    """Delay ``device``'s current stream by ``seconds``, the device held meanwhile: on CUDA a spin
    kernel (``torch.cuda._sleep``), on CPU a busy wait of the host. (A CPU rank that *slept* would
    lend its core to the other ranks time-sharing the host: with 4 ranks on 2 cores most of the
    delay then disappears from the iteration time — measured: a +150 ms sleep before stage 0's
    DP all-reduce left the median step unchanged within the noise; a device with a slow link is not
    lent to another one.)"""
    if seconds <= 0:
        return
    if is_cuda(device):
        device = torch.device(device)
        with torch.cuda.device(device):
            torch.cuda._sleep(int(seconds * _cycles_per_second(device)))
    else:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
