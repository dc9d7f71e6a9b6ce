"""Live profiling for adaptive PP schedules (PipeMorph §6 "profiler").

What is measured, on every rank, for every iteration:

* **Per-action compute time** of F / I / W / B, through the device layer (``runtime/execute/device.py``): on
  CPU a monotonic clock (``time.perf_counter``) around the action; on GPU a pair of CUDA events per
  action recorded on the compute stream, mapped onto the host clock through an anchor event whose
  completion was stamped, and resolved without a host sync on the critical path.  The input's stall
  (the stream waiting for a receive) is recorded apart (``recv_wait_ms``).  An iteration's times of one
  kind are summarised by their :func:`stall_free_mean` (a plan's makespan sums them).
* **Per-message timing** on the PP links: the sender stamps each SEND at hand-over on the compute
  stream's time; the receiver stamps each RECV when its data has *landed* — a watcher thread per peer
  observes the receive's completion (``is_completed()``, or gloo's blocking ``wait()``) and stamps it,
  so the stamp is exact whether or not the compute thread was blocked on that message, and the
  consumer's wait stays just before the consumer.  On gloo, a link whose deployed plan hides no delay
  is stamped by the consumer's own wait instead (an upper bound, exact whenever the consumer waited;
  ``policy.exact_arrival_links``, docs/runtime.md).

Link-delay estimate (documented method, :func:`link_delay_estimates`): messages on one link and
direction are FIFO, so the k-th send matches the k-th receive.  With clocks that may differ by an
unknown offset θ between the two ranks, the raw forward samples are ``d_f + θ`` and the backward ones
``d_b − θ``; the per-iteration link delay is

    ``c_i = (min_k raw_fwd + min_k raw_bwd) / 2``     (minimum over the iteration's messages)

in which θ cancels exactly; Eq.1 needs only ``2 c_i = d_f + d_b`` (one forward plus one backward
crossing, PipeMorph §4.1).  Error sources: (1) the watcher's wake-up latency after arrival (a positive
bias, typically 0.05–1 ms, more on an over-subscribed CPU); (2) the send stamp is taken when the message
is handed over, so any transport-side queueing counts as link delay (intended: the plan must absorb it);
(3) direction asymmetry is averaged; (4) a receive posted late by a busy receiver delays delivery.
All four only ever add to a sample, and the planner's c_i is a lone message's delay, so the minimum
is taken (it would underestimate only a link whose delay jitters within one iteration).  Across iterations
the runtime keeps a window and uses its median (robust statistics).

Clock offsets (only needed for the cross-rank timeline behind the bubble rate) come from an NTP-style
ping-pong at start-up (:func:`estimate_clock_offsets`): min-RTT sample, error ≤ RTT/2.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from titan_ext.plan.ir import COMPUTE_KINDS, TimedAction
from titan_ext.plan.timing import bubble_rate

from ..execute.device import now

__all__ = ["PROFILE_TAG", "ActionRecord", "IterationProfile", "RankProfile", "decode_profiles", "encode_profile",
           "estimate_clock_offsets", "link_delay_estimates", "now", "one_way_delay_ms", "profile_length",
           "timeline_bubble_rate"]


@dataclass(init=False)
class ActionRecord(TimedAction):
    """A measured action: the one record (``plan.ir.TimedAction``), times in seconds on the device
    layer's host clock (set by its timer), plus the input's stall ``recv_wait_ms``; constructed
    ``ActionRecord(kind, stage, microbatch, start=nan, end=nan, recv_wait_ms=0.0)``."""

    recv_wait_ms: float = 0.0

    def __init__(self, kind: str, stage: int, microbatch: int, start: float = math.nan, end: float = math.nan,
                 recv_wait_ms: float = 0.0):
        TimedAction.__init__(self, stage, kind, microbatch, start, end)
        self.recv_wait_ms = recv_wait_ms


#: a sample this many times the next smaller one (and all above it) is an isolated stall
STALL_RATIO = 4.0
#: at most this share of an iteration's samples (at least one) can be stalls
STALL_SHARE = 0.1


def stall_free_mean(xs: list[float], ratio: float = STALL_RATIO, share: float = STALL_SHARE) -> float:
    """The mean of ``xs`` without its isolated stalls (the median below 5 samples; NaN when empty).

    What an iteration's action times and gaps are summarised by: a plan's makespan is a sum of action
    times, so its model needs their *mean*, right tail included — a CPU's oversleep and preemption (2–4 %
    of the compute on a quiet 2-core host, 5–9 % and a third of the executor's gaps with one core busy)
    recur every iteration, and a trimmed mean that cut them predicted makespans the runtime never reached.
    A one-off stall (a first iteration's lazy initialisation, a communicator's creation, a garbage
    collection) must not price every action: it stands far above every other sample, so the largest
    samples are dropped down to the lowest one within the top ``share`` that is more than ``ratio`` times
    the next smaller sample.  A tail that rises continuously (a busy host's preemptions) has no such jump
    and is kept; a stall that recurs in every iteration is what the estimator's window (the median over
    checks) cannot tell from a tail, and is dropped like one."""
    if len(xs) < 5:
        return statistics.median(xs) if xs else math.nan
    xs = sorted(xs)
    n = len(xs)
    cut = n
    for j in range(n - 1, n - 1 - max(int(share * n), 1), -1):
        if xs[j] > ratio * xs[j - 1]:
            cut = j
    return math.fsum(xs[:cut]) / cut


@dataclass
class IterationProfile:
    """What one rank measured in one iteration (local clock)."""

    actions: list[ActionRecord] = field(default_factory=list)
    sends_next: list[float] = field(default_factory=list)  # stamps of messages to rank+1
    sends_prev: list[float] = field(default_factory=list)
    arrivals_prev: list[float] = field(default_factory=list)  # arrivals from rank-1
    arrivals_next: list[float] = field(default_factory=list)
    send_bytes_next: int = 0
    activation_bytes: float = math.nan

    def landed(self) -> "IterationProfile":
        """A copy with the receive handles' arrival times read (what a rank exchanges at a check)."""
        return IterationProfile(self.actions, self.sends_next, self.sends_prev,
                                [h.arrival_time() for h in self.arrivals_prev],
                                [h.arrival_time() for h in self.arrivals_next], self.send_bytes_next,
                                self.activation_bytes)

    def compute_ms(self, kind: str, stage: int | None = None) -> float:
        """Typical time (ms) of this iteration's ``kind`` actions (of one ``stage``, or all): their
        :func:`stall_free_mean`."""
        return stall_free_mean([1e3 * (a.end - a.start) for a in self.actions
                                if a.kind == kind and stage in (None, a.stage)])

    def gap_ms(self) -> float:
        """The executor's typical cost per compute action (ms): the :func:`stall_free_mean`, over consecutive
        actions in the order they ran, of the time from one's end to the next one's start that was not a
        wait for the next one's input (a busy host's preemptions in, an isolated stall such as the first
        iteration's warm-up out).  On a GPU the stamps are the compute stream's, so host work
        the stream ran ahead of costs nothing; the timing model's actions have none
        (``backward.faster_by_model``)."""
        acts = sorted(self.actions, key=lambda a: a.start)
        return stall_free_mean([max(1e3 * (b.start - a.end) - b.recv_wait_ms, 0.0) for a, b in zip(acts, acts[1:])])

    def stage_times_ms(self, stages: list[int]) -> list[tuple[float, float, float, float]]:
        """(F, I, W, B) per local stage, each as :meth:`compute_ms` (several stages per rank:
        ``runtime/decide/placement.py``)."""
        return [tuple(self.compute_ms(k, s) for k in COMPUTE_KINDS) for s in stages]  # type: ignore[misc]

    def busy_ms(self) -> float:
        return sum(1e3 * (a.end - a.start) for a in self.actions)


# --- the fixed-size vector each rank contributes to the one all_gather per check -----------------
_HDR = 18  # iteration, plan hash (2 x 26 bits), F, I, W, B ms, busy ms, first start, first F, last end,
#             activation bytes, clock offset to prev, rtt to prev, send bytes, candidate-plan hash (52 bits),
#             activation memory budget (bytes; NaN: none), gap ms per action


#: the point-to-point tag of the profile exchange on the control group: its receives are posted at the start of
#: the iteration whose boundary exchanges (``ControlPlane.expect``); the control plane's other gathers use 0
PROFILE_TAG = 1


def profile_length(n_microbatches: int, local_stages: int = 0) -> int:
    """The length of :func:`encode_profile`'s vector (``local_stages``: rows of ``stage_ms``)."""
    return _HDR + 4 * n_microbatches + 4 * local_stages


def encode_profile(p: IterationProfile, iteration: int, plan_hash: int, n_microbatches: int,
                   clock_offset_prev: float, rtt_prev: float, candidate_hash: int = 0,
                   memory_budget_bytes: float = math.nan,
                   stage_ms: list[tuple[float, float, float, float]] | None = None) -> torch.Tensor:
    """Pack a rank's profile into a float64 vector of length 18 + 4·N (NaN-padded), plus 4 values
    (F, I, W, B) per local stage when ``stage_ms`` is given (several stages per rank; N is then the
    most messages one direction of a link carries per iteration, V·N)."""
    n = n_microbatches
    times: dict[str, list[float]] = {k: [] for k in COMPUTE_KINDS}  # compute_ms of each kind, in one pass
    for a in p.actions:
        times[a.kind].append(1e3 * (a.end - a.start))
    starts = [a.start for a in p.actions]
    f_starts = [a.start for a in p.actions if a.kind == "F"]
    ends = [a.end for a in p.actions]
    out = [
        float(iteration), float(plan_hash & ((1 << 26) - 1)), float((plan_hash >> 26) & ((1 << 26) - 1)),
        *(stall_free_mean(times[k]) for k in COMPUTE_KINDS), p.busy_ms(),
        min(starts) if starts else math.nan, min(f_starts) if f_starts else math.nan,
        max(ends) if ends else math.nan, p.activation_bytes, clock_offset_prev, rtt_prev,
        float(p.send_bytes_next), float(candidate_hash), float(memory_budget_bytes), p.gap_ms(),
    ]
    for stamps in (p.sends_next, p.sends_prev, p.arrivals_prev, p.arrivals_next):
        k = min(len(stamps), n)
        out += stamps[:k]
        out += [math.nan] * (n - k)
    for row in stage_ms or ():
        out += row
    return torch.tensor(out, dtype=torch.float64)


@dataclass
class RankProfile:
    iteration: int
    plan_hash: int
    f_ms: float
    i_ms: float
    w_ms: float
    b_ms: float
    busy_ms: float
    first_start: float
    first_f: float
    last_end: float
    activation_bytes: float
    clock_offset_prev: float
    rtt_prev: float
    send_bytes_next: float
    candidate_hash: int
    sends_next: list[float]
    sends_prev: list[float]
    arrivals_prev: list[float]
    arrivals_next: list[float]
    memory_budget_bytes: float = math.nan  # bytes this rank can spend on activations (NaN: no limit)
    stage_ms: list[list[float]] = field(default_factory=list)  # (F, I, W, B) per local stage
    gap_ms: float = math.nan  # IterationProfile.gap_ms: per action, neither compute nor an input wait


def decode_profiles(gathered: list[torch.Tensor], n_microbatches: int, local_stages: int = 0) -> list[RankProfile]:
    """Unpack ``encode_profile``'s vectors (``local_stages``: the per-stage block's rows, 0: none)."""
    n = n_microbatches
    out = []
    for vec in gathered:
        v = vec.tolist()

        def stamps(slot: int) -> list[float]:
            return [x for x in v[_HDR + slot * n: _HDR + (slot + 1) * n] if x == x]  # NaN: padding

        out.append(RankProfile(
            iteration=int(v[0]), plan_hash=int(v[1]) | (int(v[2]) << 26), f_ms=v[3], i_ms=v[4], w_ms=v[5],
            b_ms=v[6], busy_ms=v[7], first_start=v[8], first_f=v[9], last_end=v[10], activation_bytes=v[11],
            clock_offset_prev=v[12], rtt_prev=v[13], send_bytes_next=v[14], candidate_hash=int(v[15]),
            memory_budget_bytes=v[16], gap_ms=v[17],
            sends_next=stamps(0), sends_prev=stamps(1), arrivals_prev=stamps(2), arrivals_next=stamps(3),
            stage_ms=[v[_HDR + 4 * n + 4 * j: _HDR + 4 * n + 4 * j + 4] for j in range(local_stages)],
        ))
    return out


def _median(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else math.nan


def _quantile(xs: list[float], q: float) -> float:
    xs = [x for x in xs if x == x]  # NaN left out
    if not xs:
        return math.nan
    if q == 0.0:  # the minimum (DELAY_QUANTILE): no sort
        return min(xs)
    xs.sort()
    pos = q * (len(xs) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


#: Per-iteration statistic of the per-message one-way samples of one direction.  Everything that
#: distorts a sample only ever *adds* to it: the watcher's wake-up on a loaded CPU, a receive posted
#: late by a busy receiver (gloo delivers once the receive is posted), queueing behind earlier
#: messages. The planner's c_i is the delay of a lone message (α + size·β, queueing is the simulator's
#: job), which is the smallest sample; the window median over iterations then removes outliers.
#: (A lower quartile, tried first, read 10–20 ms on idle links of a 4-rank CPU run with busy receivers
#: and triggered needless re-plans.)
DELAY_QUANTILE = 0.0


def one_way_delay_ms(forward_s: list[float], backward_s: list[float], offset_s: float = 0.0) -> float:
    """The one measured link delay (ms) of one iteration, from a link's per-message one-way samples
    (seconds) of each direction: forward samples read d_f + θ and backward ones d_b − θ, θ the
    downstream rank's clock minus the upstream one's (``offset_s``; 0 on one clock). Each direction's
    statistic is its smallest sample (:data:`DELAY_QUANTILE`); with both directions the delay is their
    mean, in which θ cancels (Eq.1 needs 2c = d_f + d_b); with one, that one corrected by θ; with none,
    NaN. Never negative. The profiler's send → arrival stamps (:func:`link_delay_estimates`) and
    TorchTitan's monitor's producer-end → consumer-start gaps (``titan.monitor.timeline_stats``) both
    reduce through it."""
    mf, mb = _quantile(forward_s, DELAY_QUANTILE), _quantile(backward_s, DELAY_QUANTILE)
    if forward_s and backward_s:
        c = 1e3 * (mf + mb) / 2
    elif forward_s or backward_s:  # one direction only (forward-only iteration): needs the offset
        c = 1e3 * ((mf - offset_s) if forward_s else (mb + offset_s))
    else:
        return math.nan
    return max(c, 0.0) if not math.isnan(c) else c


def link_delay_estimates(ranks: list[RankProfile]) -> list[dict[str, float]]:
    """Per link i (ranks i, i+1): offset-free one-way delay ``c_i`` and per-direction values (ms).

    ``c_ms`` = (q raw fwd + q raw bwd)/2 with q the minimum (``DELAY_QUANTILE``); the clock
    offset cancels (module docstring);
    ``fwd_ms``/``bwd_ms`` use the start-up clock-offset estimate (error ≤ RTT/2) and are for reporting.
    """
    out = []
    for i in range(len(ranks) - 1):
        a, b = ranks[i], ranks[i + 1]
        k_f = min(len(a.sends_next), len(b.arrivals_prev))
        k_b = min(len(b.sends_prev), len(a.arrivals_next))
        raw_f = [b.arrivals_prev[k] - a.sends_next[k] for k in range(k_f)]
        raw_b = [a.arrivals_next[k] - b.sends_prev[k] for k in range(k_b)]
        mf, mb = _quantile(raw_f, DELAY_QUANTILE), _quantile(raw_b, DELAY_QUANTILE)
        theta = b.clock_offset_prev if not math.isnan(b.clock_offset_prev) else 0.0  # clock_{i+1} - clock_i
        out.append({
            "c_ms": one_way_delay_ms(raw_f, raw_b, theta),
            "fwd_ms": 1e3 * (mf - theta) if raw_f else math.nan,
            "bwd_ms": 1e3 * (mb + theta) if raw_b else math.nan,
            "messages": float(k_f + k_b),
        })
    return out


def timeline_bubble_rate(ranks: list[RankProfile]) -> tuple[float, float]:
    """Bubble rate = 1 − Σ busy / (S · T), T from the first F on stage 0 to the last op anywhere.

    Cross-rank times are put on rank 0's clock with the start-up offsets.  Returns (bubble, T ms).
    """
    offsets = [0.0]
    for r in ranks[1:]:
        theta = r.clock_offset_prev if not math.isnan(r.clock_offset_prev) else 0.0
        offsets.append(offsets[-1] + theta)
    start = ranks[0].first_f
    end = max(r.last_end - off for r, off in zip(ranks, offsets))
    span_ms = 1e3 * (end - start)
    if not span_ms > 0:
        return math.nan, math.nan
    return bubble_rate(sum(r.busy_ms for r in ranks), len(ranks), span_ms), span_ms


def estimate_clock_offsets(group: Any, rounds: int = 8) -> tuple[float, float]:
    """NTP-style ping-pong with the previous PP rank; returns (clock_self − clock_prev [s], min RTT [s]).

    Rank i (client) pings rank i+1 (server) for every link in order, so no two pairs deadlock.
    Rank 0 returns (nan, nan).
    """
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    buf = torch.zeros(2, dtype=torch.float64)
    result = (math.nan, math.nan)
    for link in range(size - 1):
        if rank == link:  # client
            peer = dist.get_global_rank(group, link + 1) if group is not None else link + 1
            best = (math.inf, 0.0)
            for _ in range(rounds):
                t0 = now()
                dist.send(torch.tensor([t0, 0.0], dtype=torch.float64), dst=peer, group=group)
                dist.recv(buf, src=peer, group=group)
                t3 = now()
                t1, t2 = buf.tolist()
                rtt = (t3 - t0) - (t2 - t1)
                theta_server_minus_client = ((t1 - t0) + (t2 - t3)) / 2
                if rtt < best[0]:
                    best = (rtt, theta_server_minus_client)
            # tell the server its offset to us (it owns link `link` as "prev")
            dist.send(torch.tensor([best[1], best[0]], dtype=torch.float64), dst=peer, group=group)
        elif rank == link + 1:  # server
            peer = dist.get_global_rank(group, link) if group is not None else link
            for _ in range(rounds):
                dist.recv(buf, src=peer, group=group)
                t1 = now()
                dist.send(torch.tensor([t1, now()], dtype=torch.float64), dst=peer, group=group)
            dist.recv(buf, src=peer, group=group)
            result = (buf[0].item(), buf[1].item())
    return result
