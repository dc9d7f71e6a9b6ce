"""The runtime on CUDA stages with the device behind the host, on one GPU (scripts/check_gpu.sh's ``runtime`` step).

    python scripts/gpu_tier.py --json gpu_tier.json [--worlds 2,4] [--steps 6] [--action-ms 50]

For 2 and 4 ranks sharing the one GPU, each schedule — torch's Schedule1F1B and ScheduleZBVZeroBubble,
our PipeMorph and CrossPipe, and PipeMorph with every message through the delegates
(``PipeMorph(delegation="always")``) — trains an MLP in float64 on CUDA stages, with no delay and
with +60 ms on one link (link ``world - 2``; delegated PipeMorph without delay only, see ``_batches``).

**The device is behind the host.**  Every action (a stage's forward or backward of one microbatch)
runs a spin kernel of ``--action-ms`` (50) ms on the compute stream (``torch.cuda._sleep``, its cycles
calibrated once with CUDA events before the ranks start; :func:`calibrate_spin`), so the host, which
only enqueues, is ahead of the device unless something makes it wait.  No step synchronizes: the
harness's own synchronize and barrier come once before the steady steps (``--warmup``) and once after.
What is measured, per steady step (``schedule.step`` + ``optimizer.step``) and per rank:

* **host syncs** on the training thread by kind and call site (``titan_ext.testing.host_syncs.counting()``:
  ``torch.cuda.synchronize``, ``Event.synchronize``, ``Stream.synchronize`` — it wraps torch's own —,
  host reads and blocking copies of device tensors), held to docs/runtime.md's budget: 0 in a step
  without a profile exchange, at most :data:`EXCHANGE_BUDGET` in one with (our schedules run with
  ``profile_every=2``, so half the steady steps exchange and half must make none);
* **host ahead at the boundary**: whether, when the host has returned from the step and the optimizer
  step, the device is still running the step's last action (its end event's ``query()``, no wait);
* **GPU idle fraction from events**: a CUDA event before and after every action on the compute stream
  (:class:`ActionLog`), read after the run: ``1 - busy / span`` over the steady window (busy = the
  union of the action spans, span = first start to last end, boundaries included:
  :func:`idle_fraction`), and the gap between one step's last action and the next step's first
  (:func:`boundary_gaps`).  Reported next to torch's 1F1B at the same world and delay;

and against independent references, as before:

* **losses and parameters** equal (rtol 1e-9) to the same schedule run on the CPU in the same process
  (losses kept on the device and read once, after the run);
* **peak CUDA memory** of the last steady step above what was allocated at its start (the caching
  allocator's host-side statistics: no synchronize) against the planner's prediction for our
  schedules: the deployed plan's peak in-flight activations per stage × the executor's measured bytes
  per microbatch (:func:`plan_readout`, run on every device, so the CPU smoke run checks it);
* **device time**: the forward time the runtime books for stage 0 against the same module's forward
  timed alone with two CUDA events (median of 7, after the run);
* the mean steady step (host wall between the two harness synchronizes) and its ratio to torch's 1F1B.

**Messages on one GPU.**  NCCL refuses two ranks on one device ("Duplicate GPU detected"), so the
ranks talk over gloo (said in the JSON's ``transport``) through :class:`StagedP2P`, which wraps
``schedules._batch_p2p`` (as link-delay injection does; installed first, so the injector wraps it)
and gives the training thread NCCL's semantics: a send records an event on the current stream and
enqueues a device-to-host copy into pinned memory on a side stream after it (``non_blocking``); a
sender thread per peer waits for that copy and issues the gloo send.  A receive gloo-receives into a
pinned buffer; a lander thread per peer copies it up on another side stream (after an event recorded
at issue, as ProcessGroupNCCL's stream waits on the current stream) and records an event; ``wait()``
makes the current stream wait on it and ``is_completed()`` is that event's ``query()``.  So the device
layer is told the messages have NCCL semantics (``set_backend("nccl")``).  What gloo cannot do is a
stream wait on data that has not arrived: a ``wait()`` on a message still on the wire blocks the
training thread until the lander has it (counted and timed as ``arrival_waits``, not a device sync;
on NCCL the stream would wait instead).  Delegated PipeMorph's plan messages go through the delegates.

``--device cpu`` runs all of it without a GPU (the transport stages host tensors, events are host
clock stamps, the spin is a sleep): tests/runtime/test_runtime_gpu_tier_smoke.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import queue
import statistics
import sys
import threading
import time
from typing import Any, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as Fn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from titan_ext.testing import mlp_stages, run_ranks, seeded_batch, static_stage_shapes  # noqa: E402

SCHEDULES = ("1F1B", "ZBV", "PipeMorph", "CrossPipe", "PipeMorph-delegated")
OURS = ("PipeMorph", "CrossPipe", "PipeMorph-delegated")
DELAY_MS = 60.0
#: what a steady step with a profile exchange may make (docs/runtime.md "Host syncs per step": the
#: blocking resolve of an exchange waits on the iteration's last event, never a device synchronize)
EXCHANGE_BUDGET = {"Event.synchronize": 1}
#: a step's actions must be at least this share of --action-ms (else the device is not behind)
ACTION_MS_FLOOR = 0.9
TRANSPORT = {
    "pp_backend": "gloo",
    "why": "ranks share one GPU and NCCL refuses two ranks on one device ('Duplicate GPU detected'); "
           "real NCCL runs in scripts/gpu_tier_multi.py (>= 2 GPUs)",
    "staging": "pinned host buffers, non_blocking copies on side streams ordered by events; a sender thread "
               "per peer waits for the device-to-host copy, a lander thread per peer copies up",
    "device_layer_semantics": "nccl: wait() is a stream wait, is_completed() is truthful",
    "host_blocks": "a wait() on a message not yet arrived blocks the training thread (arrival_waits)",
}


# --------------------------------------------------------------------------------------------------
# pure read-outs (tested on their own)
# --------------------------------------------------------------------------------------------------
def idle_fraction(spans: Sequence[tuple[float, float]]) -> float:
    """``1 - busy / span`` of (start, end) intervals (ms): busy is their union, span first start to last
    end.  NaN without a span."""
    spans = sorted((s, e) for s, e in spans if e >= s)
    if not spans:
        return math.nan
    busy, cur_s, cur_e = 0.0, spans[0][0], spans[0][1]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    total = max(e for _, e in spans) - spans[0][0]
    return 1.0 - busy / total if total > 0 else math.nan


def boundary_gaps(spans: Sequence[tuple[int, float, float]]) -> list[float]:
    """Between consecutive steps (``(step, start, end)`` spans): the next step's first start minus this
    step's last end (ms; negative: they overlap)."""
    by_step: dict[int, tuple[float, float]] = {}
    for k, s, e in spans:
        lo, hi = by_step.get(k, (math.inf, -math.inf))
        by_step[k] = (min(lo, s), max(hi, e))
    steps = sorted(by_step)
    return [by_step[b][0] - by_step[a][1] for a, b in zip(steps, steps[1:])]


def budget_violations(steps: Sequence[dict], budget: dict[str, int] = EXCHANGE_BUDGET) -> list[str]:
    """The steady steps (``{"step", "exchange", "by_kind", "sites"}``) that made more host syncs than the
    budget allows: none without a profile exchange, ``budget`` (kind → count) with one."""
    out = []
    for st in steps:
        allowed = budget if st.get("exchange") else {}
        over = {k: n for k, n in st["by_kind"].items() if n > allowed.get(k, 0)}
        if over:
            where = ", ".join(f"{n} x {s}" for s, n in sorted(st["sites"].items()))
            out.append(f"step {st['step']} ({'exchange' if st.get('exchange') else 'no exchange'}): {where}")
    return out


def plan_readout(sched: Any, stages: Sequence[Any]) -> dict:
    """The deployed plan's prediction for this rank (our schedules; any device): the peak in-flight
    activations of its stages × the executor's measured bytes per microbatch, and the forward time the
    runtime booked for its first stage.  ``sched.deployed.actions`` is the plan IR (torch ``_Action``
    lists by rank): ``as_ops`` makes the ``(stage, kind, mb)`` triples ``peak_inflight`` reads — on
    2026-11-28 the IR went in directly ("too many values to unpack") on the H100, in a read-out that
    ran on CUDA only."""
    from titan_ext.plan.ir import as_ops
    from titan_ext.plan.result import peak_inflight
    from titan_ext.runtime.execute.memory import RELEASE

    out: dict = {}
    act = getattr(sched.executor, "activation_bytes", 0) or 0
    inflight = peak_inflight(as_ops(sched.deployed.actions), RELEASE)
    mine = [s.stage_index for s in stages]
    out["predicted_activation_bytes"] = sum(inflight.get(s, 0) for s in mine) * act
    out["plan_version"] = sched.plan_version
    prof = getattr(sched, "last_profile", None)
    f_ms = [1e3 * (a.end - a.start) for a in (prof.actions if prof else [])
            if a.kind == "F" and a.stage == mine[0] and a.end == a.end]
    if f_ms:
        out["booked_forward_ms"] = statistics.median(f_ms)
    return out


# --------------------------------------------------------------------------------------------------
# long actions, timed with events on the compute stream
# --------------------------------------------------------------------------------------------------
def calibrate_spin(device: torch.device, probe_cycles: int = 20_000_000) -> float:
    """Cycles of ``torch.cuda._sleep`` per millisecond on this GPU, timed with events (median of 3;
    called once, in the parent, before any rank shares the GPU)."""
    with torch.cuda.device(device):
        torch.cuda._sleep(1_000_000)
        times = []
        for _ in range(3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(probe_cycles)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
    return probe_cycles / statistics.median(times)


class ActionLog:
    """The spans of this rank's actions on the stream that runs them: a CUDA event before and after each
    (read after the run, never during it), host clock stamps on CPU (where the host runs the kernels)."""

    def __init__(self, cuda: bool, spin_cycles: int = 0, spin_ms: float = 0.0):
        self.cuda, self.spin_cycles, self.spin_ms = cuda, int(spin_cycles), float(spin_ms)
        self.spans: list[tuple[int, Any, Any]] = []  # (step, start, end)
        self.step = -1
        self.enabled = True

    def _mark(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()  # on this thread's current stream: autograd's backward thread uses the forward's
            return ev
        return time.perf_counter()

    def action(self) -> None:
        """One action's device work: the spin, between two marks."""
        start = self._mark() if self.enabled else None
        if self.cuda:
            if self.spin_cycles > 0:
                torch.cuda._sleep(self.spin_cycles)
        elif self.spin_ms > 0:
            time.sleep(self.spin_ms / 1e3)
        if start is not None:
            self.spans.append((self.step, start, self._mark()))

    def last_done(self) -> bool | None:
        """Whether the device has finished the last action enqueued (``Event.query()``: no wait); None on
        CPU (the host ran it) or with no action yet."""
        if not self.cuda or not self.spans:
            return None
        return bool(self.spans[-1][2].query())

    def intervals_ms(self) -> list[tuple[int, float, float]]:
        """``(step, start, end)`` in ms from the first mark (after the device ran them all)."""
        if not self.spans:
            return []
        origin = self.spans[0][1]
        if self.cuda:
            return [(k, origin.elapsed_time(s), origin.elapsed_time(e)) for k, s, e in self.spans]
        return [(k, 1e3 * (s - origin), 1e3 * (e - origin)) for k, s, e in self.spans]


class _LoggedAction(torch.autograd.Function):
    """Identity whose forward and backward each run one logged action (the spin)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, log: ActionLog) -> torch.Tensor:
        ctx.log = log
        log.action()
        return y.clone()  # not a view: torch's split backward detaches stage outputs in place

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        ctx.log.action()
        return grad, None


class TimedStage(nn.Module):
    """A stage module whose forward and backward of each microbatch take ``log``'s spin on the device."""

    def __init__(self, mod: nn.Module, log: ActionLog):
        super().__init__()
        self.mod, self.log = mod, log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LoggedAction.apply(self.mod(x), self.log)


# --------------------------------------------------------------------------------------------------
# PP messages between ranks that share one GPU: gloo, NCCL's semantics on the training thread
# --------------------------------------------------------------------------------------------------
class _Send:
    """A staged send: ``wait()`` orders the current stream after the copy that read the tensor."""

    __slots__ = ("copied", "sent", "error", "device")

    def __init__(self, copied: Any, device: torch.device):
        self.copied, self.device = copied, device
        self.sent = threading.Event()
        self.error: BaseException | None = None

    def wait(self, timeout: Any = None) -> bool:  # noqa: ARG002 - Work API
        if self.error is not None:
            raise self.error
        if self.copied is not None:
            torch.cuda.current_stream(self.device).wait_event(self.copied)
        return True

    def is_completed(self) -> bool:
        return self.sent.is_set()


class _Recv:
    """A staged receive: lands on the device on a side stream; ``wait()`` is a stream wait on that."""

    __slots__ = ("target", "host", "posted", "landed", "landed_ev", "error", "owner")

    def __init__(self, owner: "StagedP2P", target: torch.Tensor, host: torch.Tensor, posted: Any):
        self.owner, self.target, self.host, self.posted = owner, target, host, posted
        self.landed = threading.Event()
        self.landed_ev: Any = None
        self.error: BaseException | None = None

    def wait(self, timeout: Any = None) -> bool:
        if not self.landed.is_set():  # still on the wire: gloo cannot make a stream wait for it
            t0 = time.perf_counter()
            seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
            if not self.landed.wait(seconds):
                raise TimeoutError(f"staged receive not landed within {seconds} s")
            self.owner.note_arrival_wait(1e3 * (time.perf_counter() - t0))
        if self.error is not None:
            raise self.error
        if self.landed_ev is not None:
            torch.cuda.current_stream(self.target.device).wait_event(self.landed_ev)
        return True

    def is_completed(self) -> bool:
        """Truthful, as NCCL's: the data is in the target buffer (an error also completes it)."""
        if not self.landed.is_set():
            return False
        return self.error is not None or self.landed_ev is None or bool(self.landed_ev.query())


class StagedP2P:
    """``schedules._batch_p2p`` for ranks sharing one GPU on gloo (module docstring, "Messages on one
    GPU").  ProcessGroupNCCL's ``pointToPoint`` makes its stream wait on the current stream at issue and
    records the op's end on it; here the side streams wait on an event recorded at issue, and the
    work's ``wait()`` makes the current stream wait on the landing's event.  Every send to a peer goes
    through that peer's one sender thread and every receive is posted on the calling thread, so each
    pair stays one FIFO per direction.  Side threads make their CUDA calls under
    ``titan_ext.runtime.execute.device.thread_device()`` (the training thread's device)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.arrival_waits, self.arrival_wait_ms, self.messages = 0, 0.0, 0
        self._threads: list[threading.Thread] = []
        self._senders: dict[int, queue.SimpleQueue] = {}
        self._landers: dict[int, queue.SimpleQueue] = {}
        self._lock = threading.Lock()
        self._orig: Any = None
        self._ctx: Any = None
        self._d2h = self._h2d = None

    def note_arrival_wait(self, ms: float) -> None:
        with self._lock:
            self.arrival_waits += 1
            self.arrival_wait_ms += ms

    # -- issue (training thread) -----------------------------------------------------------------
    def batch_p2p(self, p2p_ops: list, desc: str | None = None) -> list:  # noqa: ARG002 - torch's signature
        import torch.distributed as dist

        from titan_ext.runtime._torch_compat import is_send, match_self_p2p, p2p_peer

        done = match_self_p2p(p2p_ops, dist.get_rank())  # torch 2.11 ZBV's start-up sends to its own rank
        works: list = [done.get(i) for i in range(len(p2p_ops))]
        for i, op in enumerate(p2p_ops):
            if i not in done:
                peer = p2p_peer(op)
                works[i] = (self._send if is_send(op) else self._recv)(op.tensor, peer, op.group, op.tag)
        self.messages += len(p2p_ops) - len(done)
        return works

    def _send(self, tensor: torch.Tensor, peer: int, group: Any, tag: int) -> _Send:
        copied = None
        if tensor.is_cuda:
            ready = torch.cuda.Event()
            ready.record()  # the data is ready once the current stream gets here
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            copied = torch.cuda.Event(blocking=True)  # the sender thread's wait sleeps, it does not spin
            with torch.cuda.stream(self._d2h):
                self._d2h.wait_event(ready)
                host.copy_(tensor.detach(), non_blocking=True)
                copied.record(self._d2h)
            tensor.record_stream(self._d2h)
        else:
            host = tensor.detach().clone()
        work = _Send(copied, self.device)
        self._queue(self._senders, peer, self._send_loop).put((work, host, peer, group, tag))
        return work

    def _recv(self, tensor: torch.Tensor, peer: int, group: Any, tag: int) -> _Recv:
        import torch.distributed as dist

        posted = None
        if tensor.is_cuda:
            posted = torch.cuda.Event()
            posted.record()  # the buffer may be rewritten once the current stream gets here
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
        r = _Recv(self, tensor, host, posted)
        work = dist.irecv(host, peer, group, tag)
        self._queue(self._landers, peer, self._land_loop).put((r, work))
        return r

    def _queue(self, table: dict, peer: int, loop: Any) -> queue.SimpleQueue:
        q = table.get(peer)
        if q is None:
            q = table[peer] = queue.SimpleQueue()
            t = threading.Thread(target=loop, args=(q,), daemon=True,
                                 name=f"gpu-tier-{'send' if loop == self._send_loop else 'land'}-{peer}")
            t.start()
            self._threads.append(t)
        return q

    # -- side threads ----------------------------------------------------------------------------
    def _send_loop(self, q: queue.SimpleQueue) -> None:
        import torch.distributed as dist

        failed: BaseException | None = None
        with self._ctx():
            while (item := q.get()) is not None:
                work, host, peer, group, tag = item
                try:
                    if failed is not None:
                        raise failed
                    if work.copied is not None:
                        work.copied.synchronize()  # this thread only: the copy read the device tensor
                    dist.isend(host, peer, group, tag).wait()
                except BaseException as exc:  # noqa: BLE001 - surfaced by the work's wait()
                    work.error = failed = exc
                work.sent.set()

    def _land_loop(self, q: queue.SimpleQueue) -> None:
        failed: BaseException | None = None
        with self._ctx():
            while (item := q.get()) is not None:
                r, work = item
                try:
                    if failed is not None:
                        raise failed
                    work.wait()  # gloo: returns once the data is in the host buffer
                    with torch.no_grad():  # torch's receive buffers are leaves that require grad
                        if r.posted is not None:
                            ev = torch.cuda.Event()
                            with torch.cuda.stream(self._h2d):
                                self._h2d.wait_event(r.posted)
                                r.target.copy_(r.host, non_blocking=True)
                                ev.record(self._h2d)
                            r.target.record_stream(self._h2d)
                            r.landed_ev = ev
                        else:
                            r.target.copy_(r.host)
                except BaseException as exc:  # noqa: BLE001 - surfaced by the work's wait()
                    r.error = failed = exc
                r.landed.set()

    # -- install / remove ------------------------------------------------------------------------
    def install(self) -> "StagedP2P":
        from torch.distributed.pipelining import schedules

        from titan_ext.runtime.execute.device import thread_device

        if self.cuda:
            torch.cuda.init()
            self._d2h, self._h2d = torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)
        self._ctx = thread_device()  # captured here, on the training thread, after set_device
        if self._orig is None:
            self._orig = schedules._batch_p2p
            schedules._batch_p2p = self.batch_p2p
        return self

    def remove(self, timeout_s: float = 60.0) -> None:
        """Restore torch's function and end the threads once every message they hold went through."""
        from torch.distributed.pipelining import schedules

        if self._orig is not None and schedules._batch_p2p == self.batch_p2p:
            schedules._batch_p2p = self._orig
        self._orig = None
        for q in (*self._senders.values(), *self._landers.values()):
            q.put(None)
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        self._senders.clear()
        self._landers.clear()
        self._threads.clear()
        if stuck:
            raise RuntimeError(f"staged transport threads still running after {timeout_s} s: {stuck}")


# --------------------------------------------------------------------------------------------------
# one cell
# --------------------------------------------------------------------------------------------------
def _stages_of(kind: str, rank: int, world: int) -> list[int]:
    return [rank, 2 * world - 1 - rank] if kind == "ZBV" else [rank]


def _build(kind: str, rank: int, world: int, device: torch.device, args, log: ActionLog | None) -> tuple:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleZBVZeroBubble

    from titan_ext.runtime import CrossPipe, PipeMorph

    n_stages = 2 * world if kind == "ZBV" else world
    mods = mlp_stages(n_stages, args.dim)
    example = torch.zeros(args.mb_rows, args.dim, dtype=torch.float64, device=device)
    own = [mods[s].to(device) for s in _stages_of(kind, rank, world)]
    run = [TimedStage(m, log) if log is not None else m for m in own]
    stages = [PipelineStage(m, s, n_stages, device, **static_stage_shapes(example))
              for m, s in zip(run, _stages_of(kind, rank, world))]
    n, loss = args.microbatches, Fn.mse_loss
    ours = {"profile_every": args.profile_every}
    if kind == "1F1B":
        sched = Schedule1F1B(stages[0], n, loss_fn=loss)
    elif kind == "ZBV":
        sched = ScheduleZBVZeroBubble(stages, n, loss_fn=loss)
    elif kind == "PipeMorph":
        sched = PipeMorph(stages, n, loss_fn=loss, **ours)
    elif kind == "CrossPipe":
        sched = CrossPipe(stages, n, loss_fn=loss, **ours)
    else:
        sched = PipeMorph(stages[0], n, loss_fn=loss, delegation="always", **ours)
    return own, run, stages, sched


def _step(sched, kind: str, rank: int, world: int, x, y, losses: list) -> None:
    first = rank == 0
    last = (rank == 0) if kind == "ZBV" else (rank == world - 1)
    kw = {}
    if last:
        kw.update(target=y, losses=losses)
    sched.step(x, **kw) if first else sched.step(**kw)


def _forward_ref_ms(mod, x) -> float:
    """The module's forward on one microbatch, timed alone with two CUDA events (median of 7)."""
    times = []
    with torch.no_grad():
        for _ in range(8):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            mod(x)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
    return statistics.median(times[1:])


def exchanged(sched: Any) -> bool:
    """Whether the step just run ended with a profile exchange (our schedules; torch's never do)."""
    metrics = getattr(sched, "last_metrics", None) or {}
    return float(metrics.get("exchange_ms", 0.0) or 0.0) > 0.0


def _run(kind: str, rank: int, world: int, device: torch.device, delay: float, args, reference: bool = False) -> dict:
    """One schedule trained ``args.steps`` steps.  ``reference``: the CPU reference (plain gloo, no
    spin, no staging: torch 2.11's self-sends matched by ``HostStagedP2P``, which passes host tensors)."""
    import torch.distributed as dist

    from titan_ext.runtime import inject_link_delays
    from titan_ext.testing import host_syncs
    from titan_ext.testing.shared_gpu import HostStagedP2P

    cuda = device.type == "cuda"
    # every batch on the device before the first step: a pageable .to(device) in a step is a host sync
    batches = [tuple(t.to(device) for t in seeded_batch(700 + k, args.microbatches * args.mb_rows, args.dim))
               for k in range(args.steps)]
    log = None if reference else ActionLog(cuda, args.spin_cycles, args.action_ms)
    transport = HostStagedP2P().install() if reference else StagedP2P(device).install()
    link = world - 2
    injector = inject_link_delays(f"{link}:{delay}" if delay > 0 else "") if args.delays else None
    own, run, stages, sched = _build(kind, rank, world, device, args, log)
    if not reference and hasattr(sched, "executor"):
        sched.executor.device.set_backend("nccl")  # the staged works' semantics (StagedP2P)
    params = [p for m in own for p in m.parameters()]
    initial = [p.detach().cpu().clone() for p in params]
    opt = torch.optim.SGD(params, lr=0.05)
    out: dict = {}
    losses_dev: list = []
    steady: list[dict] = []
    before = 0
    try:
        for k in range(args.steps):
            x, y = batches[k]
            losses: list = []
            if k == args.warmup:  # the harness's one wait before the steady window
                if cuda:
                    torch.cuda.synchronize()
                dist.barrier()
                t0 = time.perf_counter()
            if log is not None:
                log.step = k
            if cuda and k == args.steps - 1:  # the caching allocator's host-side statistics: no sync
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            if k >= args.warmup:
                with host_syncs.counting() as counter:
                    opt.zero_grad()
                    _step(sched, kind, rank, world, x, y, losses)
                    opt.step()
                done = log.last_done() if log is not None else None
                by_kind: dict[str, int] = {}
                for (what, _site), n in counter.by_site.items():
                    by_kind[what] = by_kind.get(what, 0) + n
                steady.append({"step": k, "exchange": exchanged(sched), "syncs": counter.total, "by_kind": by_kind,
                               "sites": {f"{what}@{site}": n for (what, site), n in counter.by_site.items()},
                               "host_ahead": None if done is None else not done})
            else:
                opt.zero_grad()
                _step(sched, kind, rank, world, x, y, losses)
                opt.step()
            losses_dev.append(torch.stack([v.detach() for v in losses]) if losses else None)
        if cuda:
            torch.cuda.synchronize()  # the harness's one wait after the steady window
        steady_s = time.perf_counter() - t0
        elapsed = torch.tensor([1e3 * steady_s / max(1, args.steps - args.warmup)], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        out["step_ms"] = elapsed.item()
        out["losses"] = [t.cpu().tolist() if t is not None else [] for t in losses_dev]
        out["params"] = [p.detach().cpu() for p in params]
        # training reached this rank: every parameter tensor moved (a static-shape stage whose received
        # activations need no gradient leaves the earlier stages' gradients zero, equal on CPU and GPU)
        out["params_moved"] = all(not torch.equal(a, b) for a, b in zip(out["params"], initial))
        out["steady_steps"] = steady
        if log is not None:
            spans = [(k, s, e) for k, s, e in log.intervals_ms() if k >= args.warmup]
            out["idle_fraction"] = idle_fraction([(s, e) for _, s, e in spans])
            gaps = boundary_gaps(spans)
            out["boundary_gap_ms_max"] = max(gaps) if gaps else None
            out["action_ms_median"] = statistics.median([e - s for _, s, e in spans]) if spans else None
            out["actions_per_step"] = len(spans) / max(1, args.steps - args.warmup)
        if isinstance(transport, StagedP2P):
            out["arrival_waits"], out["arrival_wait_ms"] = transport.arrival_waits, transport.arrival_wait_ms
            out["messages"] = transport.messages
        if cuda:
            out["peak_bytes"] = torch.cuda.max_memory_allocated(device) - before
        if hasattr(sched, "deployed"):  # on any device: the CPU smoke run checks this read-out too
            out.update(plan_readout(sched, stages))
            if cuda and rank == 0 and "booked_forward_ms" in out:
                log.enabled = False
                xs = seeded_batch(1, args.mb_rows, args.dim)[0].to(device)
                out["event_forward_ms"] = _forward_ref_ms(run[0], xs)
    finally:
        if getattr(sched, "delegation", None) is not None:  # an adaptive schedule's transport
            sched.delegation.close()
        if injector is not None:
            injector.remove()
        transport.remove()
    return out


def _worker(rank: int, world: int, args, kinds: list[str], delays: list[float]) -> list[dict]:
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # every rank shares the one GPU
    if args.stack_dump_s > 0:  # a hang shows where every thread of every rank is
        import faulthandler

        faulthandler.dump_traceback_later(args.stack_dump_s, exit=True)
    cpu = torch.device("cpu")
    cells = []
    for kind in kinds:
        # the CPU reference: the same schedule (delegated PipeMorph's is PipeMorph: one delegate pool per
        # process, see main())
        ref = _run("PipeMorph" if kind == "PipeMorph-delegated" else kind, rank, world, cpu, 0.0, args, reference=True)
        # and torch's Schedule1F1B on CPU, the independent reference for our schedules (same model split)
        torch_ref = None if kind in ("1F1B", "ZBV") else _run("1F1B", rank, world, cpu, 0.0, args, reference=True)
        for delay in delays:
            try:
                got = _run(kind, rank, world, device, delay, args)
            except Exception as e:
                # raised, not recorded: the peers may wait for this rank's messages, and a message left in
                # flight would be matched by the next cell's (run_ranks ends every rank now; main() reports it)
                raise RuntimeError(f"{kind} +{delay:g} ms on rank {rank}: {type(e).__name__}: {e}") from e
            flat, ref_flat = sum(got.pop("losses"), []), sum(ref["losses"], [])
            params = got.pop("params")
            cell = {"schedule": kind, "delay_ms": delay, **got,
                    "losses_equal_cpu": len(flat) == len(ref_flat) and all(
                        abs(a - b) <= 1e-9 * max(1.0, abs(b)) for a, b in zip(flat, ref_flat)),
                    "params_equal_cpu": all(torch.allclose(a, b, rtol=1e-9, atol=1e-12)
                                            for a, b in zip(params, ref["params"])),
                    "params_equal_torch_1f1b": torch_ref is None or all(
                        torch.allclose(a, b, rtol=1e-9, atol=1e-12) for a, b in zip(ref["params"], torch_ref["params"])),
                    "params_max_abs_diff": max((float((a - b).abs().max()) for a, b in zip(params, ref["params"])),
                                               default=0.0)}
            cells.append(cell)
    return cells


def _batches(kinds: list[str], delays: bool = True) -> list[tuple[list[str], list[float]]]:
    """run_ranks calls: one per schedule (several schedules' objects in one process have been seen to
    end it after its last step), delegated PipeMorph without delay only (a delegate pool whose send
    delegate delayed messages ended its process after the run: both noted in docs/runtime.md "GPU
    correctness", not yet explained)."""
    return [([k], [0.0] if k == "PipeMorph-delegated" or not delays else [0.0, DELAY_MS]) for k in kinds]


PER_RANK = ("peak_bytes", "predicted_activation_bytes", "idle_fraction", "boundary_gap_ms_max", "action_ms_median",
            "arrival_waits", "arrival_wait_ms", "steady_steps")


def merge_cells(world: int, cells: Sequence[dict], cuda: bool, action_ms: float) -> tuple[dict, list[str]]:
    """One cell's ranks → the summary row and its failures (why the cell did not pass)."""
    c0 = dict(cells[0])
    c0["world"] = world
    for key in ("losses_equal_cpu", "params_equal_cpu", "params_moved", "params_equal_torch_1f1b"):
        c0[key] = all(c.get(key, False) for c in cells)
    c0["params_max_abs_diff"] = max((c.get("params_max_abs_diff", math.nan) for c in cells), default=math.nan)
    for key in PER_RANK:
        c0[f"{key}_per_rank"] = [c.get(key) for c in cells]
        c0.pop(key, None)
    steps = [st for c in cells for st in c.get("steady_steps", [])]
    c0["host_syncs_per_step_max_per_rank"] = [max((st["syncs"] for st in c.get("steady_steps", [])), default=None)
                                              for c in cells]
    c0["steps_without_exchange"] = sum(1 for st in cells[0].get("steady_steps", []) if not st["exchange"])
    ahead = [st["host_ahead"] for st in steps if not st["exchange"] and st["host_ahead"] is not None]
    c0["host_ahead_at_boundaries"] = f"{sum(ahead)}/{len(ahead)}" if ahead else None
    why: list[str] = [c["error"] for c in cells if "error" in c][:1]
    if not why:
        checks = {"differs from CPU": c0["losses_equal_cpu"] and c0["params_equal_cpu"],
                  "a rank's parameters did not move": c0["params_moved"],
                  "its CPU run differs from torch's 1F1B": c0["params_equal_torch_1f1b"]}
        why += [k for k, ok in checks.items() if not ok]
        for r, c in enumerate(cells):
            why += [f"rank {r} host syncs: {v}" for v in budget_violations(c.get("steady_steps", []))]
        if cuda:
            why += [f"host behind the device at {len(ahead) - sum(ahead)} of {len(ahead)} steady boundaries "
                    f"without an exchange"] if ahead and not all(ahead) else []
            short = [r for r, c in enumerate(cells) if (c.get("action_ms_median") or 0.0) < ACTION_MS_FLOOR * action_ms]
            why += [f"actions shorter than {ACTION_MS_FLOOR:g} x {action_ms:g} ms on ranks {short} "
                    f"(the device is not behind)"] if short else []
        if c0["schedule"] in OURS and not all(b is not None and b > 0 for b in c0["predicted_activation_bytes_per_rank"]):
            why.append("no plan read-out (predicted activation bytes)")
    return c0, why


def finish(summary: dict, failures: list[str], path: str, note: str = "") -> None:
    """A GPU tier's end (this script's and scripts/gpu_tier_multi.py's): ``failures`` into ``summary``, the
    summary as JSON at ``path``, a last line, and exit status 1 on any failure."""
    summary["failures"] = failures
    with open(path, "w") as fh:
        json.dump(summary, fh, indent=1)
    print(f"JSON: {path}; {note}failures: {failures or 'none'}")
    sys.exit(1 if failures else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    ap.add_argument("--schedules", type=lambda s: s.split(","), default=list(SCHEDULES))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--mb-rows", type=int, default=64)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--action-ms", type=float, default=None,
                    help="device time of each action (default 50 on CUDA, 1 on --device cpu)")
    ap.add_argument("--profile-every", type=int, default=2,
                    help="our schedules' check period: the steps between exchanges must make no host sync")
    ap.add_argument("--budget-s", type=float, default=320.0,
                    help="the schedules not started by then are reported as not run (a failure); the one "
                         "running then ends within about 40 s, so the whole stays under 6 min")
    ap.add_argument("--batch-timeout-s", type=float, default=300.0,
                    help="one schedule's ranks are ended after this long (a hang)")
    ap.add_argument("--json", default="gpu_tier.json")
    ap.add_argument("--no-delays", dest="delays", action="store_false",
                    help="no link-delay injection at all (not even its +0 ms wrapper)")
    ap.add_argument("--stack-dump-s", type=float, default=0.0,
                    help="> 0: each rank prints every thread's stack and exits after this many seconds")
    ap.add_argument("--device", default="cuda:0", help="cpu: a smoke run of this script without a GPU")
    args = ap.parse_args()
    if args.steps <= args.warmup:
        sys.exit("scripts/gpu_tier.py: --steps must exceed --warmup")
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        sys.exit("scripts/gpu_tier.py: no CUDA GPU")
    if args.action_ms is None:
        args.action_ms = 50.0 if cuda else 1.0
    started = time.time()
    calibration: dict = {"action_ms": args.action_ms}
    args.spin_cycles = 0
    if cuda:
        cycles_per_ms = calibrate_spin(torch.device(args.device))
        args.spin_cycles = int(args.action_ms * cycles_per_ms)
        calibration.update(cycles_per_ms=round(cycles_per_ms), spin_cycles=args.spin_cycles)
    summary: dict = {"torch": torch.__version__, "cuda": torch.version.cuda,
                     "gpu": torch.cuda.get_device_name(0) if cuda else "none (cpu)", "python": platform.python_version(),
                     "date": time.strftime("%Y-%m-%d"), "args": vars(args), "transport": TRANSPORT,
                     "calibration": calibration, "exchange_budget": EXCHANGE_BUDGET, "cells": []}
    failures = []
    for world in args.worlds:
        t0 = time.time()
        per_rank = [[] for _ in range(world)]
        for kinds, delays in _batches(args.schedules, args.delays):
            if time.time() - started > args.budget_s:
                failures += [f"world {world} {k} +{d:g} ms: not run (past --budget-s {args.budget_s:g})"
                             for k in kinds for d in delays]
                continue
            print(f"[gpu_tier] world {world}: {', '.join(kinds)} at +{delays} ms ({time.time() - t0:.0f} s)",
                  flush=True)
            try:
                results = run_ranks(_worker, world, args, kinds, delays, backend="gloo", timeout_s=args.batch_timeout_s)
            except Exception as e:  # noqa: BLE001 - this schedule's cells fail; the JSON is still written
                err = f"{type(e).__name__}: {e}"
                print(f"[gpu_tier] world {world}: {', '.join(kinds)} failed: {err[-3000:]}", flush=True)
                for k in kinds:
                    for d in delays:
                        summary["cells"].append({"world": world, "schedule": k, "delay_ms": d, "error": err[-4000:]})
                        failures.append(f"world {world} {k} +{d:g} ms: {err.splitlines()[-1][:300] if err else '?'}")
                continue
            for r, cells in enumerate(results):
                per_rank[r] += cells
        for cells in zip(*per_rank):
            c0, why = merge_cells(world, cells, cuda, args.action_ms)
            failures += [f"world {world} {c0['schedule']} +{c0['delay_ms']:g} ms: {w}" for w in why]
            summary["cells"].append(c0)
        summary.setdefault("seconds_per_world", {})[world] = round(time.time() - t0, 1)
    summary["seconds"] = round(time.time() - started, 1)
    base = {(c["world"], c["delay_ms"]): c for c in summary["cells"] if c["schedule"] == "1F1B"}
    print(f"{'world':>5} {'schedule':>20} {'delay':>6} {'step ms':>8} {'vs 1F1B':>8} {'=CPU':>5} {'idle':>15} "
          f"{'1F1B idle':>15} {'ahead':>6} {'syncs':>9} {'peak MB/rank':>20} {'pred act MB/rank':>20} {'F ms booked/event':>18}")
    for c in summary["cells"]:
        b = base.get((c["world"], c["delay_ms"]), {})
        med = c.get("step_ms")
        c["ratio_to_1f1b"] = round(b["step_ms"] / med, 3) if med and b.get("step_ms") else None
        c["idle_fraction_1f1b_per_rank"] = b.get("idle_fraction_per_rank")
        mb = lambda v: "/".join("-" if x is None else f"{x / 2**20:.1f}" for x in v)  # noqa: E731
        fr = lambda v: "/".join("-" if x is None or x != x else f"{x:.2f}" for x in (v or []))  # noqa: E731
        fm = (f"{c['booked_forward_ms']:.3f}/{c['event_forward_ms']:.3f}"
              if "booked_forward_ms" in c and "event_forward_ms" in c else "-")
        print(f"{c['world']:>5} {c['schedule']:>20} {c['delay_ms']:>6g} "
              f"{med if med is not None else math.nan:>8.1f} {c['ratio_to_1f1b'] or math.nan:>8.2f} "
              f"{'yes' if c.get('losses_equal_cpu') and c.get('params_equal_cpu') else 'NO':>5} "
              f"{fr(c.get('idle_fraction_per_rank')):>15} {fr(c.get('idle_fraction_1f1b_per_rank')):>15} "
              f"{c.get('host_ahead_at_boundaries') or '-':>6} "
              f"{'/'.join(str(v) for v in c.get('host_syncs_per_step_max_per_rank', [])) or '-':>9} "
              f"{mb(c.get('peak_bytes_per_rank', [])):>20} {mb(c.get('predicted_activation_bytes_per_rank', [])):>20} {fm:>18}")
        if "error" in c:
            print("   error:", c["error"].splitlines()[-1][:300] if c["error"] else "?")
    finish(summary, failures, args.json, f"{summary['seconds']:.0f} s; ")


if __name__ == "__main__":
    main()
