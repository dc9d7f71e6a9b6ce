"""Memory safety of adaptive plans: a cap on in-flight activations from measured bytes.

PipeMorph's Alg.2 buys slackness with warm-up forwards (§4.2): stage 0 may hold up to N activations,
nearly twice 1F1B's, which the paper affords by offloading to host memory.  Without offloading, the
runtime caps every adaptive plan at what fits:

    cap = min over ranks r of ⌊ budget_r / M^F_r ⌋

with M^F_r the bytes autograd saves for one microbatch on rank r (measured in the first forward,
``executor.measured_forward``) and budget_r the memory available for activations on rank r:

* GPU: (``torch.cuda.mem_get_info`` free bytes at the iteration boundary — the iteration's activations
  are released then — plus what torch's caching allocator holds reserved but unused, since freed
  activations stay reserved, not free) × (1 − headroom) — unless a budget is configured.  Read through
  the device layer (``DeviceLayer.memory_free_bytes``), and only once an optimizer has stepped: the
  first boundary comes before the first ``optimizer.step()``, when AdamW has not allocated its state
  (2 × the parameters) yet, so a budget read then would be too large by that much.  Until then the
  budget is :data:`PENDING` and the cap stays at the initial plan's memory regime;
  a job whose optimizer is no ``torch.optim.Optimizer`` keeps that regime;
* CPU: the configured budget (``memory_budget_bytes`` / ``[titan_ext] memory_budget_gib``), else no
  cap (host memory, the paper's setting).

Every rank sends its budget in the profile exchange, so every rank computes the same cap.

Several stages per rank: the cap is per rank, in activations of the rank's whole model part
(a chunk of a rank with V stages counts 1/V, the planners' unit, ``plan.virtual``):

    K_r = ⌊ budget_r / a_r ⌋ / V

with a_r the bytes one of rank r's chunks saves per microbatch (its first measured forward; chunks
assumed equal — measuring every local stage mid-iteration deadlocked under the NCCL-rules backend). ``plan_virtual`` then
splits each rank's K_r among its stages by what the delay needs (``search_warmup``).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Iterable, Sequence

import torch

from torch.multiprocessing.reductions import StorageWeakRef
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["DEFAULT_HEADROOM", "PENDING", "RELEASE", "ActivationMeter", "LiveStorages", "activation_budget_bytes",
           "inflight_cap", "optimizer_steps", "parameter_storages", "rank_memory_limits", "saved_bytes_key",
           "selective_checkpointing", "stage_caps", "storage_id"]

#: the memory rule of every plan this runtime runs (``plan.profile.RELEASES``): torch's split backward keeps a
#: microbatch's autograd graph from its I until its W (``ActivationMeter`` sees an I free nothing), so an
#: activation is in flight until its W (or full B) — the rule the estimator's profiles carry, the
#: validator checks and the memory caps count
RELEASE = "W"
#: fraction of the budget kept free (allocator fragmentation, temporaries of the backward)
DEFAULT_HEADROOM = 0.2
#: a budget not readable yet (a device budget before the first optimizer step); exchanged as is
PENDING = -1.0

_steps = [0]


def _count_step(optimizer: Any, args: Any, kwargs: Any) -> None:  # noqa: ARG001
    _steps[0] += 1


register_optimizer_step_post_hook(_count_step)


def optimizer_steps() -> int:
    """``torch.optim`` optimizer steps taken in this process (a global post-step hook counts them)."""
    return _steps[0]


def activation_budget_bytes(layer: Any, configured: float | None, headroom: float = DEFAULT_HEADROOM) -> float:
    """Bytes this rank can spend on activations now: the configured budget, else the device layer's
    free memory × (1 − headroom) once an optimizer has stepped (:data:`PENDING` before), NaN: no limit."""
    if configured is not None:
        return float(configured)
    free = layer.memory_free_bytes()
    if math.isnan(free):
        return math.nan
    if optimizer_steps() == 0:
        return PENDING
    return float(free) * (1.0 - headroom)


def inflight_cap(budgets: Sequence[float], activation_bytes: Sequence[float], n_microbatches: int,
                 pending_cap: int | None = None) -> int | None:
    """Activations any stage may hold (≥ 1, ≤ N); None when no rank has both a budget and M^F;
    ``pending_cap`` while a rank's budget is :data:`PENDING` (the initial plan's regime)."""
    if any(b == PENDING for b in budgets):
        return pending_cap
    caps = [math.floor(b / a) for b, a in zip(budgets, activation_bytes)
            if math.isfinite(b) and math.isfinite(a) and a > 0]
    if not caps:
        return None
    return max(1, min(min(caps), n_microbatches))


def stage_caps(budgets: Sequence[float], activation_bytes: Sequence[float], n_microbatches: int) -> list[int] | None:
    """One stage per rank: per stage, the activations its rank's budget holds, ⌊budget_r / M^F_r⌋ within
    [1, N] (a rank without both: N) — each rank's own, so a rank whose microbatches save less holds more
    (stage 0 under 1F1B's memory holds S of its own); None while a budget is :data:`PENDING` or none known."""
    if any(b == PENDING for b in budgets):
        return None
    known = [math.isfinite(b) and math.isfinite(a) and a > 0 for b, a in zip(budgets, activation_bytes)]
    if not any(known):
        return None
    N = n_microbatches
    return [max(1, min(math.floor(b / a), N)) if ok else N for ok, b, a in zip(known, budgets, activation_bytes)]


def rank_memory_limits(budgets: Sequence[float], chunk_bytes: Sequence[float], stages_per_rank: int,
                       n_microbatches: int) -> tuple[float, ...] | None:
    """Per rank K_r = ⌊budget_r / a_r⌋ / V activations of its whole model part, within [1, N] (a rank
    without a known budget or a_r: N, no limit); None when no rank has both."""
    V, N = stages_per_rank, n_microbatches
    if any(b == PENDING for b in budgets):
        return None  # a device budget is not known yet: the initial regime (inflight_cap's pending_cap)
    known = [math.isfinite(b) and math.isfinite(a) and a > 0 for b, a in zip(budgets, chunk_bytes)]
    if not any(known):
        return None
    out = []
    for ok, b, a in zip(known, budgets, chunk_bytes):
        chunks = math.floor(b / a) if ok else N * V
        out.append(min(max(chunks, V), N * V) / V)  # every chunk holds at least one activation
    return tuple(out)


def storage_id(t: torch.Tensor) -> int:
    """The identity of a tensor's storage (its ``StorageImpl``): the same for every view of it, distinct
    between storages also on the meta device, where every data pointer is 0 (the dry run measures M^F
    there, :mod:`titan_ext.titan.dryrun`)."""
    return t.untyped_storage()._cdata


def parameter_storages(parameters: Iterable[torch.Tensor]) -> set[int]:
    """The storages of ``parameters`` (:func:`storage_id`), for :func:`saved_bytes_key`."""
    out = set()
    for p in parameters:
        with contextlib.suppress(Exception):  # a parameter without a storage of its own (a DTensor)
            out.add(storage_id(p))
    return out


def saved_bytes_key(t: torch.Tensor, parameters: set[int]) -> tuple[tuple, int] | None:
    """How a tensor autograd saves counts as activation memory — the one rule of M^F
    (``executor.measured_forward``) and of :class:`ActivationMeter`: (key, bytes), a view counting its
    own elements (a microbatch is a view of the user's batch), the same view once; None for a parameter
    (or a view of one), which is not an activation: one whose storage is in ``parameters``
    (:func:`parameter_storages`), or an ``nn.Parameter`` (or its view) made during the forward, as FSDP2's
    unsharded parameters are (they live for the step, not per microbatch). A DTensor counts its local
    shard (its ``numel`` is the global one)."""
    if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
        return None
    t = getattr(t, "_local_tensor", t)  # a DTensor (tensor parallelism) holds its local shard
    nbytes = t.numel() * t.element_size()
    try:
        storage = storage_id(t)
    except Exception:  # noqa: BLE001 - e.g. tensors without storage
        return (id(t), nbytes), nbytes
    if storage in parameters:
        return None
    return (str(t.device), storage, t.storage_offset(), nbytes), nbytes


def selective_checkpointing(module: torch.nn.Module) -> bool:
    """Some submodule of ``module`` runs under selective activation checkpointing (a checkpoint wrapper
    whose checkpoint function carries a ``context_fn``, as TorchTitan's ``selective`` mode and torch's
    ``create_selective_checkpoint_contexts`` make it): the ops it saves live in the checkpoint's own cache,
    which autograd's saved-tensor hooks (:func:`saved_bytes_key`) never see."""
    for m in module.modules():
        fn = getattr(m, "checkpoint_fn", None)
        if isinstance(fn, functools.partial) and fn.keywords.get("context_fn") is not None:
            return True
    return False


class LiveStorages(TorchDispatchMode):
    """Every storage an operation creates while the mode is active (a DTensor: its local shard), by
    identity with a weak reference: :meth:`alive_bytes` is what of it is still alive — what a forward
    keeps until its backward, whoever holds it (autograd, a checkpoint's cache, the caller).
    Higher-order operators (FlexAttention) pass through it too: run by the modes below, their outputs
    recorded as any operation's."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.records: dict[int, tuple[Any, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = getattr(t, "_local_tensor", t).untyped_storage()
                seen = self.records.get(s._cdata)
                if seen is None or seen[0].expired():  # a freed storage's address may come back
                    self.records[s._cdata] = (StorageWeakRef(s), s.nbytes())
        return out

    def alive_bytes(self, exclude: set[int] = frozenset()) -> int:
        """Bytes of the recorded storages still alive, but those in ``exclude`` (:func:`storage_id`)."""
        return sum(n for key, (ref, n) in self.records.items() if key not in exclude and not ref.expired())


class _Held:
    """One saved tensor as autograd holds it between pack and its graph's release."""

    __slots__ = ("meter", "tensor", "key", "__weakref__")

    def __init__(self, meter: "ActivationMeter", tensor: torch.Tensor, key: tuple):
        self.meter, self.tensor, self.key = meter, tensor, key

    def __del__(self) -> None:  # autograd released the saved tensor (its graph was freed)
        self.meter._release(self.key)


class ActivationMeter:
    """Bytes of autograd-saved activations alive on this rank, and their peak: the one memory measure
    that applies alike to torch's schedules and ours (``scripts/bench_frontier.py``).

    Use as a context manager around ``schedule.step(...)``: a ``saved_tensors_hooks`` pair records every
    tensor autograd saves, counted by :func:`saved_bytes_key` (a view its own elements, the same view
    once while any saved tensor holds it, parameters never).  A saved tensor is released when
    autograd drops it — when the backward that needs it ran (W for a split backward), or its graph was
    freed — so ``bytes`` follows the schedule's real in-flight activations.  Same unit as M^F of
    Alg.1 (``Executor.activation_bytes``: bytes one microbatch's forward saves).  An inner
    ``saved_tensors_hooks`` (the executor's one-off M^F measurement in the first forward) takes
    precedence, so that forward is not seen: ``reset_peak()`` after the first iteration.  Saved tensors
    are held detached (no double backward through a metered step).

    With ``stages`` (torch's ``PipelineStage``s) it also counts what M^F counts beside the saved tensors:
    each microbatch's stage outputs, which the stage keeps (``fwd_cache``) from its ``forward_one_chunk``
    to its ``backward_one_chunk`` — each storage not alive as a saved tensor, once (:meth:`held_with`).
    Both are the stage's own methods, whichever schedule runs them, so torch's schedules and ours are
    measured alike, in M^F's unit."""

    def __init__(self, parameters: Iterable[torch.Tensor] = (), stages: Iterable[Any] = ()):
        self._params = parameter_storages(parameters)
        self._alive: dict[tuple, list[int]] = {}  # key → [bytes, saved tensors holding it]
        self._outputs: dict[tuple, int] = {}  # (stage, microbatch) → bytes of the outputs its stage keeps
        self._stages = list(stages)
        self._wrapped: list[tuple[Any, dict]] = []  # (stage, its own attributes the wrappers replaced)
        self.bytes = 0
        self.peak_bytes = 0
        self._hooks: Any = None

    def _pack(self, t: torch.Tensor) -> Any:
        counted = saved_bytes_key(t, self._params)
        if counted is None or counted[1] == 0:
            return t
        key, nbytes = counted
        entry = self._alive.get(key)
        if entry is None:
            entry = self._alive[key] = [nbytes, 0]
            self.bytes += entry[0]
            self.peak_bytes = max(self.peak_bytes, self.bytes)
        entry[1] += 1
        # detached: a saved *output* handed over with its grad_fn would form a cycle through the holder
        # (output → grad_fn → holder → output) and be freed only by the cycle collector
        return _Held(self, t.detach(), key)

    @staticmethod
    def _unpack(held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def _release(self, key: tuple) -> None:
        entry = self._alive.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._alive[key]
            self.bytes -= entry[0]

    def held_with(self, tensors: Iterable[Any]) -> int:
        """Bytes held now, plus those of ``tensors`` (a pytree's tensor leaves) not among them, each
        storage once: what a microbatch keeps when its outputs are kept beside its saved tensors."""
        extra: dict[tuple, int] = {}
        for t in torch.utils._pytree.tree_leaves(tensors):
            counted = saved_bytes_key(t, self._params) if isinstance(t, torch.Tensor) else None
            if counted is not None and counted[0] not in self._alive:
                extra[counted[0]] = counted[1]
        return self.bytes + sum(extra.values())

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now."""
        self.peak_bytes = self.bytes

    def hold_outputs(self, key: tuple, tensors: Any) -> None:
        """Count ``tensors`` (a pytree) as alive under ``key`` until :meth:`release_outputs`: each storage not
        alive as a saved tensor, once."""
        self.release_outputs(key)
        nbytes = self.held_with(tensors) - self.bytes
        self._outputs[key] = nbytes
        self.bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def release_outputs(self, key: tuple) -> None:
        self.bytes -= self._outputs.pop(key, 0)

    def _watch(self, stage: Any) -> None:
        """Count ``stage``'s kept outputs from its forward of a microbatch to its backward of it."""
        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

        def forward_one_chunk(chunk: int, *args: Any, **kwargs: Any) -> Any:
            out = forward(chunk, *args, **kwargs)
            kept = getattr(stage, "fwd_cache", {}).get(chunk)
            if kept is not None:
                self.hold_outputs((stage.stage_index, chunk), kept[0])
            return out

        def backward_one_chunk(chunk: int, *args: Any, **kwargs: Any) -> Any:
            try:
                return backward(chunk, *args, **kwargs)
            finally:
                if chunk not in getattr(stage, "fwd_cache", {}):
                    self.release_outputs((stage.stage_index, chunk))

        stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk

    def __enter__(self) -> "ActivationMeter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        for stage in self._stages:
            names = ("forward_one_chunk", "backward_one_chunk")
            self._wrapped.append((stage, {n: stage.__dict__[n] for n in names if n in stage.__dict__}))
            self._watch(stage)
        return self

    def __exit__(self, *exc: Any) -> None:
        for stage, before in self._wrapped:  # what the stage had: its class's methods or another wrapper
            for name in ("forward_one_chunk", "backward_one_chunk"):
                stage.__dict__.pop(name, None)
            stage.__dict__.update(before)
        self._wrapped.clear()
        self._hooks.__exit__(*exc)
        self._hooks = None
