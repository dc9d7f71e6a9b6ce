"""``nccl_rules``: a CPU test process-group backend that enforces NCCL's rules.

No GPU runs this project's tests, so NCCL's rules (DESIGN.md "GPU rules the CPU tests must enforce")
are enforced by a backend that runs on CPU over gloo but behaves like NCCL where gloo is lenient:

* **tags ignored, one FIFO per rank pair, direction and communicator**: every message travels on the
  inner gloo group with one tag, so the k-th send to a peer matches the peer's k-th receive from this
  rank, whatever the tags say (a size or dtype mismatch is reported, NCCL would corrupt or hang).  Bare
  ``isend``/``irecv`` and ``batch_isend_irecv`` ops are on different FIFOs: ProcessGroupNCCL runs a bare
  P2P op on a two-rank communicator of the pair and a batched one on the group's communicator, so a
  batched op never pairs with a bare one (it hangs until the watchdog) — under lazy init; under eager
  init both run on the group's communicator and pair (below);
* **communicators are created by the first op that needs them** (lazy init, torch's default and
  TorchTitan's: ``init_process_group`` without ``device_id``; ``getNCCLComm``/``initNCCLComm`` in
  ProcessGroupNCCL.cpp): the group's first collective or ``batch_isend_irecv`` blocks the calling thread
  until every rank of the group issued its own, and the first bare ``isend``/``irecv`` of a pair until
  the other rank issued its first bare op with this one (a rendezvous through the group's store, as NCCL
  exchanges the ``ncclUniqueId`` there before ``ncclCommInitRank`` blocks); counted as a host-blocking
  call by :mod:`titan_ext.testing.host_syncs` ("communicator creation").  A rank whose peers never come
  hangs on NCCL; here the op fails after the group's timeout (raises, or ends the process as the watchdog
  would when ops are in flight).  ``$TITAN_EXT_NCCL_RULES_INIT=eager`` models ``device_id`` (which a CPU
  test cannot pass): every group's communicator exists from its creation and bare P2P ops run on it,
  serialised with everything else, as torch >= 2.5 does under eager init;
* **one NCCL stream per rank** (per group): a rank's groups — a ``batch_isend_irecv`` list (to any
  number of peers), one bare op, or one collective — run in issue order, across *all* peers, and
  collectives and P2P of the group are ordered alike.  A group starts when every earlier group of the
  rank completed; a P2P op transfers once its group and its match's group both run (each side tells its
  peers when a group starts); a group's works complete together, when all its ops have transferred (a
  batch is one kernel).  Both sides send a description of each group (and its send data) when it is
  issued; a state where this rank's running group needs a peer's later group while the peer's running
  group needs a later group of this rank is reported at once (:class:`NcclRuleError` with both op
  sequences); a longer cycle through several peers hangs, as on NCCL, until the watchdog;
* **the group timeout and NCCL's watchdog**: a group unfinished after its timeout — the group's timeout
  when it was issued (given at creation, or moved by ``torch.distributed.distributed_c10d._set_pg_timeout``,
  which this backend patches for its groups, for the works issued after the move: ProcessGroupNCCL fixes
  ``opTimeout_`` as it creates a work; at most ``$TITAN_EXT_NCCL_RULES_TIMEOUT_S``, default 60 s) — aborts the
  communicator and ends the process with SIGABRT, as ProcessGroupNCCL's watchdog does; so does the
  inner channel failing while ops are in flight (a dead peer: NCCL's async error handling).  With
  ``$TITAN_EXT_NCCL_RULES_WATCHDOG=raise`` (tests) the works raise instead and the process lives on;
* **a communicator abort** (``ProcessGroup.abort()``, ncclCommAbort) poisons the whole group on this rank:
  every pending op fails (``is_completed()`` True, ``wait()`` raises :class:`CommunicatorAborted`, a
  ``DistBackendError`` as ProcessGroupNCCL raises), every later op or collective on the group raises, and
  a kernel queued behind a stream wait on an aborted op runs (the abort ends the communicator's kernels);
  the peers are not told (their ops on the group hang, as on NCCL, until they abort or time out).
  :func:`inject_abort` makes a test's group abort itself at a chosen P2P op (a link failing mid-step);
* **``Work.wait()`` returns before the data has landed**: the data is copied into the receive buffer
  later, by the lander or completer thread, when the NCCL matching completes.  As NCCL's wait makes the
  *current stream* wait, the calling thread (a CPU "stream") runs no further torch kernel until the ops
  it waited on have landed (a ``TorchDispatchMode`` on that thread); host code that stamps a time right
  after ``wait()`` gets the enqueue time, as on a GPU, and another thread that reads the buffer without
  its own wait can see stale data.  **``Work.wait(timeout)`` with a timeout blocks the calling thread**
  until the op completes (ProcessGroupNCCL's blocking wait busy-waits the host) and, when the timeout
  expires first, raises and aborts the communicator: every later op on the group raises.  A barrier's
  ``wait()`` blocks the host (ProcessGroupNCCL's barrier synchronises the device; counted as a host sync).
  ``is_completed()`` is truthful: True once the data has landed (the contract the device layer relies
  on) or once the op failed (``WorkNCCL::isCompleted`` is ``exception() || finished``: the error is in
  ``exception()``, ``is_success()`` is False and ``wait()`` raises it).  ``get_future()`` is completed at
  enqueue, as ProcessGroupNCCL marks it right after launching the kernel; its ``wait()``/``value()``/
  ``then()`` order the calling thread's later kernels after the data, like ``Work.wait()`` (a CUDA
  future makes the current stream wait): the future says nothing about arrival.  When a test installed
  the lagging simulated device (:mod:`titan_ext.testing.lagdevice`), ``Work.wait``/``is_completed`` and the
  future's waits are device calls of the calling thread there and a ``wait()`` enqueues a wait on its
  stream;
* **a send buffer is read when the transfer runs**, not at ``isend``: a send whose tensor was written in
  place (its version counter moved) after ``isend`` returned and before its transfer is reported at the
  transfer, naming the op (on NCCL the peer would get the old data, the new or a mix).  A write after the
  send's ``wait()`` is ordered after the transfer and passes.  Writes the version counter does not see
  (through ``.data``, or from outside torch) are not caught;
* **NCCL's dtypes only** (``getNcclDataType``): no int16, no unsigned 16/32/64-bit, no complex — torch's
  Python layer views complex tensors as real before the backend for P2P, ``broadcast``, ``all_reduce``
  (SUM/AVG/PREMUL_SUM), ``all_gather``, ``scatter``, ``all_to_all``; the backend's ``allreduce`` takes a
  complex tensor for SUM/AVG/PREMUL_SUM (ProcessGroupNCCL views it as real) and every other op refuses it
  (``reduce``, ``gather``, ``reduce_scatter`` of a complex tensor fail on NCCL).  float8: P2P only here
  (NCCL refuses it in reductions before 2.24; gloo has no float8 for the other collectives: stricter);
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
  is the one test of it (the host-sync accounting of :mod:`titan_ext.testing.host_syncs` uses it to
  tell a device read from a host one).

Collectives are gloo's (host-tensor rule checked), launched in stream order.  **One stream per group
and rank** where ProcessGroupNCCL has one per communicator (the group's, and under lazy init one per pair
for bare P2P ops): *stricter for deadlocks* — a bare op to one peer waits here behind a bare op to
another, or behind a batch or collective of the group, where NCCL's separate streams would let it run,
so some orders reported here as a deadlock or hang pass on NCCL — and *more lenient for cross-stream
races*: two ops on different NCCL communicators (a bare receive into a buffer that a batched send or a
collective reads, with no stream wait between them) run concurrently on NCCL and race; here they run one
after the other and never race.  Under eager init the model is exact (one communicator, one stream).
What a CPU run cannot show either: eager small-message buffering (here every send waits for its
receive), and device timing.

Use: ``run_ranks(fn, n, backend="nccl_rules")``, the environment variable ``TITAN_EXT_TEST_BACKEND``
(read by :func:`titan_ext.testing.run_ranks` and the TorchTitan CPU shim), or
``install(); dist.init_process_group("nccl_rules", ...)``.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import os
import queue
import sys
import threading
import time
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

BACKEND = "nccl_rules"
ENV_VAR = "TITAN_EXT_TEST_BACKEND"
TIMEOUT_ENV = "TITAN_EXT_NCCL_RULES_TIMEOUT_S"
WATCHDOG_ENV = "TITAN_EXT_NCCL_RULES_WATCHDOG"
#: ``lazy`` (default: ``init_process_group`` without ``device_id``, as TorchTitan calls it) or ``eager`` (as
#: with ``device_id``, which a CPU test cannot pass: torch refuses a CPU ``device_id``), read per group
INIT_ENV = "TITAN_EXT_NCCL_RULES_INIT"
#: titan_ext modules whose tensors are device tensors: the device layer, and the
#: test harness's models and batches (the user's side of a job)
DEVICE_LAYER_MODULES = ("titan_ext.runtime.execute.device", "titan_ext.testing.ranks", "titan_ext.testing.models")

__all__ = ["BACKEND", "ENV_VAR", "INIT_ENV", "CommunicatorAborted", "NcclRuleError", "NcclRulesGroup", "inject_abort",
           "install", "installed", "is_host_made", "mark_host", "names_host"]

_SEND, _RECV = 0, 1
_CLOSE, _START = -1, -2  # a head that is no group description: the FIFO's end, a group's start notice
_BARE, _BATCHED = 0, 1  # the communicator of a P2P op: ProcessGroupNCCL's two-rank one, the group's
_INLINE_OPS = 8  # ops of one group on one pair described in its fixed-size head (more: a second message)
_META_LEN = 3 + 3 * _INLINE_OPS
_TAG = 0  # tags are ignored: one FIFO per pair and direction
#: the dtypes ProcessGroupNCCL takes: its ``ncclDataType`` map (``getNcclDataType`` in
#: ProcessGroupNCCL.cpp / NCCLUtils.hpp: kChar, kByte, kFloat, kDouble, kInt, kLong, kHalf, kBool as uint8,
#: kBFloat16, the four float8 types); no int16, no unsigned 16/32/64-bit, no complex (their index is the
#: wire code of a P2P op's dtype)
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int8, torch.uint8, torch.bool,
           *[getattr(torch, n) for n in ("float8_e5m2", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2fnuz")
             if hasattr(torch, n)]]
_FLOAT8 = frozenset(_DTYPES[9:])
#: the collectives that reduce (ProcessGroupNCCL refuses float8 there: "Float8 dtypes are not currently
#: supported for NCCL reductions", before NCCL 2.24)
_REDUCTIONS = frozenset({"allreduce", "allreduce_coalesced", "reduce", "reduce_scatter", "_reduce_scatter_base",
                         "reduce_scatter_tensor_coalesced"})
_HOST_ATTR = "_titan_ext_host_site"
_SHUTDOWN_S = 2.0  # how long a group's shutdown waits for its peers' close messages
_KEPT_OPEN: list = []  # shut-down groups whose landers still wait on a peer
_EXIT_WAIT_S = 60.0  # how long interpreter exit waits for the peers' close messages
_INNER_TIMEOUT = timedelta(days=7)
_GROUPS: "weakref.WeakSet[NcclRulesGroup]" = weakref.WeakSet()  # every group whose threads may run


class NcclRuleError(RuntimeError):
    """Traffic that NCCL would hang on, corrupt, or refuse (the message says which rule)."""


class CommunicatorAborted(NcclRuleError, dist.DistBackendError):
    """The error of an aborted communicator (``ProcessGroup.abort()``, :func:`inject_abort`): a
    ``DistBackendError``, as ProcessGroupNCCL raises for a communicator error or abort."""


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
            ("torch.overrides", __name__, "titan_ext.testing.host_syncs", "titan_ext.testing.lagdevice")):
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
    try:
        _orig_bootstrap_inner(self)
    finally:
        _leave_modes()


def _leave_modes() -> None:
    """Empty this thread's torch-function and torch-dispatch mode stacks as the thread ends.  The stacks
    are C++ thread-locals holding Python objects: left on them, their destructor decrefs those objects as
    the OS thread exits — after ``join()`` has returned — and takes the GIL to do it; when the interpreter
    is finalising by then, that thread is ended inside the destructor and the process aborts
    ("terminate called without an active exception", SIGABRT; seen 4 runs in 12 of two ranks exiting
    normally under load, torch 2.11, the backtrace in ``~PythonTorchFunctionTLS``)."""
    while torch._C._len_torch_function_stack() > 0:
        torch._C._pop_torch_function_stack()
    while torch._C._len_torch_dispatch_stack() > 0:
        torch._C._pop_torch_dispatch_stack()


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
        if not getattr(_modes, "hold", False):
            _drain_pending()
        return func(*args, **(kwargs or {}))


class _StreamWaitHostRead(TorchFunctionMode):
    """The same for host reads that bypass the dispatcher (``tolist()``, ``numpy()``): on a GPU they
    are a copy ordered on the stream."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not getattr(_modes, "hold", False):
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


def _seconds(timeout: Any) -> float | None:
    """A ``Work.wait`` timeout in seconds; None for none (c10d's ``kNoTimeout`` is a zero duration)."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
    return seconds if seconds > 0 else None


def _lagdevice() -> Any:
    """The lagging simulated device (:mod:`titan_ext.testing.lagdevice`) when a test loaded and installed
    it, else None (looked up, never imported: a run without it pays nothing)."""
    lag = sys.modules.get("titan_ext.testing.lagdevice")
    return lag if lag is not None and lag.installed() else None


def _record_host_sync(kind: str) -> None:
    """Count a host-blocking call on this thread's open :func:`titan_ext.testing.host_syncs.counting` blocks."""
    syncs = sys.modules.get("titan_ext.testing.host_syncs")
    if syncs is not None:
        syncs.record(kind)


class _EnqueuedFuture(torch.futures.Future):
    """A work's future, completed when the op is enqueued, as ProcessGroupNCCL's: ``pointToPoint`` and
    ``collective`` build ``work->future_`` under a guard of the NCCL stream and call
    ``work->future_->markCompleted(at::IValue(*work->outputs_))`` right after launching the kernel, before
    returning the work.  It is a CUDA future: ``wait()`` / ``value()`` and a callback run by ``then()`` make
    the *current stream* wait on the work's end event (the host does not wait), so here they make the
    calling thread's later kernels wait until the op has landed, like :meth:`_RulesWork.wait`.  Its value
    is the op's outputs (the receive buffer, the collective's output), not to be read before that wait."""

    def __init__(self, work: "_RulesWork", outputs: Any):
        super().__init__()
        self._work = work
        self.set_result(outputs)

    def wait(self) -> Any:
        self._work._stream_wait("Future.wait")
        return super().wait()

    def value(self) -> Any:
        self._work._stream_wait("Future.value")
        return super().value()

    def then(self, callback: Any) -> Any:
        self._work._stream_wait("Future.then")  # complete: the callback runs now, on this thread
        return super().then(callback)

    def add_done_callback(self, callback: Any) -> None:
        self._work._stream_wait("Future.add_done_callback")
        super().add_done_callback(callback)


class _RulesWork(dist.Work):
    """One op's handle (a P2P op or a collective).

    ``wait()`` makes the calling "stream" wait (ProcessGroupNCCL's ``wait()`` without a timeout makes the
    current CUDA stream wait on the NCCL stream and returns).  ``wait(timeout)`` blocks the calling thread
    until the op completes (ProcessGroupNCCL's blocking wait: the host busy-waits on the work's end
    event) and, when the timeout expires first, raises and aborts the communicator: every later op on the
    group raises.  A barrier's ``wait()`` blocks the host too (ProcessGroupNCCL's barrier synchronises the
    device: counted by :mod:`titan_ext.testing.host_syncs`).  ``is_completed()`` is truthful: True once the
    op has landed, or has failed (``WorkNCCL::isCompleted``: ``exception() || finishedGPUExecutionInternal()``;
    the error is in ``exception()`` and ``wait()`` raises it).  ``get_future()`` is completed at enqueue
    (:class:`_EnqueuedFuture`)."""

    def __init__(self, group: "NcclRulesGroup", result: Any, host_blocking: bool = False, what: str = "op"):
        super().__init__()
        self._group = group
        self._host_blocking = host_blocking
        self._what = what
        self._settled = threading.Event()
        self._error: BaseException | None = None
        self._resumed = False  # failed by an abort: a stream wait on it no longer holds the stream
        self._future: torch.futures.Future = _EnqueuedFuture(self, result)

    def wait(self, timeout: Any = None) -> bool:
        lag = _lagdevice()
        if lag is not None:
            lag.device_call("Work.wait")
        if self._error is not None:
            raise self._error
        seconds = _seconds(timeout)
        if seconds is None and not self._host_blocking:
            self._stream_wait()
            return True
        # a barrier synchronises the device on NCCL (a host sync, counted); any other collective's
        # wait() only orders the stream there, and waits on the host here because the CPU test runs
        # its kernels on the host (functional collectives read the result through C++): not counted
        device_sync = self._what == "barrier"
        if device_sync and lag is None:
            _record_host_sync("barrier (device synchronize)")
        if not self._settled.wait(seconds):
            raise self._group._abort(
                f"Work.wait(timeout={seconds:g} s) timed out: ProcessGroupNCCL's blocking wait aborts the "
                f"communicator, and every later op on this group raises")
        if self._error is not None:
            raise self._error
        if lag is not None and self._host_blocking:
            lag.stream_wait(self._settled.is_set, self._what)
            if device_sync:  # ProcessGroupNCCL's barrier: cudaDeviceSynchronize (counted by host_block)
                lag.host_block("barrier (device synchronize)")
        return True

    def _stream_wait(self, call: str | None = None) -> None:
        """The current stream waits for the op (the thread's next kernel here; the lagging device's
        stream too when a test installed it)."""
        lag = _lagdevice()
        if lag is not None:
            if call is not None:
                lag.device_call(call)
            lag.stream_wait(self._settled.is_set, self._what)
        if not self._settled.is_set():
            _stream_wait_later(self)
        else:
            _join_stream()

    def is_completed(self) -> bool:
        lag = _lagdevice()
        if lag is not None:
            lag.device_call("Work.is_completed")
        return self._settled.is_set()

    def is_success(self) -> bool:
        return self._error is None and self._settled.is_set()

    def exception(self) -> Any:
        return self._error

    def get_future(self) -> torch.futures.Future:
        return self._future

    def _land(self) -> None:
        self._settled.set()

    def _fail(self, error: BaseException, resumed: bool = False) -> None:
        if self._settled.is_set():
            return
        self._error = error
        self._resumed = resumed
        self._settled.set()

    def _block(self) -> None:
        self._settled.wait()
        if self._error is not None and not self._resumed:
            raise self._error


# --------------------------------------------------------------------------------------------------
# NCCL progress: one stream per rank, per pair a FIFO per communicator
# --------------------------------------------------------------------------------------------------
class _StreamGroup:
    """One NCCL group on this rank's stream: a ``batch_isend_irecv`` list (any peers), one bare P2P op,
    or one collective (``launch`` starts it on the inner gloo group).  ``timeout_s`` is the group's
    timeout when it was issued: ProcessGroupNCCL sets ``work->opTimeout_ = options_->timeout`` as it
    creates the work, and the watchdog's ``checkTimeout`` compares ``workStartTime_`` with that, so a
    later ``_set_pg_timeout`` (which moves ``options_->timeout``) applies to later works only."""

    __slots__ = ("ops", "launch", "work", "issued", "started", "left", "what", "timeout_s")

    def __init__(self, ops: list["_Op"], timeout_s: float, launch: Any = None, work: "_RulesWork | None" = None,
                 what: str = ""):
        self.ops, self.launch, self.work, self.what = ops, launch, work, what
        self.issued = time.monotonic()
        self.timeout_s = timeout_s
        self.started = False
        self.left = len(ops) if launch is None else 1


class _Op:
    """One P2P op; ``tensor`` and ``work`` are dropped once it has landed (nothing kept alive).

    A send's buffer is NCCL's to read until the transfer (the kernel reads it when it runs, not at
    ``isend``): ``version`` is the tensor's version counter at issue; a send whose tensor was written in
    place before its transfer (the version moved) is reported at the transfer (:meth:`_Pair.land`)."""

    __slots__ = ("kind", "tensor", "numel", "dtype", "k", "group", "pair", "stream", "work", "payload", "done",
                 "version")

    def __init__(self, owner: "NcclRulesGroup", kind: int, tensor: torch.Tensor, peer: int):
        if not tensor.is_contiguous():
            raise NcclRuleError("NCCL rules: P2P tensors must be contiguous")
        _check_dtype(tensor, "a P2P op")
        self.kind, self.tensor = kind, tensor
        self.numel, self.dtype = tensor.numel(), _DTYPES.index(tensor.dtype)
        self.k = self.group = -1
        self.done = False  # its transfer happened (its work completes with its whole group)
        self.pair: _Pair | None = None
        self.stream: _StreamGroup | None = None
        what = f"send to {peer}" if kind == _SEND else f"recv from {peer}"
        self.work: _RulesWork | None = _RulesWork(owner, [tensor], what=what)
        # the bytes a send puts on the wire (made here, outside the group's lock: a torch op may wait)
        self.payload = tensor.reshape(-1).view(torch.uint8) if kind == _SEND and self.numel else None
        self.version = tensor._version if kind == _SEND else 0

    def written_since_issue(self) -> tuple[int, int] | None:
        """A send whose buffer was written in place since it was issued: (version at issue, now)."""
        if self.kind != _SEND or self.tensor is None:
            return None
        now = self.tensor._version
        return (self.version, now) if now != self.version else None

    def land(self, staged: torch.Tensor | None) -> None:
        """The transfer: a receive's bytes go into its tensor (its work completes with its group)."""
        if staged is not None and self.numel:
            self.tensor.reshape(-1).view(torch.uint8).copy_(staged)
        self.done = True
        self.stream.left -= 1
        self.tensor = self.payload = None

    def complete(self) -> None:
        self.work._land()
        self.work = self.stream = None


def _group_meta(g: int, channel: int, group: list[_Op]) -> list[torch.Tensor]:
    """A group's description on the wire: a fixed-size head (op count, group index, communicator, (kind,
    numel, dtype) of its first ``_INLINE_OPS`` ops), then, for a larger group, the rest's fields (any
    size: torch's ``batch_isend_irecv`` of a whole state dict to one peer is one NCCL group)."""
    fields = [x for op in group for x in (op.kind, op.numel, op.dtype)]
    head = [len(group), g, channel, *fields[:3 * _INLINE_OPS]]
    out = [torch.tensor(head + [0] * (_META_LEN - len(head)), dtype=torch.int64)]
    if len(group) > _INLINE_OPS:
        out.append(torch.tensor(fields[3 * _INLINE_OPS:], dtype=torch.int64))
    return out


def _describe(kind: int, k: int, numel: int, dtype: int) -> str:
    return f"{'send' if kind == _SEND else 'recv'}#{k}({numel} {str(_DTYPES[dtype]).removeprefix('torch.')})"


def _other(kind: int) -> int:
    return _RECV if kind == _SEND else _SEND


class _Mismatch(Exception):
    """A rule broken on one pair (the message says which)."""


class _Pair:
    """One rank pair on one communicator (``channel``: ProcessGroupNCCL's two-rank communicator for bare
    ``isend``/``irecv``, the group's communicator for batched ops), as seen by this rank.

    My send k matches the peer's receive k and my receive k the peer's send k (one FIFO per direction
    and communicator, tags ignored).  An op completes once its group has started on this rank's stream
    and its match's group has started on the peer's (``their_started``, from the peer's start notices):
    a group is one kernel, and both kernels must run for the transfer to happen."""

    def __init__(self, me: int, peer: int, channel: int):
        self.me, self.peer, self.channel = me, peer, channel
        self.mine: list[list[_Op]] = []
        self.my_group_of: dict[int, list[int]] = {_SEND: [], _RECV: []}  # k → my group
        self.theirs: list[list[tuple[int, int, int, int]]] = []  # (kind, k, numel, dtype) per op
        self.their_group_of: dict[int, list[int]] = {_SEND: [], _RECV: []}  # k → their group
        self.their_spec: dict[int, list[tuple[int, int]]] = {_SEND: [], _RECV: []}  # k → (numel, dtype)
        self.staged: dict[int, torch.Tensor] = {}  # peer's send k → its bytes, arrived
        self.pending: list[_Op] = []  # mine, started, not landed
        self.my_started = self.their_started = -1

    def add_mine(self, group: list[_Op]) -> int:
        g = len(self.mine)
        for op in group:
            op.group, op.k, op.pair = g, len(self.my_group_of[op.kind]), self
            self.my_group_of[op.kind].append(g)
        self.mine.append(group)
        return g

    def add_theirs(self, group: list[tuple[int, int, int]]) -> None:
        h, ops = len(self.theirs), []
        for kind, numel, dtype in group:
            ops.append((kind, len(self.their_group_of[kind]), numel, dtype))
            self.their_group_of[kind].append(h)
            self.their_spec[kind].append((numel, dtype))
        self.theirs.append(ops)

    def start_mine(self, g: int) -> None:
        self.my_started = g
        self.pending += self.mine[g]

    def match(self, op: _Op) -> int | None:
        """The peer's group holding ``op``'s match (None: not issued yet)."""
        groups = self.their_group_of[_other(op.kind)]
        if op.k >= len(groups):
            return None
        spec = self.their_spec[_other(op.kind)][op.k]
        if spec != (op.numel, op.dtype):
            raise _Mismatch(f"size/dtype mismatch: this rank's {_describe(op.kind, op.k, op.numel, op.dtype)} "
                            f"meets the peer's {_describe(_other(op.kind), op.k, *spec)}")
        return groups[op.k]

    def land(self) -> None:
        """Complete started ops whose match runs: sends at once, receives once their bytes arrived."""
        waiting = []
        for op in self.pending:
            h = self.match(op)
            if h is None or h > self.their_started:
                waiting.append(op)
            elif op.kind == _SEND:
                written = op.written_since_issue()
                if written is not None:
                    raise _Mismatch(
                        f"send buffer written before the transfer: this rank's "
                        f"{_describe(op.kind, op.k, op.numel, op.dtype)} to rank {self.peer} was written in place "
                        f"after isend returned and before its transfer ran (tensor version {written[0]} -> "
                        f"{written[1]}); NCCL reads a send buffer when its kernel runs, not at isend, so the peer "
                        f"gets the old data, the new or a mix: make the writer wait on the send's work "
                        f"(Work.wait() orders the stream) or write a copy")
                op.land(None)
            elif op.k in self.staged:
                op.land(self.staged.pop(op.k))
            else:
                waiting.append(op)
        self.pending = waiting

    def their_current_needs_my_later(self) -> int | None:
        """My unstarted group that the peer's started group on this pair needs (None: none known).  That
        group of the peer cannot complete before it, so the peer's stream is stuck there."""
        if not 0 <= self.their_started < len(self.theirs):
            return None
        for kind, k, _, _ in self.theirs[self.their_started]:
            mine = self.my_group_of[_other(kind)]
            if k < len(mine) and mine[k] > self.my_started:
                return mine[k]
        return None

    def sequences(self, last: int = 12) -> str:
        """Both sides' groups on this pair (the last ``last`` of each; -> marks the started one)."""
        def fmt(groups: list[list[str]], current: int) -> str:
            first = max(0, len(groups) - last)
            text = " ".join(("->" if g == current else "") + f"#{g}{{" + ", ".join(ops) + "}"
                            for g, ops in enumerate(groups) if g >= first)
            return ("... " if first else "") + (text or "(none)")

        mine = [[_describe(op.kind, op.k, op.numel, op.dtype) for op in g] for g in self.mine]
        theirs = [[_describe(*op) for op in g] for g in self.theirs]
        verb = "issued to" if self.channel == _BARE else "batched to"
        return (f"  rank {self.me} {verb} {self.peer}: {fmt(mine, self.my_started)}\n"
                f"  rank {self.peer} {verb} {self.me}: {fmt(theirs, self.their_started)}")


@contextlib.contextmanager
def _issuing() -> Any:
    """The issuing thread's torch ops under the group's lock do not wait on the emulated stream (it
    drained before: an issued op is ordered after the ops this thread waited on)."""
    held = getattr(_modes, "hold", False)
    _modes.hold = True
    try:
        yield
    finally:
        _modes.hold = held


# --------------------------------------------------------------------------------------------------
# the process group
# --------------------------------------------------------------------------------------------------
class NcclRulesGroup(dist.ProcessGroup):
    """A data process group with NCCL's rules over an inner gloo group (module docstring)."""

    def __init__(self, store: Any, rank: int, size: int, timeout: Any):
        super().__init__(rank, size)
        # the inner group never times out by itself (its landers wait on idle peers): the group's timeout
        # is this backend's watchdog's (:meth:`_watchdog`)
        self._inner = dist.ProcessGroupGloo(dist.PrefixStore("nccl_rules", store), rank, size, _INNER_TIMEOUT)
        _never_destroyed(self._inner)
        self._rank, self._size = rank, size
        self._group_timeout_s = _seconds(timeout)
        self._timeout_cap_s = float(os.environ.get(TIMEOUT_ENV, "60"))
        # communicators (:meth:`_communicator`): under eager init the group's exists from creation (its
        # construction was the rendezvous: the inner gloo group connects every rank) and bare P2P ops run
        # on it; under lazy init each is created by the first op that needs it
        init = os.environ.get(INIT_ENV, "lazy")
        if init not in ("lazy", "eager"):
            raise ValueError(f"${INIT_ENV} is {init!r}: 'lazy' (no device_id, torch's default) or 'eager'")
        self.eager_init = init == "eager"
        self._comm_store = dist.PrefixStore("nccl_rules_comm", store)
        self._comms: set[str] = {"group"} if self.eager_init else set()
        self._comm_locks: dict[str, threading.Lock] = {}  # per communicator: creations run concurrently
        self._lock = threading.RLock()
        self._events: queue.Queue = queue.Queue()
        self._pairs = {(p, ch): _Pair(rank, p, ch) for p in range(size) if p != rank for ch in (_BARE, _BATCHED)}
        self._peers = [p for p in range(size) if p != rank]
        self._threads: dict[int, tuple[int, str]] = {}  # peer → the thread that issues its ops
        self._their_head: dict[int, tuple[int, int]] = {}  # peer → (channel, group) it started last
        self._stream: collections.deque[_StreamGroup] = collections.deque()
        self._error: NcclRuleError | None = None  # set once: the communicator is aborted
        self._batch = threading.local()
        self._sends: queue.SimpleQueue = queue.SimpleQueue()  # inner sends, kept alive until sent
        self._collectives: queue.SimpleQueue = queue.SimpleQueue()  # launched inner collectives
        self._closed = False
        self._inject: tuple[int, str] | None = None  # :func:`inject_abort`: (P2P ops before the abort, why)
        self._posted = 0  # P2P ops issued since inject_abort
        self._landers = [threading.Thread(target=self._read_peer, args=(p,), daemon=True,
                                          name=f"nccl_rules-lander-{rank}<-{p}") for p in self._peers]
        self._completer = threading.Thread(target=self._complete, daemon=True, name=f"nccl_rules-completer-{rank}")
        self._reaper = threading.Thread(target=self._reap, daemon=True, name=f"nccl_rules-reaper-{rank}")
        self._collective_waiter = threading.Thread(target=self._wait_collectives, daemon=True,
                                                   name=f"nccl_rules-collectives-{rank}")
        for t in (*self._landers, self._completer, self._reaper, self._collective_waiter):
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

    # -- the group timeout (NCCL's watchdog) ------------------------------------------------------
    @property
    def timeout_s(self) -> float:
        """The watchdog's limit: the group's timeout (creation, or ``_set_pg_timeout``), at most
        ``$TITAN_EXT_NCCL_RULES_TIMEOUT_S`` (default 60 s: a test's hang ends within a minute)."""
        group = self._group_timeout_s
        return self._timeout_cap_s if group is None else min(group, self._timeout_cap_s)

    def _set_timeout(self, timeout: Any) -> None:
        self._group_timeout_s = _seconds(timeout)

    # -- P2P ------------------------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> _RulesWork:  # noqa: ARG002
        return self._post(_SEND, tensors, dst)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> _RulesWork:  # noqa: ARG002
        return self._post(_RECV, tensors, src)

    def recv_anysource(self, *args: Any) -> None:
        raise NcclRuleError("NCCL rules: NCCL has no receive from any source")

    def _post(self, kind: int, tensors: list[torch.Tensor], peer: int) -> _RulesWork:
        if self._error is not None:
            raise self._error
        injected = self._inject
        if injected is not None:
            self._posted += 1
            if self._posted > injected[0]:
                self._inject = None
                raise self._abort(f"{injected[1]} (injected: after {injected[0]} P2P ops of this rank)",
                                  aborted=True)
        if len(tensors) != 1:
            raise NcclRuleError("NCCL rules: one tensor per P2P op")
        if peer not in self._peers:
            raise NcclRuleError(f"NCCL rules: peer {peer} is not another rank of this {self._size}-rank group")
        _check_device_tensor(tensors[0], "a P2P op")
        op = _Op(self, kind, tensors[0], peer)
        work = op.work  # the op lets go of it when it lands, perhaps before _issue returns
        batch = getattr(self._batch, "ops", None)
        if batch is not None:
            batch.append((peer, op))
        elif self.eager_init:  # eager init: a bare op runs on the group's communicator, serialised with all
            self._issue([(peer, op)], _BATCHED)
        else:
            self._communicator(f"pair {min(self._rank, peer)}:{max(self._rank, peer)}", [self._rank, peer],
                               f"a bare {'isend' if kind == _SEND else 'irecv'} with rank {peer}")
            self._issue([(peer, op)], _BARE)
        return work

    def begin_batch(self) -> None:
        """Start a ``batch_isend_irecv`` group (ops collected until :meth:`end_batch`)."""
        self._batch.ops = []

    def end_batch(self) -> None:
        ops, self._batch.ops = self._batch.ops, None
        if ops:
            self._communicator("group", list(range(self._size)), "a batch_isend_irecv")
            self._issue(ops, _BATCHED)

    # -- communicator creation (lazy init) ------------------------------------------------------
    def _communicator(self, key: str, ranks: list[int], what: str) -> None:
        """The communicator ``key`` exists once this returns: under lazy init (``init_process_group``
        without ``device_id``, torch's default and TorchTitan's) ProcessGroupNCCL creates a communicator at
        the first op that needs it (``getNCCLComm`` / ``initNCCLComm``): rank 0 of it puts an
        ``ncclUniqueId`` in the store, the others ``store->get`` it, and every rank then blocks in
        ``ncclCommInitRank`` until all ranks of the communicator joined.  The group's communicator
        (collectives and ``batch_isend_irecv``; key "group") needs every rank of the group; a bare
        ``isend``/``irecv`` creates a two-rank communicator of the pair (``getKeySendRecv``: "lo:hi").  Here:
        a rendezvous through the group's store, the calling thread blocked until every rank of it
        arrived, counted as a host-blocking call (:mod:`titan_ext.testing.host_syncs`: "communicator
        creation").  A rank whose peers never arrive hangs on NCCL; here it fails after the group's timeout
        (as the watchdog would end a hung op): the process ends, or with ``$TITAN_EXT_NCCL_RULES_WATCHDOG=raise``
        the op raises and the group is aborted."""
        if key in self._comms:
            return
        with self._comm_locks.setdefault(key, threading.Lock()):
            if key in self._comms:
                return
            if self._error is not None:
                raise self._error
            _record_host_sync("communicator creation")
            store, timeout_s = self._comm_store, self.timeout_s
            store.set(f"{key}/{self._rank}", "1")
            keys = [f"{key}/{r}" for r in ranks]
            deadline, pause = time.monotonic() + timeout_s, 1e-4
            # polled, not ``store.wait``: a client blocked in ``wait`` holds the process's store socket,
            # and every other store user of this process (delay injection, other groups) would stall
            while not store.check(keys):
                if self._error is not None:
                    raise self._error
                if time.monotonic() > deadline:
                    missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
                    self._end_process(
                        f"communicator creation: {what} is this rank's first op on the {key} communicator "
                        f"(lazy init: no device_id in init_process_group), and rank(s) {missing} of it did not "
                        f"issue theirs within the group's timeout {timeout_s:g} s; NCCL creates a communicator "
                        f"at its first op and blocks the host until every rank of it has joined (the group's: "
                        f"its first collective or batch_isend_irecv on every rank; a pair's: the first bare "
                        f"isend/irecv of each side)")
                    raise self._error
                time.sleep(pause)
                pause = min(2 * pause, 0.01)
            self._comms.add(key)

    def _issue(self, ops: list[tuple[int, _Op]], channel: int) -> None:
        """One NCCL group on this rank's stream: per pair, its description then its send data, on the
        inner FIFO (the data moves now; the ops complete when NCCL's progress says so)."""
        if getattr(_modes, "on", False):
            _drain_pending()  # the issued kernel is ordered after what this thread waited on
        by_peer: dict[int, list[_Op]] = {}
        for peer, op in ops:
            by_peer.setdefault(peer, []).append(op)
        me = (threading.get_ident(), threading.current_thread().name)
        with self._lock, _issuing():
            if self._error is not None:
                raise self._error
            for peer in by_peer:
                owner = self._threads.setdefault(peer, me)
                if owner[0] != me[0]:
                    raise NcclRuleError(
                        f"NCCL rules: ranks {self._rank}<->{peer}: op issued from thread {me[1]!r}, but the "
                        f"pair's earlier ops came from thread {owner[1]!r}; NCCL needs one issuing "
                        f"order per pair (issue every op of a pair from one thread)")
            stream_group = _StreamGroup([op for _, op in ops], self.timeout_s)
            for peer, group in by_peer.items():
                g = self._pairs[(peer, channel)].add_mine(group)
                for op in group:
                    op.stream = stream_group
                for data in (*_group_meta(g, channel, group), *[op.payload for op in group if op.payload is not None]):
                    self._sends.put(self._inner.send([data], peer, _TAG))
            self._stream.append(stream_group)
        self._events.put(("issued", None, None))

    def _read_peer(self, peer: int) -> None:
        """Lander: read the peer's FIFO (group descriptions with their send data, start notices) and step
        the progress itself, so a receive lands in the thread its data arrived on (no thread hop)."""
        their_sends = {_BARE: 0, _BATCHED: 0}
        try:
            while True:
                meta = torch.empty(_META_LEN, dtype=torch.int64)
                self._inner.recv([meta], peer, _TAG).wait()
                n, g, channel, *fields = meta.tolist()
                if n == _CLOSE:
                    return
                if n == _START:
                    self._progress(peer, "start", (channel, g))
                    continue
                if n > _INLINE_OPS:
                    rest = torch.empty(3 * (n - _INLINE_OPS), dtype=torch.int64)
                    self._inner.recv([rest], peer, _TAG).wait()
                    fields += rest.tolist()
                group = [tuple(fields[3 * i: 3 * i + 3]) for i in range(n)]
                self._progress(peer, "meta", (channel, group))
                for kind, numel, dtype in group:
                    if kind != _SEND:
                        continue
                    buf = torch.empty(numel * _DTYPES[dtype].itemsize, dtype=torch.uint8)
                    if numel:
                        self._inner.recv([buf], peer, _TAG).wait()
                    self._progress(peer, "data", (channel, their_sends[channel], buf))
                    their_sends[channel] += 1
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

    def _wait_collectives(self) -> None:
        """Waits for each started collective on the inner gloo group, then reports it done."""
        while True:
            item = self._collectives.get()
            if item is None:
                return
            stream_group, inner = item
            try:
                inner.wait()
                error = None
            except Exception as exc:  # noqa: BLE001 - reported through the work
                error = exc
            self._events.put(("collective", None, (stream_group, error)))

    def _complete(self) -> None:
        """Completer: steps the stream after this rank issued (off the issuing thread, whose torch ops
        wait on the emulated stream) and after a collective ended, and runs the watchdog."""
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

    def _progress(self, peer: int | None, kind: str, payload: Any) -> None:
        """Apply one event, step this rank's stream as far as NCCL would, land what completed."""
        with self._lock:
            if self._error is not None:
                return
            try:
                self._apply(peer, kind, payload)
                self._step()
            except _Mismatch as exc:
                self._fail_pair(exc.args[1] if len(exc.args) > 1 else peer, str(exc.args[0]))
            except NcclRuleError:
                pass  # the group is aborted
            except Exception as exc:  # noqa: BLE001 - surface anything else through the works
                self._abort(f"internal error: {exc!r}")

    def _apply(self, peer: int | None, kind: str, payload: Any) -> None:
        if kind == "meta":
            channel, group = payload
            self._pairs[(peer, channel)].add_theirs(group)
        elif kind == "start":
            channel, h = payload
            self._pairs[(peer, channel)].their_started = h
            self._their_head[peer] = (channel, h)
        elif kind == "data":
            channel, k, buf = payload
            self._pairs[(peer, channel)].staged[k] = buf
        elif kind == "collective":
            stream_group, error = payload
            if error is not None:
                raise self._abort(f"the collective {stream_group.what} failed on the inner gloo group: {error!r}")
            stream_group.work._land()
            stream_group.left = 0
        elif kind == "dead":
            self._end_process(f"the inner gloo channel from the peer failed: {payload!r}", peer)

    def _step(self) -> None:
        """NCCL's stream: the head group starts once every earlier group completed; its ops complete
        when their matches run on the peers; a state where the head needs a peer's later group while
        that peer's running group needs a later group of this rank is NCCL's deadlock."""
        while self._stream:
            head = self._stream[0]
            if not head.started:
                self._start(head)
            pairs = {id(op.pair): op.pair for op in head.ops if not op.done}
            for pair in pairs.values():
                try:
                    pair.land()
                except _Mismatch as exc:
                    raise _Mismatch(str(exc), pair.peer) from None
            if head.left > 0:
                self._check_deadlock(head)
                return
            for op in head.ops:  # a group is one kernel: its works complete together
                op.complete()
            self._stream.popleft()

    def _start(self, head: _StreamGroup) -> None:
        head.started = True
        if head.launch is not None:
            self._collectives.put((head, head.launch()))
            return
        started: dict[int, tuple[int, int]] = {}
        for op in head.ops:
            started[id(op.pair)] = (op.pair, op.group)
        for pair, g in started.values():
            pair.start_mine(g)
            notice = torch.tensor([_START, g, pair.channel] + [0] * (_META_LEN - 3), dtype=torch.int64)
            self._sends.put(self._inner.send([notice], pair.peer, _TAG))

    def _check_deadlock(self, head: _StreamGroup) -> None:
        for op in head.ops:
            if op.done:
                continue
            pair = op.pair
            h = pair.match(op)
            if h is None or h <= pair.their_started:
                continue  # not issued yet, or running there (bytes in flight)
            channel, _ = self._their_head.get(pair.peer, (pair.channel, -1))
            needs = self._pairs[(pair.peer, channel)].their_current_needs_my_later()
            if needs is not None:
                raise _Mismatch(
                    f"deadlock: this rank's running group #{op.group} needs the peer's group #{h}, the peer's "
                    f"running group #{self._pairs[(pair.peer, channel)].their_started} needs this rank's "
                    f"group #{needs}; NCCL runs a rank's groups in issue order on one stream and a "
                    f"batch_isend_irecv list as one group, so a reordered or split batch hangs", pair.peer)

    def _watchdog(self) -> None:
        """NCCL's watchdog: a work open longer than its timeout (the group's when it was issued:
        :class:`_StreamGroup`) aborts the communicator and ends the process (ProcessGroupNCCL tears the
        process down with SIGABRT; with ``$TITAN_EXT_NCCL_RULES_WATCHDOG=raise`` the works raise instead and
        the process lives on)."""
        with self._lock:
            if self._closed or self._error is not None or not self._stream:
                return
            now = time.monotonic()
            late = next((g for g in self._stream if now - g.issued > g.timeout_s), None)
            if late is None:
                return
            waited = now - late.issued
            peers = sorted({op.pair.peer for op in late.ops if not op.done})
            what = late.what or "P2P group"
            what = (f"watchdog: a {what} unfinished after {waited:.1f} s > its timeout {late.timeout_s:g} s (the "
                    f"group's when it was issued; peers {peers}); NCCL's watchdog aborts the communicator and "
                    f"ends the process" + "".join("\n" + self._sequences(p) for p in peers))
            self._end_process(what)

    def _end_process(self, what: str, peer: int | None = None) -> None:
        """NCCL's watchdog on a timeout or a communicator error with ops in flight: the process ends
        (SIGABRT) before any work raises (a waiting thread would end it with an error of its own); with
        ``$TITAN_EXT_NCCL_RULES_WATCHDOG=raise`` the group is aborted instead (its works raise)."""
        if os.environ.get(WATCHDOG_ENV, "abort") == "raise" or not self._stream:
            self._abort(what, peer)
            return
        sys.stderr.write(f"[rank {dist.get_rank() if dist.is_initialized() else self._rank}] NCCL rules: {what}\n")
        sys.stderr.flush()
        os.abort()

    def _sequences(self, peer: int) -> str:
        parts = [pair.sequences() for (p, _), pair in self._pairs.items() if p == peer and (pair.mine or pair.theirs)]
        return "\n".join(parts) or f"  (no P2P op with {peer})"

    def _fail_pair(self, peer: int, what: str) -> NcclRuleError:
        return self._abort(f"{what}", peer)

    def _abort(self, what: str, peer: int | None = None, aborted: bool = False) -> NcclRuleError:
        """Abort the communicator (ProcessGroupNCCL's ``abort()``): every open work and every later op of
        the group raises the error; it is returned (raise it).  ``aborted``: an abort (``abort()``,
        :func:`inject_abort`), whose error is a :class:`CommunicatorAborted` (a ``DistBackendError``) and
        whose failed works no longer hold the stream (ncclCommAbort ends the communicator's kernels, so the
        stream's later kernels run): their ``wait()`` raises, a kernel queued behind their earlier stream
        wait runs.  Otherwise (a timeout, a dead peer) that kernel raises the error too."""
        with self._lock:
            if self._error is None:
                where = f"ranks {self._rank}<->{peer} (group ranks)" if peer is not None else f"rank {self._rank}"
                detail = f"\n{self._sequences(peer)}" if peer is not None else ""
                kind = CommunicatorAborted if aborted else NcclRuleError
                self._error = kind(f"NCCL rules, {where}: {what}{detail}")
                for group in self._stream:
                    for op in group.ops:
                        if op.work is not None:
                            op.work._fail(self._error, aborted)
                    if group.work is not None:
                        group.work._fail(self._error, aborted)
                self._stream.clear()
            return self._error

    # -- collectives (gloo's, in stream order, host-tensor rule checked on inputs *and* outputs) ---
    def _collective(self, name: str, tensors: list, result: Any, *args: Any, host_blocking: bool = True,
                    reduce_op: Any = None) -> _RulesWork:
        """A collective on gloo, in this rank's stream order, after refusing host tensors among
        ``tensors`` (every input and output buffer: NCCL writes a collective's result into device
        memory, so a host output is refused like a host input).  Its ``wait()`` blocks until the result
        has landed: the stream-wait model does not reach reads that go through functional collectives
        (``wait_tensor`` in C++, then the host read of an ``AsyncCollectiveTensor``), which read the
        un-reduced input (seen: TorchTitan's ``dist_mean`` of the loss gave a rank's own value) where a
        GPU's host read would wait for the stream."""
        for t in tensors:
            _check_device_tensor(t, f"a collective ({name})")
            _check_dtype(t, f"a collective ({name})", name, reduce_op)
        if self._error is not None:
            raise self._error
        self._communicator("group", list(range(self._size)), f"a collective ({name})")
        if getattr(_modes, "on", False):
            _drain_pending()
        work = _RulesWork(self, result, host_blocking, what=name)
        inner = getattr(self._inner, name)
        with self._lock:
            if self._error is not None:
                raise self._error
            self._stream.append(_StreamGroup([], self.timeout_s, launch=lambda: inner(*args), work=work, what=name))
        self._events.put(("issued", None, None))
        return work

    def allreduce(self, tensors, opts=None):
        return self._collective("allreduce", tensors, tensors, tensors, *_opt(opts), reduce_op=_reduce_op(opts))

    def allreduce_coalesced(self, tensors, opts=None):
        return self._collective("allreduce_coalesced", tensors, tensors, tensors, *_opt(opts),
                                reduce_op=_reduce_op(opts))

    def broadcast(self, tensors, opts=None):
        return self._collective("broadcast", tensors, tensors, tensors, *_opt(opts))

    def allgather(self, outputs, inputs, opts=None):
        return self._collective("allgather", [*inputs, *_flat(outputs)], outputs, outputs, inputs, *_opt(opts))

    def _allgather_base(self, output, inp, opts=None):
        return self._collective("_allgather_base", [inp, output], [output], output, inp, *_opt(opts))

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._collective("allgather_into_tensor_coalesced", [*inputs, *outputs], outputs, outputs, inputs,
                                *_opt(opts))

    def reduce_scatter(self, outputs, inputs, opts=None):
        return self._collective("reduce_scatter", [*_flat(inputs), *outputs], outputs, outputs, inputs, *_opt(opts))

    def _reduce_scatter_base(self, output, inp, opts=None):
        return self._collective("_reduce_scatter_base", [inp, output], [output], output, inp, *_opt(opts))

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._collective("reduce_scatter_tensor_coalesced", [*inputs, *outputs], outputs, outputs, inputs,
                                *_opt(opts))

    def alltoall_base(self, output, inp, out_splits, in_splits, opts=None):
        return self._collective("alltoall_base", [inp, output], [output], output, inp, out_splits, in_splits,
                                *_opt(opts))

    def gather(self, outputs, inputs, opts=None):
        return self._collective("gather", [*inputs, *_flat(outputs)], outputs, outputs, inputs, *_opt(opts))

    def scatter(self, outputs, inputs, opts=None):
        return self._collective("scatter", [*_flat(inputs), *outputs], outputs, outputs, inputs, *_opt(opts))

    def reduce(self, tensors, opts=None):
        return self._collective("reduce", tensors, tensors, tensors, *_opt(opts))

    def barrier(self, opts=None):
        return self._collective("barrier", [], [], *_opt(opts))

    # -- lifetime -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Tell each peer's lander this FIFO is finished; give this rank's landers a moment (peers
        shut their groups down in their own order) to read their peers' close.  A group whose lander
        is still blocked in gloo stays referenced, so its inner group is never destroyed under it."""
        if self._closed:
            return
        close = torch.full((_META_LEN,), _CLOSE, dtype=torch.int64)
        with self._lock:
            for p in self._peers:
                try:
                    self._sends.put(self._inner.send([close], p, _TAG))
                except RuntimeError:  # the inner pair is gone (its peer exited, or gloo's timeout closed it)
                    pass
        self._sends.put(None)
        self._collectives.put(None)
        self._closed = True
        self._events.put(("stop", None, None))
        deadline = time.monotonic() + _SHUTDOWN_S
        for t in self._threads_to_join():
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._threads_to_join()):
            _KEPT_OPEN.append(self)  # referenced, so that interpreter exit still waits for its threads

    def _threads_to_join(self) -> tuple:
        """Every thread of this group that may be inside a gloo call: a thread still there when the
        interpreter finalises aborts the process (``_close_at_exit``)."""
        return (*self._landers, self._completer, self._reaper, self._collective_waiter)

    def abort(self) -> None:
        """ProcessGroupNCCL's ``abort()`` (``ncclCommAbort``) on this rank: the communicator is poisoned —
        every pending op of the group fails (its ``wait()`` raises :class:`CommunicatorAborted`,
        ``is_completed()`` is True) and every later op or collective on it raises.  The peers are not
        told (as on NCCL: theirs hang until they abort or time out).  The inner channels stay open, so
        the group still shuts down cleanly (``shutdown()``, interpreter exit)."""
        self._abort("the communicator was aborted (ProcessGroup.abort())", aborted=True)

    def op_sequences(self) -> dict[int, str]:
        """Both sides' op sequences per peer (diagnostics)."""
        with self._lock:
            return {p: self._sequences(p) for p in self._peers}


def inject_abort(group: Any = None, *, after_ops: int, reason: str = "injected NCCL link failure") -> None:
    """Test hook: this rank's communicator of ``group`` (None: the default group; an ``nccl_rules``
    group) aborts itself at this rank's next P2P op after ``after_ops`` more (each op of a
    ``batch_isend_irecv`` counts): that op raises :class:`CommunicatorAborted` and the group is poisoned
    as by ``abort()`` — a link whose NCCL path fails mid-step.  Inject it on both ends of the link (a dead
    link fails for both); the other ranks' ops hang as on NCCL until they abort or time out."""
    target = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(target, NcclRulesGroup):
        raise TypeError(f"inject_abort needs an nccl_rules group, got {type(target).__name__}")
    if isinstance(after_ops, bool) or not isinstance(after_ops, int) or after_ops < 0:
        raise ValueError(f"after_ops must be an int >= 0, got {after_ops!r}")
    with target._lock:
        target._inject, target._posted = (after_ops, str(reason)), 0


def _flat(tensor_lists: Any) -> list:
    return [t for ts in tensor_lists for t in ts]


def _opt(opts: Any) -> tuple:
    return () if opts is None else (opts,)


def _reduce_op(opts: Any) -> Any:
    return getattr(opts, "reduceOp", None)


def _complex_allowed(reduce_op: Any) -> bool:
    """ProcessGroupNCCL's ``complexViewAsRealAllowed``: SUM, AVG and PREMUL_SUM of a complex tensor are
    those of its real view; MIN, MAX, PRODUCT and the bitwise ops are not."""
    op = dist.ReduceOp.SUM if reduce_op is None else reduce_op
    return any(op == ok for ok in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.PREMUL_SUM))


def _check_dtype(tensor: torch.Tensor, what: str, collective: str | None = None, reduce_op: Any = None) -> None:
    """Refuse a dtype ProcessGroupNCCL refuses (``getNcclDataType``: "Input tensor data type is not
    supported for NCCL process group").  Complex tensors: torch's Python layer views them as real
    (``torch.view_as_real``) before the backend sees them for ``isend``/``irecv`` (and so ``send``/``recv``
    and ``batch_isend_irecv``), ``broadcast``, ``all_reduce`` (SUM/AVG/PREMUL_SUM only), ``all_reduce_coalesced``,
    ``all_gather``, ``all_gather_into_tensor``, ``all_gather_coalesced``, ``scatter``, ``all_to_all`` and
    ``all_to_all_single``; of the backend's own methods only ``ProcessGroupNCCL::allreduce`` views a complex
    tensor as real (``complexViewAsRealAllowed(opts.reduceOp)``, else "all_reduce does not support ... on
    complex tensors").  So a complex tensor that reaches this backend is refused everywhere but in
    ``allreduce`` with SUM/AVG/PREMUL_SUM: ``reduce``, ``gather``, ``reduce_scatter`` and
    ``reduce_scatter_tensor`` of a complex tensor fail on NCCL (gloo takes them).  Float8: P2P and
    non-reducing collectives on NCCL, refused in reductions (ProcessGroupNCCL before NCCL 2.24); here
    refused in every collective (gloo has no float8: stricter)."""
    dtype = tensor.dtype
    if dtype.is_complex and collective == "allreduce":
        if _complex_allowed(reduce_op):
            return
        raise NcclRuleError(f"NCCL rules: all_reduce does not support {reduce_op} on complex tensors "
                            f"(ProcessGroupNCCL::allreduce views a complex tensor as real for SUM/AVG/PREMUL_SUM only)")
    if dtype not in _DTYPES:
        extra = (" (torch views a complex tensor as real for P2P, broadcast, all_reduce, all_gather, scatter "
                 "and all_to_all before the backend; reduce, gather and reduce_scatter pass it on, and NCCL has "
                 "no complex type)" if dtype.is_complex else "")
        raise NcclRuleError(f"NCCL rules: {what}: input tensor data type is not supported for NCCL process "
                            f"group: {dtype}{extra}")
    if dtype in _FLOAT8 and collective is not None:
        why = ("Float8 dtypes are not supported for NCCL reductions" if collective in _REDUCTIONS
               else "a float8 collective is refused by this CPU backend (gloo has no float8; NCCL takes it)")
        raise NcclRuleError(f"NCCL rules: {what}: {why}: {dtype}")


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
    wait, up to ``_EXIT_WAIT_S``, for every lander to read its peer's close and every completer, reaper
    and collective waiter to stop.  A thread of this module still running when the interpreter finalises is ended by
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
        for t in group._threads_to_join():
            t.join(timeout=max(0.0, deadline - time.monotonic()))


def _create(store: Any, rank: int, size: int, timeout: Any) -> NcclRulesGroup:
    return NcclRulesGroup(store, rank, size, timeout)


# --------------------------------------------------------------------------------------------------
# installation
# --------------------------------------------------------------------------------------------------
_installed = False
_orig_batch_isend_irecv = dist.batch_isend_irecv
_orig_set_pg_timeout = dist.distributed_c10d._set_pg_timeout


def _set_pg_timeout(timeout: Any, group: Any = None) -> None:
    """torch's ``_set_pg_timeout``, which also moves an ``nccl_rules`` group's timeout (its watchdog's
    limit), as it moves ProcessGroupNCCL's (torch's own skips a Python process group)."""
    target = group if group is not None else dist.distributed_c10d._get_default_group()
    if isinstance(target, NcclRulesGroup):
        target._set_timeout(timeout)
        return
    _orig_set_pg_timeout(timeout, group)


def _batch_isend_irecv(p2p_op_list: list) -> list:
    """torch's ``batch_isend_irecv``, made one NCCL group on an ``nccl_rules`` group. Ops whose peer is
    this rank are matched in place, as NCCL delivers a send to self (gloo refuses it; torch < 2.13's
    start-up handshake sends one between two stages of a rank)."""
    from titan_ext.runtime._torch_compat import match_self_p2p

    group = p2p_op_list[0].group if p2p_op_list else None
    if group is None and p2p_op_list and dist.is_initialized():
        group = dist.distributed_c10d._get_default_group()
    if not isinstance(group, NcclRulesGroup):
        return _orig_batch_isend_irecv(p2p_op_list)
    done = match_self_p2p(p2p_op_list, dist.get_rank())
    group.begin_batch()
    try:
        works = iter(_issue_each([op for i, op in enumerate(p2p_op_list) if i not in done]))
    finally:
        group.end_batch()
    return [done[i] if i in done else next(works) for i in range(len(p2p_op_list))]


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
    dist.distributed_c10d._set_pg_timeout = _set_pg_timeout
    _mark_on_every_thread()  # stays on each thread's torch-function mode stack
    _join_stream()
    _register_host_marker()
    _installed = True


def _register_host_marker() -> None:
    """The delegate ring's views (made by the C++ extension, which no torch factory saw) are host memory:
    :func:`mark_host` registered into the ring (the runtime names no test module)."""
    from titan_ext.runtime.comm.delegate import ring

    ring.register_host_marker(mark_host)
