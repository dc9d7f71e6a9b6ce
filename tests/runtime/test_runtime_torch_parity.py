"""Drop-in parity with torch's own schedules, in the spirit of torch's
test/distributed/pipelining/test_schedule_multiproc.py, written in our own words.

Two gloo ranks, float64, a deterministic MLP. Every scenario is checked against an independent
single-process reference (the whole model run microbatch by microbatch: per-microbatch losses, the
concatenated outputs, gradients summed over microbatches) and, where one exists, against torch's
matching built-in schedule on the same stages:

* a deployed plan whose last stage runs its forwards out of microbatch order: ``step()`` returns the
  outputs in microbatch order (torch merges ``output_chunks`` as appended);
* a FORWARD custom function registered with torch's ``register_custom_function``, written as torch's
  test writes it (it calls ``schedule._maybe_compute_loss``), one stage per rank and "v";
* n_microbatches < stages with two stages per rank ("loop" vs Interleaved1F1B, "v" vs ZBV);
* ``eval()`` (losses and outputs, no gradients), gradient accumulation over two steps without
  ``zero_grad``, model kwargs split by a kwargs chunk spec;
* errors name the class in use.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as Fn

from titan_ext.plan.virtual import virtual_stage_to_rank
from titan_ext.testing import mlp_stages, run_ranks, seeded_batch

pytestmark = pytest.mark.timeout(300)

R, DIM, BATCH = 2, 8, 8
RTOL = 1e-10


class ScaledStage(nn.Module):
    """A stage that takes a keyword argument (split per microbatch by a kwargs chunk spec)."""

    def __init__(self, inner: nn.Module, first: bool):
        super().__init__()
        self.inner, self.first = inner, first

    def forward(self, x, scale=None):
        return self.inner(x * scale if self.first and scale is not None else x)


def _reference(n_stages: int, n_mb: int, x, y, scale=None):
    """Whole model, microbatch by microbatch: (losses, outputs, grads per stage module)."""
    mods = mlp_stages(n_stages, DIM)
    losses, outs = [], []
    for xm, ym, sm in zip(x.chunk(n_mb), y.chunk(n_mb), (scale.chunk(n_mb) if scale is not None else [None] * n_mb)):
        h = xm * sm if sm is not None else xm
        for m in mods:
            h = m(h)
        loss = Fn.mse_loss(h, ym)
        loss.backward()
        losses.append(loss.detach())
        outs.append(h.detach())
    grads = [[p.grad.clone() for p in m.parameters()] for m in mods]
    return torch.stack(losses), torch.cat(outs), grads


def _stages(local: list[int], n_stages: int, kwargs: bool = False):
    from torch.distributed.pipelining import PipelineStage

    mods = mlp_stages(n_stages, DIM)
    wrapped = {s: (ScaledStage(mods[s], s == 0) if kwargs else mods[s]) for s in local}
    return [PipelineStage(wrapped[s], s, n_stages, torch.device("cpu")) for s in local], wrapped


def _run(sched, local, n_stages, x, y, *, steps=1, kwargs=None, method="step"):
    """``steps`` calls of step()/eval() with this rank's share; returns (losses, outputs) of the last."""
    losses: list = []
    args = (x,) if 0 in local else ()
    extra = dict(kwargs or {}) if 0 in local else {}
    if n_stages - 1 in local:
        extra.update(target=y, losses=losses)
    out = None
    for _ in range(steps):
        out = getattr(sched, method)(*args, **extra)
    return ([float(v) for v in losses] if losses else None), (out.detach() if out is not None else None)


def _grads(mods: dict) -> dict:
    return {s: [p.grad.clone() if p.grad is not None else None for p in m.parameters()] for s, m in mods.items()}


def _reversed_plan(n_mb: int) -> dict:
    """Both ranks forward microbatches N−1 … 0 (the same order on both ends of the link), then full
    backwards 0 … N−1: the last stage's forwards run out of microbatch order."""
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    F, B = _ComputationType.FORWARD, _ComputationType.FULL_BACKWARD
    return {r: [_Action(r, F, m) for m in reversed(range(n_mb))] + [_Action(r, B, m) for m in range(n_mb)]
            for r in range(R)}


def _forward_callback(calls: list):
    """A FORWARD custom function as torch's own test writes one (it computes the loss through the
    schedule's ``_maybe_compute_loss``)."""
    from torch.distributed.pipelining.schedules import _wait_batch_p2p

    def forward(action, ctx):
        schedule = ctx.schedule_ref
        by_index = {st.stage_index: st for st in schedule._stages}
        stage, mb = by_index[action.stage_index], action.microbatch_index
        calls.append((action.stage_index, mb))
        if not stage.is_first and action.stage_index - 1 not in by_index:
            _wait_batch_p2p(schedule.fwd_recv_ops.pop((action.stage_index, mb)))
        output = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb])
        schedule._maybe_compute_loss(stage, output, ctx.target_mbs, mb)
        if action.stage_index + 1 in by_index:
            by_index[action.stage_index + 1].set_local_fwd_input(output, mb)

    return forward


def _worker(rank: int, world: int) -> dict:
    from torch.distributed.pipelining import (ScheduleInterleaved1F1B, ScheduleZBVZeroBubble)
    from torch.distributed.pipelining.microbatch import TensorChunkSpec
    from torch.distributed.pipelining.schedules import _ComputationType

    from titan_ext.runtime import CrossPipe, PipeMorph

    x, y = seeded_batch(7, BATCH, DIM)
    out: dict = {}

    # out-of-order last-stage forwards, deployed by the user (one stage per rank)
    N = 4
    stages, mods = _stages([rank], R)
    sched = PipeMorph(stages, N, loss_fn=Fn.mse_loss, scale_grads=False, adaptive=False)
    out["deployed"] = sched.deploy(_reversed_plan(N), reason="reversed forwards")
    out["reversed"] = (*_run(sched, [rank], R, x, y), _grads(mods))

    # a FORWARD custom function through torch's API: one stage per rank, then "v" with 2 stages per rank
    for placement, V in (("one", 1), ("v", 2)):
        S = R * V
        local = [s for s, r in enumerate(virtual_stage_to_rank(R, V, "v")) if r == rank] if V > 1 else [rank]
        stages, mods = _stages(local, S)
        sched = PipeMorph(stages, 2 * S, loss_fn=Fn.mse_loss, scale_grads=False)
        calls: list = []
        sched.register_custom_function(_ComputationType.FORWARD, _forward_callback(calls))
        out[f"custom_{placement}"] = (*_run(sched, local, S, x, y), _grads(mods), len(calls))

    # n_microbatches < stages with two stages per rank, against torch's matching built-in
    for placement, torch_cls in (("loop", ScheduleInterleaved1F1B), ("v", ScheduleZBVZeroBubble)):
        S = 2 * R
        local = [s for s, r in enumerate(virtual_stage_to_rank(R, 2, placement)) if r == rank]
        for name, make in (("ours", lambda st: PipeMorph(st, R, loss_fn=Fn.mse_loss, scale_grads=False)),
                           ("torch", lambda st: torch_cls(st, R, loss_fn=Fn.mse_loss, scale_grads=False))):
            stages, mods = _stages(local, S)
            out[f"few_{placement}_{name}"] = (*_run(make(stages), local, S, x, y), _grads(mods))

    # [titan_ext] settings arrive as a plain ReplanPolicy: with two stages per rank the multi-stage policy
    # runs, with the same thresholds
    from titan_ext.runtime import ReplanPolicy

    local = [s for s, r in enumerate(virtual_stage_to_rank(R, 2, "v")) if r == rank]
    stages, _ = _stages(local, 2 * R)
    sched = PipeMorph(stages, 4, loss_fn=Fn.mse_loss, policy=ReplanPolicy(window=5, rel_margin=0.3))
    out["policy"] = (type(sched.policy).__name__, sched.policy.window, sched.policy.rel_margin)

    # eval(): losses and outputs, no gradients
    stages, mods = _stages([rank], R)
    sched = PipeMorph(stages, 4, loss_fn=Fn.mse_loss, scale_grads=False)
    out["eval"] = (*_run(sched, [rank], R, x, y, method="eval"), _grads(mods))

    # gradient accumulation: two steps without zero_grad
    stages, mods = _stages([rank], R)
    sched = PipeMorph(stages, 4, loss_fn=Fn.mse_loss, scale_grads=False)
    out["accumulate"] = (*_run(sched, [rank], R, x, y, steps=2), _grads(mods))

    # model kwargs split by a kwargs chunk spec
    scale = torch.linspace(0.5, 1.5, BATCH, dtype=torch.float64).unsqueeze(1)
    stages, mods = _stages([rank], R, kwargs=True)
    sched = PipeMorph(stages, 4, loss_fn=Fn.mse_loss, scale_grads=False,
                      kwargs_chunk_spec={"scale": TensorChunkSpec(0)})
    out["kwargs"] = (*_run(sched, [rank], R, x, y, kwargs={"scale": scale}), _grads(mods))

    # errors name the class in use
    stages, _ = _stages([rank], R)
    try:
        CrossPipe(stages, 1, loss_fn=Fn.mse_loss)
        out["error"] = None
    except ValueError as exc:
        out["error"] = str(exc)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, R)


def _last(results, key, last_rank=R - 1):
    return results[last_rank][key]


def _check_grads(results, key, ref_grads, factor=1.0):
    for res in results:
        for s, grads in res[key][2].items():
            for g, ref in zip(grads, ref_grads[s]):
                torch.testing.assert_close(g, factor * ref, rtol=RTOL, atol=1e-12)


@pytest.mark.multiprocess
def test_outputs_are_merged_in_microbatch_order_for_a_plan_with_reversed_last_stage_forwards(results):
    ref_losses, ref_out, ref_grads = _reference(R, 4, *seeded_batch(7, BATCH, DIM))
    assert all(res["deployed"] for res in results)
    losses, outputs, _ = _last(results, "reversed")
    torch.testing.assert_close(outputs, ref_out, rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), ref_losses, rtol=RTOL, atol=0)
    _check_grads(results, "reversed", ref_grads)


@pytest.mark.multiprocess
@pytest.mark.parametrize("placement, V", [("one", 1), ("v", 2)])
def test_a_forward_custom_function_written_as_torchs_test_writes_it(results, placement, V):
    S = R * V
    ref_losses, ref_out, ref_grads = _reference(S, 2 * S, *seeded_batch(7, BATCH, DIM))
    last_rank = R - 1 if V == 1 else 0  # "v": the last stage lives on rank 0
    losses, outputs, _, _ = results[last_rank][f"custom_{placement}"]
    torch.testing.assert_close(outputs, ref_out, rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), ref_losses, rtol=RTOL, atol=0)
    _check_grads(results, f"custom_{placement}", ref_grads)
    for res in results:  # every forward of this rank's stages went through the custom function
        assert res[f"custom_{placement}"][3] == V * 2 * S


@pytest.mark.multiprocess
@pytest.mark.parametrize("placement", ["loop", "v"])
def test_fewer_microbatches_than_stages_with_two_stages_per_rank(results, placement):
    S = 2 * R
    ref_losses, ref_out, ref_grads = _reference(S, R, *seeded_batch(7, BATCH, DIM))
    last_rank = virtual_stage_to_rank(R, 2, placement)[S - 1]
    for name in ("ours", "torch"):
        losses, outputs, _ = results[last_rank][f"few_{placement}_{name}"]
        torch.testing.assert_close(outputs, ref_out, rtol=RTOL, atol=0)
        torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), ref_losses, rtol=RTOL, atol=0)
        _check_grads(results, f"few_{placement}_{name}", ref_grads)


@pytest.mark.multiprocess
def test_eval_returns_losses_and_outputs_and_leaves_gradients_alone(results):
    ref_losses, ref_out, _ = _reference(R, 4, *seeded_batch(7, BATCH, DIM))
    losses, outputs, _ = _last(results, "eval")
    torch.testing.assert_close(outputs, ref_out, rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), ref_losses, rtol=RTOL, atol=0)
    for res in results:
        assert all(g is None for grads in res["eval"][2].values() for g in grads)


@pytest.mark.multiprocess
def test_two_steps_without_zero_grad_accumulate_twice_the_gradient(results):
    ref_losses, _, ref_grads = _reference(R, 4, *seeded_batch(7, BATCH, DIM))
    losses, _, _ = _last(results, "accumulate")
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), ref_losses, rtol=RTOL, atol=0)
    _check_grads(results, "accumulate", ref_grads, factor=2.0)


@pytest.mark.multiprocess
def test_model_kwargs_are_split_by_the_kwargs_chunk_spec(results):
    scale = torch.linspace(0.5, 1.5, BATCH, dtype=torch.float64).unsqueeze(1)
    ref_losses, ref_out, ref_grads = _reference(R, 4, *seeded_batch(7, BATCH, DIM), scale=scale)
    losses, outputs, _ = _last(results, "kwargs")
    torch.testing.assert_close(outputs, ref_out, rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), ref_losses, rtol=RTOL, atol=0)
    for res in results:  # the wrapper adds no parameters: compare the wrapped MLP's gradients
        for s, grads in res["kwargs"][2].items():
            for g, ref in zip(grads, ref_grads[s]):
                torch.testing.assert_close(g, ref, rtol=RTOL, atol=1e-12)


@pytest.mark.multiprocess
def test_errors_name_the_class_in_use(results):
    for res in results:
        assert res["error"] is not None and res["error"].startswith("CrossPipe"), res["error"]
        assert "PipeMorph" not in res["error"]


@pytest.mark.multiprocess
def test_titan_settings_reach_the_multi_stage_policy(results):
    """titan/options.py passes a ReplanPolicy built from [titan_ext]; with several stages per rank the
    schedule must run VirtualReplanPolicy with those thresholds (it used to keep the one-stage policy)."""
    for res in results:
        assert res["policy"] == ("VirtualReplanPolicy", 5, 0.3)
