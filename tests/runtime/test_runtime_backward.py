"""PipeMorph's ``backward`` variants on gloo/loopback with emulated (sleep) compute.

``backward="measure"`` runs the other backward variant for a window after each new regime and keeps the
one whose measured iteration span is lower; ``backward="auto"`` measures both variants' times in the first
iteration (a mixed plan) and keeps the one the simulator predicts faster, measuring the other only when a
refine finds its plan running more than 5 % above the prediction.  The reference for which variant must win is set by the
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
    """Every backward-input action (split backward only) costs ``overhead_s`` extra on its rank: around
    the action (``measure``'s spans see it, the action's own time does not) or, ``inside``, within the
    timed action (what ``auto``'s model reads — as the I/W split of a CPU autograd graph costs)."""

    overhead_s = 0.0
    inside = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        prepare, backward_input = self.executor.prepare, self.executor._backward_input

        def slow_input_backward(action, ctx):
            step = prepare(action, ctx)
            if action.computation_type.value != "I":
                return step

            def slow(c):
                if self.overhead_s and not self.inside:
                    time.sleep(self.overhead_s)
                step(c)
            return slow

        def slow_split_input(stage, mb, full, ctx):
            if not full and self.overhead_s and self.inside:
                time.sleep(self.overhead_s)
            return backward_input(stage, mb, full, ctx)

        self.executor.prepare = slow_input_backward
        self.executor._backward_input = slow_split_input


def _worker(rank: int, world: int, overhead_ms: float, backward: str, compute_ms: float = 6.0,
            inside: bool | None = None, steps: int = STEPS) -> dict:
    mod = SleepComputeStage(DIM, compute_ms, compute_ms, compute_ms, seed=rank)
    stage = PipelineStage(mod, rank, world, torch.device("cpu"))
    sched = SplitOverhead([stage], N_MB, loss_fn=Fn.mse_loss, backward=backward)
    sched.overhead_s, sched.inside = overhead_ms / 1e3, backward == "auto" if inside is None else inside
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2 * N_MB, DIM, generator=g), torch.randn(2 * N_MB, DIM, generator=g)
    ran, spans, hashes, kinds = [], [], [], []
    for _ in range(steps):
        step_rank(sched, rank, world, x, y)
        m = sched.last_metrics
        kinds.append(sorted({r.kind for r in sched.last_timeline}))
        ran.append({r.kind for r in sched.last_timeline} >= {"B"})
        spans.append(m["timeline_span_ms"])
        hashes.append(m["plan_hash"])
    log = [e for e in sched.decision_log if e["decision"] in ("probe", "select", "reject")]
    # after the calibrated plan: a refine's swap (a plan predicted 2 % faster, or the probe of a plan not
    # realised) and a select's
    later = [e["iteration"] for e in sched.decision_log if e["decision"] == "deploy"
             and e["reason"].startswith(("refine:", "select:"))]
    return {"full_ran": ran, "spans": spans, "hashes": hashes, "log": log, "final": sched.deployed.backward,
            "kinds": kinds, "versions": sched.plan_version, "later": later}


@pytest.mark.parametrize("overhead_ms,winner", [(0.0, "split"), (40.0, "full")])
def test_auto_chooses_by_the_model_from_a_mixed_first_iteration(overhead_ms, winner):
    """No probe: the first iteration runs B for half the microbatches and I + W for the rest, the
    calibrated plan is the variant the model predicts faster from those times — two plan versions.
    One measured iteration decides, so the sleeps are 20 ms: split's gain (filling 1F1B's bubbles with
    W, about 9 % of a 4-stage, 8-microbatch step: ~60 ms) stays >= 3x the real per-action CPU cost of
    the I/W split on a loaded 2-core host (1-2 ms a microbatch; at 6 ms sleeps CI once chose full)."""
    results = run_ranks(_worker, 4, overhead_ms, "auto", 20.0)
    for res in results:
        assert res["hashes"] == results[0]["hashes"]
        # no reject; a probe only of a plan its refine found not realised (regime.py, MODEL_TOLERANCE)
        assert [e["decision"] for e in res["log"]] in ([], ["probe", "select"]), res["log"]
        assert all("beyond 5 %" in e["reason"] for e in res["log"] if e["decision"] == "probe")
        assert res["kinds"][0] == ["B", "F", "I", "W"]  # the first iteration measured both variants
        assert res["final"] == winner and res["versions"] == 2 + len(res["later"]), res
        # one variant from the calibrated plan on (up to a refine's or a select's swap)
        first = 2 if not res["later"] else res["later"][-1] + 1
        assert all(k == res["kinds"][-1] for k in res["kinds"][first:])


def test_auto_measures_the_variants_when_its_plan_is_not_realised():
    """Every split I costs 12 ms *between* actions, where the model sees it only as the executor's
    per-action cost, averaged over every action of both variants (as it sees ranks sharing host cores):
    it picks split and predicts it more than 5 % (``MODEL_TOLERANCE``) faster than it runs.  The refine
    finds that and makes the probe instead: the planner's full plan at the same memory, which has no I
    and so runs 12 ms a microbatch faster in truth, is measured and selected."""
    results = run_ranks(_worker, 4, 12.0, "auto", 6.0, False, 16)
    for res in results:
        assert res["hashes"] == results[0]["hashes"]
        assert [e["decision"] for e in res["log"]] == ["probe", "select"], res["log"]
        probe, select = res["log"]
        assert "beyond 5 %" in probe["reason"] and probe["backward"] == "full", probe
        assert select["reason"].endswith("-> full") and res["final"] == "full", select
        assert res["kinds"][0] == ["B", "F", "I", "W"] and res["kinds"][-1] == ["B", "F"]
    ran, spans = results[0]["full_ran"], results[0]["spans"]
    full = [s for s, f in zip(spans[2:], ran[2:]) if f and s == s]
    split = [s for s, f in zip(spans[2:], ran[2:]) if not f and s == s]
    assert statistics.median(full) < statistics.median(split)  # the measured verdict is the truth here


@pytest.mark.parametrize("overhead_ms,winner", [(0.0, "split"), (12.0, "full")])
def test_measure_keeps_the_measured_faster_backward(overhead_ms, winner):
    world = 4
    results = run_ranks(_worker, world, overhead_ms, "measure")
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


@pytest.mark.soak  # 17 s; CI: tests/runtime/test_runtime_backward_chooser.py::test_disabled_chooser_passes_the_policy_through
def test_fixed_backward_never_probes():
    world = 4
    for res in run_ranks(_worker, world, 12.0, "split"):
        assert not res["log"] and not any(res["full_ran"]) and res["final"] == "split"
