"""Delegation in the schedule under NCCL's rules, default tier ("delegation ... run under
these backends, in the default tier").

Two ranks on the ``nccl_rules`` test backend (tags ignored, per-pair FIFO, batches as groups,
asynchronous completion, no titan_ext host tensors on the data group): ``delegation="always"`` and
``"auto"`` (switched on by a measured +30 ms link) must train bit for bit like direct P2P with the
same fixed plan. The longer scenarios (the per-op failover of gloo PP groups, and > 64 MiB
activations) are in tests/runtime/test_delegate_schedule.py (slow tier); the step-level failover of an NCCL PP
group in tests/runtime/test_delegate_nccl_failover.py."""

from __future__ import annotations

import pytest
import torch.nn.functional as Fn

from titan_ext.testing import run_ranks, train_steps

pytestmark = pytest.mark.timeout(300)

DIM, BATCH, N_MB, STEPS = 8, 16, 4, 3  # tests/runtime/test_delegate_schedule.py's model, batch and micro-batches


def _train(rank, world, make, steps):
    return train_steps(rank, world, make, steps, dim=DIM, batch=BATCH)


def _worker(rank, world):
    import torch

    from titan_ext.runtime import PipeMorph, inject_link_delays, remove_link_delays

    kw = dict(loss_fn=Fn.mse_loss, adaptive=False)
    _, ref_losses, ref_params = _train(rank, world, lambda st: PipeMorph(st, N_MB, **kw), STEPS)
    out = {}
    for mode in ("always", "auto"):
        inj = inject_link_delays("0:30") if mode == "auto" else None
        try:
            sched, losses, params = _train(rank, world, lambda st: PipeMorph(
                st, N_MB, delegation=mode, slow_link_ms=10.0, **kw), STEPS)
        finally:
            if inj is not None:
                remove_link_delays()
        out[mode] = {"equal": losses == ref_losses and all(torch.equal(a, b) for a, b in zip(params, ref_params)),
                     "counts": dict(sched.delegation.router.counts), "log": list(sched.delegation.log)}
        sched.delegation.close()
    return out


@pytest.mark.slow  # 25 s of 4 ranks: the default tier keeps the delegate data-plane tests under nccl_rules
def test_delegation_always_and_auto_under_nccl_rules_train_like_direct_p2p():
    for rank, r in enumerate(run_ranks(_worker, 2, backend="nccl_rules")):
        assert r["always"]["equal"] and r["auto"]["equal"], (rank, r)
        assert r["always"]["counts"] == {"direct": 0, "delegate": 2 * N_MB * STEPS}, (rank, r)
        log = r["auto"]["log"]  # switched on at a boundary once the delay was measured; delegated after
        assert len(log) == 1 and log[0]["delegating"] and 1 <= log[0]["iteration"] < STEPS, (rank, log)
        assert r["auto"]["counts"] == {"direct": 0, "delegate": 2 * N_MB * (STEPS - log[0]["iteration"])}, (rank, r)
