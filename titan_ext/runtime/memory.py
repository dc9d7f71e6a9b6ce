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

import math
from typing import Any, Sequence

from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["DEFAULT_HEADROOM", "PENDING", "activation_budget_bytes", "inflight_cap", "optimizer_steps",
           "rank_memory_limits"]

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
