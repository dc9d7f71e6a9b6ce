"""PipeMorph's ``backward`` variants on gloo/loopback with emulated (sleep) compute.

``backward="auto"`` runs the other backward variant for a window after each new regime and keeps the
one whose measured iteration span is lower.  The reference for which variant must win is set by the
emulated hardware, not by our code: with uniform 6 ms F / I / W sleeps the split plan fills 1F1B's
bubbles with W (ZeroBubble, PipeMorph §3.1) so split must win; when every split I costs 12 ms extra
(as the I/W split of a CPU autograd graph does, in kind) the full backward must win.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.nn.functional as Fn
from torch.distributed.pipelining import PipelineStage

from titan_ext.runtime import PipeMorph
from titan_ext.testing import SleepComputeStage, run_ranks, step_rank

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DIM, N_MB, STEPS = 8, 8, 13


class SplitOverhead(PipeMorph):
    """Every backward-input action (split backward only) costs ``overhead_s`` extra on its rank."""

    overhead_s = 0.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        perform = self.executor.perform

        def slow_input_backward(action, ctx):
            if action.computation_type.value == "I" and self.overhead_s:
                time.sleep(self.overhead_s)
            return perform(action, ctx)

        self.executor.perform = slow_input_backward


def _worker(rank: int, world: int, overhead_ms: float, backward: str) -> dict:
    mod = SleepComputeStage(DIM, 6.0, 6.0, 6.0, seed=rank)
    stage = PipelineStage(mod, rank, world, torch.device("cpu"))
    sched = SplitOverhead([stage], N_MB, loss_fn=Fn.mse_loss, backward=backward)
    sched.overhead_s = overhead_ms / 1e3
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2 * N_MB, DIM, generator=g), torch.randn(2 * N_MB, DIM, generator=g)
    ran, spans, hashes = [], [], []
    for _ in range(STEPS):
        step_rank(sched, rank, world, x, y)
        m = sched.last_metrics
        ran.append({r.kind for r in sched.last_timeline} >= {"B"})
        spans.append(m["timeline_span_ms"])
        hashes.append(m["plan_hash"])
    log = [e for e in sched.decision_log if e["decision"] in ("probe", "select", "reject")]
    return {"full_ran": ran, "spans": spans, "hashes": hashes, "log": log, "final": sched.deployed.backward}


@pytest.mark.parametrize("overhead_ms,winner", [(0.0, "split"), (12.0, "full")])
def test_auto_keeps_the_measured_faster_backward(overhead_ms, winner):
    world = 4
    results = run_ranks(_worker, world, overhead_ms, "auto")
    for res in results:
        assert res["hashes"] == results[0]["hashes"]  # every rank ran the same plans
        assert not [e for e in res["log"] if e["decision"] == "reject"], res["log"]
        assert [e["decision"] for e in res["log"]] == ["probe", "select"], res["log"]
        selects = [e for e in res["log"] if e["decision"] == "select"]
        assert len(selects) == 1 and selects[0]["reason"].endswith(f"-> {winner}"), res["log"]
        assert res["final"] == winner
        # both variants really ran, the full one for a window of 3 iterations at least
        assert sum(res["full_ran"]) >= 3 and not all(res["full_ran"])
        assert res["full_ran"][-1] == (winner == "full")
    spans = results[0]["spans"]
    full = [s for s, f in zip(spans, results[0]["full_ran"]) if f]
    split = [s for s, f in zip(spans[2:], results[0]["full_ran"][2:]) if not f]  # after calibration
    faster, slower = (full, split) if winner == "full" else (split, full)
    assert statistics.median(faster) < statistics.median(slower)


def test_fixed_backward_never_probes():
    world = 4
    for res in run_ranks(_worker, world, 12.0, "split"):
        assert not res["log"] and not any(res["full_ran"]) and res["final"] == "split"
