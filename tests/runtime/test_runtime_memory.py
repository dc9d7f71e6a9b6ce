"""Memory caps of adaptive plans (defect 10).

* the first budget is not read before the optimizer's state exists: a device budget is PENDING until
  a ``torch.optim`` optimizer has stepped (AdamW allocates 2 × the parameters then), and the cap
  holds the initial plan's regime meanwhile;
* a background candidate planned under an old cap is re-checked against the current cap before the
  swap, and rejected when the cap shrank below its in-flight peak.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as Fn
from torch.distributed.pipelining import PipelineStage

from titan_ext.plan.simulate import peak_inflight
from titan_ext.plan.ir import as_ops
from titan_ext.runtime import Decision, PipeMorph
from titan_ext.runtime.execute import memory
from titan_ext.runtime.execute.memory import inflight_cap
from titan_ext.testing import SleepComputeStage, run_ranks, step_rank

pytestmark = pytest.mark.timeout(240)

GIB = float(1 << 30)


class _DeviceMemory:
    """A device layer's memory view: 16 GiB free minus what the optimizer's state took."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params

    def memory_free_bytes(self) -> float:
        state = 2 * 4 * GIB if memory.optimizer_steps() > 0 else 0.0  # AdamW: exp_avg + exp_avg_sq
        return 16 * GIB - state


def test_device_budget_pending_until_the_optimizer_state_exists(monkeypatch):
    monkeypatch.setattr(memory, "_steps", [0])
    p = torch.nn.Parameter(torch.zeros(4))
    layer = _DeviceMemory([p])
    first = memory.activation_budget_bytes(layer, None, headroom=0.0)
    assert first == memory.PENDING  # not 16 GiB: AdamW has not allocated its 8 GiB yet
    # while pending, the cap keeps the initial plan's regime (here x_max = 3), whatever the free memory
    assert memory.inflight_cap([first, 12 * GIB], [1 * GIB, 1 * GIB], 8, pending_cap=3) == 3
    opt = torch.optim.AdamW([p])
    p.grad = torch.ones(4)
    opt.step()
    after = memory.activation_budget_bytes(layer, None, headroom=0.0)
    assert after == pytest.approx(8 * GIB)
    assert memory.inflight_cap([after, 12 * GIB], [1 * GIB, 1 * GIB], 16) == 8
    # a configured budget is always known; a host without a device limit has none
    assert memory.activation_budget_bytes(layer, 5.0) == 5.0
    assert math.isnan(memory.activation_budget_bytes(type("Cpu", (), {"memory_free_bytes": lambda s: math.nan})(),
                                                     None))


N_MB, DIM, ACT_BYTES = 4, 8, 1000.0


class _WidenOnce:
    """First check: ask for an adaptive plan holding all N activations on stage 0 (planned in the
    background, swapped at the next boundary); then keep."""

    window = 1

    def __init__(self):
        self.calls = 0

    def decide(self, estimate, deployed_counts, initial_counts, since, slack_floor=2):
        self.calls += 1
        if self.calls == 1:
            return Decision("adapt", "test: widen", mode="adaptive", warmup_counts=[N_MB, N_MB - 1])
        return Decision("keep", "test")


def _cap_worker(rank: int, world: int) -> dict:
    mod = SleepComputeStage(DIM, 0.0, 0.0, 0.0, seed=rank)
    sched = PipeMorph(PipelineStage(mod, rank, world, torch.device("cpu")), N_MB, loss_fn=Fn.mse_loss,
                      policy=_WidenOnce(), memory_budget_bytes=1e6, activation_bytes=ACT_BYTES, max_inflight=2,
                      backward="split")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2 * N_MB, DIM, generator=g), torch.randn(2 * N_MB, DIM, generator=g)
    out = []
    for it in range(3):
        step_rank(sched, rank, world, x, y)
        if it == 0:  # the candidate is being planned under a cap of N; memory shrinks to 2 activations
            sched.memory_budget_bytes = 2 * ACT_BYTES
        peak = max(peak_inflight(as_ops(sched.pipeline_order)).values())
        out.append({"cap": sched.inflight_cap, "peak": peak, "version": sched.plan_version})
    return {"steps": out, "log": [e for e in sched.decision_log if e["decision"] in ("reject", "deploy")]}


@pytest.mark.multiprocess
def test_background_candidate_rechecked_against_the_current_cap():
    res = run_ranks(_cap_worker, 2)
    for r in res:
        first, second = r["steps"][0], r["steps"][1]
        assert first["cap"] == N_MB  # the candidate was planned under this cap
        assert second["cap"] == 2  # ... and the cap shrank before its swap
        for s in r["steps"]:
            assert s["peak"] <= s["cap"], r["steps"]
        assert any(e["decision"] == "reject" and "memory cap" in e["reason"] for e in r["log"]), r["log"]


def test_memory_cap_is_the_tightest_rank():
    # rank 1: 10 GB / 1 GB = 10; rank 0: 4.5 GB / 0.5 GB = 9; rank 2 has no budget (CPU, none configured)
    assert inflight_cap([4.5e9, 10e9, math.nan], [0.5e9, 1e9, 2e9], 16) == 9
    assert inflight_cap([math.nan] * 3, [1.0] * 3, 16) is None
    assert inflight_cap([1e12], [1.0], 16) == 16 and inflight_cap([1.0], [1e9], 16) == 1
