"""Fail-slow emulation inside Falcon's DP x PP job (the faults themselves:
:mod:`titan_ext.runtime.falcon.emulation`).

* :func:`check_emulation` — the ``[titan_ext] emulate_slow_*`` keys, checked before any process group;
* :func:`install_compute_stretch` — the slow device: every forward and backward-input pass of a model
  part is stretched by its factor (on CPU the host sleeps, on CUDA the device: :class:`DeviceStretch`);
* :class:`PPLinkDelays` — the slow link when it is a PP hop of this rank's pipeline (the delay
  injector on its two ends). The slow DP link is :class:`~titan_ext.titan.falcon_dp.DPSync`'s.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torchtitan.tools.logging import logger

from titan_ext.runtime.falcon.device_clock import DeviceTimer, device_sleep
from titan_ext.runtime.falcon.emulation import (
    EmulationSpecError,
    FailSlowEmulation,
    parse_slow_device,
    parse_slow_link,
)
from titan_ext.runtime.falcon.files import emulation_specs

__all__ = ["check_emulation", "install_compute_stretch", "install_device_passes", "DeviceStretch", "PPLinkDelays"]


def check_emulation(section: Any, pp: int, dp_replicate: int, dp_shard: int,
                    world_size: int | None) -> None:
    """Emulated faults need a DP x PP job with the trainer's DP sync, and devices that exist
    (before any process group; ValueError naming the key)."""
    for key, (spec, parse) in {"emulate_slow_device": (emulation_specs(section)[0], parse_slow_device),
                               "emulate_slow_link": (emulation_specs(section)[1], parse_slow_link)}.items():
        if not spec:
            continue
        where = f"[titan_ext] {key} = {spec!r}"
        try:
            fault = parse(spec)
        except EmulationSpecError as e:
            raise ValueError(f"{where}: {e}") from None
        if not (pp > 1 and dp_replicate > 1 and dp_shard <= 1):
            raise ValueError(f"{where}: fail-slow emulation runs in DP x PP jobs only "
                             f"(pipeline_parallel_degree > 1 and data_parallel_replicate_degree > 1)")
        devices = [fault.device] if key == "emulate_slow_device" else sorted(fault.devices)
        if world_size is not None and max(devices) >= world_size:
            raise ValueError(f"{where}: device {max(devices)} does not exist (world size {world_size})")


class _Mark(torch.autograd.Function):
    """Identity; its backward runs ``on_backward()`` (a part's backward begins / ends there)."""

    @staticmethod
    def forward(ctx, x, on_backward):
        ctx.on_backward = on_backward
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.on_backward()
        return grad, None


def _on_grad(fn):
    """A tensor hook that runs ``fn()`` when the tensor's gradient is computed (the gradient unchanged)."""
    def hook(_grad):
        fn()
        return None
    return hook


class DeviceStretch:
    """The emulated slow device on CUDA: a region (forward or backward) is
    followed by a device-side delay of (F - 1) × its device time. The region's time comes from CUDA
    events read without a host sync: the last completed measurement of the same region (the first
    occurrence, with none yet, is not stretched)."""

    def __init__(self, emulation: FailSlowEmulation, device):
        self.emulation, self.device = emulation, device
        self.timer = DeviceTimer(device)
        self.pending: dict[str, tuple[Any, Any]] = {}
        self.estimate_s: dict[str, float] = {}

    def end(self, region: str, start: Any) -> None:
        end = self.timer.mark()
        if region in self.pending:
            seconds = self.timer.elapsed_s(*self.pending[region], wait=False)
            if seconds is not None:
                self.estimate_s[region] = seconds
        self.pending[region] = (start, end)
        factor = self.emulation.compute_factor()
        if factor > 1.0 and region in self.estimate_s:
            device_sleep((factor - 1.0) * self.estimate_s[region], self.device)


def install_compute_stretch(part: torch.nn.Module, emulation: FailSlowEmulation, device=None) -> None:
    """Slow every forward and backward-input pass of ``part`` by the emulated device factor.

    Forward: hooks around the part. Backward: a mark on the part's output (backward begins) and on
    the first tensor with a gradient entering it — the input activation, or, on the first stage,
    the token embedding's output (backward ends). On CPU the host sleeps (F - 1) × the region, or
    to the emulated device time of the region (``emulate_device_pass_ms``;
    :meth:`FailSlowEmulation.stretch`); on CUDA the device sleeps (:class:`DeviceStretch`)."""
    if device is not None and torch.device(device).type == "cuda":
        cuda = DeviceStretch(emulation, device)
        mark = cuda.timer.mark
    else:
        cuda, mark = None, time.perf_counter
    clock: dict[str, Any] = {"f": 0.0, "b": 0.0}

    def stretch(region: str) -> None:
        if cuda is not None:
            cuda.end(region, clock[region])
        else:
            emulation.stretch(clock[region], passes=2.0 if region == "b" else 1.0)

    def begin_backward():
        clock["b"] = mark()

    def end_backward():
        stretch("b")

    def pre(_mod, args):
        clock["f"] = mark()
        if args and torch.is_tensor(args[0]) and args[0].requires_grad:
            return (_Mark.apply(args[0], end_backward), *args[1:])
        return None

    def post(_mod, _args, out):
        stretch("f")
        if torch.is_tensor(out) and out.requires_grad:
            # a hook, not a _Mark: the stage output must not be a view (torch's split backward
            # detaches a stage's outputs in place, which a view refuses: a middle stage of PP >= 3)
            out.register_hook(_on_grad(begin_backward))
        return None

    part.register_forward_pre_hook(pre)
    part.register_forward_hook(post)
    embed = getattr(part, "tok_embeddings", None)
    if isinstance(embed, torch.nn.Module):
        embed.register_forward_hook(
            lambda _m, _a, out: _Mark.apply(out, end_backward) if out.requires_grad else None)


def install_device_passes(trainer: Any, pass_ms: float) -> None:
    """Dedicated-device emulation (``emulate_device_pass_ms``) in a PP job without Falcon's DP x PP
    job — the DP 1 job that S4 restarts: every model part's passes padded to their device time."""
    import torch.distributed as dist

    emulation = FailSlowEmulation(dist.get_rank(), range(dist.get_world_size()), pass_s=pass_ms / 1e3)
    for part in trainer.model_parts:
        install_compute_stretch(part, emulation, getattr(trainer, "device", None))


class PPLinkDelays:
    """The emulated slow link on a PP hop of this rank's pipeline: ``inject_link_delays`` on the
    hop's two ends, installed at the first step it applies and removed when S3 changes the grid;
    ``hol``: NCCL's head-of-line blocking on the direct path (``[titan_ext] emulate_link_hol``),
    holding the issuer ``hol_hold`` of each delay (``emulate_link_hol_hold``)."""

    def __init__(self, emulation: FailSlowEmulation, rank: int, hol: bool = False, hol_hold: float = 1.0):
        self.emulation, self.rank, self.hol, self.hol_hold = emulation, rank, hol, hol_hold
        self.installed = False

    def maybe_install(self, pipeline: list[int]) -> None:
        if self.installed:
            return
        spec = self.emulation.pp_link_spec(pipeline)
        if spec:
            from titan_ext.runtime import inject_link_delays

            inject_link_delays(spec, origin="[titan_ext] emulate_slow_link", hol=self.hol,
                               hol_hold=self.hol_hold)
            self.installed = True
            logger.info(f"[titan_ext] emulated slow PP link on rank {self.rank}: {spec}"
                        f"{f' (head-of-line blocking, hold {self.hol_hold:g})' if self.hol else ''}")

    def remove(self) -> None:
        if self.installed:
            from titan_ext.runtime.emulate.delay_injection import remove_link_delays

            remove_link_delays()
            self.installed = False
