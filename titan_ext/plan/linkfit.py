"""Per-link latency α and bandwidth 1/β fitted from timed messages of known sizes.

CrossPipe's α-β model (§2.2, §4.2.3; ``timing.LinkQueues``): a message of ``s`` bytes handed to a link
direction at ``send`` starts transmitting when the direction is free, occupies it for ``s·β`` and
arrives ``α`` after its transmission ends. For the k-th message of one direction (FIFO)

    e_k = max(send_k, e_{k−1}) + s_k·β,        arrival_k = e_k + α.

The transmission ends e_k depend on β and the send times only, so for a candidate β the best α is an
offset. Measured arrivals only ever come late (wake-up latency, a receive posted late, queueing in
the transport — see ``runtime/measure/profiler.py``), so the fit takes the lower envelope: α(β) = min_k
(arrival_k − e_k(β)), and β minimises the mean residual arrival_k − e_k(β) − α(β) ≥ 0 (a log-spaced
grid over bandwidth, then golden-section refinement). Two things identify β: messages of different
sizes, and messages that queue behind each other (their arrivals are spaced s·β apart: the
packet-train dispersion). Messages of one size that never queue carry no information about β — the
fit says so (``identifiable=False``) and attributes the whole delay to latency, which is what the
runtime does without a fit.

Clocks: α is measured in the receiver's clock minus the sender's. With samples of both directions,
:func:`fit_link` averages the two α's, in which a constant clock offset cancels (as the profiler's
link-delay estimate does); β needs no common clock at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from ..args import ArgumentTypeError, real_arg
from .profile import LinkProfile


def _reals(value, name: str) -> list[float]:
    """A sequence of real numbers (not text, not bools)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ArgumentTypeError(f"{name} must be a sequence of numbers, got {type(value).__name__}")
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ArgumentTypeError(f"{name}[{i}] must be a number, got {v!r}")
    return list(value)

# bandwidth grid of the search, bytes/s (1 kB/s … 10 TB/s); β = 0 (infinite bandwidth) is tried too
_GRID_DECADES = (3.0, 13.0)
_GRID_POINTS = 241
_REFINE_STEPS = 40


@dataclass(frozen=True)
class LinkFit:
    """α-β fit of one link (or one direction)."""

    latency_ms: float  # α (per direction: includes the receiver-minus-sender clock offset)
    bandwidth_bytes_per_s: float  # 1/β; inf when β is not identifiable or fits as 0
    identifiable: bool  # the samples determine β (sizes differ or messages queued)
    residual_ms: float  # mean amount by which arrivals came later than the fitted model
    samples: int

    def link_profile(self, message_bytes: float) -> LinkProfile:
        """The fitted link as the planners' ``LinkProfile`` for messages of ``message_bytes``."""
        return LinkProfile(latency_ms=max(0.0, self.latency_ms),
                           bandwidth_bytes_per_s=self.bandwidth_bytes_per_s, message_bytes=message_bytes)


def _transmission_ends(send_s: Sequence[float], nbytes: Sequence[float], beta: float) -> list[float]:
    """e_k = max(send_k, e_{k−1}) + s_k·β (FIFO occupancy of one direction), seconds."""
    ends, e = [], -math.inf
    for t, s in zip(send_s, nbytes):
        e = max(t, e) + s * beta
        ends.append(e)
    return ends


def _envelope(send_s, arrival_s, nbytes, beta: float) -> tuple[float, float]:
    """(α, mean residual) of the lower-envelope fit for a given β, seconds."""
    gaps = [a - e for a, e in zip(arrival_s, _transmission_ends(send_s, nbytes, beta))]
    alpha = min(gaps)
    return alpha, sum(gaps) / len(gaps) - alpha


def fit_alpha_beta(
    send_s: Sequence[float], arrival_s: Sequence[float], nbytes: Sequence[float], *, flat_tolerance: float = 0.05
) -> LinkFit:
    """Fit α and β of one link direction from its messages in FIFO (send) order.

    ``send_s``: when each message was handed to the transport (sender's clock, seconds);
    ``arrival_s``: when it arrived (receiver's clock); ``nbytes``: its size. β counts as identifiable
    when the best fit's mean residual is below (1 − ``flat_tolerance``) of the pure-latency fit's (β = 0).
    """
    send_s, arrival_s, nbytes = (_reals(v, name) for v, name in ((send_s, "send_s"), (arrival_s, "arrival_s"),
                                                                  (nbytes, "nbytes")))
    real_arg(flat_tolerance, "flat_tolerance", minimum=0, maximum=1)
    n = len(send_s)
    if n < 2 or len(arrival_s) != n or len(nbytes) != n:
        raise ValueError(f"need >= 2 messages with a send time, an arrival time and a size each, got {n}")
    if any(s < 0 or not math.isfinite(s) for s in nbytes) or not all(map(math.isfinite, (*send_s, *arrival_s))):
        raise ValueError("message sizes must be finite and >= 0, times finite")
    if any(b < a for a, b in zip(send_s, send_s[1:])):
        raise ValueError("messages must be given in send (FIFO) order")

    def cost(beta: float) -> float:
        return _envelope(send_s, arrival_s, nbytes, beta)[1]

    lo, hi = _GRID_DECADES
    grid = [10 ** -(lo + (hi - lo) * i / (_GRID_POINTS - 1)) for i in range(_GRID_POINTS)]  # β, large → small
    costs = [cost(b) for b in grid]
    i = min(range(len(grid)), key=costs.__getitem__)
    a, b = grid[min(i + 1, len(grid) - 1)], grid[max(i - 1, 0)]
    for _ in range(_REFINE_STEPS):  # golden section on [a, b] around the best grid point
        m1, m2 = b - 0.618 * (b - a), a + 0.618 * (b - a)
        if cost(m1) <= cost(m2):
            b = m2
        else:
            a = m1
    beta = (a + b) / 2
    best, flat = cost(beta), cost(0.0)
    identifiable = best < (1.0 - flat_tolerance) * flat
    if not identifiable:
        beta = 0.0
    alpha, residual = _envelope(send_s, arrival_s, nbytes, beta)
    return LinkFit(alpha * 1e3, math.inf if beta == 0 else 1.0 / beta, identifiable, residual * 1e3, n)


def fit_link(
    forward: tuple[Sequence[float], Sequence[float], Sequence[float]],
    backward: tuple[Sequence[float], Sequence[float], Sequence[float]] | None = None,
) -> LinkFit:
    """α-β of a link from its forward messages (send_s, arrival_s, nbytes) and, optionally, its
    backward ones: β is the mean over the directions where it is identifiable, then each direction's α
    is refitted with that β and the two are averaged (a constant clock offset cancels)."""
    directions = [forward] + ([backward] if backward is not None else [])
    for name, d in zip(("forward", "backward"), directions):
        if isinstance(d, (str, bytes)) or not isinstance(d, Sequence) or len(d) != 3:
            raise ArgumentTypeError(f"{name} must be (send_s, arrival_s, nbytes), got {type(d).__name__}")
    fits = [fit_alpha_beta(*d) for d in directions]
    known = [1.0 / f.bandwidth_bytes_per_s for f in fits if f.identifiable]
    beta = sum(known) / len(known) if known else 0.0
    envelopes = [_envelope(*d, beta) for d in directions]
    alpha = sum(e[0] for e in envelopes) / len(envelopes)
    residual = sum(e[1] for e in envelopes) / len(envelopes)
    return LinkFit(alpha * 1e3, math.inf if beta == 0 else 1.0 / beta, bool(known), residual * 1e3,
                   sum(f.samples for f in fits))
