"""The runtime on gloo ranks: delegation as a transport choice of CrossPipe (float64,
identical to torch's ScheduleGPipe), and plan stability under a constant straggler."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as Fn
from torch.distributed.pipelining import PipelineStage

from titan_ext.testing import gpipe_reference, mlp_stages, run_ranks, seeded_batch, step_rank

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

DIM, BATCH = 8, 16


def _batch(step, dtype=torch.float64):
    return seeded_batch(3000 + step, BATCH, DIM, dtype)


def _step(sched, rank, world, k):
    x, y = _batch(k)
    losses: list = []
    step_rank(sched, rank, world, x, y, losses)
    return [float(v.detach()) for v in losses]


def _crosspipe_delegated_worker(rank, world, n_mb, steps):
    from titan_ext.runtime import CrossPipe

    ref_losses, ref_params = gpipe_reference(rank, world, n_mb, steps, lambda s, k: _step(s, rank, world, k), DIM)
    mods = mlp_stages(world, DIM)
    sched = CrossPipe(PipelineStage(mods[rank], rank, world, torch.device("cpu")), n_mb, loss_fn=Fn.mse_loss,
                      delegation="always")
    opt = torch.optim.SGD(mods[rank].parameters(), lr=0.05)
    losses = []
    try:
        for k in range(steps):
            opt.zero_grad()
            losses.append(_step(sched, rank, world, k))
            opt.step()
        counts = dict(sched.delegation.router.counts)
    finally:
        sched.delegation.close()
    return {"losses": losses, "ref_losses": ref_losses, "counts": counts,
            "params_close": all(torch.allclose(p, q, rtol=1e-9, atol=1e-12)
                                for p, q in zip(mods[rank].parameters(), ref_params)),
            "rejects": [e for e in sched.decision_log if e["decision"] == "reject"],
            "delegating": [m["delegating"] for m in sched.metrics_history]}


@pytest.mark.soak  # 30 s; CI: tests/runtime/test_delegate_nccl_rules.py (delegation "always" trains like direct P2P)
def test_crosspipe_with_delegation_always_matches_gpipe():
    # 3 ranks (a middle rank uses all four channel kinds): each rank starts its delegate processes,
    # which dominates the cost on a 2-core machine
    world, n_mb, steps = 3, 4, 3
    results = run_ranks(_crosspipe_delegated_worker, world, n_mb, steps)
    for rank, r in enumerate(results):
        assert r["params_close"], rank
        assert not r["rejects"], r["rejects"]
        assert all(r["delegating"])
        # every PP message of this rank went through its delegates: F out and B in on all but the
        # last rank, F in and B out on all but the first
        per_iter = 2 * n_mb * ((rank > 0) + (rank < world - 1))
        assert r["counts"] == {"direct": 0, "delegate": per_iter * steps}, (rank, r["counts"])
    for got, want in zip(results[-1]["losses"], results[-1]["ref_losses"]):
        assert got == pytest.approx(want, rel=1e-9, abs=0)


def _stability_worker(rank, world, n_mb, steps, delay_ms):
    from titan_ext.runtime import PipeMorph, inject_link_delays
    from titan_ext.testing import SleepComputeStage

    inject_link_delays(f"{world - 2}:{delay_ms:g}")
    mod = SleepComputeStage(DIM, 3.0, 3.0, 3.0, seed=rank)
    sched = PipeMorph(PipelineStage(mod, rank, world, torch.device("cpu")), n_mb, loss_fn=Fn.mse_loss)
    for k in range(steps):
        x, y = _batch(k, torch.float32)
        step_rank(sched, rank, world, x, y)
    return {"versions": [m["plan_version"] for m in sched.metrics_history],
            "deploys": [(e["iteration"], e["kind"], e["reason"][:60]) for e in sched.decision_log
                        if e["decision"] == "deploy"],
            "periods": [(m["profile_every"], m["decision"]) for m in sched.metrics_history]}


def test_constant_delay_settles_within_four_plan_versions():
    """+60 ms on the last link from the start, 30 iterations, defaults (backward="auto"): at most 4
    plan versions in all — the initial plan, the adaptation, the other backward's probe and the
    verdict — and the profiling period grows once the plan has settled (adaptive k)."""
    world, n_mb, steps = 4, 16, 30
    results = run_ranks(_stability_worker, world, n_mb, steps, 60.0)
    r = results[0]
    assert all(x["versions"] == r["versions"] for x in results)
    assert r["versions"][-1] <= 4, r["deploys"]
    assert any(k["kind"] == "adaptive" for k in [dict(zip(("it", "kind", "reason"), d)) for d in r["deploys"]])
    assert max(p for p, _ in r["periods"]) > 1, r["periods"]
