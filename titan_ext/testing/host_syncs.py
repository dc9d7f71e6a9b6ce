"""Host-sync accounting: every call that blocks the host on the device, counted per call site.

On a GPU the host enqueues kernels and NCCL ops ahead of the device ("host run-ahead"); a call that
waits for the device drains that queue, and every later kernel starts only after the host has issued it
again.  What CUDA / NCCL block the calling host thread on:

* ``Work.wait(timeout)`` with an explicit timeout: ProcessGroupNCCL busy-waits the host until the op
  completes (``wait()`` without one only makes the current stream wait: not a host sync);
* ``torch.cuda.synchronize()``, ``Event.synchronize()``, ``Stream.synchronize()``;
* reading a device tensor on the host: ``.item()``, ``.tolist()``, ``.numpy()``, ``float()``/``int()``/
  ``bool()`` of it, ``.cpu()``, ``.to("cpu")`` (a device-to-host copy that returns once the data is there);
* a blocking copy between host and device: ``copy_`` without ``non_blocking=True`` (either direction:
  from pageable memory CUDA stages the data synchronously), ``torch.tensor(data, device=<device>)``.

:func:`counting` counts them on the calling thread (the one whose run-ahead matters: the training
loop's) while its ``with`` block runs::

    with host_syncs.counting() as syncs:
        schedule.step(...)
    syncs.by_site  # Counter {(kind, "file:line"): n}

"Device tensor" on a CPU test: a tensor on a non-CPU device, or, under the ``nccl_rules`` test backend,
a CPU tensor that backend does not recognise as a host tensor (:func:`titan_ext.testing.nccl_rules.is_host_made`:
the one definition of where a tensor lives).  On plain gloo every tensor is the host's: only the
synchronising calls are counted.  The CUDA calls are counted by wrapping torch's own
``torch.cuda.synchronize`` / ``Event.synchronize`` / ``Stream.synchronize``; a fake device
(tests/_fake_cuda.py) reports its own through :func:`record`.

The budget (docs/runtime.md "Host syncs per step"): zero per steady-state iteration beyond the
documented once-per-step reads (the loss, the metrics), enforced by tests/runtime/test_host_syncs.py.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections import Counter
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

__all__ = ["HostSyncs", "counting", "is_device_tensor", "record"]

_HERE = __name__
#: frames skipped when naming the call site: the accounting itself and torch's dispatch glue
_GLUE = (__name__, "torch.overrides", "torch.utils._python_dispatch", "titan_ext.testing.nccl_rules",
         "titan_ext.testing.lagdevice",
         "contextlib")

_active: dict[int, list["HostSyncs"]] = {}  # thread ident → counters open on it (innermost last)
_lock = threading.Lock()


class HostSyncs:
    """The host syncs one :func:`counting` block saw, by (kind, call site)."""

    def __init__(self) -> None:
        self.by_site: Counter = Counter()

    @property
    def total(self) -> int:
        return sum(self.by_site.values())

    def of_kind(self, kind: str) -> int:
        return sum(n for (k, _), n in self.by_site.items() if k == kind)

    def sites(self) -> list[str]:
        """One line per (kind, site), most frequent first (test messages)."""
        return [f"{n} x {kind} at {site}" for (kind, site), n in self.by_site.most_common()]

    def add(self, kind: str, site: str) -> None:
        self.by_site[(kind, site)] += 1


def _counters() -> list[HostSyncs]:
    return _active.get(threading.get_ident(), [])


def _site() -> str:
    """``file:line`` of the code that made the call: the innermost titan_ext or TorchTitan frame (past
    the glue and torch's own frames: a collective's ``wait()`` inside ``torch.distributed`` names the
    product code that ran the collective), else the innermost torch frame, else the innermost frame."""
    frame = sys._getframe(1)
    first = torch_frame = None
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(_GLUE):
            if first is None:
                first = frame
            if module.startswith(("titan_ext", "torchtitan")):
                break
            if torch_frame is None and module.startswith("torch"):
                torch_frame = frame
        frame = frame.f_back
    frame = frame or torch_frame or first
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    for marker in ("site-packages" + os.sep, os.sep + "titan_ext" + os.sep):
        if marker in path:
            path = path.split(marker, 1)[1] if marker.startswith("site") else "titan_ext" + os.sep + path.split(marker, 1)[1]
            break
    return f"{path}:{frame.f_lineno}"


def record(kind: str) -> None:
    """Count one host sync of ``kind`` on this thread's open counters (fake devices call it)."""
    counters = _counters()
    if counters:
        site = _site()
        for c in counters:
            c.add(kind, site)


def is_device_tensor(t: Any) -> bool:
    """Whether reading ``t`` on the host waits for the device (module docstring)."""
    if not isinstance(t, torch.Tensor):
        return False
    if t.device.type != "cpu":
        return t.device.type != "meta"
    rules = sys.modules.get("titan_ext.testing.nccl_rules")
    return bool(rules is not None and rules.installed() and rules.is_host_made(t) is None)


def _host_target(target: Any) -> bool:
    """A ``.to()`` / ``device=`` target that names the host (nccl_rules' convention on a CPU test:
    the string ``"cpu"``; a ``torch.device`` value is the stage's device)."""
    rules = sys.modules.get("titan_ext.testing.nccl_rules")
    if rules is not None and rules.installed():
        return rules.names_host(target)
    return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"


_READS = {"item": "item()", "tolist": "tolist()", "numpy": "numpy()", "__float__": "float()",
          "__int__": "int()", "__bool__": "bool()", "__index__": "int()", "cpu": "cpu()"}


class _Counting(TorchFunctionMode):
    """Sees the host reads and copies of the thread it is entered on."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = self._kind(func, args, kwargs)
        if kind is not None:
            record(kind)
        return func(*args, **kwargs)

    @staticmethod
    def _kind(func: Any, args: tuple, kwargs: dict) -> str | None:
        name = getattr(func, "__name__", "")
        if name in _READS:
            return _READS[name] if args and is_device_tensor(args[0]) else None
        if name == "to" and args and is_device_tensor(args[0]) and not kwargs.get("non_blocking", False):
            target = kwargs.get("device", args[1] if len(args) > 1 else None)
            return "blocking copy (to cpu)" if target is not None and not isinstance(target, torch.dtype) \
                and _host_target(target) else None
        if name == "copy_" and len(args) > 1 and not kwargs.get("non_blocking", args[2] if len(args) > 2 else False):
            dst, src = args[0], args[1]
            if isinstance(src, torch.Tensor) and is_device_tensor(src) != is_device_tensor(dst):
                return "blocking copy (copy_)"
        if name in ("tensor", "as_tensor") and args and not isinstance(args[0], torch.Tensor):
            target = kwargs.get("device")
            if target is not None and not _host_target(target) and torch.device(target).type != "cpu":
                return "blocking copy (torch.tensor on device)"
        return None


# -- the synchronising calls ------------------------------------------------------------------------
def _wrap(owner: Any, attr: str, kind: str, only_with_timeout: bool = False) -> None:
    fn = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
    if fn is None or getattr(fn, "_titan_ext_host_sync", False):
        return

    def counted(*args: Any, **kwargs: Any) -> Any:
        if _counters() and (not only_with_timeout or kwargs.get("timeout", args[1] if len(args) > 1 else None) is not None):
            record(kind)
        return fn(*args, **kwargs)

    counted._titan_ext_host_sync = True  # type: ignore[attr-defined]
    counted.__name__, counted.__doc__ = getattr(fn, "__name__", attr), getattr(fn, "__doc__", None)
    try:
        setattr(owner, attr, counted)
    except (TypeError, AttributeError):  # an immutable type: not counted
        pass


def _work_classes() -> Iterator[type]:
    todo = [dist.Work]
    while todo:
        cls = todo.pop()
        yield cls
        todo += cls.__subclasses__()


_REAL_CUDA_SYNC = torch.cuda.synchronize


def _install() -> None:
    """Wrap the synchronising calls (idempotent; work classes defined since the last call too)."""
    for cls in _work_classes():
        if "wait" in cls.__dict__:
            _wrap(cls, "wait", "wait(timeout)", only_with_timeout=True)
    if torch.cuda.synchronize is _REAL_CUDA_SYNC:  # a fake device counts its own (record())
        _wrap(torch.cuda, "synchronize", "torch.cuda.synchronize")
    _wrap(torch.cuda.Event, "synchronize", "Event.synchronize")
    _wrap(torch.cuda.Stream, "synchronize", "Stream.synchronize")


@contextlib.contextmanager
def counting() -> Iterator[HostSyncs]:
    """Count the host syncs this thread makes inside the block (module docstring)."""
    syncs = HostSyncs()
    me = threading.get_ident()
    with _lock:
        _install()
        _active.setdefault(me, []).append(syncs)
    try:
        with _Counting():
            yield syncs
    finally:
        with _lock:
            _active[me].remove(syncs)
            if not _active[me]:
                del _active[me]
