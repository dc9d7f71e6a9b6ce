"""runtime/execute/executor.py: the action loop on two local stages against plain autograd (moved from
test_runtime_parts.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as Fn
from torch.distributed.pipelining import schedules as torch_schedules


@pytest.fixture
def single_rank_group():
    """torch's PipelineStage asks the default group for its rank: a one-rank in-memory gloo group."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()



def _two_local_stages(n: int, seed: int):
    """Two MLP stages on one rank under torch's runtime (which owns the per-step state: receive tables,
    counters, loss) set up for a training step, a reference copy of the modules, and ``n`` microbatches."""
    from titan_ext.testing import mlp_stages
    from titan_ext.runtime import _torch_compat
    from torch.distributed.pipelining import PipelineStage

    mods, ref = mlp_stages(2, 8), mlp_stages(2, 8)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 8, generator=g, dtype=torch.float64), torch.randn(8, 8, generator=g, dtype=torch.float64)
    stages = [PipelineStage(mods[i], i, 2, torch.device("cpu")) for i in range(2)]
    sched = torch_schedules._PipelineScheduleRuntime(stages, n, loss_fn=Fn.mse_loss, scale_grads=False)
    arg_mbs, kwarg_mbs = sched._split_inputs((x,), {})
    ys = list(y.chunk(n))
    for st in stages:  # what step() sets for a training step
        st.has_backward = True
    _torch_compat.initialize_stages(sched, arg_mbs[0], kwarg_mbs[0], ys[0], None)
    return mods, ref, stages, sched, arg_mbs, kwarg_mbs, ys


def test_executor_runs_two_local_stages_like_autograd(single_rank_group):
    """Two stages on one rank (no communication): a split-backward action list runs through the
    executor; losses and gradients equal plain autograd's, every compute action is timed."""
    from titan_ext.runtime.execute.executor import Executor, RunContext

    n = 4
    mods, ref, stages, sched, arg_mbs, kwarg_mbs, ys = _two_local_stages(n, seed=0)
    xs = [a[0] for a in arg_mbs]
    from torch.distributed.pipelining.schedules import _Action, _ComputationType as C
    # F all, then per microbatch I on stage 1 and 0, then all W (a split-backward order)
    actions = [_Action(s, C.FORWARD, m) for m in range(n) for s in (0, 1)]
    actions += [_Action(s, C.BACKWARD_INPUT, m) for m in range(n) for s in (1, 0)]
    actions += [_Action(s, C.BACKWARD_WEIGHT, m) for m in range(n) for s in (1, 0)]
    ex = Executor(torch.device("cpu"))
    ctx = RunContext(sched, {0: stages[0], 1: stages[1]}, arg_mbs, kwarg_mbs, ys, None)
    ex.run(actions, ctx)
    losses = [sched._internal_losses[m].item() for m in range(n)]  # torch's own loss state
    want = [Fn.mse_loss(ref[1](ref[0](a)), b) for a, b in zip(xs, ys)]
    sum(want).backward()
    assert losses == pytest.approx([w.item() for w in want], rel=1e-12)
    for mod, rmod in zip(mods, ref):
        for p, q in zip(mod.parameters(), rmod.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)
    assert sorted((r.kind, r.stage, r.microbatch) for r in ctx.profile.actions) == sorted(
        (a.computation_type.value, a.stage_index, a.microbatch_index) for a in actions)
    assert all(r.end >= r.start for r in ctx.profile.actions) and ex.activation_bytes > 0


def test_executor_prepares_a_changed_action_list_again(single_rank_group):
    """The executor keeps each action list's prepared steps between iterations: a different list — a new
    plan, or the same list object changed in place — must run as itself. Three iterations on one executor
    (split backward, then full backward in a new list, then that list changed in place back to a split
    backward): each runs the kinds its list names, and each iteration's gradients equal plain autograd's."""
    from titan_ext.runtime.execute.executor import Executor, RunContext
    from torch.distributed.pipelining.schedules import _Action, _ComputationType as C

    n = 4
    mods, ref, stages, sched, arg_mbs, kwarg_mbs, ys = _two_local_stages(n, seed=1)
    forwards = [_Action(s, C.FORWARD, m) for m in range(n) for s in (0, 1)]
    split = forwards + [_Action(s, C.BACKWARD_INPUT, m) for m in range(n) for s in (1, 0)] + [
        _Action(s, C.BACKWARD_WEIGHT, m) for m in range(n) for s in (1, 0)]
    full = forwards + [_Action(s, C.FULL_BACKWARD, m) for m in range(n) for s in (1, 0)]
    ex = Executor(torch.device("cpu"))
    for step, actions in enumerate((split, full, full)):
        if step == 2:
            actions[len(forwards):] = split[len(forwards):]  # the same list object, changed in place
        for mod in mods + ref:
            mod.zero_grad()
        for st in stages:  # what torch's step() does before each iteration
            st.clear_runtime_states()
        sched._internal_losses.clear()
        ctx = RunContext(sched, {0: stages[0], 1: stages[1]}, arg_mbs, kwarg_mbs, ys, None)
        ex.run(actions, ctx)
        kinds = sorted({r.kind for r in ctx.profile.actions})
        assert kinds == sorted({a.computation_type.value for a in actions}), (step, kinds)
        sum(Fn.mse_loss(ref[1](ref[0](a[0])), b) for a, b in zip(arg_mbs, ys)).backward()
        for mod, rmod in zip(mods, ref):
            for p, q in zip(mod.parameters(), rmod.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)
