"""The control plane: every profile exchange, plan-hash agreement, vote and clock
ping-pong goes over the schedule's own gloo group, never as CPU tensors on the PP data group.

Proof: the data group is made to refuse every collective and blocking send/recv that titan_ext code
issues on it (as NCCL refuses the CPU tensors those calls carry).  The transport's batched P2P
(``batch_isend_irecv`` → ``isend``/``irecv``; device tensors under NCCL) passes, and so does torch's
own stage set-up (shape inference and warm-up votes of ``PipelineStage``: device tensors under NCCL,
CPU ones only in this CPU test).  PipeMorph and CrossPipe must still train exactly like torch's ScheduleGPipe,
re-plan every check, agree on every plan and accept a user-pushed plan.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn.functional as Fn
from torch.distributed.pipelining import PipelineStage

from titan_ext.plan.builtin import builtin_plan
from titan_ext.runtime import CrossPipe, Decision, PipeMorph
from titan_ext.runtime.comm.control_plane import ControlPlane
from titan_ext.testing import gpipe_reference, mlp_stages, run_ranks, seeded_batch, step_rank

# In the default tier: the core runtime contract (GPipe equivalence, agreement, control plane), ~1 min.
pytestmark = pytest.mark.timeout(300)

DIM, BATCH, N_MB, STEPS = 8, 16, 8, 6

#: collectives and blocking point-to-point calls the data group refuses (module-level names, so that
#: torch's own helpers such as all_gather_object, which call them as globals, are caught too)
REFUSED = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "reduce", "gather", "scatter",
           "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv", "barrier")
#: point-to-point calls counted when they name another group (the control plane's exchange); on the
#: data group they are the pipeline's own traffic
COUNTED = ("isend", "irecv")


_TITAN_EXT = os.path.dirname(os.path.dirname(os.path.abspath(__import__("titan_ext").__file__))) + os.sep \
    + "titan_ext" + os.sep


class DataGroupRefusal(RuntimeError):
    pass


def _called_from_titan_ext() -> bool:
    """Whether the nearest caller outside torch's c10d module (e.g. behind all_gather_object) is
    titan_ext code. The NCCL-rules test backend's function mode (testing/nccl_rules.py) and torch's
    dispatch to it (overrides, the c10d logger) sit between a caller and c10d: they are not callers."""
    import torch.distributed.c10d_logger as c10d_logger
    import torch.overrides

    from titan_ext.testing import nccl_rules

    between = (c10d.__file__, __file__, nccl_rules.__file__, torch.overrides.__file__, c10d_logger.__file__)
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename in between:
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(_TITAN_EXT)


@contextlib.contextmanager
def data_group_refuses_cpu_collectives(calls: dict, direct: tuple = (False,)):
    """While active, the default (data) group raises on the REFUSED calls that come from titan_ext code
    (or from the test body itself); calls on any other group are counted in ``calls[name]``."""
    saved = {name: getattr(c10d, name) for name in REFUSED + COUNTED}

    def wrap(name, fn):
        def guarded(*args, **kwargs):
            group = kwargs.get("group", args[2] if name in COUNTED and len(args) > 2 else None)
            on_data_group = group is None or group == dist.group.WORLD
            if name in COUNTED:  # the data plane's own p2p (executor) is allowed: count the others only
                if not on_data_group:
                    calls[name] = calls.get(name, 0) + 1
                return fn(*args, **kwargs)
            if on_data_group and (_called_from_titan_ext() or direct[0]):
                raise DataGroupRefusal(f"{name} from titan_ext on the PP data group")
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return guarded

    try:
        for name, fn in saved.items():
            setattr(c10d, name, wrap(name, fn))
            setattr(dist, name, getattr(c10d, name))
        yield
    finally:
        for name, fn in saved.items():
            setattr(c10d, name, fn)
            setattr(dist, name, fn)


def _batch(step):
    return seeded_batch(2000 + step, BATCH, DIM)


def _step(sched, rank, world, k):
    x, y = _batch(k)
    losses: list = []
    step_rank(sched, rank, world, x, y, losses)
    return [float(v) for v in losses]


class ReplanEveryCheck:
    """A different warm-up vector at every check (1F1B's counts, then Alg.1's, in turn)."""

    window = 1
    forces = True

    def __init__(self):
        self.k = 0

    def decide(self, estimate, deployed_counts, initial_counts, since, slack_floor=2):
        self.k += 1
        S = len(initial_counts)
        counts = [S - i for i in range(S)] if self.k % 2 else list(initial_counts)
        return Decision("force", "re-plan", warmup_counts=counts)


def _worker(rank, world):
    ref_losses, ref_params = gpipe_reference(rank, world, N_MB, STEPS, lambda s, k: _step(s, rank, world, k), DIM)
    out = {"ref_losses": ref_losses}
    with data_group_refuses_cpu_collectives({}, direct=(True,)):  # the guard is real: the test could fail
        try:
            dist.all_gather([torch.zeros(1) for _ in range(world)], torch.zeros(1))
            out["guard"] = "passed"
        except DataGroupRefusal:
            out["guard"] = "refused"
    for name, cls in (("pipemorph", PipeMorph), ("crosspipe", CrossPipe)):
        calls: dict = {}
        mods = mlp_stages(world, DIM)
        stage = PipelineStage(mods[rank], rank, world, torch.device("cpu"))
        opt = torch.optim.SGD(mods[rank].parameters(), lr=0.05)
        with data_group_refuses_cpu_collectives(calls):
            kw = {"policy": ReplanEveryCheck()} if cls is PipeMorph else {}
            sched = cls(stage, N_MB, loss_fn=Fn.mse_loss, **kw)
            losses = []
            for k in range(STEPS):
                if k == 3 and cls is PipeMorph:  # the synchronous deploy path agrees on the control group
                    out["pushed"] = sched.deploy(builtin_plan("1F1B", world, N_MB)[0], reason="user")
                opt.zero_grad()
                losses.append(_step(sched, rank, world, k))
                opt.step()
        out[name] = {
            "losses": losses, "calls": calls,
            "params_close": all(torch.allclose(p, q, rtol=1e-9, atol=1e-12)
                                for p, q in zip(mods[rank].parameters(), ref_params)),
            "hashes": [e["plan_hash"] for e in sched.decision_log if e["decision"] == "deploy"],
            "rejects": [e for e in sched.decision_log if e["decision"] == "reject"],
            "versions": sched.plan_version,
        }
    return out


@pytest.mark.multiprocess
def test_schedules_train_and_agree_when_the_data_group_refuses_cpu_collectives():
    world = 3  # a first, a middle and a last stage: every role a rank has in the exchanges (a 4th costs a process)
    results = run_ranks(_worker, world)
    assert [r["guard"] for r in results] == ["refused"] * world
    for name in ("pipemorph", "crosspipe"):
        for r in results:
            res = r[name]
            assert not res["rejects"], res["rejects"]
            assert res["params_close"], name
            # the control group carried the profile exchanges (one per iteration: a message to each other
            # rank) and the clock ping-pong
            assert res["calls"].get("isend", 0) >= STEPS * (world - 1), res["calls"]
            assert res["hashes"] == results[0][name]["hashes"]
        for got, want in zip(results[-1][name]["losses"], results[-1]["ref_losses"]):
            assert got == pytest.approx(want, rel=1e-9, abs=0)
    # plans were swapped (background agreement) and a user plan went through the synchronous agreement
    assert results[0]["pipemorph"]["versions"] >= 3
    assert all(r["pushed"] is True for r in results)
    assert results[1]["pipemorph"]["calls"].get("send", 0) + results[1]["pipemorph"]["calls"].get("recv", 0) > 0


def test_control_plane_without_a_process_group_is_local():
    cp = ControlPlane(None)
    assert cp.local and cp.size == 1
    assert cp.agree(5) == (True, [5]) and cp.any(True) and not cp.any(False)
    assert [t.tolist() for t in cp.all_gather(torch.tensor([1.0, 2.0]))] == [[1.0, 2.0]]
    assert all(math.isnan(x) for x in cp.clock_offsets())


RINGS = [(False, False, False), (True, False, True), (True, True, False)]


def _gathers_in_flight(rank: int, world: int) -> list[dict]:
    return [_gathers_in_flight_once(rank, world, ring) for ring in RINGS]


def _gathers_in_flight_once(rank: int, world: int, ring: tuple[bool, bool, bool]) -> dict:
    cp = ControlPlane(None if world == 1 else dist.group.WORLD)
    first = cp.start_all_gather(torch.tensor([float(rank), 1.0]), ring=ring[0])
    agreed = cp.agree(7)  # another collective while the gather is in flight: it settles the gather first
    second = cp.start_all_gather(torch.tensor([10.0 + rank]), ring=ring[1])
    third = cp.start_all_gather(torch.tensor([20.0 + rank]), ring=ring[2])  # starts after the second, which it settles
    vote = cp.any(rank == world - 1)
    return {"first": [t.tolist() for t in first.result()], "second": [t.tolist() for t in second.result()],
            "third": [t.tolist() for t in third.result()], "agreed": agreed, "vote": vote}


@pytest.mark.multiprocess
def test_gathers_in_flight_keep_their_results_across_other_collectives():
    """A check that runs behind leaves its exchange in flight while the next iteration runs, and other
    collectives of the control plane (agreement, votes, the next exchange) may start before it is read;
    the same with gloo's own all_gather (``ring``: the exchange of a check that runs behind) beside the
    point-to-point one, in either order."""
    world = 3
    for r in (one for rank in run_ranks(_gathers_in_flight, world, backend="gloo") for one in rank):
        assert r["first"] == [[float(k), 1.0] for k in range(world)]
        assert r["second"] == [[10.0 + k] for k in range(world)] and r["third"] == [[20.0 + k] for k in range(world)]
        assert r["agreed"] == (True, [7]) and r["vote"] is True


def _receives_posted_early(rank: int, world: int) -> dict:
    cp = ControlPlane(dist.group.WORLD)
    cp.expect(2, tag=1)
    cp.expect(2, tag=1)  # posted already: nothing more (a second set would take the next gather's messages)
    received = cp._expected[1][0]
    received.fill_(-1.0)  # before the tag-0 gather below, so before any peer can send on tag 1
    other = cp.all_gather(torch.tensor([100.0 + rank]))  # tag 0 in between: not matched with tag 1's receives
    if rank == 0:  # the peers' tag-1 messages land meanwhile (without a posted receive they never would)
        deadline = time.monotonic() + 30.0
        while (received[1:] == -1.0).any() and time.monotonic() < deadline:
            time.sleep(0.01)
    landed = received.tolist()  # before this rank starts its gather: the peers' rows are there already
    first = cp.start_all_gather(torch.tensor([float(rank), 1.0], dtype=torch.float64), tag=1)
    rounds = [[t.tolist() for t in first.result()]]
    for k in range(2):  # the next iterations': posted early again, then gathered
        cp.expect(2, tag=1)
        rounds.append([t.tolist() for t in cp.start_all_gather(torch.tensor([float(rank), 2.0 + k],
                                                                            dtype=torch.float64), tag=1).result()])
    cp.expect(3, tag=1)
    try:
        cp.start_all_gather(torch.tensor([1.0, 2.0], dtype=torch.float64), tag=1)
        mismatch = None
    except ValueError as e:
        mismatch = str(e)
    return {"other": [t.tolist() for t in other], "landed": landed, "rounds": rounds, "mismatch": mismatch}


@pytest.mark.multiprocess
def test_receives_posted_early_take_the_messages_as_they_are_sent():
    """``ControlPlane.expect`` posts a gather's receives before the gather: the peers' messages land while
    this rank still works (gloo hands a message over only to a posted receive), each gather on the tag
    gets its own messages, and a gather on another tag in between is not mixed with them."""
    world = 3
    for rank, r in enumerate(run_ranks(_receives_posted_early, world, backend="gloo")):
        assert r["other"] == [[100.0 + k] for k in range(world)]
        if rank == 0:  # it waited before its gather, the others did not
            assert r["landed"] == [[-1.0, -1.0]] + [[float(k), 1.0] for k in range(1, world)]
        assert r["rounds"] == [[[float(k), v] for k in range(world)] for v in (1.0, 2.0, 3.0)]
        assert r["mismatch"] and "posted for 3" in r["mismatch"]
