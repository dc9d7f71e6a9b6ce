"""Slot rings in pinned shared memory (PipeMorph §5.2, Fig. 11/12).

One ring is the shared state of one training process and one delegate process: a control block
followed by ``num_slots`` slots.  Each slot has a 32-bit state flag (written with release, read with
acquire; waiters sleep on a process-shared futex), a 256-byte message header and a payload area.

Slot life cycle (``FREE → WRITING → READY → BUSY → FREE``):

* send ring (producer: training process, consumer: send delegate)
  the trainer claims a FREE slot, copies the tensor in (CPU copy, or async D2H whose stream then writes
  READY from a kernel), the delegate sees READY, marks BUSY, sends header + payload over Gloo straight
  from the slot, and sets FREE.
* recv ring (producer: recv delegate, consumer: training process)
  the delegate receives header + payload into a FREE slot (eager fetch) and sets READY; the trainer
  marks BUSY, copies the payload out (CPU copy, or async H2D whose stream then writes FREE), and FREE.

Both sides walk the slots in the same cyclic order, so a ring is FIFO.  The segment is created by
``Region.create`` (POSIX shm, mode 0600, unique name, unlinked at once; the delegate attaches through the
inherited file descriptor), so nothing of ours is left in /dev/shm after any crash.
"""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ._ext import load_ext

FREE, WRITING, READY, BUSY = 0, 1, 2, 3

MAGIC = 0x54584447  # "TXDG"
PAGE = 4096
HEADER_BYTES = 256
HEADER_WORDS = HEADER_BYTES // 8
MAX_DIMS = 24

# control block (first page)
CTRL_MAGIC = 0
CTRL_NUM_SLOTS = 8          # int64
CTRL_SLOT_BYTES = 16        # int64
CTRL_DELEGATE_STATE = 64    # u32: 0 starting, 1 running, 2 stopped
CTRL_ERROR = 128            # u32: non-zero once the delegate failed (text at CTRL_ERROR_TEXT)
CTRL_STOP = 192             # u32: trainer asks the delegate to stop
CTRL_BYTES = 256            # int64 payload bytes moved
CTRL_BUSY_NS = 264          # int64 ns spent in Gloo send/recv (throughput = bytes / busy)
CTRL_MESSAGES = 272         # int64 messages moved
CTRL_ACKED = 288            # int64 send ring: last seq the peer's recv delegate acknowledged (-1: none)
CTRL_HEARTBEAT = 296        # int64 incremented by the delegate every HEARTBEAT_S (a frozen one stops)
HEARTBEAT_S = 0.1
CTRL_ERROR_TEXT = 1024
CTRL_ERROR_TEXT_MAX = PAGE - CTRL_ERROR_TEXT

SLOT_STATE = 0
SLOT_HEADER = 64
SLOT_PAYLOAD = PAGE

# header words
H_SEQ, H_NBYTES, H_DTYPE, H_NDIM, H_SHAPE = 0, 1, 2, 3, 4
H_DUE_NS = HEADER_WORDS - 1  # CLOCK_MONOTONIC ns before which the send delegate does not send (0: at once):
# an injected link delay on the delegate path (delay_injection.py, DelegatePool.set_link_delay_ms)

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]
DTYPE_CODE = {d: i for i, d in enumerate(DTYPES)}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        DTYPE_CODE[getattr(torch, _name)] = len(DTYPES)
        DTYPES.append(getattr(torch, _name))


SHM_DIR = "/dev/shm"  # where POSIX shared memory lives (shm_open)

#: the site a ring tensor names in the host-sync accounting (``testing/host_syncs.py``)
HOST_SITE = "titan_ext/runtime/comm/delegate/ring.py (pinned shared-memory slot ring)"


#: who marks the ring's views as host memory: a CPU test backend that tells device from host tensors
#: registers its marker while installed (:func:`register_host_marker`); the runtime names no test module
_HOST_MARKERS: list[Callable[[torch.Tensor, str], Any]] = []


def register_host_marker(mark: Callable[[torch.Tensor, str], Any]) -> None:
    """Have ``mark(tensor, site)`` called on every view of a ring (idempotent).  The ``nccl_rules`` test
    backend registers itself when it is installed: it tells device from host tensors on a CPU test by
    where titan_ext made them, and the ring's views come from the C++ extension (``Region.tensor``,
    ``torch::from_blob``), which no torch factory saw, so they would pass for device tensors and a
    blocking copy between a slot and a device buffer would go uncounted."""
    if mark not in _HOST_MARKERS:
        _HOST_MARKERS.append(mark)


def host_tensor(t: torch.Tensor) -> torch.Tensor:
    """A view of the ring, marked as host memory by every registered marker
    (:func:`register_host_marker`; none outside the tests).  Returns ``t``."""
    for mark in _HOST_MARKERS:
        mark(t, HOST_SITE)
    return t


class SharedMemoryShortage(RuntimeError):
    """Not enough free shared memory for a delegate ring (refused up front: a segment larger than what
    the tmpfs can hold used to end every rank with SIGBUS at its first write)."""


def shm_free_bytes(path: str = SHM_DIR) -> int:
    """Bytes an unprivileged process may still allocate in the shared-memory file system (the probe;
    tests replace it)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def check_shm(nbytes: int, what: str = "the delegate rings") -> None:
    """Raise :class:`SharedMemoryShortage` unless ``nbytes`` fit in the free shared memory."""
    try:
        free = shm_free_bytes()
    except OSError:
        return  # no statvfs for it: the reservation (posix_fallocate) still checks
    if nbytes > free:
        raise SharedMemoryShortage(f"{what}: {nbytes / 2**20:.1f} MiB of shared memory needed, {SHM_DIR} has "
                                   f"{free / 2**20:.1f} MiB free (enlarge it, e.g. docker --shm-size, or lower "
                                   f"delegation_slot_mib)")


def _reserve(region, nbytes: int) -> None:
    """Allocate the segment's pages now (tmpfs charges them at the first write otherwise: SIGBUS when
    it is full); :class:`SharedMemoryShortage` if they are not there."""
    try:
        os.posix_fallocate(region.fd, 0, nbytes)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return  # a file system without fallocate: the free-space check above stands
        raise SharedMemoryShortage(f"reserving {nbytes / 2**20:.1f} MiB of shared memory for a delegate ring "
                                   f"failed: {e.strerror or e} ({SHM_DIR} full?)") from None


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class RingGeometry:
    num_slots: int
    slot_bytes: int

    @property
    def stride(self) -> int:
        return SLOT_PAYLOAD + _round_up(max(self.slot_bytes, 1), PAGE)

    @property
    def total_bytes(self) -> int:
        return PAGE + self.num_slots * self.stride

    def slot_offset(self, i: int) -> int:
        return PAGE + i * self.stride


class SlotRing:
    """A ring over a mapped :class:`Region` (created here, or attached from an inherited fd)."""

    def __init__(self, region, geometry: RingGeometry):
        self.region = region
        self.geometry = geometry
        self.num_slots = geometry.num_slots
        self.slot_bytes = geometry.slot_bytes
        g = geometry
        self._state_off: list[int] = [g.slot_offset(i) + SLOT_STATE for i in range(g.num_slots)]
        # every view of the ring is host memory (pinned: cudaHostRegister'ed with CUDA): marked as such
        base_views = [host_tensor(region.tensor(g.slot_offset(i) + SLOT_HEADER, HEADER_BYTES))
                      for i in range(g.num_slots)]
        self.header_bytes = base_views                                   # uint8 views (sent over Gloo)
        self.headers = [host_tensor(v.view(torch.int64)) for v in base_views]  # int64 views of the same bytes
        self._headers_np = [h.numpy() for h in self.headers]
        self._payload = [host_tensor(region.tensor(g.slot_offset(i) + SLOT_PAYLOAD, g.slot_bytes))
                         for i in range(g.num_slots)]

    @classmethod
    def create(cls, num_slots: int, slot_bytes: int) -> "SlotRing":
        if num_slots < 1 or slot_bytes < 1:
            raise ValueError(f"ring needs num_slots >= 1 and slot_bytes >= 1, got {num_slots}, {slot_bytes}")
        g = RingGeometry(num_slots, slot_bytes)
        check_shm(g.total_bytes, "a delegate ring")
        region = load_ext().Region.create(g.total_bytes)
        _reserve(region, g.total_bytes)  # before the first write: never SIGBUS
        region.store64(CTRL_NUM_SLOTS, num_slots)
        region.store64(CTRL_SLOT_BYTES, slot_bytes)
        region.store64(CTRL_ACKED, -1)
        region.store(CTRL_MAGIC, MAGIC)
        return cls(region, g)

    @classmethod
    def attach(cls, fd: int, num_slots: int, slot_bytes: int) -> "SlotRing":
        g = RingGeometry(num_slots, slot_bytes)
        region = load_ext().Region.attach(fd, g.total_bytes)
        if region.load(CTRL_MAGIC) != MAGIC or region.load64(CTRL_NUM_SLOTS) != num_slots:
            raise RuntimeError("shared-memory ring does not match the expected geometry")
        return cls(region, g)

    # --- slot flags -----------------------------------------------------------------------------
    def state(self, i: int) -> int:
        return self.region.load(self._state_off[i])

    def set_state(self, i: int, value: int, wake: bool = True) -> None:
        self.region.store(self._state_off[i], value, wake)

    def claim(self, i: int, expected: int, new: int) -> bool:
        return self.region.cas(self._state_off[i], expected, new)

    def wait_state(self, i: int, want: int, timeout_s: float, abort_off: int = -1, max_sleep_us: int = 1000) -> int:
        """0: reached; 1: timeout; 2: the abort word became non-zero."""
        return self.region.wait(self._state_off[i], want, timeout_s, abort_off, max_sleep_us)

    def state_offset(self, i: int) -> int:
        return self._state_off[i]

    # --- headers and payloads -------------------------------------------------------------------
    def payload(self, i: int, nbytes: int) -> torch.Tensor:
        return host_tensor(self._payload[i][:nbytes])

    def write_header(self, i: int, seq: int, tensor: torch.Tensor, due_ns: int = 0) -> int:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self.slot_bytes:
            raise ValueError(f"message of {nbytes} bytes exceeds the delegate slot size {self.slot_bytes} "
                             f"(raise slot_bytes)")
        if tensor.dim() > MAX_DIMS:
            raise ValueError(f"tensors of more than {MAX_DIMS} dims are not supported")
        if tensor.dtype not in DTYPE_CODE:
            raise TypeError(f"dtype {tensor.dtype} not supported by the delegate path")
        h = [seq, nbytes, DTYPE_CODE[tensor.dtype], tensor.dim(), *tensor.shape]
        self._headers_np[i][: len(h)] = h
        self._headers_np[i][H_DUE_NS] = due_ns
        return nbytes

    def due_ns(self, i: int) -> int:
        """Slot ``i``'s send time (CLOCK_MONOTONIC ns; 0: at once) — see :data:`H_DUE_NS`."""
        return int(self._headers_np[i][H_DUE_NS])

    def read_header(self, i: int) -> tuple[int, int, torch.dtype, tuple[int, ...]]:
        h = self._headers_np[i][: H_SHAPE + MAX_DIMS].tolist()
        ndim = h[H_NDIM]
        return h[H_SEQ], h[H_NBYTES], DTYPES[h[H_DTYPE]], tuple(h[H_SHAPE:H_SHAPE + ndim])

    def copy_in(self, i: int, tensor: torch.Tensor, nbytes: int) -> None:
        """Copy a CPU tensor into slot ``i`` (single-threaded memcpy when contiguous: the intra-op pool
        of a busy host costs far more than the copy itself)."""
        if tensor.is_contiguous():
            ctypes.memmove(self.region.address + self.geometry.slot_offset(i) + SLOT_PAYLOAD,
                           tensor.data_ptr(), nbytes)
        else:
            self.typed_view(i, tensor.dtype, tensor.shape).copy_(tensor)

    def copy_out(self, i: int, tensor: torch.Tensor, nbytes: int) -> None:
        """Copy slot ``i`` into a CPU tensor of the message's dtype and shape (from the pinned slot: a
        ``non_blocking`` copy, as a GPU's H2D from it is)."""
        if tensor.is_contiguous():
            ctypes.memmove(tensor.data_ptr(), self.region.address + self.geometry.slot_offset(i) + SLOT_PAYLOAD,
                           nbytes)
        else:
            tensor.copy_(self.typed_view(i, tensor.dtype, tensor.shape), non_blocking=True)

    def typed_view(self, i: int, dtype: torch.dtype, shape) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        return host_tensor(self._payload[i][:nbytes].view(dtype).view(tuple(shape)))

    # --- control block --------------------------------------------------------------------------
    def error_text(self) -> str:
        if not self.region.load(CTRL_ERROR):
            return ""
        raw = bytes(host_tensor(self.region.tensor(CTRL_ERROR_TEXT, CTRL_ERROR_TEXT_MAX)).tolist())
        return raw.split(b"\0", 1)[0].decode(errors="replace")

    def set_error(self, text: str) -> None:
        data = text.encode(errors="replace")[: CTRL_ERROR_TEXT_MAX - 1] + b"\0"
        host_tensor(self.region.tensor(CTRL_ERROR_TEXT, len(data))).copy_(
            torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.region.store(CTRL_ERROR, 1)
        # wake anybody sleeping on a slot flag so they notice the error promptly
        for off in self._state_off:
            self.region.store(off, self.region.load(off))

    def stats(self) -> dict:
        r = self.region
        busy = r.load64(CTRL_BUSY_NS) / 1e9
        moved = r.load64(CTRL_BYTES)
        return {"bytes": moved, "messages": r.load64(CTRL_MESSAGES), "busy_s": busy,
                "bytes_per_s": moved / busy if busy > 0 else float("nan")}


def our_shm_names(pids=None) -> list[str]:
    """Names in /dev/shm that this package created (``titanx_<pid>_...``), optionally only for ``pids``."""
    if pids is not None:
        from titan_ext.args import ArgumentTypeError, int_arg

        if isinstance(pids, (str, bytes)) or not hasattr(pids, "__iter__"):
            raise ArgumentTypeError(f"pids must be an iterable of process ids or None, got {pids!r}")
        pids = {int_arg(p, f"pids[{i}]", 1) for i, p in enumerate(pids)}
    try:
        names = os.listdir("/dev/shm")
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        if not n.startswith("titanx_"):
            continue
        if pids is not None:
            try:
                if int(n.split("_")[1]) not in pids:
                    continue
            except (IndexError, ValueError):
                continue
        out.append(n)
    return out


def sweep_stale_segments() -> list[str]:
    """Unlink ``titanx_<pid>_*`` names whose creating process is gone (only a crash between shm_open and
    the immediate shm_unlink could leave one).  Returns the names removed."""
    removed = []
    for n in our_shm_names():
        try:
            pid = int(n.split("_")[1])
            os.kill(pid, 0)
            continue
        except ProcessLookupError:
            pass
        except (PermissionError, ValueError, IndexError):
            continue
        try:
            os.unlink(os.path.join("/dev/shm", n))
            removed.append(n)
        except OSError:
            pass
    return removed
