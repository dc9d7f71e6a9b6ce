"""torch 2.15's explicit waits (WAIT_SEND_F / WAIT_SEND_B / WAIT_REDUCE_GRAD) in our lowering, the dry
run and the executor; on torch 2.13/2.14 their absence (sends waited at the end of the step).

References: torch's own ``_PipelineScheduleRuntime._prepare_schedule_with_comms`` (the lowering must
equal it action for action), torch's ``_validate_send_waits`` (the dry run), and the semantics of
torch 2.15's ``_step_microbatches`` (stored in tests/torch_loops/torch-2.15.py.txt) for the executor."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.pipelining import schedules as ts

from titan_ext.plan import PlanValidationError
from titan_ext.plan.builtin import builtin_plan
from titan_ext.plan.validate import torch_dry_run_lowered
from titan_ext.runtime.execute import executor as ex
from titan_ext.runtime._torch_compat import has_wait_actions
from titan_ext.runtime.control.deploy import prepare_candidate

S, N = 4, 8
needs_waits = pytest.mark.skipif(not has_wait_actions(), reason="torch < 2.15 has no WAIT_* actions")


def _torch_lowering(plan, num_stages, n_microbatches=N):
    """torch's own lowering: its runtime's _prepare_schedule_with_comms on a bare instance."""
    sched = object.__new__(ts._PipelineScheduleRuntime)
    for k, v in dict(_defer_pp_recv=False, _max_active_stages=3, _unshard_lookahead="full",
                     _defer_reduce_grad_wait=False, _max_outstanding_sends=None, _n_microbatches=n_microbatches,
                     _num_stages=num_stages, pp_group_size=S, _stages=[], stage_index_to_group_rank={}).items():
        setattr(sched, k, v)
    sched._prepare_schedule_with_comms({r: list(a) for r, a in plan.items()})
    return {r: [str(a) for a in acts] for r, acts in sched.pipeline_order_with_comms.items()}


@pytest.mark.parametrize("name", ["1F1B", "GPipe", "Interleaved1F1B", "ZBVZeroBubble"])
def test_lowering_equals_torchs_runtime_lowering(name):
    plan, _ = builtin_plan(name, S, N)
    stages = sorted({a.stage_index for acts in plan.values() for a in acts})
    owner = tuple(r for s in stages for r, acts in plan.items() if any(a.stage_index == s for a in acts))
    cand = prepare_candidate(plan, None, "external", "t", num_stages=len(stages), n_microbatches=N, num_ranks=S,
                             fsdp=True, stage_to_rank=owner)
    assert {r: [str(a) for a in acts] for r, acts in cand.lowered.items()} == _torch_lowering(plan, len(stages))


def test_waits_exist_exactly_where_the_gate_says():
    plan, _ = builtin_plan("1F1B", S, N)
    cand = prepare_candidate(plan, None, "external", "t", num_stages=S, n_microbatches=N, num_ranks=S)
    kinds = Counter(a.computation_type.value for acts in cand.lowered.values() for a in acts)
    sends = kinds["SEND_F"] + kinds["SEND_B"]
    assert sends == 2 * (S - 1) * N
    if has_wait_actions():
        assert kinds["WAIT_SEND_F"] + kinds["WAIT_SEND_B"] == sends
        assert kinds["WAIT_REDUCE_GRAD"] == kinds["REDUCE_GRAD"] == S
    else:
        assert not any(k.startswith("WAIT") for k in kinds)


@needs_waits
def test_forward_send_waits_follow_the_local_backward_and_reduce_waits_follow_their_reduction():
    plan, _ = builtin_plan("1F1B", S, N)
    cand = prepare_candidate(plan, None, "external", "t", num_stages=S, n_microbatches=N, num_ranks=S)
    for acts in cand.lowered.values():
        text = [str(a) for a in acts]
        for i, a in enumerate(text):
            if "WAIT_SEND_F" in a:
                s, m = a.split("WAIT_SEND_F")
                assert text.index(f"{s}SEND_F{m}") < text.index(f"{s}B{m}") < i
            if a.endswith("REDUCE_GRAD") and "WAIT" not in a:
                assert text[i + 1] == a.replace("REDUCE_GRAD", "WAIT_REDUCE_GRAD")


@needs_waits
def test_dry_run_rejects_a_send_without_its_wait():
    plan, _ = builtin_plan("1F1B", S, N)
    cand = prepare_candidate(plan, None, "external", "t", num_stages=S, n_microbatches=N, num_ranks=S)
    lowered = {r: list(a) for r, a in cand.lowered.items()}
    torch_dry_run_lowered(lowered, cand.mapping, S)  # as lowered: fine
    lowered[0] = [a for a in lowered[0] if str(a) != "0WAIT_SEND_F3"]
    with pytest.raises(PlanValidationError, match="no matching wait"):
        torch_dry_run_lowered(lowered, cand.mapping, S)


# -- the executor's handlers, on recording fakes (no process group) ---------------------------------
class _Handle:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait(self):
        self.log.append(("waited", self.name))


class _Transport:
    def __init__(self, log):
        self.log = log

    def issue(self, action, ops):
        return [_Handle(self.log, str(action))]


class _Stage:
    stage_index, is_first, is_last = 0, True, False
    submod = torch.nn.Linear(1, 1)

    def __init__(self, log):
        self.log = log

    def get_fwd_send_ops(self, mb):
        return []

    def release_fwd_send_outputs(self, mb):
        self.log.append(("release", mb))

    def perform_reduce_grad(self, scale):
        self.log.append(("reduce", scale))

    def start_gradient_reduction(self):
        self.log.append(("start_reduce",))

    def wait_for_gradient_reduction(self, scale):
        self.log.append(("wait_reduce", scale))


def _run(actions, fsdp=False, finalize=True, monkeypatch=None):
    log: list = []
    sched = SimpleNamespace(_comp_type_to_function_map={}, backward_counter=Counter(), _finalized_stages=set(),
                            _deferred_stages=set(), unsharded_stages=set(), _n_microbatches=2, scale_grads=True,
                            _finalize_gradients=finalize, stage_index_to_group_rank={0: 0, 1: 1}, rank=0,
                            unshard_ops={})
    monkeypatch.setattr(ex, "uses_fsdp", lambda stage: fsdp)
    ctx = ex.RunContext(sched, {0: _Stage(log)}, [], [], None, None)
    ex.Executor(torch.device("cpu"), transport=_Transport(log)).run([ts._Action.from_str(a) for a in actions], ctx)
    return log, sched


@needs_waits
def test_executor_waits_a_send_at_its_wait_and_releases_the_outputs_then(monkeypatch):
    log, _ = _run(["0SEND_F0", "0SEND_F1", "0WAIT_SEND_F1", "0REDUCE_GRAD", "0WAIT_SEND_F0", "0WAIT_REDUCE_GRAD"],
                  monkeypatch=monkeypatch)
    assert log == [("waited", "0SEND_F1"), ("release", 1), ("reduce", 2), ("waited", "0SEND_F0"), ("release", 0)]


@needs_waits
def test_executor_refuses_a_send_without_wait(monkeypatch):
    with pytest.raises(AssertionError, match="no matching wait"):
        _run(["0SEND_F0"], monkeypatch=monkeypatch)


@needs_waits
@pytest.mark.parametrize("finalize", [True, False])
def test_executor_fsdp_reduction_starts_then_waits_or_is_deferred(monkeypatch, finalize):
    log, sched = _run(["0REDUCE_GRAD", "0WAIT_REDUCE_GRAD"], fsdp=True, finalize=finalize, monkeypatch=monkeypatch)
    if finalize:  # 2.15: start, then wait + scale by n_microbatches; the stage counts as finalized
        assert log == [("start_reduce",), ("wait_reduce", 2)] and sched._finalized_stages == {0}
    else:  # step(finalize_gradients=False): nothing reduced, the stage stays unsharded for the next step
        assert log == [] and sched._deferred_stages == {0}


@pytest.mark.skipif(has_wait_actions(), reason="torch >= 2.15 waits each send at its WAIT_SEND")
def test_executor_without_waits_waits_every_send_at_the_end(monkeypatch):
    log, _ = _run(["0SEND_F0", "0REDUCE_GRAD", "0SEND_F1"], monkeypatch=monkeypatch)
    assert log[0] == ("reduce", 2) and sorted(log[1:]) == [("waited", "0SEND_F0"), ("waited", "0SEND_F1")]


# --------------------------------------------------------------------------- torch 2.15's runtime keywords

_RUNTIME_OPTIONS = {
    "defaults": {},
    "fsdp_residency": {"max_active_stages": 1, "unshard_lookahead": "auto"},
    "deferred_reduce_wait": {"defer_reduce_grad_wait": True},
    "send_budget": {"max_outstanding_sends": 1},
    "all": {"max_active_stages": 2, "unshard_lookahead": "auto", "defer_reduce_grad_wait": True,
            "max_outstanding_sends": 2},
}


@needs_waits
@pytest.mark.parametrize("name", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"])
@pytest.mark.parametrize("options", sorted(_RUNTIME_OPTIONS))
def test_runtime_keywords_lower_as_torchs_runtime_lowers_them(name, options):
    """max_active_stages / unshard_lookahead / defer_reduce_grad_wait / max_outstanding_sends: our
    lowering (what every deployed plan, re-plans included, goes through) equals torch 2.15's own
    ``_prepare_schedule_with_comms`` with the same keywords -- and they do change the lowering."""
    from titan_ext.runtime._torch_compat import RUNTIME_KWARGS, lowering_options

    plan, _ = builtin_plan(name, S, N)
    stages = sorted({a.stage_index for acts in plan.values() for a in acts})
    owner = tuple(r for s in stages for r, acts in plan.items() if any(a.stage_index == s for a in acts))
    values = {**RUNTIME_KWARGS, **_RUNTIME_OPTIONS[options]}
    torch_sched = object.__new__(ts._PipelineScheduleRuntime)
    for k, v in dict(_defer_pp_recv=False, _n_microbatches=N, _num_stages=len(stages), pp_group_size=S, _stages=[],
                     stage_index_to_group_rank={}, **{f"_{k}": v for k, v in values.items()}).items():
        setattr(torch_sched, k, v)
    torch_sched._prepare_schedule_with_comms({r: list(a) for r, a in plan.items()})
    want = {r: [str(a) for a in acts] for r, acts in torch_sched.pipeline_order_with_comms.items()}
    cand = prepare_candidate(plan, None, "external", "t", num_stages=len(stages), n_microbatches=N, num_ranks=S,
                             fsdp=True, stage_to_rank=owner, lowering=lowering_options(torch_sched))
    assert {r: [str(a) for a in acts] for r, acts in cand.lowered.items()} == want
    if options != "defaults" and not (options == "fsdp_residency" and name == "1F1B"):  # 1 stage a rank: no residency
        default = prepare_candidate(plan, None, "external", "t", num_stages=len(stages), n_microbatches=N,
                                    num_ranks=S, fsdp=True, stage_to_rank=owner)
        assert {r: [str(a) for a in acts] for r, acts in default.lowered.items()} != want


def test_runtime_keywords_are_gated_by_torch_version():
    from titan_ext.runtime._torch_compat import check_runtime_kwargs

    assert check_runtime_kwargs({}, version=(2, 13)) == {}
    assert check_runtime_kwargs({"max_outstanding_sends": 2}, version=(2, 15)) == {"max_outstanding_sends": 2}
    with pytest.raises(TypeError, match=r"max_outstanding_sends: torch 2\.15's runtime options; torch 2\.13 has no"):
        check_runtime_kwargs({"max_outstanding_sends": 2}, version=(2, 13))
    with pytest.raises(TypeError, match=r"defer_pp_recv .*max_active_stages, unshard_lookahead"):
        check_runtime_kwargs({"defer_pp_recv": True}, version=(2, 15))


@needs_waits
def test_a_bad_runtime_keyword_value_is_refused_by_torchs_own_check():
    from titan_ext.runtime._torch_compat import lowering_options

    sched = SimpleNamespace(_max_active_stages=2, _unshard_lookahead=(1, 2, 3), pp_group_size=S)
    with pytest.raises(ValueError, match="unshard_lookahead tuple length must equal the pipeline degree"):
        lowering_options(sched)
