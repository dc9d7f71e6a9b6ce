"""Small models, batches and step helpers of the multi-process tests and benchmarks (one stage per
rank unless said): deterministic MLP stages, seeded batches, torch's GPipe as the reference run,
calibrated-sleep stages (emulated device compute) and a tiny transformer slice.

Tensors made here are the user's side of a job (the model, its batches): the ``nccl_rules`` backend
treats them as device tensors (:data:`titan_ext.testing.nccl_rules.DEVICE_LAYER_MODULES`).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn


def seeded_batch(seed: int, batch: int, dim: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of one step, the same on every rank (one generator seeded with ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, dim, generator=g, dtype=dtype), torch.randn(batch, dim, generator=g, dtype=dtype))


def timed_step(optimizer: Any, step: Callable[[], Any]) -> float:
    """One benchmark iteration: barrier, ``step()`` between ``zero_grad`` and the optimizer step, and
    the slowest rank's wall time of it in ms (MAX all-reduce, so every rank returns the same)."""
    dist.barrier()
    t0 = time.perf_counter()
    optimizer.zero_grad()
    step()
    elapsed = torch.tensor([1e3 * (time.perf_counter() - t0)], dtype=torch.float64)
    optimizer.step()
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def step_rank(schedule: Any, rank: int, world: int, x: Any, y: Any, losses: list | None = None) -> None:
    """One ``schedule.step`` with this rank's share of the data: inputs on the first stage, targets
    (and the loss list) on the last, nothing in between (one stage per rank)."""
    if world == 1:
        schedule.step(x, target=y, losses=losses)
    elif rank == 0:
        schedule.step(x)
    elif rank == world - 1:
        schedule.step(target=y, losses=losses)
    else:
        schedule.step()


def sgd_step(schedule: Any, optimizer: Any, rank: int, world: int, x: Any, y: Any) -> list[float]:
    """One training step: ``zero_grad``, :func:`step_rank`, the optimizer's step; this rank's losses."""
    losses: list = []
    optimizer.zero_grad()
    step_rank(schedule, rank, world, x, y, losses)
    optimizer.step()
    return [float(v) for v in losses]


def counted_sgd_step(schedule: Any, optimizer: Any, rank: int, world: int, x: Any, y: Any) -> tuple[list, Any]:
    """:func:`sgd_step` with the host syncs of ``step_rank`` + the optimizer's step counted
    (:func:`titan_ext.testing.host_syncs.counting`), not those of the ``zero_grad``: (this rank's losses,
    unread, so that the caller decides whether their read is counted; the count)."""
    from . import host_syncs

    losses: list = []
    optimizer.zero_grad()
    with host_syncs.counting() as syncs:
        step_rank(schedule, rank, world, x, y, losses)
        optimizer.step()
    return losses, syncs


def train_steps(rank: int, world: int, make: Callable[[Any], Any], steps: int, *, dim: int, batch: int,
                seed_base: int = 1000, lr: float = 0.05) -> tuple[Any, list[list[float]], list[torch.Tensor]]:
    """SGD-train ``mlp_stages(world, dim)[rank]`` for ``steps`` steps on two ranks' schedule
    ``make(PipelineStage)``, step k's data ``seeded_batch(seed_base + k, batch, dim)`` (inputs on rank
    0, targets on the other). Returns (schedule, losses per step, parameters after training)."""
    from torch.distributed.pipelining import PipelineStage

    mods = mlp_stages(world, dim)
    sched = make(PipelineStage(mods[rank], rank, world, torch.device("cpu")))
    opt = torch.optim.SGD(mods[rank].parameters(), lr=lr)
    losses = [sgd_step(sched, opt, rank, world, *seeded_batch(seed_base + k, batch, dim)) for k in range(steps)]
    return sched, losses, [p.detach().clone() for p in mods[rank].parameters()]


def static_stage_shapes(example: torch.Tensor) -> dict[str, torch.Tensor]:
    """``PipelineStage`` keyword arguments that fix a stage's message shapes (no shape inference, whose
    metadata messages would be device tensors on a gloo group), for a stage whose input and output are
    both shaped like ``example``.  torch >= 2.13 also takes the gradients' shapes (``output_grads``,
    ``input_grads``) and, in this static mode, takes ``requires_grad`` from the examples: an activation
    example without it makes the received activations leaves that need no gradient, so no gradient
    reaches the earlier stages and a split backward's W finds no weight to update (torch's own
    ``Schedule1F1B`` then trains stage 0 with zero gradients).  So the activation examples require grad."""
    import inspect

    from torch.distributed.pipelining import PipelineStage

    act = example.detach().clone().requires_grad_(example.is_floating_point())
    grad = example.detach().clone()
    wanted = {"input_args": act, "output_args": act, "output_grads": grad, "input_grads": grad}
    params = inspect.signature(PipelineStage.__init__).parameters
    return {k: v for k, v in wanted.items() if k in params}


def mlp_stages(num_stages: int, dim: int = 16, layers_per_stage: int = 2, seed: int = 0,
               dtype: torch.dtype = torch.float64) -> list[nn.Module]:
    """A deterministic MLP split into ``num_stages`` stage modules (same weights for every caller)."""
    gen = torch.Generator().manual_seed(seed)
    stages = []
    for _ in range(num_stages):
        mods: list[nn.Module] = []
        for _ in range(layers_per_stage):
            lin = nn.Linear(dim, dim, dtype=dtype)
            with torch.no_grad():
                lin.weight.copy_(torch.randn(dim, dim, generator=gen, dtype=dtype) / math.sqrt(dim))
                lin.bias.copy_(torch.randn(dim, generator=gen, dtype=dtype) * 0.1)
            mods += [lin, nn.Tanh()]
        stages.append(nn.Sequential(*mods))
    return stages


def gpipe_reference(rank: int, world: int, n_microbatches: int, steps: int,
                    step_fn: Callable[[Any, int], list[float]], dim: int = 16,
                    lr: float = 0.05) -> tuple[list[list[float]], list[torch.Tensor]]:
    """The reference run of equivalence tests: torch's ScheduleGPipe on ``mlp_stages(world, dim)``,
    ``steps`` SGD steps, ``step_fn(schedule, k)`` running step k and returning its losses.
    Returns (losses per step, this rank's parameters after training)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    mod = mlp_stages(world, dim)[rank]
    ref = ScheduleGPipe(PipelineStage(mod, rank, world, torch.device("cpu")), n_microbatches,
                        loss_fn=nn.functional.mse_loss)
    opt = torch.optim.SGD(mod.parameters(), lr=lr)
    losses = []
    for k in range(steps):
        opt.zero_grad()
        losses.append(step_fn(ref, k))
        opt.step()
    return losses, [p.detach().clone() for p in mod.parameters()]


class _SleepIdentity(torch.autograd.Function):
    """Identity that sleeps ``fwd_s`` in forward and ``bwd_s`` in backward (emulated device compute)."""

    @staticmethod
    def forward(ctx, x, fwd_s: float, bwd_s: float):  # type: ignore[override]
        if fwd_s > 0:
            time.sleep(fwd_s)
        ctx.bwd_s = bwd_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if ctx.bwd_s > 0:
            time.sleep(ctx.bwd_s)
        return grad, None, None


class SleepComputeStage(nn.Module):
    """A stage whose F / I / W take calibrated sleeps: F sleeps in forward, I on the input-gradient
    path, W on the weight-gradient path (so torch's split backward puts each sleep in its own action).
    Real tensors flow (``dim``-wide activations), so the PP messages have their real size."""

    def __init__(self, dim: int, f_ms: float, i_ms: float, w_ms: float, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(dim, dim, generator=gen) / math.sqrt(dim))
        self.f_s, self.i_s, self.w_s = f_ms / 1e3, i_ms / 1e3, w_ms / 1e3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = _SleepIdentity.apply(self.weight, 0.0, self.w_s)
        h = torch.tanh(x @ w)
        return _SleepIdentity.apply(h, self.f_s, self.i_s)


class TinyTransformerStage(nn.Module):
    """A slice of a small decoder-only transformer (embedding on stage 0, LM head on the last)."""

    def __init__(self, vocab: int, dim: int, n_layers: int, n_heads: int, first: bool, last: bool, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, dim) if first else None
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, n_heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(dim) if last else None
        self.head = nn.Linear(dim, vocab) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        seq = x.shape[1]
        mask = torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x
