"""The ``nccl_rules`` test backend: each NCCL rule fails the way NCCL would, correct traffic passes.

One 2-rank run (module fixture) plays every scenario on a fresh ``nccl_rules`` group, so a scenario
that breaks a pair cannot disturb the next; the tests read what each rank saw.  The references are
NCCL's documented rules (DESIGN.md "GPU rules"), not captured output.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from titan_ext.runtime.comm.control_plane import ControlPlane, new_control_group
from titan_ext.testing.nccl_rules import NcclRuleError, is_host_made, mark_host
from titan_ext.runtime.measure.profiler import estimate_clock_offsets
from titan_ext.testing import run_ranks

pytestmark = pytest.mark.timeout(120)


def _settle(works: list, limit_s: float = 20.0) -> str:
    """Poll the works like the device layer does: 'ok', or the error of the first failed one (a failed
    work is completed, its error in ``exception()``, as on ProcessGroupNCCL)."""
    deadline = time.monotonic() + limit_s
    try:
        while not all(w.is_completed() for w in works):
            if time.monotonic() > deadline:
                return "still pending"
            time.sleep(0.005)
    except NcclRuleError as exc:  # an earlier backend raised from is_completed()
        return str(exc)
    errors = [w.exception() for w in works if w.exception() is not None]
    return str(errors[0]) if errors else "ok"


def _batch(ops: list) -> list:
    return dist.batch_isend_irecv(ops)


def _warm_pair(g, rank: int, peer: int, meet: bool = True) -> None:
    """Create the pair's two-rank communicator of ``g`` (lazy init: the first bare op of each side is a
    rendezvous): one bare message from the lower rank to the higher.  ``meet``: both ranks first meet on
    the default group, so a busy host's scheduling skew between them (seconds at load 10) is not spent
    from ``g``'s short timeout; every rank of the default group must call it then."""
    if meet:
        dist.barrier()
    t = torch.zeros(1)
    work = dist.isend(t, peer, g) if rank < peer else dist.irecv(t, peer, g)
    assert _settle([work]) == "ok"


def _warm_group(g) -> None:
    """Create ``g``'s communicator (lazy init: its first collective or batch needs every rank)."""
    dist.all_reduce(torch.zeros(1), group=g)


def _scenarios(rank: int, world: int) -> dict:
    peer, out = 1 - rank, {}
    out["control"] = _control_with_uneven_group_counts(rank)
    control = ControlPlane()

    # 1. a batch with mismatched tags is still matched (tags ignored), data correct
    g = dist.new_group()
    mine, theirs = torch.full((3,), 10.0 + rank, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    works = _batch([dist.P2POp(dist.isend, mine, peer, g, tag=5 + rank),
                    dist.P2POp(dist.irecv, theirs, peer, g, tag=7 - rank)])
    out["batch"] = (_settle(works), theirs.tolist())

    # 2. one FIFO per direction: the first receive gets the first send whatever the tags
    g = dist.new_group()
    if rank == 0:
        works = [dist.isend(torch.tensor([1.0]), 1, g, tag=1), dist.isend(torch.tensor([2.0]), 1, g, tag=2)]
        out["fifo"] = (_settle(works), None)
    else:
        a, b = torch.zeros(1), torch.zeros(1)
        works = [dist.irecv(a, 0, g, tag=2), dist.irecv(b, 0, g, tag=1)]
        out["fifo"] = (_settle(works), [a.item(), b.item()])

    # 3. a split batch (each side: send, then receive, as two groups) is NCCL's deadlock
    g = dist.new_group()
    x, y = torch.ones(4), torch.zeros(4)
    works = [dist.isend(x, peer, g), dist.irecv(y, peer, g)]
    out["split"] = _settle(works)

    # 4. a reordered batch: sizes meet in the wrong order
    g = dist.new_group()
    small, big = torch.ones(2), torch.ones(5)
    if rank == 0:
        works = _batch([dist.P2POp(dist.isend, small, 1, g), dist.P2POp(dist.isend, big, 1, g)])
    else:
        works = _batch([dist.P2POp(dist.irecv, big, 0, g), dist.P2POp(dist.irecv, small, 0, g)])
    out["reordered"] = _settle(works)

    # 5. wait() returns before the data lands; the data lands later.  wait(timeout) blocks the host until
    #    the op completes (ProcessGroupNCCL's blocking wait); one that expires aborts the group
    g = dist.new_group()
    g_expire = dist.new_group()
    _warm_pair(g, rank, peer)
    _warm_pair(g_expire, rank, peer)  # the pair's communicators exist: no rendezvous below
    control.any(False)  # both ranks here
    if rank == 0:
        time.sleep(0.4)
        dist.isend(torch.full((8,), 3.0), 1, g).wait()
        time.sleep(0.8)
        dist.isend(torch.full((8,), 5.0), 1, g).wait()
        out["late"] = None
    else:
        buf = torch.zeros(8)
        work = dist.irecv(buf, 0, g)
        t0 = time.perf_counter()
        work.wait()
        wait_ms = 1e3 * (time.perf_counter() - t0)
        completed_after_wait = work.is_completed()
        seen = []  # a consumer on another thread, which never waited: no stream order for it
        t = threading.Thread(target=lambda: seen.append(buf.clone().tolist()))
        t.start()
        t.join()
        total = buf.sum().item()  # a kernel after wait(): ordered after the data lands
        landed_ms = 1e3 * (time.perf_counter() - t0)
        second = dist.irecv(torch.zeros(8), 0, g)
        t1 = time.perf_counter()
        timed = second.wait(timeout=timedelta(seconds=10))
        timed_ms = 1e3 * (time.perf_counter() - t1)
        out["late"] = dict(wait_ms=wait_ms, completed_after_wait=completed_after_wait,
                           stale=seen[0], total=total, landed_ms=landed_ms,
                           future=work.get_future().done(), completed=work.is_completed(),
                           timed=timed, timed_ms=timed_ms, timed_completed=second.is_completed())
        t2 = time.perf_counter()
        try:  # rank 0 never sends again on g_expire
            dist.irecv(torch.zeros(1), 0, g_expire).wait(timeout=timedelta(milliseconds=300))
            expired = "returned"
        except RuntimeError as exc:
            expired = str(exc)
        expired_ms = 1e3 * (time.perf_counter() - t2)
        try:
            dist.isend(torch.ones(1), 0, g_expire)
            after = "accepted"
        except RuntimeError as exc:
            after = str(exc)
        out["expired"] = (expired, expired_ms, after)

    # 6. one thread per pair
    g = dist.new_group()
    if rank == 0:
        dist.isend(torch.ones(1), 1, g)
        errors = []

        def other_thread() -> None:
            try:
                dist.isend(torch.ones(1), 1, g)
            except NcclRuleError as exc:
                errors.append(str(exc))

        t = threading.Thread(target=other_thread, name="not-the-main-thread")
        t.start()
        t.join()
        out["thread"] = errors
    else:
        out["thread"] = _settle([dist.irecv(torch.zeros(1), 0, g)])

    # 7. host tensors: titan_ext's clock ping-pong (host float64 timestamps) is refused on a data
    #    group and runs on the gloo control group; the model's tensors pass
    g = dist.new_group()
    try:
        estimate_clock_offsets(g)
        out["host_on_data"] = "accepted"
    except NcclRuleError as exc:
        out["host_on_data"] = str(exc)
    out["host_on_control"] = estimate_clock_offsets(control.group)
    model_tensor = torch.randn(4)
    marked = mark_host(torch.ones(4) * 2)
    out["marks"] = (is_host_made(model_tensor), bool(is_host_made(marked)), bool(is_host_made(marked + 1)))
    try:
        dist.all_reduce(marked, group=dist.new_group())
        out["host_allreduce"] = "accepted"
    except NcclRuleError as exc:
        out["host_allreduce"] = str(exc)
    dist.all_reduce(model_tensor, group=dist.new_group())
    out["model_allreduce"] = "ok"

    # 8. S2's chunks: gathered on the host by titan_ext (marked); the user's side (TorchTitan) moves
    #    its batch to the device with `.to(device)`, which on a GPU makes a device tensor (unmarked);
    #    a dtype-only `.to` moves nothing
    from titan_ext.runtime.falcon.redistribute import redistribute_chunks

    chunk = redistribute_chunks([torch.full((2,), float(rank))], [1, 1], rank, control.group)[0]
    moved = chunk.to(torch.device("cpu"))
    out["s2_marks"] = (bool(is_host_made(chunk)), is_host_made(moved), bool(is_host_made(chunk.to(torch.float64))))
    dist.all_reduce(moved, group=dist.new_group())
    out["s2_moved_allreduce"] = moved.tolist()

    # 9. ``zeros_like`` / ``new_*`` follow their source's device (on a GPU a device tensor): S2's
    #    weighted gradient sum fills a missing gradient with zeros_like(parameter), a device tensor
    from titan_ext.runtime.falcon.redistribute import weighted_all_reduce_gradients

    lin = torch.nn.Linear(2, 1)
    lin.weight.grad = torch.full((1, 2), float(rank + 1))  # the bias has no gradient on either rank
    try:
        weighted_all_reduce_gradients(lin.parameters(), 0.5, group=dist.new_group())
        out["like_allreduce"] = (lin.weight.grad.tolist(), lin.bias.grad.tolist())
    except NcclRuleError as exc:
        out["like_allreduce"] = str(exc)

    # 10. a batch of any size is one group (S3 moves a whole stage state to one peer in one batch:
    #     hundreds of ops), here 150 sends and 150 receives each way
    g = dist.new_group()
    mine = [torch.full((3,), float(100 * rank + i)) for i in range(150)]
    theirs = [torch.zeros(3) for _ in range(150)]
    ops = [dist.P2POp(dist.isend, t, 1 - rank, g) for t in mine] + \
          [dist.P2POp(dist.irecv, t, 1 - rank, g) for t in theirs]
    out["big_batch"] = _settle(dist.batch_isend_irecv(ops)), [t[0].item() for t in theirs[::50]]

    # 11.-13. host tensors by placement, on any thread, among collective outputs
    out["placement"] = _placement_scenarios(peer)

    # 14. the group timeout is NCCL's watchdog: an op unmatched past it aborts the group (here, with
    #     $TITAN_EXT_NCCL_RULES_WATCHDOG=raise, the works raise; by default the process ends), whether the
    #     timeout came with the group or from _set_pg_timeout (what timeouts.set_timeout calls)
    #     A work's timeout is the group's when it was issued (ProcessGroupNCCL: opTimeout_ set at the work's
    #     creation): moved to 30 s after the op was issued (g_moved), the watchdog still fires after 2 s; a
    #     work issued with 15 s (g_long) is still pending after its group moved to 1 s and 2 s passed
    g_made = dist.new_group(timeout=timedelta(seconds=2))
    g_set = dist.new_group()
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=2), g_set)
    g_moved = dist.new_group(timeout=timedelta(seconds=2))
    g_long = dist.new_group(timeout=timedelta(seconds=15))
    control.any(False)
    for g in (g_made, g_set, g_moved, g_long):
        _warm_pair(g, rank, peer)
    t0 = time.monotonic()
    long_lonely = dist.isend(torch.ones(1), peer, g_long)  # neither rank receives it
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=1), g_long)
    lonely = dist.isend(torch.ones(1), peer, g_made if rank == 0 else g_set)  # the peer never receives it
    moved = dist.isend(torch.ones(1), peer, g_moved)
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=30), g_moved)
    out["watchdog"] = (_settle([lonely], 8.0), time.monotonic() - t0)
    out["moved_after_issue"] = (_settle([moved], 8.0), time.monotonic() - t0)
    time.sleep(max(0.0, 2.5 - (time.monotonic() - t0)))
    try:
        out["lowered_after_issue"] = (long_lonely.is_completed(), time.monotonic() - t0)
    except NcclRuleError as exc:  # the old backend: fired after the group's current 1 s
        out["lowered_after_issue"] = (f"raised: {exc}", time.monotonic() - t0)
    #     is_completed() of a failed work is True (WorkNCCL::isCompleted: exception() || finished), the
    #     error in exception(), wait() raises it
    try:
        completed = lonely.is_completed()
    except NcclRuleError as exc:
        completed = f"raised: {exc}"
    try:
        lonely.wait()
        waited = "returned"
    except NcclRuleError:
        waited = "raised"
    out["completed_on_error"] = (completed, lonely.is_success(), type(lonely.exception()).__name__, waited)

    # 15. bare and batched ops travel on different communicators: a batched send never meets a bare recv
    g = dist.new_group(timeout=timedelta(seconds=2))
    _warm_pair(g, rank, peer)
    _warm_group(g)  # both communicators exist: the ops below only fail to pair
    if rank == 0:
        works = _batch([dist.P2POp(dist.isend, torch.ones(2), 1, g)])
    else:
        works = [dist.irecv(torch.zeros(2), 0, g)]
    out["bare_vs_batched"] = _settle(works, 8.0)

    # 16. collectives and P2P on one communicator run in issue order: rank 0 sends then all-reduces,
    #     rank 1 all-reduces then receives (NCCL hangs: each stream waits for the other's first op)
    g = dist.new_group(timeout=timedelta(seconds=2))
    _warm_pair(g, rank, peer)
    _warm_group(g)  # else the first ops already hang in communicator creation (NCCL too)
    x = torch.ones(2)
    if rank == 0:
        works = [dist.isend(torch.ones(2), 1, g), dist.all_reduce(x, group=g, async_op=True)]
    else:
        works = [dist.all_reduce(x, group=g, async_op=True), dist.irecv(torch.zeros(2), 0, g)]
    out["collective_order"] = _settle(works, 8.0)
    # ... in the same order on both ranks they pass
    g = dist.new_group(timeout=timedelta(seconds=10))
    _warm_pair(g, rank, peer)
    y, z = torch.ones(2), torch.full((2,), float(rank))
    if rank == 0:
        works = [dist.isend(z, 1, g), dist.all_reduce(y, group=g, async_op=True)]
    else:
        works = [dist.irecv(z, 0, g), dist.all_reduce(y, group=g, async_op=True)]
    out["collective_in_order"] = (_settle(works, 8.0), y.tolist(), z.tolist())

    out.update(_issue46_scenarios(rank, peer, control))
    return out


class _FakeLagDevice:
    """Stands for :mod:`titan_ext.testing.lagdevice` (installed): records the calls the backend makes."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def installed(self) -> bool:
        return True

    def device_call(self, what: str) -> None:
        self.calls.append(("device_call", what))

    def stream_wait(self, landed, name: str) -> None:
        self.calls.append(("stream_wait", name, landed()))

    def host_block(self, kind: str) -> None:
        self.calls.append(("host_block", kind))


def _timed(fn) -> tuple:
    """(result or the NcclRuleError's message, seconds the call blocked the host)."""
    t0 = time.perf_counter()
    try:
        result = fn()
    except NcclRuleError as exc:
        result = f"raised: {exc}"
    return result, time.perf_counter() - t0


def _issue46_scenarios(rank: int, peer: int, control: ControlPlane) -> dict:
    """The differences from ProcessGroupNCCL the module docstring lists, each where NCCL's behaviour shows."""
    import sys

    from titan_ext.testing import host_syncs

    out = {}
    # 17. lazy communicator creation (no device_id: torch's default, TorchTitan's).  The group's first
    #     collective blocks the host until every rank issued its own (rank 0 comes 0.8 s late); a later
    #     one does not block; the host block is counted as a host sync.  The first bare op of a pair is
    #     a two-rank rendezvous: rank 1's first irecv returns once rank 0 issued its first bare op
    #     (0.8 s late; rank 0's batch on the group before that does not count: another communicator);
    #     rank 1's second irecv returns at once
    g = dist.new_group(timeout=timedelta(seconds=10))
    control.any(False)
    if rank == 0:
        time.sleep(0.8)
    with host_syncs.counting() as syncs:
        first = _timed(lambda: dist.all_reduce(torch.ones(1), group=g, async_op=True))
        second = _timed(lambda: dist.all_reduce(torch.ones(1), group=g, async_op=True))
    out["lazy_group"] = (first[1], second[1], syncs.of_kind("communicator creation"))
    g = dist.new_group(timeout=timedelta(seconds=10))
    _warm_group(g)
    control.any(False)
    if rank == 0:
        batched = _batch([dist.P2POp(dist.isend, torch.full((2,), 7.0), 1, g)])
        time.sleep(0.8)
        sends = [dist.isend(torch.full((2,), 8.0), 1, g), dist.isend(torch.full((2,), 9.0), 1, g)]
        out["lazy_pair"] = (_settle(batched + sends), None, None)
    else:
        got = [torch.zeros(2) for _ in range(3)]
        batched = _batch([dist.P2POp(dist.irecv, got[0], 0, g)])
        with host_syncs.counting() as syncs:
            first = _timed(lambda: dist.irecv(got[1], 0, g))
            second = _timed(lambda: dist.irecv(got[2], 0, g))
        state = _settle(batched + [first[0], second[0]])
        out["lazy_pair"] = (state, (first[1], second[1], syncs.of_kind("communicator creation")),
                            [t[0].item() for t in got])
    #     a rank whose peer never issues a bare op on the pair stays in communicator creation: the op
    #     itself fails after the group's timeout (2 s), here raising (NCCL hangs in ncclCommInitRank)
    g_hang = dist.new_group(timeout=timedelta(seconds=2))
    control.any(False)
    if rank == 0:
        result, seconds = _timed(lambda: dist.isend(torch.ones(1), 1, g_hang))
        out["lazy_hang"] = (result if isinstance(result, str) else "returned", seconds)
    else:
        out["lazy_hang"] = None
    control.any(False)

    # 18. get_future() is completed at enqueue (ProcessGroupNCCL marks it completed right after
    #     launching the kernel); its wait() is a stream wait: returns at once, and a kernel after it
    #     reads the landed data (rank 0 sends 0.5 s later)
    g = dist.new_group()
    _warm_pair(g, rank, peer)
    control.any(False)
    if rank == 0:
        time.sleep(0.5)
        dist.isend(torch.full((4,), 6.0), 1, g).wait()
        out["future"] = None
    else:
        buf = torch.zeros(4)
        work = dist.irecv(buf, 0, g)
        fut = work.get_future()
        done_at_issue, completed_at_issue = fut.done(), work.is_completed()
        t0 = time.perf_counter()
        value = fut.wait()
        wait_s = time.perf_counter() - t0
        total = buf.sum().item()  # a kernel after the future's wait: the data
        out["future"] = dict(done_at_issue=done_at_issue, completed_at_issue=completed_at_issue, wait_s=wait_s,
                             value_is_buffer=value[0] is buf, total=total, landed_s=time.perf_counter() - t0)

    # 19. a send buffer is read when the transfer runs, not at isend: written in place after isend
    #     returned and before the peer's receive (0.5 s later), the send fails naming the op; written
    #     after the send's wait() (the writer's kernel waits for the transfer), it passes
    g_race, g_ok = dist.new_group(), dist.new_group()
    _warm_pair(g_race, rank, peer)
    _warm_pair(g_ok, rank, peer)
    control.any(False)
    if rank == 0:
        raced = torch.ones(4)
        work = dist.isend(raced, 1, g_race)
        raced.add_(1.0)  # a kernel writing the buffer, not ordered after the send
        ordered = torch.ones(4)
        ok = dist.isend(ordered, 1, g_ok)
        ok.wait()
        ordered.add_(1.0)  # ordered after the transfer by wait()
        out["send_race"] = (_settle([work], 8.0), _settle([ok], 8.0))
    else:
        time.sleep(0.5)
        a, b = torch.zeros(4), torch.zeros(4)
        works = [dist.irecv(a, 0, g_race), dist.irecv(b, 0, g_ok)]
        out["send_race"] = (_settle(works[1:], 8.0), b.tolist())
        _settle(works[:1], 8.0)

    # 20. dtypes: NCCL has no int16 and no complex type.  torch views a complex tensor as real for
    #     isend/irecv and all_reduce before the backend (both pass); ProcessGroupNCCL's own allreduce views
    #     it as real for SUM only among these ops (MAX refused); reduce and reduce_scatter pass it
    #     on to the backend, which refuses it.  float8 goes by P2P; no collective here takes it.
    g = dist.new_group()
    _warm_pair(g, rank, peer)
    _warm_group(g)
    control.any(False)
    seen = {}
    c = torch.full((2,), 1.0 + 2.0j * (rank + 1), dtype=torch.complex64)
    c_op = (lambda: dist.isend(c, 1, g)) if rank == 0 else (lambda: dist.irecv(c, 0, g))
    seen["complex_p2p"] = (_timed(lambda: _settle([c_op()]))[0], c.tolist())
    z = torch.full((2,), 1.0 + 1.0j * rank, dtype=torch.complex64)
    dist.all_reduce(z, group=g)
    seen["complex_all_reduce"] = z.tolist()
    f8 = torch.full((4,), float(rank + 1)).to(torch.float8_e4m3fn)
    f8_op = (lambda: dist.isend(f8, 1, g)) if rank == 0 else (lambda: dist.irecv(f8, 0, g))
    seen["float8_p2p"] = (_timed(lambda: _settle([f8_op()]))[0], f8.float().tolist())
    # the refusals, each on a group of its own (a backend that took one and failed later aborts its group)
    i16 = torch.ones(2, dtype=torch.int16)
    g1 = dist.new_group()
    i16_op = (lambda: dist.isend(i16, 1, g1)) if rank == 0 else (lambda: dist.irecv(i16, 0, g1))
    seen["int16_p2p"] = _timed(lambda: _settle([i16_op()]))[0]
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    refused = {
        "int16_allreduce": lambda g: dist.all_reduce(torch.ones(2, dtype=torch.int16), group=g),
        "complex_backend_max": lambda g: g.allreduce([torch.ones(2, dtype=torch.complex64)], opts).wait(),
        "complex_reduce": lambda g: dist.reduce(torch.ones(2, dtype=torch.complex64), 0, group=g),
        "complex_reduce_scatter": lambda g: dist.reduce_scatter(
            torch.zeros(1, dtype=torch.complex64), [torch.ones(1, dtype=torch.complex64)] * 2, group=g),
        "float8_all_reduce": lambda g: dist.all_reduce(torch.ones(2).to(torch.float8_e4m3fn), group=g),
    }
    for key, call in refused.items():
        group = dist.new_group()
        seen[key] = _timed(lambda: call(group))[0]
    out["dtypes"] = seen

    # 21. the lagging simulated device (when a test installed it) sees every Work.wait / is_completed
    #     as a device call of this thread, and a wait() as a wait on its stream
    g = dist.new_group()
    _warm_pair(g, rank, peer)
    fake = _FakeLagDevice()
    before = sys.modules.get("titan_ext.testing.lagdevice")
    sys.modules["titan_ext.testing.lagdevice"] = fake
    try:
        t = torch.ones(2)
        work = dist.isend(t, 1, g) if rank == 0 else dist.irecv(t, 0, g)
        work.wait()
        _settle([work])
        work.get_future().wait()
    finally:
        if before is None:
            del sys.modules["titan_ext.testing.lagdevice"]
        else:
            sys.modules["titan_ext.testing.lagdevice"] = before
    out["lagdevice"] = fake.calls
    return out


#: stands for any titan_ext module (the rules look at the calling module's name): what titan_ext code
#: would write to make a host tensor on purpose, a stage-device tensor, and one on a helper thread
_TITAN_EXT_CODE = """
import threading
import torch

def host_named(n):
    return torch.zeros(n, device="cpu")

def stage_device(n, like):
    return torch.zeros(n, device=like.device)

def on_helper_thread(n):
    made = []
    t = threading.Thread(target=lambda: made.append(torch.ones(n)), name="titan_ext-helper")
    t.start()
    t.join()
    return made[0]
"""


def _titan_ext_probe() -> dict:
    scope = {"__name__": "titan_ext.runtime._probe"}
    exec(compile(_TITAN_EXT_CODE, "titan_ext/runtime/_probe.py", "exec"), scope)
    return scope


def _try(fn) -> str:
    try:
        fn()
        return "accepted"
    except NcclRuleError as exc:
        return str(exc)


def _placement_scenarios(peer: int) -> dict:
    code, out = _titan_ext_probe(), {}
    model = torch.nn.Linear(4, 4).weight  # the stage's device
    # 11. a tensor titan_ext placed on the host by name (device="cpu") is refused on a data group; one
    #     placed on the stage's device (a torch.device value: t.device) passes
    host, dev = code["host_named"](4), code["stage_device"](4, model)
    out["named"] = (bool(is_host_made(host)), is_host_made(dev))
    out["named_send"] = _try(lambda: dist.isend(host, peer, dist.new_group()))
    # 12. made on a helper thread (a factory without device=: the host on every thread)
    helper = code["on_helper_thread"](4)
    out["thread_site"] = is_host_made(helper)
    out["thread_send"] = _try(lambda: dist.isend(helper, peer, dist.new_group()))
    # 13. a collective's output buffers are checked too: NCCL writes the result into device memory
    outputs = [code["host_named"](2) for _ in range(2)]
    out["gather_out"] = _try(lambda: dist.all_gather(outputs, torch.ones(2), group=dist.new_group()))
    g = dist.new_group()
    dev_outputs = [torch.zeros(2) for _ in range(2)]
    dist.all_gather(dev_outputs, torch.full((2,), 1.0 + (1 - peer)), group=g)
    out["gather_dev"] = [t.tolist() for t in dev_outputs]

    return out


@pytest.fixture(scope="module")
def seen() -> list[dict]:
    return run_ranks(_scenarios, 2, backend="nccl_rules",
                     env={"TITAN_EXT_NCCL_RULES_TIMEOUT_S": "15", "TITAN_EXT_NCCL_RULES_WATCHDOG": "raise"})


@pytest.mark.multiprocess
def test_tags_are_ignored_and_a_whole_batch_matches(seen):
    assert seen[0]["batch"] == ("ok", [11.0] * 3)
    assert seen[1]["batch"] == ("ok", [10.0] * 3)
    # gloo would match by tag and put 2.0 first; NCCL runs the pair's FIFO in issue order
    assert seen[1]["fifo"] == ("ok", [1.0, 2.0])


@pytest.mark.multiprocess
def test_split_batch_deadlocks_and_both_sequences_are_reported(seen):
    for rank, other in ((0, 1), (1, 0)):
        msg = seen[rank]["split"]
        assert "deadlock" in msg, msg
        assert f"rank {rank} issued to {other}: ->#0{{send#0(4 float32)}} #1{{recv#0(4 float32)}}" in msg, msg
        assert f"rank {other} issued to {rank}: ->#0{{send#0(4 float32)}} #1{{recv#0(4 float32)}}" in msg, msg


@pytest.mark.multiprocess
def test_reordered_batch_is_a_size_mismatch(seen):
    for rank in (0, 1):
        assert "size/dtype mismatch" in seen[rank]["reordered"], seen[rank]["reordered"]


@pytest.mark.multiprocess
def test_wait_returns_before_the_data_lands_and_completion_is_truthful(seen):
    late = seen[1]["late"]
    assert late["wait_ms"] < 200 and not late["completed_after_wait"], late
    assert late["stale"] == [0.0] * 8, late  # read without waiting: stale
    assert late["total"] == 24.0 and late["landed_ms"] >= 300, late  # kernels after wait(): the data
    assert late["future"] and late["completed"]


@pytest.mark.multiprocess
def test_a_wait_with_a_timeout_blocks_the_host_and_its_expiry_aborts_the_group(seen):
    """ProcessGroupNCCL's ``wait(timeout)`` busy-waits the host until the op completes; when the timeout
    expires it raises and aborts the communicator (the old backend returned at once and never raised)."""
    late = seen[1]["late"]
    assert late["timed"] is True and late["timed_completed"], late
    assert late["timed_ms"] >= 200, late  # rank 0 sends 0.8 s after its first send
    expired, expired_ms, after = seen[1]["expired"]
    assert "timed out" in expired and 250 <= expired_ms < 5000, seen[1]["expired"]
    assert "timed out" in after, after  # every later op on the aborted group raises


@pytest.mark.multiprocess
def test_an_op_unmatched_past_the_group_timeout_is_the_watchdog(seen):
    """Created with a 2 s timeout, or moved to 2 s by ``_set_pg_timeout``: the watchdog fires after the
    group's timeout (the old backend waited $TITAN_EXT_NCCL_RULES_TIMEOUT_S whatever the group said)."""
    for rank in (0, 1):
        msg, seconds = seen[rank]["watchdog"]
        assert "watchdog" in msg and "timeout 2 s" in msg, msg
        assert 1.5 <= seconds < 7, seconds


@pytest.mark.multiprocess
def test_a_works_timeout_is_fixed_when_it_is_issued(seen):
    """ProcessGroupNCCL sets ``opTimeout_`` as it creates a work; ``_set_pg_timeout`` moves the group's
    timeout for later works only.  The old backend applied the group's current timeout to works in flight:
    the 2 s work moved to 30 s after issue fired after min(30, 15) s (still pending at 8 s), and the 15 s
    work whose group moved to 1 s fired after 1 s."""
    for rank in (0, 1):
        msg, seconds = seen[rank]["moved_after_issue"]
        assert "watchdog" in msg and "timeout 2 s" in msg, msg
        assert 1.5 <= seconds < 7, seconds
        completed, seconds = seen[rank]["lowered_after_issue"]
        assert completed is False and seconds >= 2.0, seen[rank]["lowered_after_issue"]


@pytest.mark.multiprocess
def test_a_failed_work_is_completed_with_its_error(seen):
    """``WorkNCCL::isCompleted`` returns ``exception() || finishedGPUExecutionInternal()``: a failed work
    is completed (not successful, its error in ``exception()``, raised by ``wait()``); the old backend
    raised from ``is_completed()``."""
    for rank in (0, 1):
        assert seen[rank]["completed_on_error"] == (True, False, "NcclRuleError", "raised"), \
            seen[rank]["completed_on_error"]


@pytest.mark.multiprocess
def test_lazy_init_creates_communicators_at_the_first_op_with_a_host_rendezvous(seen):
    """Under lazy init (no ``device_id``) a group's first collective waits on the host for every rank
    (rank 0 came 1 s late), a pair's first bare op for the other side (0.8 s late; a batch on the group
    is another communicator), each counted as a host sync; later ops do not wait; a peer that never
    comes makes the op fail after the group's timeout (NCCL hangs).  The old backend created nothing."""
    first_s, second_s, counted = seen[1]["lazy_group"]
    assert first_s >= 0.5 and second_s < first_s / 2, seen[1]["lazy_group"]
    assert counted == 1 and seen[0]["lazy_group"][2] == 1, (seen[0]["lazy_group"], seen[1]["lazy_group"])
    state, (first_s, second_s, counted), values = seen[1]["lazy_pair"]
    assert state == "ok" and values == [7.0, 8.0, 9.0], seen[1]["lazy_pair"]
    assert first_s >= 0.4 and second_s < first_s / 2 and counted == 1, seen[1]["lazy_pair"]
    assert seen[0]["lazy_pair"][0] == "ok", seen[0]["lazy_pair"]
    msg, seconds = seen[0]["lazy_hang"]
    assert msg.startswith("raised:") and "communicator creation" in msg and "rank(s) [1]" in msg, msg
    assert 1.5 <= seconds < 10, seconds


@pytest.mark.multiprocess
def test_get_future_is_completed_at_enqueue_and_its_wait_orders_the_stream(seen):
    """ProcessGroupNCCL marks a work's future completed right after launching the kernel
    (``work->future_->markCompleted(...)`` in ``pointToPoint`` / ``collective``), a CUDA future whose
    ``wait()`` makes the current stream wait.  The old backend completed it when the data landed."""
    f = seen[1]["future"]
    assert f["done_at_issue"] is True and f["completed_at_issue"] is False, f
    assert f["wait_s"] < 0.3 and f["value_is_buffer"], f
    assert f["total"] == 24.0 and f["landed_s"] >= 0.25, f  # a kernel after the wait reads the data


@pytest.mark.multiprocess
def test_a_send_buffer_written_before_its_transfer_is_reported(seen):
    """NCCL reads a send buffer when the kernel runs; a write after ``isend`` returned and before the
    transfer is a race.  The old backend sent the bytes at issue and passed it."""
    raced, ordered = seen[0]["send_race"]
    assert "send buffer written before the transfer" in raced and "send#1(4 float32)" in raced, raced
    assert "version 0 -> 1" in raced, raced
    assert ordered == "ok", ordered
    assert seen[1]["send_race"] == ("ok", [1.0] * 4), seen[1]["send_race"]


@pytest.mark.multiprocess
def test_dtypes_are_nccls_int16_and_complex_refused_where_nccl_refuses_them(seen):
    """``getNcclDataType`` has no int16 and no complex type; torch views a complex tensor as real for
    P2P and ``all_reduce`` before the backend, ``ProcessGroupNCCL::allreduce`` for SUM/AVG/PREMUL_SUM only;
    ``reduce`` and ``reduce_scatter`` pass it on and fail.  The old backend took int16 P2P and
    handed every complex collective to gloo; it refused float8 P2P."""
    for rank in (0, 1):
        d = seen[rank]["dtypes"]
        for key in ("int16_p2p", "int16_allreduce"):
            assert d[key].startswith("raised:") and "not supported for NCCL" in d[key] and "int16" in d[key], d
        assert d["complex_p2p"] == ("ok", [1 + 2j, 1 + 2j]), d
        assert d["complex_all_reduce"] == [2 + 1j, 2 + 1j], d
        assert d["complex_backend_max"].startswith("raised:") and "complex" in d["complex_backend_max"], d
        for key in ("complex_reduce", "complex_reduce_scatter"):
            assert d[key].startswith("raised:") and "complex64" in d[key], d
        assert d["float8_p2p"] == ("ok", [1.0] * 4), d
        assert d["float8_all_reduce"].startswith("raised:") and "Float8" in d["float8_all_reduce"], d


@pytest.mark.multiprocess
def test_work_calls_reach_the_lagging_device(seen):
    """With the lagging simulated device installed, ``Work.wait`` / ``is_completed`` / the future's wait
    are device calls of the calling thread, and a ``wait()`` enqueues a wait on its stream."""
    for rank, name in ((0, "send to 1"), (1, "recv from 0")):
        calls = seen[rank]["lagdevice"]
        kinds = {c[:2] for c in calls}
        assert {("device_call", "Work.wait"), ("device_call", "Work.is_completed"),
                ("device_call", "Future.wait"), ("stream_wait", name)} <= kinds, calls


@pytest.mark.multiprocess
def test_a_batched_op_never_pairs_with_a_bare_one(seen):
    for rank in (0, 1):
        msg = seen[rank]["bare_vs_batched"]
        assert "watchdog" in msg, msg
    assert "rank 0 batched to 1: ->#0{send#0(2 float32)}" in seen[0]["bare_vs_batched"]
    assert "rank 1 issued to 0: #0{recv#0(1 float32)} ->#1{recv#1(2 float32)}" in seen[1]["bare_vs_batched"]


@pytest.mark.multiprocess
def test_collectives_and_p2p_on_one_group_run_in_issue_order(seen):
    for rank in (0, 1):
        assert "watchdog" in seen[rank]["collective_order"], seen[rank]["collective_order"]
        assert seen[rank]["collective_in_order"] == ("ok", [2.0, 2.0], [0.0, 0.0]), seen[rank]["collective_in_order"]


@pytest.mark.multiprocess
def test_an_op_from_a_second_thread_on_a_pair_fails(seen):
    assert len(seen[0]["thread"]) == 1 and "not-the-main-thread" in seen[0]["thread"][0]
    assert seen[1]["thread"] == "ok"


@pytest.mark.multiprocess
def test_host_tensors_made_by_titan_ext_are_refused_on_data_groups_only(seen):
    for rank in (0, 1):
        msg = seen[rank]["host_on_data"]
        assert "host-side tensor made by titan_ext (titan_ext.runtime.measure.profiler" in msg, msg
        offset, rtt = seen[rank]["host_on_control"]
        assert rank == 0 or rtt >= 0  # ran on the control group
        assert seen[rank]["marks"] == (None, True, True)
        assert "host-side tensor" in seen[rank]["host_allreduce"]
        assert seen[rank]["model_allreduce"] == "ok"
        assert seen[rank]["s2_marks"] == (True, None, True)
        assert seen[rank]["s2_moved_allreduce"] == [1.0, 1.0]  # rank 0's chunk + rank 1's
        assert seen[rank]["like_allreduce"] == ([[1.5, 1.5]], [0.0]), seen[rank]["like_allreduce"]  # 0.5·1 + 0.5·2
        assert seen[rank]["big_batch"] == ("ok", [100.0 * (1 - rank) + i for i in (0, 50, 100)]), seen[rank]["big_batch"]


@pytest.mark.multiprocess
def test_host_tensors_are_recognised_by_placement_on_any_thread_and_as_collective_outputs(seen):
    """On an earlier backend a titan_ext tensor made with ``device="cpu"``, one made on a helper
    thread, and host output buffers of a collective all passed unchecked."""
    for rank in (0, 1):
        p = seen[rank]["placement"]
        assert p["named"] == (True, None), p
        assert "host-side tensor" in p["named_send"] and "titan_ext.runtime._probe: zeros()" in p["named_send"], p
        assert p["thread_site"] and "thread 'titan_ext-helper'" in p["thread_site"], p
        assert "host-side tensor" in p["thread_send"], p
        assert "host-side tensor" in p["gather_out"] and "allgather" in p["gather_out"], p
        assert p["gather_dev"] == [[1.0, 1.0], [2.0, 2.0]], p


def _control_with_uneven_group_counts(rank: int) -> list[int]:
    watchdog = threading.Timer(30.0, lambda: os._exit(7))  # a hang at construction fails the run
    watchdog.start()
    if rank == 0:
        new_control_group([0])  # a group only rank 0 holds, made by rank 0 alone
    planes = [ControlPlane(), ControlPlane()]  # two schedules: two control groups, same on both
    dist.new_group()  # a default-named group after them (torch 2.15 names it from a per-rank count)
    watchdog.cancel()
    return [plane.gather_ints(10 * rank + i)[1 - rank] for i, plane in enumerate(planes)]


@pytest.mark.multiprocess
def test_control_group_forms_when_pp_ranks_hold_different_numbers_of_groups(seen):
    """On a01ec7e rank 0's control group got another name (torch <= 2.14 hashes len(_world.pg_names)
    into it) and both ranks waited at construction until the watchdog ended the run.  Under torch
    2.15's own naming, rank 0's control group would advance ``_world.group_count`` on rank 0 only, and
    the control groups and the default-named group after them would wait the same way."""
    assert [seen[0]["control"], seen[1]["control"]] == [[10, 11], [0, 1]]


def _exit_worker(rank: int, port: int, late_s: float) -> None:
    """A rank that uses the backend, destroys its groups ``late_s`` after its peer (rank 1), and leaves
    through the interpreter's normal exit (finalisation included; ``run_ranks`` skips it)."""
    from titan_ext.testing.nccl_rules import install

    install()
    dist.init_process_group("nccl_rules", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    t = torch.ones(4)
    dist.send(t, 1) if rank == 0 else dist.recv(t, 0)
    dist.barrier()
    if rank == 1:
        time.sleep(late_s)
    dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.parametrize("late_s", [0.0, pytest.param(3.0, marks=pytest.mark.slow)])
def test_ranks_exit_cleanly_when_peers_destroy_their_groups_at_different_times(late_s):
    """A clean run exits 0 on every rank, also when a peer destroys its groups later than the 2 s a
    shutdown waits for it (a busy host): the TorchTitan trainer's ranks aborted at exit (SIGABRT from
    the inner gloo group's destructor, and threads of this backend taken down inside C++ frames)."""
    import torch.multiprocessing as mp

    from titan_ext.testing import free_port

    ctx, port = mp.get_context("spawn"), free_port()
    procs = [ctx.Process(target=_exit_worker, args=(r, port, late_s)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(100)
    assert [p.exitcode for p in procs] == [0, 0]


def _three_rank_scenarios(rank: int, world: int) -> dict:
    """One NCCL stream per rank: its groups complete in issue order across *all* peers."""
    out = {}
    control = ControlPlane()
    # a batch that spans peers is one group: rank 0's send to 1 completes only once rank 2 (which
    # posts its receive 0.6 s late) runs its part too
    g = dist.new_group(timeout=timedelta(seconds=10))
    _warm_group(g)  # the group's communicator exists: rank 0's batch below is no rendezvous
    if rank == 0:
        works = _batch([dist.P2POp(dist.isend, torch.ones(2), 1, g), dist.P2POp(dist.isend, torch.ones(2), 2, g)])
        time.sleep(0.3)
        early = works[0].is_completed()
        out["spanning"] = (early, _settle(works))
    else:
        if rank == 2:
            time.sleep(0.6)
        out["spanning"] = (None, _settle(_batch([dist.P2POp(dist.irecv, torch.zeros(2), 0, g)])))
    control.any(False)
    # a cycle across pairs, each pair in order: 0 sends to 1 then to 2; 1 receives from 2 then from 0;
    # 2 receives from 0 then sends to 1 (rank 0's send to 2 waits behind its send to 1, which waits behind
    # rank 1's receive from 2, which waits behind rank 2's receive from 0): NCCL hangs
    g = dist.new_group(timeout=timedelta(seconds=2))
    for lo, hi in ((0, 1), (0, 2), (1, 2)):  # each pair's communicator, in an order that cannot wait in a circle
        if rank in (lo, hi):
            _warm_pair(g, rank, hi if rank == lo else lo, meet=False)
    a, b = torch.zeros(2), torch.zeros(2)
    if rank == 0:
        works = [dist.isend(torch.ones(2), 1, g), dist.isend(torch.ones(2), 2, g)]
    elif rank == 1:
        works = [dist.irecv(a, 2, g), dist.irecv(b, 0, g)]
    else:
        works = [dist.irecv(a, 0, g), dist.isend(torch.ones(2), 1, g)]
    out["cycle"] = _settle(works, 8.0)
    return out


@pytest.mark.multiprocess
def test_one_stream_per_rank_orders_groups_across_peers():
    """A batch spanning two peers completes as one, and a cross-pair cycle (each pair in issue order)
    is NCCL's hang, reported by the group's watchdog (the old per-pair model passed both)."""
    seen = run_ranks(_three_rank_scenarios, 3, backend="nccl_rules",
                     env={"TITAN_EXT_NCCL_RULES_WATCHDOG": "raise"}, timeout_s=100)
    assert seen[0]["spanning"] == (False, "ok"), seen[0]["spanning"]
    assert seen[1]["spanning"] == (None, "ok") and seen[2]["spanning"] == (None, "ok")
    for rank in range(3):
        assert "watchdog" in seen[rank]["cycle"], seen[rank]["cycle"]


def _eager_scenarios(rank: int, world: int) -> dict:
    """Eager init (``init_process_group(device_id=...)``): every communicator of a group exists from its
    creation, and a bare P2P op runs on the group's (torch >= 2.5: "In eager initialization mode,
    unbatched P2P ops are treated as independent collective ops")."""
    from titan_ext.testing import host_syncs

    out, control = {}, ControlPlane()
    g = dist.new_group(timeout=timedelta(seconds=3))
    control.any(False)
    if rank == 0:
        time.sleep(0.8)
    with host_syncs.counting() as syncs:
        t = torch.full((2,), float(rank))
        first = _timed(lambda: dist.isend(t, 1, g) if rank == 0 else dist.irecv(t, 0, g))
        reduced = torch.ones(1)
        collective = _timed(lambda: dist.all_reduce(reduced, group=g, async_op=True))
    out["no_rendezvous"] = (first[1], collective[1], syncs.of_kind("communicator creation"),
                            _settle([first[0], collective[0]], 8.0), t.tolist(), reduced.tolist())
    # a bare send meets a batched receive: one communicator
    got = torch.zeros(2)
    works = [dist.isend(torch.full((2,), 5.0), 1, g)] if rank == 0 else _batch([dist.P2POp(dist.irecv, got, 0, g)])
    out["bare_meets_batched"] = (_settle(works, 8.0), got.tolist())
    return out


@pytest.mark.multiprocess
def test_eager_init_has_every_communicator_from_creation_and_bare_ops_on_the_groups():
    """With ``$TITAN_EXT_NCCL_RULES_INIT=eager`` (what ``device_id`` does; a CPU test cannot pass one) no op
    waits for a communicator (rank 1's first irecv returns before rank 0's send 0.8 s later) and a bare
    send pairs with a batched receive (the old backend had no such mode: they never paired)."""
    seen = run_ranks(_eager_scenarios, 2, backend="nccl_rules", timeout_s=100,
                     env={"TITAN_EXT_NCCL_RULES_INIT": "eager", "TITAN_EXT_NCCL_RULES_WATCHDOG": "raise"})
    first_s, collective_s, counted, state, t, reduced = seen[1]["no_rendezvous"]
    assert first_s < 0.4 and counted == 0 and state == "ok", seen[1]["no_rendezvous"]
    assert t == [0.0, 0.0] and reduced == [2.0], seen[1]["no_rendezvous"]
    for rank in (0, 1):
        assert seen[rank]["bare_meets_batched"][0] == "ok", seen[rank]["bare_meets_batched"]
    assert seen[1]["bare_meets_batched"][1] == [5.0, 5.0]


def _functional_reads(rank: int, world: int) -> list[float]:
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    out = []
    for _ in range(10):
        out.append(float(funcol.all_reduce(torch.full((1,), float(rank + 1)), "avg", mesh)))
        t = torch.full((1,), float(rank + 1))
        dist.all_reduce(t)
        out.append(float(t))
    return out


@pytest.mark.multiprocess
def test_a_host_read_of_a_collective_result_sees_the_reduced_value():
    """A collective's result read on the host (TorchTitan's loss: ``dist_mean`` through functional
    collectives) is the reduced value, as a GPU's host read waits for the stream; the stream-wait model
    had let ``float(funcol.all_reduce(...))`` read the rank's own input (the DP × PP job's logged loss
    came out 2× or ½× the reference's)."""
    for got in run_ranks(_functional_reads, 2, backend="nccl_rules", timeout_s=120):
        assert got == [1.5, 3.0] * 10, got
