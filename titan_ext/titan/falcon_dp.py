"""Data parallelism owned by the trainer in Falcon's DP x PP job, and its timing.

TorchTitan 0.2.2 refuses DDP next to PP ("DDP has not supported > 1D parallelism") and its FSDP
needs ``ReduceOp.PREMUL_SUM``, which gloo lacks. With ``data_parallel_replicate_degree > 1`` and PP,
TorchTitan still builds its ``(pp, dp_replicate)`` mesh and per-replica data loaders;
:func:`install_replication_by_trainer` makes its parallelize function skip DDP, and :class:`DPSync`
sums the gradients over the ``dp_replicate`` group after the last backward of every step.
TorchTitan's losses are token *sums* (and its FSDP's gradient divide factor is 1), so a sum is
TorchTitan's own DP gradient; owning that step is what lets S2 change it (Falcon §5.3).

:class:`DPSync` also times the sum (Falcon §4.3 profiling: the group's *transfer* time) and holds
the base of an emulated slow DP link (``A-B:xF``: the all-reduce takes F x its healthy time): the
healthy time is what this all-reduce takes *in training* on this host — the median of its last
:data:`HEALTHY_WINDOW` transfer times, the emulated delay excluded — not an idle measurement.

In a step nothing here waits for the device: the times are marks of the step's
:class:`~titan_ext.runtime.falcon.measure.StepClock` (device events read once the device ran them), the MIN over the world
travels in the check's one exchange of host data (:class:`~titan_ext.runtime.falcon.measure.ObservationExchange`), and the
healthy base is updated when a step's exchanged times come back (:meth:`DPSync.absorb`, the same on
every rank).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torchtitan.tools.logging import logger

from titan_ext.runtime.falcon import device_clock
from titan_ext.runtime.falcon.device_clock import DeviceTimer, device_buffer, device_sleep
from titan_ext.runtime.falcon.redistribute import weighted_all_reduce_gradients

__all__ = ["replicated_by_trainer", "install_replication_by_trainer", "DPSync", "HEALTHY_WINDOW"]

_RING_STEPS = 2  # ring all-reduce = reduce-scatter + all-gather (one step each for 2 ranks)
HEALTHY_WINDOW = 5
"""The DP all-reduce's healthy time = the median of its last 5 in-training transfer times (a median,
so one pre-empted step on a shared host does not move it)."""


def replicated_by_trainer(parallel_dims: Any) -> bool:
    """True when the trainer (not DDP/FSDP) synchronises the DP replicas: dp_replicate with PP."""
    return (parallel_dims.pp_enabled and parallel_dims.dp_replicate_enabled
            and not parallel_dims.fsdp_enabled)


class WithoutReplicate:
    """``parallel_dims`` as TorchTitan's parallelize function should see it: no DDP to apply."""

    dp_replicate_enabled = False

    def __init__(self, dims: Any):
        self._dims = dims

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dims, name)


def _parallelize_without_ddp(parallelize_fn):
    def parallelize(model, parallel_dims, job_config):
        if replicated_by_trainer(parallel_dims):
            parallel_dims = WithoutReplicate(parallel_dims)
        return parallelize_fn(model, parallel_dims, job_config)

    parallelize.titan_ext_replicated = True
    return parallelize


def install_replication_by_trainer() -> None:
    """Make TorchTitan's train specs skip DDP where :func:`replicated_by_trainer` (idempotent)."""
    import torchtitan.protocols.train_spec as train_spec

    original = train_spec.get_train_spec
    if getattr(original, "titan_ext_replicated", False):
        return

    def get_train_spec(name: str):
        spec = original(name)
        if getattr(spec.parallelize_fn, "titan_ext_replicated", False):
            return spec
        return dataclasses.replace(spec, parallelize_fn=_parallelize_without_ddp(spec.parallelize_fn))

    get_train_spec.titan_ext_replicated = True
    train_spec.get_train_spec = get_train_spec


class DPSync:
    """The DP gradient sum of this rank's stage, its timing and the emulated DP-link fault on it.

    Host data (start-up barriers and maxima) goes on gloo control groups, the gradients on the data
    group; times are device completion times: marks on ``clock`` (the job's
    :class:`~titan_ext.runtime.falcon.measure.StepClock`: ``step_start``, ``dp_start``, ``dp_reduce``, ``dp_end``), read once
    the device ran them (:meth:`step_read`)."""

    def __init__(self, trainer: Any, emulation: Any, control: Any, device, clock: Any = None):
        self.trainer, self.emulation, self.control, self.device = trainer, emulation, control, device
        self.timer = DeviceTimer(device)  # start-up measurement only
        self.clock = clock
        self.sync_s = 0.0
        """This rank's last DP sync time read (the emulated delay included)."""
        self.compute_s = math.nan
        """This rank's last compute phase: step start to the DP sync (its chunks' forwards and
        backwards, device time)."""

    def regroup(self, dp_group: Any, dp_control: Any, dp_ranks: list[int], pp_index: int, num_pp: int) -> None:
        """(Re)bind to this rank's DP group (at start and after S3): the stages' gradient sizes, and
        the healthy base measured once now (fastest of 3 after a barrier) until training steps
        replace it (:meth:`transfer_times`). The start-up measure all-reduces a probe of at most
        :data:`~titan_ext.runtime.falcon.device_clock.PROBE_BYTES` (freed after it), its time scaled
        to the fp32 gradient's size: no buffer of the stage's size is held."""
        self.dp_group, self.dp_control, self.dp_ranks = dp_group, dp_control, list(dp_ranks)
        self.pp_index, self.num_pp = pp_index, num_pp
        numel = sum(p.numel() for m in self.trainer.model_parts for p in m.parameters())
        self.stage_bytes = self._per_stage(numel * 4, dist.ReduceOp.MAX)  # fp32 gradient sums
        self.history = [deque(maxlen=HEALTHY_WINDOW) for _ in range(num_pp)]
        self._set_base(self._per_stage(self._fastest_of_3(numel), dist.ReduceOp.MAX))
        logger.info(f"[titan_ext] Falcon: stage {pp_index}'s DP all-reduce {1e3 * self.base_s:.1f} ms "
                    f"({self.stage_bytes[pp_index] / 1e6:.1f} MB) at start, link bandwidth "
                    f"{self.emulation.link_bytes_per_s / 1e9:.2f} GB/s")

    def _fastest_of_3(self, numel: int) -> float:
        """The fastest of 3 all-reduces of a probe (:func:`~titan_ext.runtime.falcon.device_clock.probe_numel`
        elements), scaled to ``numel``."""
        probe = device_clock.probe_numel(numel)
        buf, best = device_buffer(probe, self.device), math.inf
        for _ in range(3):
            dist.barrier(group=self.dp_control)
            start = self.timer.mark()
            dist.all_reduce(buf, group=self.dp_group)
            best = min(best, self.timer.elapsed_s(start, self.timer.mark()))
        return best * numel / probe

    def _per_stage(self, mine: float, op) -> list[float]:
        """Every stage's value of a per-rank number (``op`` over the world: a stage's DP members
        agree on it)."""
        vec = torch.full((self.num_pp,), math.inf if op == dist.ReduceOp.MIN else 0.0, dtype=torch.float64)
        vec[self.pp_index] = mine
        dist.all_reduce(vec, op=op, group=self.control)
        return vec.tolist()

    def _set_base(self, healthy_s: list[float]) -> None:
        """This stage's healthy all-reduce time, and the link bandwidth the stages' times imply (every
        rank of a 2-rank ring sends the gradient's size once; the world's lowest, so both ends of a
        link emulate the same one)."""
        self.base_s = healthy_s[self.pp_index]
        self.emulation.link_bytes_per_s = min(b / t for b, t in zip(self.stage_bytes, healthy_s))

    def step_started(self) -> None:
        """Marks the start of a step's compute phase."""
        self._mark("step_start")

    def _mark(self, name: str) -> None:
        if self.clock is not None:
            self.clock.mark(name)

    def sync(self) -> None:
        """Σ over DP replicas of the token-sum gradients (TorchTitan's DP gradient), after the emulated
        slow link's extra time (held back on the device before the all-reduce)."""
        self._mark("dp_start")
        # a ring step of a 2-member all-reduce moves half the gradient over the link
        step_bytes = self.stage_bytes[self.pp_index] * (len(self.dp_ranks) - 1) / max(1, len(self.dp_ranks))
        device_sleep(self.emulation.collective_delay_s(self.dp_ranks, _RING_STEPS, self.base_s, step_bytes),
                     self.device)
        self._mark("dp_reduce")
        params = [p for m in self.trainer.model_parts for p in m.parameters()]
        weighted_all_reduce_gradients(params, 1.0, self.dp_group)
        self._mark("dp_end")

    def step_read(self, step: Any) -> None:
        """A step of this rank whose device times were read: its DP sync time and compute phase (step
        start to the DP sync: its chunks' forwards and backwards) — this rank's own numbers."""
        sync_s, compute_s = step.span_s("dp_start", "dp_end"), step.span_s("step_start", "dp_start")
        if sync_s == sync_s:
            self.sync_s = sync_s
        if compute_s == compute_s:
            self.compute_s = compute_s

    def absorb(self, reduce_s: list[float]) -> None:
        """A step's exchanged DP all-reduce times (per stage, the MIN over its members: Falcon §4.3
        profiling's *transfer* time — every member's call ends when the last one has arrived and the
        data moved; the last to arrive waited for no one, so its time is the transfer, and the members
        that waited for a slow peer read longer), the emulated delay excluded: the healthy base's
        history.  The same on every rank, so every rank emulates the same link."""
        for history, t in zip(self.history, reduce_s):
            if math.isfinite(t):
                history.append(t)
        if all(self.history):
            self._set_base([float(np.median(h)) for h in self.history])
