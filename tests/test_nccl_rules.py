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

from titan_ext.runtime.control import ControlPlane, new_control_group
from titan_ext.testing.nccl_rules import NcclRuleError, is_host_made, mark_host
from titan_ext.runtime.profiler import estimate_clock_offsets
from titan_ext.testing import run_ranks

pytestmark = pytest.mark.timeout(120)


def _settle(works: list, limit_s: float = 20.0) -> str:
    """Poll the works like the device layer does: 'ok', or the NcclRuleError message."""
    deadline = time.monotonic() + limit_s
    try:
        while not all(w.is_completed() for w in works):
            if time.monotonic() > deadline:
                return "still pending"
            time.sleep(0.005)
    except NcclRuleError as exc:
        return str(exc)
    return "ok"


def _batch(ops: list) -> list:
    return dist.batch_isend_irecv(ops)


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
        try:  # rank 0 never sends on g_expire
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

    # 11.-13. host tensors by placement, on any thread, among collective outputs (issue 34)
    out["placement"] = _placement_scenarios(peer)

    # 14. the group timeout is NCCL's watchdog: an op unmatched past it aborts the group (here, with
    #     $TITAN_EXT_NCCL_RULES_WATCHDOG=raise, the works raise; by default the process ends), whether the
    #     timeout came with the group or from _set_pg_timeout (what timeouts.set_timeout calls)
    g_made = dist.new_group(timeout=timedelta(seconds=2))
    g_set = dist.new_group()
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=2), g_set)
    control.any(False)
    t0 = time.monotonic()
    lonely = dist.isend(torch.ones(1), peer, g_made if rank == 0 else g_set)  # the peer never receives it
    out["watchdog"] = (_settle([lonely], 8.0), time.monotonic() - t0)

    # 15. bare and batched ops travel on different communicators: a batched send never meets a bare recv
    g = dist.new_group(timeout=timedelta(seconds=2))
    if rank == 0:
        works = _batch([dist.P2POp(dist.isend, torch.ones(2), 1, g)])
    else:
        works = [dist.irecv(torch.zeros(2), 0, g)]
    out["bare_vs_batched"] = _settle(works, 8.0)

    # 16. collectives and P2P on one communicator run in issue order: rank 0 sends then all-reduces,
    #     rank 1 all-reduces then receives (NCCL hangs: each stream waits for the other's first op)
    g = dist.new_group(timeout=timedelta(seconds=2))
    x = torch.ones(2)
    if rank == 0:
        works = [dist.isend(torch.ones(2), 1, g), dist.all_reduce(x, group=g, async_op=True)]
    else:
        works = [dist.all_reduce(x, group=g, async_op=True), dist.irecv(torch.zeros(2), 0, g)]
    out["collective_order"] = _settle(works, 8.0)
    # ... in the same order on both ranks they pass
    g = dist.new_group(timeout=timedelta(seconds=10))
    y, z = torch.ones(2), torch.full((2,), float(rank))
    if rank == 0:
        works = [dist.isend(z, 1, g), dist.all_reduce(y, group=g, async_op=True)]
    else:
        works = [dist.irecv(z, 0, g), dist.all_reduce(y, group=g, async_op=True)]
    out["collective_in_order"] = (_settle(works, 8.0), y.tolist(), z.tolist())
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


def test_tags_are_ignored_and_a_whole_batch_matches(seen):
    assert seen[0]["batch"] == ("ok", [11.0] * 3)
    assert seen[1]["batch"] == ("ok", [10.0] * 3)
    # gloo would match by tag and put 2.0 first; NCCL runs the pair's FIFO in issue order
    assert seen[1]["fifo"] == ("ok", [1.0, 2.0])


def test_split_batch_deadlocks_and_both_sequences_are_reported(seen):
    for rank, other in ((0, 1), (1, 0)):
        msg = seen[rank]["split"]
        assert "deadlock" in msg, msg
        assert f"rank {rank} issued to {other}: ->#0{{send#0(4 float32)}} #1{{recv#0(4 float32)}}" in msg, msg
        assert f"rank {other} issued to {rank}: ->#0{{send#0(4 float32)}} #1{{recv#0(4 float32)}}" in msg, msg


def test_reordered_batch_is_a_size_mismatch(seen):
    for rank in (0, 1):
        assert "size/dtype mismatch" in seen[rank]["reordered"], seen[rank]["reordered"]


def test_wait_returns_before_the_data_lands_and_completion_is_truthful(seen):
    late = seen[1]["late"]
    assert late["wait_ms"] < 200 and not late["completed_after_wait"], late
    assert late["stale"] == [0.0] * 8, late  # read without waiting: stale
    assert late["total"] == 24.0 and late["landed_ms"] >= 300, late  # kernels after wait(): the data
    assert late["future"] and late["completed"]


def test_a_wait_with_a_timeout_blocks_the_host_and_its_expiry_aborts_the_group(seen):
    """ProcessGroupNCCL's ``wait(timeout)`` busy-waits the host until the op completes; when the timeout
    expires it raises and aborts the communicator (the old backend returned at once and never raised)."""
    late = seen[1]["late"]
    assert late["timed"] is True and late["timed_completed"], late
    assert late["timed_ms"] >= 200, late  # rank 0 sends 0.8 s after its first send
    expired, expired_ms, after = seen[1]["expired"]
    assert "timed out" in expired and 250 <= expired_ms < 5000, seen[1]["expired"]
    assert "timed out" in after, after  # every later op on the aborted group raises


def test_an_op_unmatched_past_the_group_timeout_is_the_watchdog(seen):
    """Created with a 2 s timeout, or moved to 2 s by ``_set_pg_timeout``: the watchdog fires after the
    group's timeout (the old backend waited $TITAN_EXT_NCCL_RULES_TIMEOUT_S whatever the group said)."""
    for rank in (0, 1):
        msg, seconds = seen[rank]["watchdog"]
        assert "watchdog" in msg and "timeout 2 s" in msg, msg
        assert 1.5 <= seconds < 7, seconds


def test_a_batched_op_never_pairs_with_a_bare_one(seen):
    for rank in (0, 1):
        msg = seen[rank]["bare_vs_batched"]
        assert "watchdog" in msg, msg
    assert "rank 0 batched to 1: ->#0{send#0(2 float32)}" in seen[0]["bare_vs_batched"]
    assert "rank 1 issued to 0: ->#0{recv#0(2 float32)}" in seen[1]["bare_vs_batched"]


def test_collectives_and_p2p_on_one_group_run_in_issue_order(seen):
    for rank in (0, 1):
        assert "watchdog" in seen[rank]["collective_order"], seen[rank]["collective_order"]
        assert seen[rank]["collective_in_order"] == ("ok", [2.0, 2.0], [0.0, 0.0]), seen[rank]["collective_in_order"]


def test_an_op_from_a_second_thread_on_a_pair_fails(seen):
    assert len(seen[0]["thread"]) == 1 and "not-the-main-thread" in seen[0]["thread"][0]
    assert seen[1]["thread"] == "ok"


def test_host_tensors_made_by_titan_ext_are_refused_on_data_groups_only(seen):
    for rank in (0, 1):
        msg = seen[rank]["host_on_data"]
        assert "host-side tensor made by titan_ext (titan_ext.runtime.profiler" in msg, msg
        offset, rtt = seen[rank]["host_on_control"]
        assert rank == 0 or rtt >= 0  # ran on the control group
        assert seen[rank]["marks"] == (None, True, True)
        assert "host-side tensor" in seen[rank]["host_allreduce"]
        assert seen[rank]["model_allreduce"] == "ok"
        assert seen[rank]["s2_marks"] == (True, None, True)
        assert seen[rank]["s2_moved_allreduce"] == [1.0, 1.0]  # rank 0's chunk + rank 1's
        assert seen[rank]["like_allreduce"] == ([[1.5, 1.5]], [0.0]), seen[rank]["like_allreduce"]  # 0.5·1 + 0.5·2
        assert seen[rank]["big_batch"] == ("ok", [100.0 * (1 - rank) + i for i in (0, 50, 100)]), seen[rank]["big_batch"]


def test_host_tensors_are_recognised_by_placement_on_any_thread_and_as_collective_outputs(seen):
    """Issue 34: on the old backend a titan_ext tensor made with ``device="cpu"``, one made on a helper
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
    a, b = torch.zeros(2), torch.zeros(2)
    if rank == 0:
        works = [dist.isend(torch.ones(2), 1, g), dist.isend(torch.ones(2), 2, g)]
    elif rank == 1:
        works = [dist.irecv(a, 2, g), dist.irecv(b, 0, g)]
    else:
        works = [dist.irecv(a, 0, g), dist.isend(torch.ones(2), 1, g)]
    out["cycle"] = _settle(works, 8.0)
    return out


def test_one_stream_per_rank_orders_groups_across_peers():
    """A batch spanning two peers completes as one, and a cross-pair cycle (each pair in issue order)
    is NCCL's hang, reported by the group's watchdog (the old per-pair model passed both)."""
    seen = run_ranks(_three_rank_scenarios, 3, backend="nccl_rules",
                     env={"TITAN_EXT_NCCL_RULES_WATCHDOG": "raise"}, timeout_s=100)
    assert seen[0]["spanning"] == (False, "ok"), seen[0]["spanning"]
    assert seen[1]["spanning"] == (None, "ok") and seen[2]["spanning"] == (None, "ok")
    for rank in range(3):
        assert "watchdog" in seen[rank]["cycle"], seen[rank]["cycle"]


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


def test_a_host_read_of_a_collective_result_sees_the_reduced_value():
    """A collective's result read on the host (TorchTitan's loss: ``dist_mean`` through functional
    collectives) is the reduced value, as a GPU's host read waits for the stream; the stream-wait model
    had let ``float(funcol.all_reduce(...))`` read the rank's own input (the DP × PP job's logged loss
    came out 2× or ½× the reference's)."""
    for got in run_ranks(_functional_reads, 2, backend="nccl_rules", timeout_s=120):
        assert got == [1.5, 3.0] * 10, got
