"""Helpers for multi-process runtime tests and benchmarks: gloo on loopback, small models.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes (torch.multiprocessing, spawn),
initialises a process group on 127.0.0.1 with a free port, calls ``fn(rank, world_size, *args)``
and returns the per-rank return values (which must be picklable).  The backend is ``backend=``, else
``$TITAN_EXT_TEST_BACKEND``, else :data:`DEFAULT_BACKEND` (``nccl_rules``: NCCL's rules enforced on
CPU over gloo, :mod:`titan_ext.runtime.nccl_rules`; ``gloo``: plain gloo).  ``timeout_s=`` bounds
the run; ``outcomes=True`` lets ranks fail on purpose (fault tests) and returns ``(result, error)``
per rank.  The one ``run_ranks`` / ``free_port`` of the project's tests.
"""

from __future__ import annotations

import math
import os
import pickle
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: the backend of ``run_ranks`` when neither ``backend=`` nor ``$TITAN_EXT_TEST_BACKEND`` names one
DEFAULT_BACKEND = "nccl_rules"


def chosen_backend(backend: str | None = None) -> str:
    """The backend a multi-process test uses: ``backend``, ``$TITAN_EXT_TEST_BACKEND``, the default."""
    from .nccl_rules import ENV_VAR

    return backend or os.environ.get(ENV_VAR) or DEFAULT_BACKEND


def _entry(rank: int, fn: Callable, world_size: int, port: int, outdir: str, args: tuple, env: dict,
           backend: str, outcomes: bool = False) -> None:
    os.environ.update(env)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    path = os.path.join(outdir, f"rank{rank}.pkl")
    try:
        if backend == "nccl_rules":
            from .nccl_rules import install

            install()
        # outcomes: ranks may fail on purpose (fault tests), so the group's waits end after 2 minutes
        dist.init_process_group(backend, rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}",
                                **({"timeout": timedelta(seconds=120)} if outcomes else {}))
        result = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent, which stops the other ranks
        _write_result(path, ("error", traceback.format_exc()))
        os._exit(0 if outcomes else 1)  # outcomes: a failure is a result; the other ranks go on
    from .delay_injection import remove_link_delays

    remove_link_delays()
    if not outcomes:  # outcomes: another rank may have failed on purpose; nobody waits for it
        dist.barrier()
    dist.destroy_process_group()
    _write_result(path, result)
    # Skip interpreter finalisation (daemon threads, C++ destructors of process-group objects): the
    # result is on disk and the process group is already destroyed.
    os._exit(0)


def _write_result(path: str, result: tuple) -> None:
    """Atomically (a rank being terminated never leaves half a file)."""
    with open(path + ".tmp", "wb") as fh:
        pickle.dump(result, fh)
    os.replace(path + ".tmp", path)


def run_ranks(fn: Callable, world_size: int, *args: Any, env: dict | None = None,
              backend: str | None = None, timeout_s: float | None = None, outcomes: bool = False) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return the results by rank.
    ``backend``: see the module docstring (:func:`chosen_backend`).  ``timeout_s``: the ranks are
    killed and ``TimeoutError`` raised after this long (None: no limit).

    If a rank fails, the others are terminated and the failing rank's traceback is raised — unless
    ``outcomes``: then every rank runs to its end and each returns ``(result, None)`` or
    ``(None, traceback)`` (tests whose ranks fail on purpose, e.g. a killed delegate).
    """
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_entry, args=(fn, world_size, free_port(), outdir, args, env or {},
                                               chosen_backend(backend), outcomes),
                                 nprocs=world_size, join=False, start_method="spawn")
        try:
            _join(ctx, timeout_s)
        except TimeoutError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise RuntimeError("\n".join(f"rank {r} failed:\n{v}" for r, (s, v) in enumerate(_read_results(outdir, world_size))
                                         if s == "error") or str(exc)) from None
        results = _read_results(outdir, world_size)
    if outcomes:
        return [(value, None) if status == "ok" else (None, value) for status, value in results]
    for rank, (status, value) in enumerate(results):
        if status is None:
            raise RuntimeError(f"rank {rank} produced no result")
        if status != "ok":
            raise RuntimeError(f"rank {rank} failed:\n{value}")
    return [value for _, value in results]


def _join(ctx: Any, timeout_s: float | None) -> None:
    """Wait for every rank (``ProcessContext.join`` raises when one fails); kill them all past the deadline."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):
        if deadline is not None and time.monotonic() > deadline:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
            raise TimeoutError(f"rank processes did not finish in {timeout_s} s")


def _read_results(outdir: str, world_size: int) -> list[tuple[str | None, Any]]:
    """(status, value) by rank; (None, None) for a rank without a result file."""
    out: list[tuple[str | None, Any]] = []
    for rank in range(world_size):
        path = os.path.join(outdir, f"rank{rank}.pkl")
        if not os.path.exists(path):
            out.append((None, None))
            continue
        with open(path, "rb") as fh:
            out.append(pickle.load(fh))
    return out


# --------------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------------
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
