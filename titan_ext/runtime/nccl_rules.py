"""``nccl_rules``: a CPU test process-group backend that enforces NCCL's rules (issue 20, Build 2).

No GPU runs this project's tests, so NCCL's rules (DESIGN.md "GPU rules the CPU tests must enforce")
are enforced by a backend that runs on CPU over gloo but behaves like NCCL where gloo is lenient:

* **tags ignored, one FIFO per rank pair and direction**: every message travels on the inner gloo group
  with one tag, so the k-th send to a peer matches the peer's k-th receive from this rank, whatever the
  tags say (a size or dtype mismatch is reported, NCCL would corrupt or hang);
* **a ``batch_isend_irecv`` list is one group with rendezvous**: each rank's ops on a pair form a
  sequence of groups (a batch, or one bare op) that NCCL runs in issue order; a group completes only
  when every op of it has its match in the peer's current or earlier group.  Both sides send a small
  description of each group ahead of its data; the pair's NCCL progress is stepped by the thread
  that learnt something new (the pair's lander thread, which reads the peer's descriptions and data,
  or the group's completer thread after this rank issued); a state where each side's current group
  needs a *later* group of the other is the deadlock NCCL would hang in: every rank of the pair
  raises :class:`NcclRuleError` with both op sequences.  An op still unmatched after
  ``TITAN_EXT_NCCL_RULES_TIMEOUT_S`` (default 60 s) raises the same way (a peer that never issues it;
  NCCL's watchdog would kill the job);
* **``Work.wait()`` returns before the data has landed** (with or without a timeout, and it never
  raises on a timeout): the data is copied into the receive buffer later, by the lander or completer
  thread, when the NCCL matching completes.  As NCCL's wait makes the *current stream* wait, the
  calling thread (a CPU "stream") runs no further torch kernel until the ops it waited on have
  landed (a ``TorchDispatchMode`` on that thread); host code that stamps a time right after ``wait()`` gets the
  enqueue time, as on a GPU, and another thread that reads the buffer without its own wait can see
  stale data.  ``is_completed()`` and ``get_future()`` are truthful: they complete when the data has
  landed (the contract the device layer relies on);
* **one thread per pair**: an op issued on a pair from a thread other than the one that issued the
  pair's earlier ops raises at once;
* **no host tensors on data groups**: every group of this backend is a data group (the PP and DP
  groups; the control plane asks for ``backend="gloo"`` explicitly and gets plain gloo).  A host tensor
  is refused there, as a P2P buffer and as a collective's input *or output* (NCCL reads and writes
  device memory only).  Where a tensor lives is decided by where it was placed, since on a CPU test
  every tensor lives on the CPU: while the backend is installed, a ``TorchFunctionMode`` on *every*
  thread (the installing one and each thread started after it) marks as host

  - a tensor titan_ext code (outside the device layer, :data:`DEVICE_LAYER_MODULES`) places on the
    host: a factory (``torch.tensor``, ``zeros``, ``empty``, ``full``, ``arange`` …) called without
    ``device=`` or with the host named as the string ``"cpu"``, ``.cpu()``, ``.to("cpu")``; a
    ``torch.device`` value (``t.device``, ``layer.device``) is the stage's device (on a GPU job the
    stage's device is ``cuda:N``; code that means the host spells it ``"cpu"``, :func:`names_host`);
    ``*_like`` / ``new_*`` follow their source's device;
  - pinned memory (``pin_memory=True``, ``.pin_memory()``), whoever made it;
  - everything computed from a marked tensor — except the user's side's ``.to(device)`` (TorchTitan
    moving the batch that titan_ext's S2 gathered on the host), which on a GPU copies it onto the
    device: it gives an unmarked view.

  Tensors made by torch (pipelining's buffers), by the model, by the user's code, or through the
  device layer are device tensors.  :func:`mark_host` marks one explicitly; :func:`is_host_made`
  is the one test of it (the host-sync accounting of :mod:`titan_ext.runtime.host_syncs` uses it to
  tell a device read from a host one).

Collectives are gloo's (host-tensor rule checked), synchronous at ``wait()``.  What a CPU run cannot
show: cross-pair NCCL blocking (one NCCL stream serialises a rank's groups to *different* peers too;
the pair model here only catches cycles within a pair), eager small-message buffering, and device
timing.

Use: ``run_ranks(fn, n, backend="nccl_rules")``, the environment variable ``TITAN_EXT_TEST_BACKEND``
(read by :func:`titan_ext.runtime.testing.run_ranks` and the TorchTitan CPU shim), or
``install(); dist.init_process_group("nccl_rules", ...)``.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import queue
import sys
import threading
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

BACKEND = "nccl_rules"
ENV_VAR = "TITAN_EXT_TEST_BACKEND"
TIMEOUT_ENV = "TITAN_EXT_NCCL_RULES_TIMEOUT_S"
#: titan_ext modules whose tensors are device tensors: the device layer (issue 20 Build 1), and the
#: test harness's models and batches (the user's side of a job)
DEVICE_LAYER_MODULES = ("titan_ext.runtime.device", "titan_ext.runtime.testing")

__all__ = ["BACKEND", "ENV_VAR", "NcclRuleError", "NcclRulesGroup", "install", "installed", "is_host_made",
           "mark_host", "names_host"]

_SEND, _RECV, _CLOSE = 0, 1, -1
_INLINE_OPS = 8  # ops of one group on one pair described in its fixed-size head (more: a second message)
_META_LEN = 2 + 3 * _INLINE_OPS
_TAG = 0  # tags are ignored: one FIFO per pair and direction
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
_HOST_ATTR = "_titan_ext_host_site"
_SHUTDOWN_S = 2.0  # how long a group's shutdown waits for its peers' close messages
_KEPT_OPEN: list = []  # shut-down groups whose landers still wait on a peer
_EXIT_WAIT_S = 60.0  # how long interpreter exit waits for the peers' close messages
_GROUPS: "weakref.WeakSet[NcclRulesGroup]" = weakref.WeakSet()  # every group whose threads may run


class NcclRuleError(RuntimeError):
    """Traffic that NCCL would hang on, corrupt, or refuse (the message says which rule)."""


# --------------------------------------------------------------------------------------------------
# host tensors made by titan_ext
# --------------------------------------------------------------------------------------------------
def mark_host(tensor: torch.Tensor, site: str = "mark_host()") -> torch.Tensor:
    """Mark ``tensor`` as a host-side tensor (refused on NCCL data groups); returns it."""
    setattr(tensor, _HOST_ATTR, site)
    return tensor


def is_host_made(tensor: torch.Tensor) -> str | None:
    """Where titan_ext made ``tensor`` on the host, or None for a device tensor."""
    return getattr(tensor, _HOST_ATTR, None)


#: factories that make a tensor on the default device unless given ``device=`` (on a GPU: the host).
#: ``*_like`` and ``new_*`` are not among them: they follow their source's device (``zeros_like`` of a
#: parameter is a device tensor), so their result is marked only when the source is.
_FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "linspace", "eye",
              "rand", "randn", "randint", "randperm", "empty_strided", "from_numpy", "scalar_tensor"}


def installed() -> bool:
    """Whether this backend's rules are in force in this process (:func:`install` ran)."""
    return _installed


def names_host(target: Any) -> bool:
    """Whether a ``device=`` / ``.to()`` target names the host.  On a CPU test the stage's device *is*
    the CPU, so the two are told apart by how the code names them: a device spelled as the string
    ``"cpu"`` (``"cpu:0"``) is the host, as it is in a GPU job; a ``torch.device`` value is the stage's
    device (code that follows a tensor, ``t.device``, or the device layer's ``layer.device``, gets the
    stage's device on a GPU: ``cuda:N``)."""
    return isinstance(target, str) and torch.device(target).type == "cpu"


def _caller_module() -> str:
    """Module of the Python code that called the torch function (past torch's own dispatch glue)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(
            ("torch.overrides", __name__, "titan_ext.runtime.host_syncs")):
        frame = frame.f_back
    return frame.f_globals.get("__name__", "") if frame is not None else ""


def _is_pinned_request(func: Any, args: tuple, kwargs: dict) -> bool:
    """Pinned memory is host memory, whoever asks for it (``pin_memory=True``, ``.pin_memory()``)."""
    return getattr(func, "__name__", "") == "pin_memory" or bool(kwargs.get("pin_memory", False))


def _is_host_request(func: Any, args: tuple, kwargs: dict) -> bool:
    """A tensor placed on the host by titan_ext code: a factory without ``device=`` or with the host
    named (:func:`names_host`), ``.cpu()``, ``.to("cpu")``."""
    name = getattr(func, "__name__", "")
    if name in _FACTORIES:
        device = kwargs.get("device")
        return device is None or names_host(device)
    if name == "cpu":
        return True
    if name == "to":
        target = kwargs.get("device", args[1] if len(args) > 1 else None)
        return names_host(target)
    return False


def _is_user_device_move(func: Any, args: tuple, kwargs: dict) -> bool:
    """A ``.to(device)`` by the user's side of the job (TorchTitan, the model; not titan_ext): the
    host-to-device copy of its inputs.  On a GPU its result is a new device tensor; on a CPU test the
    device *is* the CPU (a dtype-only ``.to`` is no move)."""
    if getattr(func, "__name__", "") != "to":
        return False
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return (isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"
            and not _caller_module().startswith("titan_ext"))


def _any_marked(args: tuple, kwargs: dict) -> str | None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            site = is_host_made(a)
            if site:
                return site
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor) and is_host_made(b):
                    return is_host_made(b)
    return None


class _HostTensorMarker(TorchFunctionMode):
    """Marks host tensors (module docstring), on every thread of the process (:func:`_mark_on_every_thread`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        site = _any_marked(args, kwargs)
        if site is not None and _is_user_device_move(func, args, kwargs):
            return out.view_as(out)  # the device copy: an unmarked tensor (a view: no data copied)
        if site is None and _is_pinned_request(func, args, kwargs):
            site = f"{_caller_module()}: pinned {getattr(func, '__name__', func)}()"
        elif site is None and _is_host_request(func, args, kwargs):
            module = _caller_module()
            if module.startswith("titan_ext") and not module.startswith((*DEVICE_LAYER_MODULES, __name__)):
                site = f"{module}: {getattr(func, '__name__', func)}()"
                if threading.current_thread() is not threading.main_thread():
                    site += f" on thread {threading.current_thread().name!r}"
        if site is not None:
            for t in out if isinstance(out, (list, tuple)) else (out,):
                if isinstance(t, torch.Tensor) and not any(t is a for a in args) and not is_host_made(t):
                    mark_host(t, site)
        return out


def _enter_marker() -> None:
    """Put the marker on this thread's torch-function mode stack (mode stacks are per thread)."""
    if not getattr(_modes, "marking", False):
        _modes.marking = True
        _HostTensorMarker().__enter__()


_orig_bootstrap_inner = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]


def _bootstrap_marking(self: threading.Thread) -> None:
    _enter_marker()
    _orig_bootstrap_inner(self)


def _mark_on_every_thread() -> None:
    """Every thread started from now on marks its host tensors too (helper threads: watchers,
    planners, delegates' feeders); the calling thread at once."""
    _enter_marker()
    threading.Thread._bootstrap_inner = _bootstrap_marking  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------------------
# NCCL's wait: the stream's later kernels wait, the host does not
# --------------------------------------------------------------------------------------------------
# CUDA's current stream is the device's default stream on every thread unless code picks another, so
# the emulated process has ONE stream: a ``wait()`` from any thread orders every later torch kernel of
# the process (on the threads that run compute: the main thread and any thread that called wait())
# after the waited ops; the data-moving threads of this module are the "NCCL stream" and never wait.
_pending: list["_RulesWork"] = []
_pending_lock = threading.Lock()
_modes = threading.local()


def _drain_pending() -> None:
    """Block until every waited op has landed.  An op leaves the list only once it has landed, so
    a thread that finds the list empty never overtakes one still blocked on it."""
    if not _pending:
        return
    with _pending_lock:
        works = list(_pending)
    try:
        for work in works:
            work._block()
    finally:
        with _pending_lock:
            _pending[:] = [w for w in _pending if not w._settled.is_set()]


class _StreamWait(TorchDispatchMode):
    """The next kernel blocks until the ops some thread waited on have landed."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        _drain_pending()
        return func(*args, **(kwargs or {}))


class _StreamWaitHostRead(TorchFunctionMode):
    """The same for host reads that bypass the dispatcher (``tolist()``, ``numpy()``): on a GPU they
    are a copy ordered on the stream."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        _drain_pending()
        return func(*args, **(kwargs or {}))


def _join_stream() -> None:
    """Make this thread's kernels run on the emulated stream (mode stacks are per thread)."""
    if not getattr(_modes, "on", False):
        _modes.on = True
        _StreamWait().__enter__()  # both stay on this thread's mode stacks
        _StreamWaitHostRead().__enter__()


def _stream_wait_later(work: "_RulesWork") -> None:
    _join_stream()
    with _pending_lock:
        _pending.append(work)


class _RulesWork(dist.Work):
    """One P2P op's handle: ``wait()`` enqueues, ``is_completed()``/``get_future()`` tell the truth."""

    def __init__(self, op: "_Op"):
        super().__init__()
        self.op = op
        self._settled = threading.Event()
        self._error: BaseException | None = None
        self._future: torch.futures.Future = torch.futures.Future()

    def wait(self, timeout: Any = None) -> bool:  # noqa: ARG002 - NCCL: a timeout never raises here
        if self._error is not None:
            raise self._error
        _stream_wait_later(self)
        return True

    def is_completed(self) -> bool:
        if self._error is not None:
            raise self._error
        return self._settled.is_set() or self._future.done()

    def is_success(self) -> bool:
        return self._error is None and (self._settled.is_set() or self._future.done())

    def exception(self) -> Any:
        return self._error

    def get_future(self) -> torch.futures.Future:
        return self._future

    def _land(self) -> None:
        # the future first: whoever wakes on ``_settled`` then also sees ``get_future().done()``, and
        # ``is_completed()`` reads either, so a thread woken by the future sees it too
        self._future.set_result([self.op.tensor])
        self._settled.set()
        self.op = None

    def _fail(self, error: BaseException) -> None:
        if self._settled.is_set():
            return
        self._error = error
        self._future.set_exception(error)
        self._settled.set()

    def _block(self) -> None:
        self._settled.wait()
        if self._error is not None:
            raise self._error


# --------------------------------------------------------------------------------------------------
# per-pair NCCL progress
# --------------------------------------------------------------------------------------------------
class _Op:
    """One P2P op; ``tensor`` and ``work`` are dropped once it has landed (nothing kept alive)."""

    __slots__ = ("kind", "tensor", "numel", "dtype", "k", "group", "issued", "work", "payload")

    def __init__(self, kind: int, tensor: torch.Tensor):
        if not tensor.is_contiguous():
            raise NcclRuleError("NCCL rules: P2P tensors must be contiguous")
        if tensor.dtype not in _DTYPES:
            raise NcclRuleError(f"NCCL rules: dtype {tensor.dtype} is not supported by NCCL")
        self.kind, self.tensor = kind, tensor
        self.numel, self.dtype = tensor.numel(), _DTYPES.index(tensor.dtype)
        self.k = self.group = -1
        self.issued = time.monotonic()
        self.work: _RulesWork | None = _RulesWork(self)
        # the bytes a send puts on the wire (made here, outside the group's lock: a torch op may wait)
        self.payload = tensor.reshape(-1).view(torch.uint8) if kind == _SEND and self.numel else None

    def land(self, staged: torch.Tensor | None) -> None:
        if staged is not None and self.numel:
            self.tensor.reshape(-1).view(torch.uint8).copy_(staged)
        self.work._land()
        self.tensor = self.work = self.payload = None


def _group_meta(g: int, group: list[_Op]) -> list[torch.Tensor]:
    """A group's description on the wire: a fixed-size head (op count, group index, (kind, numel,
    dtype) of its first ``_INLINE_OPS`` ops), then, for a larger group, the rest's fields (any size:
    torch's ``batch_isend_irecv`` of a whole state dict to one peer is one NCCL group)."""
    fields = [x for op in group for x in (op.kind, op.numel, op.dtype)]
    head = [len(group), g, *fields[:3 * _INLINE_OPS]]
    out = [torch.tensor(head + [0] * (_META_LEN - len(head)), dtype=torch.int64)]
    if len(group) > _INLINE_OPS:
        out.append(torch.tensor(fields[3 * _INLINE_OPS:], dtype=torch.int64))
    return out


def _describe(kind: int, k: int, numel: int, dtype: int) -> str:
    return f"{'send' if kind == _SEND else 'recv'}#{k}({numel} {str(_DTYPES[dtype]).removeprefix('torch.')})"


def _other(kind: int) -> int:
    return _RECV if kind == _SEND else _SEND


class _Pair:
    """NCCL's progress on one rank pair, as seen by this rank (both sides' group sequences).

    My send k matches the peer's receive k and my receive k the peer's send k (one FIFO per
    direction, tags ignored).  A group completes when every op of it has its match in the other
    side's current or an earlier group (the NCCL group rendezvous)."""

    def __init__(self, me: int, peer: int):
        self.me, self.peer = me, peer
        self.thread: tuple[int, str] | None = None
        self.mine: list[list[_Op]] = []
        self.my_group_of: dict[int, list[int]] = {_SEND: [], _RECV: []}  # k → my group
        self.theirs: list[list[tuple[int, int, int, int]]] = []  # (kind, k, numel, dtype) per op
        self.their_group_of: dict[int, list[int]] = {_SEND: [], _RECV: []}  # k → their group
        self.their_spec: dict[int, list[tuple[int, int]]] = {_SEND: [], _RECV: []}  # k → (numel, dtype)
        self.staged: dict[int, torch.Tensor] = {}  # peer's send k → its bytes, arrived
        self.to_land: list[_Op] = []  # matched, not landed yet
        self.open: list[_Op] = []  # issued, not landed yet (watchdog)
        self.i = self.j = 0  # first incomplete group: mine, theirs
        self.error: NcclRuleError | None = None

    def add_mine(self, group: list[_Op]) -> int:
        g = len(self.mine)
        for op in group:
            op.group, op.k = g, len(self.my_group_of[op.kind])
            self.my_group_of[op.kind].append(g)
        self.mine.append(group)
        self.open += group
        return g

    def add_theirs(self, group: list[tuple[int, int, int]]) -> None:
        h, ops = len(self.theirs), []
        for kind, numel, dtype in group:
            ops.append((kind, len(self.their_group_of[kind]), numel, dtype))
            self.their_group_of[kind].append(h)
            self.their_spec[kind].append((numel, dtype))
        self.theirs.append(ops)

    def _my_match(self, op: _Op) -> int | None:
        groups = self.their_group_of[_other(op.kind)]
        if op.k >= len(groups):
            return None
        spec = self.their_spec[_other(op.kind)][op.k]
        if spec != (op.numel, op.dtype):
            raise self.fail(f"size/dtype mismatch: this rank's {_describe(op.kind, op.k, op.numel, op.dtype)} "
                            f"meets the peer's {_describe(_other(op.kind), op.k, *spec)}")
        return groups[op.k]

    def _mine_matches(self, g: int) -> list[int | None]:
        return [self._my_match(op) for op in self.mine[g]]

    def _their_matches(self, h: int) -> list[int | None]:
        out = []
        for kind, k, _, _ in self.theirs[h]:
            mine = self.my_group_of[_other(kind)]
            out.append(mine[k] if k < len(mine) else None)
        return out

    @staticmethod
    def _ready(matches: list[int | None], peer_index: int) -> bool:
        return all(m is not None and m <= peer_index for m in matches)

    def step(self) -> None:
        """Advance both sides as far as NCCL would; raise on a deadlock."""
        progressed = True
        while progressed:
            progressed = False
            if self.i < len(self.mine) and self._ready(self._mine_matches(self.i), self.j):
                self.to_land += self.mine[self.i]
                self.i += 1
                progressed = True
            if self.j < len(self.theirs) and self._ready(self._their_matches(self.j), self.i):
                self.j += 1
                progressed = True
        if self.i < len(self.mine) and self.j < len(self.theirs):
            mine, theirs = self._mine_matches(self.i), self._their_matches(self.j)
            if None not in mine and None not in theirs:
                raise self.fail(
                    f"deadlock: this rank's group #{self.i} needs the peer's group #{max(mine)}, the "
                    f"peer's group #{self.j} needs this rank's group #{max(theirs)}; NCCL runs a pair's "
                    f"ops in issue order and a batch_isend_irecv list as one group, so a reordered or "
                    f"split batch hangs")

    def land(self) -> None:
        """Complete matched ops: sends at once, receives once their bytes have arrived."""
        waiting = []
        for op in self.to_land:
            if op.kind == _SEND:
                op.land(None)
            elif op.k in self.staged:
                op.land(self.staged.pop(op.k))
            else:
                waiting.append(op)
        self.to_land = waiting

    def oldest_open(self) -> float | None:
        self.open = [op for op in self.open if op.work is not None]
        return self.open[0].issued if self.open else None

    def fail(self, what: str) -> NcclRuleError:
        self.error = NcclRuleError(f"NCCL rules, ranks {self.me}<->{self.peer} (group ranks): {what}\n"
                                   f"{self.sequences()}")
        for op in self.open:
            if op.work is not None:
                op.work._fail(self.error)
        return self.error

    def sequences(self, last: int = 12) -> str:
        """Both sides' groups on this pair (the last ``last`` of each; -> marks the current one)."""
        def fmt(groups: list[list[str]], current: int) -> str:
            first = max(0, len(groups) - last)
            text = " ".join(("->" if g == current else "") + f"#{g}{{" + ", ".join(ops) + "}"
                            for g, ops in enumerate(groups) if g >= first)
            return ("... " if first else "") + (text or "(none)")

        mine = [[_describe(op.kind, op.k, op.numel, op.dtype) for op in g] for g in self.mine]
        theirs = [[_describe(*op) for op in g] for g in self.theirs]
        return (f"  rank {self.me} issued to {self.peer}: {fmt(mine, self.i)}\n"
                f"  rank {self.peer} issued to {self.me}: {fmt(theirs, self.j)}")


# --------------------------------------------------------------------------------------------------
# the process group
# --------------------------------------------------------------------------------------------------
class NcclRulesGroup(dist.ProcessGroup):
    """A data process group with NCCL's rules over an inner gloo group (module docstring)."""

    def __init__(self, store: Any, rank: int, size: int, timeout: Any):
        super().__init__(rank, size)
        self._inner = dist.ProcessGroupGloo(dist.PrefixStore("nccl_rules", store), rank, size, timeout)
        _never_destroyed(self._inner)
        self._rank, self._size = rank, size
        self._timeout_s = float(os.environ.get(TIMEOUT_ENV, "60"))
        self._lock = threading.RLock()
        self._events: queue.Queue = queue.Queue()
        self._pairs = {p: _Pair(rank, p) for p in range(size) if p != rank}
        self._batch = threading.local()
        self._sends: queue.SimpleQueue = queue.SimpleQueue()  # inner sends, kept alive until sent
        self._closed = False
        self._landers = [threading.Thread(target=self._read_peer, args=(p,), daemon=True,
                                          name=f"nccl_rules-lander-{rank}<-{p}") for p in self._pairs]
        self._completer = threading.Thread(target=self._complete, daemon=True, name=f"nccl_rules-completer-{rank}")
        self._reaper = threading.Thread(target=self._reap, daemon=True, name=f"nccl_rules-reaper-{rank}")
        for t in (*self._landers, self._completer, self._reaper):
            t.start()
        _GROUPS.add(self)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    # torch names a Python process group through these (DeviceMesh reads ``group_name``)
    def getGroupName(self) -> str:  # noqa: N802
        return getattr(self, "_group_name", "")

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return getattr(self, "_group_desc", "")

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    # -- P2P ------------------------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> _RulesWork:  # noqa: ARG002
        return self._post(_SEND, tensors, dst)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> _RulesWork:  # noqa: ARG002
        return self._post(_RECV, tensors, src)

    def recv_anysource(self, *args: Any) -> None:
        raise NcclRuleError("NCCL rules: NCCL has no receive from any source")

    def _post(self, kind: int, tensors: list[torch.Tensor], peer: int) -> _RulesWork:
        if len(tensors) != 1:
            raise NcclRuleError("NCCL rules: one tensor per P2P op")
        if peer not in self._pairs:
            raise NcclRuleError(f"NCCL rules: peer {peer} is not another rank of this {self._size}-rank group")
        _check_device_tensor(tensors[0], "a P2P op")
        op = _Op(kind, tensors[0])
        work = op.work  # the op lets go of it when it lands, perhaps before _issue returns
        batch = getattr(self._batch, "ops", None)
        if batch is not None:
            batch.append((peer, op))
        else:
            self._issue([(peer, op)])
        return work

    def begin_batch(self) -> None:
        """Start a ``batch_isend_irecv`` group (ops collected until :meth:`end_batch`)."""
        self._batch.ops = []

    def end_batch(self) -> None:
        ops, self._batch.ops = self._batch.ops, None
        if ops:
            self._issue(ops)

    def _issue(self, ops: list[tuple[int, _Op]]) -> None:
        """One NCCL group: per pair, its description then its send data, on the inner FIFO."""
        by_peer: dict[int, list[_Op]] = {}
        for peer, op in ops:
            by_peer.setdefault(peer, []).append(op)
        me = (threading.get_ident(), threading.current_thread().name)
        for peer, group in by_peer.items():
            pair = self._pairs[peer]
            with self._lock:
                if pair.error is not None:
                    raise pair.error
                if pair.thread is None:
                    pair.thread = me
                elif pair.thread[0] != me[0]:
                    raise NcclRuleError(
                        f"NCCL rules: ranks {self._rank}<->{peer}: op issued from thread {me[1]!r}, but the "
                        f"pair's earlier ops came from thread {pair.thread[1]!r}; NCCL needs one issuing "
                        f"order per pair (issue every op of a pair from one thread)")
                g = pair.add_mine(group)
                payloads = [op.payload for op in group if op.payload is not None]
            works = [self._inner.send([meta], peer, _TAG) for meta in _group_meta(g, group)]
            works += [self._inner.send([data], peer, _TAG) for data in payloads]
            for w in works:
                self._sends.put(w)
            self._events.put(("issued", peer, None))

    def _read_peer(self, peer: int) -> None:
        """Lander: read the peer's FIFO (group description, then its send data) and step the pair's
        progress itself, so a receive lands in the thread its data arrived on (no thread hop)."""
        their_sends = 0
        try:
            while True:
                meta = torch.empty(_META_LEN, dtype=torch.int64)
                self._inner.recv([meta], peer, _TAG).wait()
                n, _, *fields = meta.tolist()
                if n == _CLOSE:
                    return
                if n > _INLINE_OPS:
                    rest = torch.empty(3 * (n - _INLINE_OPS), dtype=torch.int64)
                    self._inner.recv([rest], peer, _TAG).wait()
                    fields += rest.tolist()
                group = [tuple(fields[3 * i: 3 * i + 3]) for i in range(n)]
                self._progress(peer, "meta", group)
                for kind, numel, dtype in group:
                    if kind != _SEND:
                        continue
                    buf = torch.empty(numel * _DTYPES[dtype].itemsize, dtype=torch.uint8)
                    if numel:
                        self._inner.recv([buf], peer, _TAG).wait()
                    self._progress(peer, "data", (their_sends, buf))
                    their_sends += 1
        except Exception as exc:  # noqa: BLE001 - the group is going away, or gloo failed
            if not self._closed:
                self._progress(peer, "dead", exc)

    def _reap(self) -> None:
        """Reaper: holds each inner gloo send until it has gone (its buffer must outlive it), in issue
        order.  gloo's ``is_completed()`` stays False until someone waits, so a list pruned by it
        only grew (every send of the run, scanned at every issue)."""
        while True:
            work = self._sends.get()
            if work is None:
                return
            try:
                work.wait()
            except Exception:  # noqa: BLE001 - the peer is gone: its lander reports it
                pass

    def _complete(self) -> None:
        """Completer: steps a pair after this rank issued on it (off the issuing thread, whose torch
        ops wait on the emulated stream) and runs the watchdog."""
        while not self._closed:
            try:
                kind, peer, payload = self._events.get(timeout=0.5)
            except queue.Empty:
                self._watchdog()
                continue
            if kind == "stop":
                return
            self._progress(peer, kind, payload)
            self._watchdog()

    def _progress(self, peer: int, kind: str, payload: Any) -> None:
        """Apply one event to the pair, step its NCCL progress and land what matched."""
        pair = self._pairs[peer]
        with self._lock:
            if pair.error is not None:
                return
            try:
                self._apply(pair, kind, payload)
                pair.step()
                pair.land()
            except NcclRuleError:
                pass  # recorded on the pair and its works
            except Exception as exc:  # noqa: BLE001 - surface anything else through the works
                pair.fail(f"internal error: {exc!r}")

    @staticmethod
    def _apply(pair: _Pair, kind: str, payload: Any) -> None:
        if kind == "meta":
            pair.add_theirs(payload)
        elif kind == "data":
            k, buf = payload
            pair.staged[k] = buf
        elif kind == "dead":
            raise pair.fail(f"the inner gloo channel from the peer failed: {payload!r}")

    def _watchdog(self) -> None:
        now = time.monotonic()
        with self._lock:
            for pair in self._pairs.values():
                oldest = pair.oldest_open()
                if pair.error is None and oldest is not None and now - oldest > self._timeout_s:
                    try:
                        raise pair.fail(f"an op unmatched for {self._timeout_s:g} s (${TIMEOUT_ENV}); "
                                         f"NCCL would hang until its watchdog kills the job")
                    except NcclRuleError:
                        pass

    # -- collectives (gloo's, host-tensor rule checked on inputs *and* outputs) --------------------
    def _forward(self, name: str, tensors: list, *args: Any) -> Any:
        """A collective on gloo, after refusing host tensors among ``tensors`` (every input and output
        buffer: NCCL writes a collective's result into device memory, so a host output is refused
        like a host input)."""
        for t in tensors:
            _check_device_tensor(t, f"a collective ({name})")
        return getattr(self._inner, name)(*args)

    def allreduce(self, tensors, opts=None):
        return self._forward("allreduce", tensors, tensors, *_opt(opts))

    def allreduce_coalesced(self, tensors, opts=None):
        return self._forward("allreduce_coalesced", tensors, tensors, *_opt(opts))

    def broadcast(self, tensors, opts=None):
        return self._forward("broadcast", tensors, tensors, *_opt(opts))

    def allgather(self, outputs, inputs, opts=None):
        return self._forward("allgather", [*inputs, *_flat(outputs)], outputs, inputs, *_opt(opts))

    def _allgather_base(self, output, inp, opts=None):
        return self._forward("_allgather_base", [inp, output], output, inp, *_opt(opts))

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._forward("allgather_into_tensor_coalesced", [*inputs, *outputs], outputs, inputs, *_opt(opts))

    def reduce_scatter(self, outputs, inputs, opts=None):
        return self._forward("reduce_scatter", [*_flat(inputs), *outputs], outputs, inputs, *_opt(opts))

    def _reduce_scatter_base(self, output, inp, opts=None):
        return self._forward("_reduce_scatter_base", [inp, output], output, inp, *_opt(opts))

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._forward("reduce_scatter_tensor_coalesced", [*inputs, *outputs], outputs, inputs, *_opt(opts))

    def alltoall_base(self, output, inp, out_splits, in_splits, opts=None):
        return self._forward("alltoall_base", [inp, output], output, inp, out_splits, in_splits, *_opt(opts))

    def gather(self, outputs, inputs, opts=None):
        return self._forward("gather", [*inputs, *_flat(outputs)], outputs, inputs, *_opt(opts))

    def scatter(self, outputs, inputs, opts=None):
        return self._forward("scatter", [*_flat(inputs), *outputs], outputs, inputs, *_opt(opts))

    def reduce(self, tensors, opts=None):
        return self._forward("reduce", tensors, tensors, *_opt(opts))

    def barrier(self, opts=None):
        return self._inner.barrier(*_opt(opts))

    # -- lifetime -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Tell each peer's lander this FIFO is finished; give this rank's landers a moment (peers
        shut their groups down in their own order) to read their peers' close.  A group whose lander
        is still blocked in gloo stays referenced, so its inner group is never destroyed under it."""
        if self._closed:
            return
        close = torch.full((_META_LEN,), _CLOSE, dtype=torch.int64)
        for p in self._pairs:
            self._sends.put(self._inner.send([close], p, _TAG))
        self._sends.put(None)
        self._closed = True
        self._events.put(("stop", None, None))
        deadline = time.monotonic() + _SHUTDOWN_S
        for t in self._landers:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._landers):
            _KEPT_OPEN.append(self)

    def abort(self) -> None:
        self._closed = True
        self._events.put(("stop", None, None))
        self._sends.put(None)

    def op_sequences(self) -> dict[int, str]:
        """Both sides' op sequences per peer (diagnostics)."""
        with self._lock:
            return {p: pair.sequences() for p, pair in self._pairs.items()}


def _flat(tensor_lists: Any) -> list:
    return [t for ts in tensor_lists for t in ts]


def _opt(opts: Any) -> tuple:
    return () if opts is None else (opts,)


def _check_device_tensor(tensor: torch.Tensor, what: str) -> None:
    site = is_host_made(tensor)
    if site:
        raise NcclRuleError(
            f"NCCL rules: {what} on an NCCL data group got a host-side tensor made by titan_ext ({site}); "
            f"NCCL takes device tensors only: send host tensors (markers, timings, probes, chunks) on the "
            f"gloo control group, or make device tensors through the device layer")


def _never_destroyed(obj: Any) -> None:
    """One reference that is never dropped, so ``obj``'s C++ destructor never runs.  For the inner gloo
    groups: destroyed at interpreter finalisation (its module's references cleared), a
    ``ProcessGroupGloo`` whose peer already exited aborts the process (SIGABRT, "terminate called
    without an active exception", on the main thread with no Python frame) — 1 run in 3 of two ranks
    that destroy their groups and exit normally.  A test backend may keep its groups (the OS frees
    them at exit)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def _close_at_exit() -> None:
    """At interpreter exit (``atexit``, before finalisation): shut down the groups nobody destroyed and
    wait, up to ``_EXIT_WAIT_S``, for every lander to read its peer's close and every completer and
    reaper to stop.  A thread of this module still running when the interpreter finalises is ended by
    ``pthread_exit`` as it takes the GIL back, inside C++ frames: the process aborts ("terminate called
    without an active exception", SIGABRT) after a clean run — the TorchTitan trainer's ranks did."""
    groups = list(_GROUPS)
    for group in groups:
        try:
            group.shutdown()
        except Exception:  # noqa: BLE001 - a peer already gone: its lander ends on the closed socket
            pass
    deadline = time.monotonic() + _EXIT_WAIT_S
    for group in groups:
        for t in (*group._landers, group._completer, group._reaper):
            t.join(timeout=max(0.0, deadline - time.monotonic()))


def _create(store: Any, rank: int, size: int, timeout: Any) -> NcclRulesGroup:
    return NcclRulesGroup(store, rank, size, timeout)


# --------------------------------------------------------------------------------------------------
# installation
# --------------------------------------------------------------------------------------------------
_installed = False
_orig_batch_isend_irecv = dist.batch_isend_irecv


def _batch_isend_irecv(p2p_op_list: list) -> list:
    """torch's ``batch_isend_irecv``, made one NCCL group on an ``nccl_rules`` group."""
    group = p2p_op_list[0].group if p2p_op_list else None
    if group is None and p2p_op_list and dist.is_initialized():
        group = dist.distributed_c10d._get_default_group()
    if not isinstance(group, NcclRulesGroup):
        return _orig_batch_isend_irecv(p2p_op_list)
    group.begin_batch()
    try:
        works = _issue_each(p2p_op_list)
    finally:
        group.end_batch()
    return works


def _issue_each(p2p_op_list: list) -> list:
    """torch's path of ``batch_isend_irecv`` for a backend without coalescing, written out: torch up to
    2.14 takes it for a Python process group; 2.15 first asks the group for its per-device backend,
    which a Python group does not have ("No backend type associated with device type cpu")."""
    recv = (dist.irecv, dist.distributed_c10d.irecv)
    works = []
    for op in p2p_op_list:
        peer = {"group_src" if op.op in recv else "group_dst": op.group_peer}
        work = op.op(op.tensor, group=op.group, tag=op.tag, **peer)
        if work:
            works.append(work)
    return works


def install() -> None:
    """Register the ``nccl_rules`` backend, make ``batch_isend_irecv`` one group on it, and mark host
    tensors on this thread and every thread started after.  Idempotent; call before the groups exist."""
    global _installed
    if _installed:
        return
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
    atexit.register(_close_at_exit)
    dist.batch_isend_irecv = _batch_isend_irecv
    dist.distributed_c10d.batch_isend_irecv = _batch_isend_irecv
    _mark_on_every_thread()  # stays on each thread's torch-function mode stack
    _join_stream()
    _installed = True
