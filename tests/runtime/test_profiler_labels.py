"""What PipeMorph shows in a torch.profiler trace (TorchTitan's ``[profiling] enable_profiling``).

Two gloo ranks, each profiling its own steps (CPU activity, every thread recorded so the background
planning shows too): every action the runtime ran appears once by torch's name for it,
``PP:<action>``, each send waited at the end of the step as ``titan_ext:wait_send <send>``, and the
boundary, check, background re-plan and deploy by their ``titan_ext:`` names.  The expected names are
read off the action lists the schedule deployed (``pipeline_order_with_comms[rank]``), not off the
trace.  torch's own runtime (``_PipelineScheduleRuntime``) running torch's ``Schedule1F1B`` plan names
the same actions as PipeMorph running that plan.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as Fn
from torch._C._profiler import _ExperimentalConfig
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
from torch.profiler import ProfilerActivity, profile

from titan_ext.plan.builtin import builtin_plan
from titan_ext.plan.result import make_result
from titan_ext.runtime import PipeMorph
from titan_ext.runtime._torch_compat import has_wait_actions
from titan_ext.testing import mlp_stages, run_ranks, seeded_batch, step_rank

pytestmark = pytest.mark.timeout(120)

WORLD, N_MB, DIM, BATCH, STEPS = 2, 4, 8, 8, 3


def _profiled(run) -> Counter:
    """The names of the CPU events of ``run()``, every thread's, with their counts."""
    with profile(activities=[ProfilerActivity.CPU],
                 experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
        run()
    return Counter(e.name for e in prof.events())


def _steps(sched, rank: int, steps: range, ran: list) -> None:
    """``steps`` training steps; ``ran`` gets each step's deployed action list for this rank."""
    for k in steps:
        ran.append([str(a) for a in sched.pipeline_order_with_comms[rank]])
        x, y = seeded_batch(k, BATCH, DIM)
        step_rank(sched, rank, WORLD, x, y, [])


def _worker(rank: int, world: int) -> dict:
    cpu = torch.device("cpu")
    sched = PipeMorph(PipelineStage(mlp_stages(world, DIM)[rank], rank, world, cpu), N_MB, loss_fn=Fn.mse_loss)
    ran: list = []
    names = _profiled(lambda: _steps(sched, rank, range(STEPS), ran))
    checks = [m["decision"] != "none" for m in sched.metrics_history]

    # torch's 1F1B plan: deployed on PipeMorph (one step), and run by torch's runtime on its own stage
    plan, _ = builtin_plan("1F1B", world, N_MB)
    ran_1f1b: list = []

    def deploy_and_step() -> None:
        sched.deploy(make_result(plan, schedule="1F1B", predicted_makespan_ms=math.nan, plan_ms=0.0), "torch 1F1B")
        _steps(sched, rank, range(STEPS, STEPS + 1), ran_1f1b)

    ours = _profiled(deploy_and_step)
    torch_sched = _PipelineScheduleRuntime([PipelineStage(mlp_stages(world, DIM)[rank], rank, world, cpu)], N_MB,
                                           loss_fn=Fn.mse_loss)
    torch_sched._prepare_schedule_with_comms(plan)
    theirs = _profiled(lambda: step_rank(torch_sched, rank, world, *seeded_batch(0, BATCH, DIM), []))
    spans = _spans_entered(sched, rank)
    return {"spans": spans, "names": names, "ran": ran, "checks": checks, "ours": ours, "ran_1f1b": ran_1f1b[0],
            "theirs": theirs, "torch_ran": [str(a) for a in torch_sched.pipeline_order_with_comms[rank]],
            "log": list(sched.decision_log)}


def _spans_entered(sched, rank: int) -> dict[str, int]:
    """How many ``record_function`` spans the executor opens in one step with no profiler running and in one
    step under the profiler (the executor's ``record_function``, counted)."""
    from titan_ext.runtime.execute import executor

    entered = 0
    real = executor.record_function

    def counting(name):
        nonlocal entered
        entered += 1
        return real(name)

    executor.record_function = counting
    try:
        _steps(sched, rank, range(STEPS + 1, STEPS + 2), [])
        quiet, entered = entered, 0
        _profiled(lambda: _steps(sched, rank, range(STEPS + 2, STEPS + 3), []))
    finally:
        executor.record_function = real
    return {"quiet": quiet, "profiled": entered}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_worker, WORLD, timeout_s=90)


def _pp(names: Counter) -> Counter:
    return Counter({n: c for n, c in names.items() if n.startswith("PP:")})


@pytest.mark.multiprocess
def test_every_action_and_the_boundary_work_appear_by_name(results):
    for rank, res in enumerate(results):
        expected = Counter(f"PP:{a}" for step in res["ran"] for a in step)
        kinds = {a.lstrip("0123456789").rstrip("0123456789") for step in res["ran"] for a in step}
        assert {"F", "SEND_F" if rank == 0 else "RECV_F", "SEND_B" if rank == 1 else "RECV_B"} <= kinds, kinds
        assert kinds & {"B", "I"} and kinds & {"B", "W"}, kinds
        assert _pp(res["names"]) == expected, (rank, _pp(res["names"]) - expected, expected - _pp(res["names"]))
        # sends still pending at the end of a step (every send before torch 2.15, none after: WAIT_SEND actions)
        sends = Counter(f"titan_ext:wait_send {a}" for step in res["ran"] for a in step
                        if "SEND" in a and not has_wait_actions())
        assert {n: res["names"][n] for n in sends} == sends
        assert res["names"]["titan_ext:boundary"] == STEPS
        assert res["names"]["titan_ext:check"] == sum(res["checks"]) >= 1
        assert res["names"]["titan_ext:plan"] >= 1, res["log"]  # the re-plan after the first check, on its thread
        # deploy(): more if a re-plan is swapped in at the boundary; none when the plan it replaced was already
        # torch's 1F1B (a calibrated full-backward plan at Alg.1's counts is; logged "unchanged")
        kept = any(e["decision"] == "unchanged" and e["reason"].startswith("torch 1F1B") for e in res["log"])
        assert res["ours"]["titan_ext:deploy"] >= 1 or kept, res["log"]


@pytest.mark.multiprocess
def test_no_span_is_opened_when_no_profiler_runs(results):
    """A ``record_function`` span costs host time (torch's op dispatch) on every action, profiled or not:
    the executor opens them only while a profiler is recording."""
    for res in results:
        assert res["spans"]["quiet"] == 0, res["spans"]
        assert res["spans"]["profiled"] >= 4 * N_MB, res["spans"]  # F and B per micro-batch, sends, receives


@pytest.mark.multiprocess
def test_torch_runtime_names_the_same_actions_the_same_way(results):
    for rank, res in enumerate(results):
        ours, theirs = Counter(res["ran_1f1b"]), Counter(res["torch_ran"])
        # torch's lowering also adds UNSHARD / RESHARD (no-ops without FSDP); ours adds them for FSDP only
        assert not ours - theirs, ours - theirs
        assert {f"{rank}F0", f"{rank}B0", f"{rank}SEND_F0" if rank == 0 else f"{rank}RECV_F0"} <= set(ours)
        assert _pp(res["ours"]) == Counter(f"PP:{a}" for a in ours.elements())
        assert _pp(res["theirs"]) == Counter(f"PP:{a}" for a in theirs.elements())
