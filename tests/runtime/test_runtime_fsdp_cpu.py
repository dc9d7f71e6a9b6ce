"""PipeMorph over FSDP2 stages for real, on the CPU: ``fully_shard`` over gloo, DP 2 x PP 2.

Four gloo ranks, float64: each pipeline stage of a deterministic MLP is ``fully_shard``-ed over its DP
pair (mesh ``("pp", "dp")``), and PipeMorph lowers every plan with FSDP's UNSHARD / RESHARD /
REDUCE_GRAD (and, on torch >= 2.15, WAIT_REDUCE_GRAD: the reduction started in REDUCE_GRAD and waited
in WAIT_REDUCE_GRAD -- ``start_gradient_reduction`` / ``wait_for_gradient_reduction``). The gradients
after ``step()`` -- FSDP's reduce-scatter over DP, gathered back with ``full_tensor()`` -- must equal an
independent single-process reference: the whole model, both replicas' batches, microbatch by
microbatch, the DP mean (FSDP's default divide factor). On torch >= 2.15 also:
``step(finalize_gradients=False)`` then ``step()`` equals one reference over both steps' batches, and
torch 2.15's runtime keywords (``max_active_stages``, ``defer_reduce_grad_wait``,
``max_outstanding_sends``) are taken and run. And Falcon's DP gradient sum over DTensor (FSDP2)
gradients, as FalconJob runs it under TorchTitan 0.3, sums the local shards.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as Fn

from titan_ext.runtime._torch_compat import has_wait_actions
from titan_ext.testing import mlp_stages, run_ranks, seeded_batch

pytestmark = pytest.mark.timeout(300)

PP, DP, DIM, BATCH, N = 2, 2, 8, 8, 4
RTOL = 1e-10


def _reference(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[list[torch.Tensor]]:
    """Gradients of the whole model: sum over every batch's microbatches of the (sum) MSE, / DP."""
    mods = mlp_stages(PP, DIM)
    for x, y in batches:
        for xm, ym in zip(x.chunk(N), y.chunk(N)):
            h = xm
            for m in mods:
                h = m(h)
            Fn.mse_loss(h, ym, reduction="sum").backward()
    return [[p.grad / DP for p in m.parameters()] for m in mods]


def _batch(step: int, dp: int):
    return seeded_batch(100 * step + dp, BATCH, DIM)


#: (name, steps with finalize_gradients=False first, runtime keywords); the last two need torch >= 2.15
SCENARIOS = [("one step", False, {}),
             ("unfinalized then finalized step, torch 2.15 keywords", True,
              {"max_active_stages": 1, "defer_reduce_grad_wait": True, "max_outstanding_sends": 1})]


def _scenarios() -> list:
    return SCENARIOS if has_wait_actions() else SCENARIOS[:1]


def _run(rank: int, world: int) -> dict:
    """Every scenario in one process group (one spawn): this rank's full gradients after each."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (PP, DP, 1), mesh_dim_names=("pp", "dp", "fsdp"))
    out = {name: _run_scenario(mesh, unfinalized_first, kwargs) for name, unfinalized_first, kwargs in _scenarios()}
    out["falcon sum"] = _falcon_sum_of_dtensor_grads(mesh)
    return out


def _falcon_sum_of_dtensor_grads(mesh) -> list[torch.Tensor]:
    """Falcon's DP gradient sum (``weighted_all_reduce_gradients``) as FalconJob runs it under TorchTitan
    0.3: every stage ``fully_shard``-ed over the size-1 ``fsdp`` mesh (its parameters and gradients are
    DTensors, its reduction has no peer), the replicas summed by Falcon over ``dp``: the full gradients
    come out as the sum over replicas, DP times the reference's DP mean."""
    from titan_ext.runtime.falcon.redistribute import weighted_all_reduce_gradients

    module = _run_scenario(mesh, False, {}, return_module=True, shard_over="fsdp")
    weighted_all_reduce_gradients(module.parameters(), 1.0, mesh["dp"].get_group())
    return [p.grad.full_tensor() for p in module.parameters()]


def _run_scenario(mesh, unfinalized_first: bool, runtime_kwargs: dict, return_module: bool = False,
                  shard_over: str = "dp"):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage

    from titan_ext.runtime import PipeMorph

    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    module = mlp_stages(PP, DIM)[pp]
    fully_shard(module, mesh=mesh[shard_over])
    stage = PipelineStage(module, pp, PP, torch.device("cpu"), group=mesh["pp"].get_group())
    sched = PipeMorph([stage], N, loss_fn=lambda out, y: Fn.mse_loss(out, y, reduction="sum"),
                      scale_grads=False, adaptive=False, **runtime_kwargs)
    for k in ([0, 1] if unfinalized_first else [0]):
        x, y = _batch(k, dp)
        kwargs = {"finalize_gradients": False} if (unfinalized_first and k == 0) else {}
        if pp == 0:
            sched.step(x, **kwargs)
        else:
            sched.step(target=y, **kwargs)
    return module if return_module else [p.grad.full_tensor() for p in module.parameters()]


@pytest.mark.multiprocess
def test_fsdp_stages_gradients_equal_the_reference():
    results = run_ranks(_run, PP * DP, backend="gloo")
    for name, unfinalized_first, _ in _scenarios():
        ref = _reference([_batch(k, dp) for k in ([0, 1] if unfinalized_first else [0]) for dp in range(DP)])
        for rank, by_name in enumerate(results):
            grads, want = by_name[name], ref[rank // DP]
            assert len(grads) == len(want), name
            for got, w in zip(grads, want):
                torch.testing.assert_close(got, w, rtol=RTOL, atol=0, msg=lambda m: f"{name}, rank {rank}: {m}")
    ref = _reference([_batch(0, dp) for dp in range(DP)])
    for rank, by_name in enumerate(results):
        for got, w in zip(by_name["falcon sum"], ref[rank // DP]):
            torch.testing.assert_close(got, DP * w, rtol=RTOL, atol=0)
