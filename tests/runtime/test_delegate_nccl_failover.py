"""Failover when a PP link's NCCL path fails (PipeMorph §5.3), step-level (StepFailover, runtime/comm/delegate/schedule.py).

Under the ``nccl_rules`` backend the communicator of the PP group is aborted mid-step on both ends of
link 1-2 (``nccl_rules.inject_abort``): the failure is agreed at the end of the step on the gloo control
plane, every link moves to the delegates, and the step re-runs from its start with the gradients it
began with.  On gloo the same 4-rank run fails over per operation (``P2PRouter``).  Either way the
losses and parameters are bit-equal to a fault-free run, the failover is logged, no step is lost and
nothing restarts."""

from __future__ import annotations

import logging
import types

import pytest
import torch
import torch.nn.functional as Fn

from titan_ext.testing import run_ranks

pytestmark = pytest.mark.timeout(300)

DIM, BATCH, N_MB, STEPS, FAIL_STEP, WORLD = 8, 16, 4, 4, 2, 4


def _train(rank, world, group, sched_kw, before_step=None):
    from torch.distributed.pipelining import PipelineStage

    from titan_ext.runtime import PipeMorph
    from titan_ext.testing import mlp_stages, seeded_batch
    from titan_ext.testing.models import sgd_step

    mods = mlp_stages(world, DIM)
    sched = PipeMorph(PipelineStage(mods[rank], rank, world, torch.device("cpu"), group=group), N_MB,
                      loss_fn=Fn.mse_loss, adaptive=False, **sched_kw)
    opt = torch.optim.SGD(mods[rank].parameters(), lr=0.05)
    losses = []
    for k in range(STEPS):
        if before_step is not None:
            before_step(k)
        x, y = seeded_batch(1000 + k, BATCH, DIM)
        losses.append(sgd_step(sched, opt, rank, world, x, y))
    return sched, losses, [p.detach().clone() for p in mods[rank].parameters()]


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _worker(rank, world, backend):
    import torch.distributed as dist

    from titan_ext.testing.faults import FaultInjector

    # the PP group apart from the default one (as TorchTitan's PP mesh group): the abort poisons it only
    pp = dist.new_group(list(range(world)))
    _, ref_losses, ref_params = _train(rank, world, pp, {})
    warnings = _Warnings()
    logging.getLogger("titan_ext").addHandler(warnings)
    kw = dict(delegation="off", failover=True, recv_timeout_s=20.0)
    if backend == "nccl_rules":
        from titan_ext.testing import nccl_rules

        def before_step(k):  # link 1-2's NCCL path dies mid-step FAIL_STEP, seen by both its ends
            if k == FAIL_STEP and rank in (1, 2):
                nccl_rules.inject_abort(pp, after_ops=2 * N_MB + 1, reason="test: link 1-2 down")
    else:
        before_step = None
        peer = {1: 2, 2: 1}.get(rank)
        if peer is not None:  # gloo: the per-op failover of P2PRouter, from the same point
            kw["faults"] = FaultInjector(broken={(peer, "F"): FAIL_STEP * N_MB + 1})
    sched, losses, params = _train(rank, world, pp, kw, before_step)
    d = sched.delegation
    out = {"losses_equal": losses == ref_losses, "losses": losses,
           "params_equal": all(torch.equal(a, b) for a, b in zip(params, ref_params)),
           "iterations": sched.iteration, "delegating": d.delegating, "log": list(d.log),
           "failed": sorted(d.router.failed) if d.router is not None else None,
           "failover_events": len(d.router.failover_events) if d.router is not None else 0,
           "counts": dict(d.router.counts) if d.router is not None else None,
           "step_events": list(d.step_failover.events) if d.step_failover is not None else None,
           "decisions": [e["decision"] for e in sched.decision_log],
           "warnings": warnings.lines, "backend": dist.get_backend()}
    d.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["nccl_rules", "gloo"])
def test_a_pp_link_failing_mid_training_fails_over_with_losses_equal_to_a_fault_free_run(backend):
    results = run_ranks(_worker, WORLD, backend, backend=backend, timeout_s=240)
    for rank, r in enumerate(results):
        assert r["losses_equal"] and r["params_equal"], (rank, r)
        assert r["iterations"] == STEPS, (rank, r)  # no step lost, none repeated in the count
        if backend == "nccl_rules" or rank in (1, 2):  # gloo: only the link's ends fail over
            assert any("failed over to the delegates" in w for w in r["warnings"]), (rank, r["warnings"])
            assert "delegate_failover" in r["decisions"], (rank, r["decisions"])
    assert len(results[-1]["losses"]) == STEPS and all(len(v) == N_MB for v in results[-1]["losses"])
    if backend == "nccl_rules":
        for rank, r in enumerate(results):
            assert r["backend"] == "nccl_rules"
            # agreed by every rank at the end of the failed step: every link on the delegates from its re-run
            assert r["delegating"], (rank, r)
            assert [e["iteration"] for e in r["step_events"]] == [FAIL_STEP], (rank, r["step_events"])
            assert len(r["log"]) == 1 and r["log"][0]["delegating"] and r["log"][0]["iteration"] == FAIL_STEP
            assert "failover" in r["log"][0]["reason"] and "NCCL path" in r["log"][0]["reason"]
            assert any("NCCL path of the PP group failed" in w for w in r["warnings"]), (rank, r["warnings"])
            ends = 1 if rank in (0, WORLD - 1) else 2  # the rank's PP links
            # nothing on the router before the failure (torch's batched P2P), then the whole re-run and
            # every later step through the delegates
            assert r["counts"] == {"direct": 0, "delegate": 2 * N_MB * ends * (STEPS - FAIL_STEP)}, (rank, r)
            assert r["failover_events"] == 2 * ends, (rank, r)
    else:
        for rank, r in enumerate(results):
            assert not r["delegating"] and r["step_events"] is None, (rank, r)
            assert r["failed"] == ([({1: 2, 2: 1}[rank], "F")] if rank in (1, 2) else []), (rank, r)


def _abort_worker(rank, world):
    """The nccl_rules model of an NCCL communicator abort."""
    import threading
    import time

    import torch.distributed as dist

    from titan_ext.testing import nccl_rules

    out = {}
    t = torch.ones(4)
    g = dist.new_group([0, 1])  # aborted below; the default group stays for run_ranks' closing barrier
    if rank == 0:
        nccl_rules.inject_abort(g, after_ops=2)
        sent = dist.isend(t, 1, group=g)  # the two ops still allowed: this one lands on rank 1...
        while not sent.is_completed():  # (an abort ends a transfer that has not run yet)
            time.sleep(0.01)
        pending = dist.irecv(torch.empty(4), 1, group=g)  # ...this one is never sent: pending at the abort
        try:
            dist.isend(t, 1, group=g)
        except dist.DistBackendError as e:
            out["injected"] = isinstance(e, nccl_rules.CommunicatorAborted)
        out["pending_completed"] = pending.is_completed()
        try:
            pending.wait()
        except dist.DistBackendError:
            out["pending_raises"] = True
        try:
            dist.irecv(torch.empty(4), 1, group=g)
        except dist.DistBackendError:
            out["later_op_raises"] = True
    else:
        buf = torch.empty(4)
        dist.irecv(buf, 0, group=g).wait()
        out["received"] = bool(torch.equal(buf + 0, t))
        dist.irecv(torch.empty(4), 0, group=g).wait()  # never sent: the next kernel waits for it...
        threading.Thread(target=g.abort).start()  # ...until ProcessGroup.abort() (ncclCommAbort) ends it
        torch.zeros(1).add_(1)
        out["kernel_runs"] = True
        try:
            dist.isend(t, 0, group=g)
        except dist.DistBackendError:
            out["after_abort_raises"] = True
    return out


@pytest.mark.slow
def test_nccl_rules_abort_poisons_the_group_and_fails_pending_ops():
    r0, r1 = run_ranks(_abort_worker, 2, backend="nccl_rules", timeout_s=120)
    assert r0 == {"injected": True, "pending_completed": True, "pending_raises": True, "later_op_raises": True}, r0
    assert r1 == {"received": True, "kernel_runs": True, "after_abort_raises": True}, r1


def test_the_snapshot_restores_gradients_rng_and_stage_state():
    """Single process: what a re-run starts from (gradients of the failed attempt discarded)."""
    from titan_ext.runtime.comm.delegate.schedule import _Snapshot

    lin, other = torch.nn.Linear(3, 2), torch.nn.Linear(2, 2)
    lin.weight.grad = torch.ones(2, 3)  # accumulated before the step (gradient accumulation)
    cleared = []
    stages = [types.SimpleNamespace(submod=torch.nn.Sequential(lin, other), bwd_cache={1: 2},
                                    clear_runtime_states=lambda: cleared.append(1))]
    snap = _Snapshot(stages)
    drawn = torch.rand(3)
    lin.weight.grad += 5  # the failed attempt's partial backward
    lin.bias.grad = torch.ones(2)
    other.weight.grad = torch.ones(2, 2)
    snap.restore(stages)
    assert torch.equal(lin.weight.grad, torch.ones(2, 3))
    assert lin.bias.grad is None and other.weight.grad is None
    assert torch.equal(torch.rand(3), drawn)  # the re-run draws the same random numbers
    assert cleared == [1] and stages[0].bwd_cache == {}


def test_a_late_pp_wait_is_handed_to_the_failover_hook_before_the_watchdog():
    """Single process: timeouts.py's watch gives a late PP wait to a registered hook (the step-level
    failover's), which takes it over instead of the fencing note; other waits are not offered."""
    from titan_ext.runtime.comm import timeouts

    seen = []
    remove = timeouts.on_late_p2p(lambda work: seen.append(work.peer) or True)
    try:
        work = timeouts._TimedWork(types.SimpleNamespace(is_completed=lambda: False), 3, "receive", False)
        assert timeouts._taken_over(work) and seen == [3]
        assert not timeouts._taken_over(timeouts._Pending())  # a collective or an issue: not a PP wait
    finally:
        remove()
    assert not timeouts._taken_over(work) and seen == [3]
    remove()  # removing twice is harmless
