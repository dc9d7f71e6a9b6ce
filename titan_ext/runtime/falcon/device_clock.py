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
* :class:`DeviceTimer` (from the device layer, ``runtime/execute/device.py``) — ``mark()`` on the device's
  current stream (CUDA events; ``perf_counter`` on CPU, where every op has completed when it returns)
  and ``elapsed_s`` read later, when the end has completed.
* :func:`ensure_communicator` — a data group's communicator made now, by a one-element collective of
  all its members (at start-up), so that later batched P2P ops of a subset of its ranks (validation,
  S3's state move) find it: :func:`has_communicator` tells which groups had it;
* :func:`device_sleep` (the device layer's) — device-side delay (``torch.cuda._sleep`` on the current
  stream, calibrated once per device; a busy wait on CPU).

On CPU (gloo) every path here is today's behaviour; the CUDA paths follow torch's event API and were
not run in this repository's CI (no GPU; see docs/falcon.md).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..execute.device import DeviceTimer, device_sleep  # the device layer's (one door)

__all__ = ["control_group", "is_control_group", "device_buffer", "to_device", "made_for_device",
           "DeviceTimer", "device_sleep", "is_cuda", "PROBE_BYTES", "probe_numel", "ensure_communicator",
           "has_communicator"]

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
    the job's timeout (``runtime.comm.timeouts``)."""
    from ..comm.timeouts import new_group

    group = new_group(None if ranks is None else sorted(ranks), None, backend="gloo")
    _CONTROL_GROUPS.append(group)
    return group


def is_control_group(group) -> bool:
    """True for groups made by :func:`control_group` (False for the world and the mesh's groups)."""
    return group is not None and any(group is g for g in _CONTROL_GROUPS)


_WARM_GROUPS: list[Any] = []


def _group(group) -> Any:
    return dist.group.WORLD if group is None else group


def has_communicator(group) -> bool:
    """Whether :func:`ensure_communicator` ran on ``group`` (None: the default group) in this process."""
    group = _group(group)
    return any(group is g for g in _WARM_GROUPS)


def ensure_communicator(group, device) -> bool:
    """Make ``group``'s communicator exist now (None: the default group): a one-element device
    all-reduce, **collective over the group's members**, once per group and process; returns whether
    it ran now.

    Why: ProcessGroupNCCL creates a communicator lazily, at a group's first collective or batched
    P2P op, and that first op needs every member of the group (torch's ``batch_isend_irecv``
    docstring: "if this API is the first collective call in the group ..., all ranks of the group must
    participate"); a later batched op may involve a subset of the ranks and runs on the existing
    communicator.  Falcon's batched ops that involve a subset (validation's ring passes, S3's state
    move) therefore run only on groups this made at start-up.  On gloo (no communicator to make) it
    is a cheap host all-reduce."""
    group = _group(group)
    if has_communicator(group):
        return False
    dist.all_reduce(device_buffer(1, device), group=group)
    _WARM_GROUPS.append(group)
    return True


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
