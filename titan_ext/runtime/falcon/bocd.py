"""Slow-iteration detection: Bayesian online change-point detection plus verification.

Falcon §4.2 ("Slow iteration detection") and Appendix §9.1: the iteration-time series is fed to
Bayesian online change-point detection (BOCD, Adams & MacKay 2007, arXiv:0710.3742); a change-point
is reported when its posterior probability reaches 0.9, then *verified*: if the mean iteration time
after the change-point differs from the mean before it by less than 10 % it is discarded as jitter.

No PyPI package fits: the BOCD packages on the index (``bocd`` 0.1.2 of 2019, ``bocpd`` 0.0.4 of
2023, ``bayesian-changepoint-detection`` 0.2.dev1) are unmaintained research code without a bounded
per-step cost; this module is a self-contained numpy implementation.

Model (documented choices)
--------------------------
* Observations are ``y_t = log(iteration_time_t)``: multiplicative slowdowns become level shifts and
  the detector is independent of the job's absolute iteration time.
* Underlying predictive model (UPM): Gaussian with unknown mean and variance, Normal-Gamma conjugate
  prior ``(mu0, kappa0, alpha0, beta0)``; the predictive is Student-t with ``2 alpha`` degrees of
  freedom (Murphy 2007, "Conjugate Bayesian analysis of the Gaussian distribution", §3.5–3.6).
  ``mu0`` is the first observation, ``beta0 = alpha0 * prior_scale**2``.
* Change-point prior: constant hazard ``H = 1 / expected_run_length``.
* Message passing exactly as Falcon Eq. (3)–(5): ``P(r_t, x_1:t) = Σ_{r_{t-1}} P(x_t | r_t, x^(l))
  P(r_t | r_{t-1}) P(r_{t-1}, x_1:t-1)``, where a new run (``r_t = 0``) is scored with the prior
  predictive. The run-length distribution is truncated to ``max_run_length`` entries (the tail mass
  is folded into the last entry) so one step costs O(max_run_length) numpy work, never growing.
* "Change-point probability": the posterior mass of runs that began within the last
  ``window`` observations, ``p_cp(t) = P(r_t < window | x_1:t)``. (With a constant hazard the
  textbook ``P(r_t = 0 | x_1:t)`` cannot alone separate a single outlier from a level shift; the
  window makes the probability a statement about a *recent* change-point.) The change-point is placed
  at ``tau = t - r*`` with ``r*`` the most probable run length among those.
* A candidate is only judged once ``r* + 1 >= min_segment`` observations follow it, so a one- or
  two-iteration spike (whose run is abandoned by the posterior as soon as the series returns) is
  never verified as a fail-slow.
* Verification (Falcon §4.2): compare the average iteration time after ``tau`` with the average of
  those between the last *confirmed* change-point and ``tau`` (at most ``max_baseline`` of them); a
  relative difference below ``min_relative_change`` (10 %) is jitter. The "average" is the median by
  default (``BOCDConfig.average``): with only a few iterations after a candidate, one 2-iteration
  spike moves a mean by > 10 % (seed 50104 of the benchmark traces did exactly that), a median not.
* A candidate stays *pending* and is re-verified each iteration while the posterior still places the
  current run's start near it (for at most ``max_pending`` iterations), so a ramp whose level
  crosses 10 % only after some iterations is still confirmed.
* States: healthy → ``onset`` (slower by ≥ 10 %) → slow → ``level`` (another ≥ 10 % change, still
  slow) / ``relief`` (back within 10 % of the healthy level) → healthy. A ≥ 10 % speed-up while
  healthy is reported as ``speedup`` (a new healthy level).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from titan_ext.args import choice_arg, instance_arg, int_arg, real_arg

__all__ = ["BOCDConfig", "OnlineBOCD", "ChangePoint", "SlowIterationDetector"]


@dataclass(frozen=True)
class BOCDConfig:
    """Parameters of the detector (defaults: Falcon §4.2 thresholds)."""

    threshold: float = 0.9
    """Change-point probability at or above which a change-point is reported (Falcon: 0.9)."""
    min_relative_change: float = 0.10
    """Verification: |after / before - 1| below this is jitter (Falcon: 10 %)."""
    average: str = "median"
    """Statistic of the before / after windows: "median" (default, robust to a 1-2-iteration spike
    inside a short after-window) or "mean" (the paper's literal average)."""
    expected_run_length: float = 250.0
    """1 / hazard: prior expectation of iterations between change-points."""
    window: int = 32
    """Runs that started within the last ``window`` observations count as a recent change-point."""
    min_segment: int = 3
    """Observations after a candidate change-point before it is verified (spike guard)."""
    max_run_length: int = 256
    """Truncation of the run-length distribution (bounds per-step cost)."""
    max_baseline: int = 100
    """At most this many observations before the change-point form the 'before' mean."""
    prior_scale: float = 0.05
    """Prior guess of the iteration-time noise, as a fraction (std of log time)."""
    kappa0: float = 0.05
    """Prior pseudo-count on the mean (small: new runs adapt to the new level quickly)."""
    alpha0: float = 2.0
    """Prior shape of the precision (``2*alpha0`` degrees of freedom of the prior predictive)."""
    outlier_prob: float = 0.02
    """Weight of a broad outlier component in the UPM (robustness to isolated spikes)."""
    outlier_scale: float = 1.0
    """Std (in log time) of the outlier component, centred on the run's mean."""
    max_pending: int = 60
    """A change-point candidate is re-verified for at most this many iterations while the posterior
    still places the current run's start there (ramps reach 10 % only after a few iterations)."""
    start_relative_change: float = 0.25
    """A fault within the first ``min_segment`` observations (a job fed from its second step, faulty
    from its third, has one healthy iteration) is verified against that shorter baseline (at least
    one observation), but only as a slowdown of at least this fraction between the fastest
    iteration after it and the slowest before (one sample is a noisier baseline than a median of
    three). 0 = off: ``min_segment`` observations before any change-point (the monitor's per-group
    detectors, whose series are far noisier than the iteration time)."""
    peer_ratio: float = 2.0
    """Cross-replica pinpointing (Falcon's comparison of DP peers): over the last ``peer_window``
    iterations the same replica is the slowest, its time per micro-batch is a median ``peer_ratio``
    times the fastest's and never below ``peer_min_ratio`` times -- an onset of a device slow from the
    first step, which leaves the iteration-time series without a healthy level to change from. Only
    before the first confirmed change-point (afterwards the series has its baseline). 0 = off. (The
    healthy DP 2 x PP 2 job on a loaded 2-core host showed single-step ratios up to 2.5x, alternating
    between the replicas; a 4x device shows 3-4x every step.)"""
    peer_min_ratio: float = 1.25
    """The smallest ratio any iteration of the window may show (above)."""
    peer_window: int = 4
    """Iterations of the cross-replica comparison (above)."""

    def __post_init__(self) -> None:
        """Every field checked: TypeError naming it for a wrong type, ValueError for a value
        the model cannot use (a hazard needs ``expected_run_length`` > 1, a probability is within [0, 1])."""
        real_arg(self.threshold, "BOCDConfig.threshold", positive=True, maximum=1.0)
        real_arg(self.min_relative_change, "BOCDConfig.min_relative_change", minimum=0)
        choice_arg(self.average, "BOCDConfig.average", ("median", "mean"))
        if not real_arg(self.expected_run_length, "BOCDConfig.expected_run_length") > 1:
            raise ValueError(f"BOCDConfig.expected_run_length must be > 1 (1 / hazard), got {self.expected_run_length!r}")
        for name in ("window", "min_segment", "max_run_length", "max_baseline", "peer_window"):
            int_arg(getattr(self, name), f"BOCDConfig.{name}", 1)
        int_arg(self.max_pending, "BOCDConfig.max_pending", 0)
        for name in ("prior_scale", "kappa0", "alpha0", "outlier_scale"):
            real_arg(getattr(self, name), f"BOCDConfig.{name}", positive=True)
        if not real_arg(self.outlier_prob, "BOCDConfig.outlier_prob", minimum=0) < 1:
            raise ValueError(f"BOCDConfig.outlier_prob must be within [0, 1), got {self.outlier_prob!r}")
        for name in ("start_relative_change", "peer_ratio", "peer_min_ratio"):
            real_arg(getattr(self, name), f"BOCDConfig.{name}", minimum=0)


def _logsumexp(x: np.ndarray) -> float:
    m = float(x.max())
    return m + math.log(float(np.exp(x - m).sum()))


class OnlineBOCD:
    """Adams & MacKay (2007) run-length posterior with a Normal-Gamma UPM (Falcon Appendix §9.1).

    ``update(y)`` consumes one observation and returns the normalised run-length posterior
    ``P(r_t = r | y_1:t)`` for ``r = 0 .. len-1`` (index ``r`` = run of length ``r`` ending at ``t``,
    i.e. that began at observation ``t - r``).
    """

    def __init__(self, config: BOCDConfig = BOCDConfig()):
        self.config = instance_arg(config, "config", BOCDConfig)
        self.log_hazard = math.log(1.0 / config.expected_run_length)
        self.log_1m_hazard = math.log1p(-1.0 / config.expected_run_length)
        self._mu0: float | None = None
        self.t = 0
        # Sufficient statistics per run length (index = run length before the new point).
        self._log_joint = np.zeros(0)
        self._n = np.zeros(0)
        self._mean = np.zeros(0)
        self._m2 = np.zeros(0)
        # Precomputed lgamma for dof = 2*alpha0 + n (n = 0..max_run_length).
        if config.outlier_prob > 0.0:
            self._log_eps = math.log(config.outlier_prob)
            self._log_1m_eps = math.log1p(-config.outlier_prob)
            self._log_out_norm = -0.5 * math.log(2.0 * math.pi * config.outlier_scale ** 2)
        n_all = np.arange(config.max_run_length + 2, dtype=np.float64)
        dof = 2.0 * config.alpha0 + n_all
        self._n_grid = n_all
        self._lg_ratio = np.array(
            [math.lgamma((d + 1.0) / 2.0) - math.lgamma(d / 2.0) for d in dof]
        )

    def _predictive_logpdf(self, y: float, n: np.ndarray, mean: np.ndarray, m2: np.ndarray) -> np.ndarray:
        c = self.config
        kappa = c.kappa0 + n
        mu = (c.kappa0 * self._mu0 + n * mean) / kappa
        alpha = c.alpha0 + n / 2.0
        beta0 = c.alpha0 * c.prior_scale ** 2
        beta = beta0 + 0.5 * m2 + c.kappa0 * n * (mean - self._mu0) ** 2 / (2.0 * kappa)
        dof = 2.0 * alpha
        scale2 = beta * (kappa + 1.0) / (alpha * kappa)
        z = (y - mu) ** 2 / (dof * scale2)
        lp_t = np.interp(n, self._n_grid, self._lg_ratio) - 0.5 * np.log(np.pi * dof * scale2) - (dof + 1.0) / 2.0 * np.log1p(z)
        if c.outlier_prob <= 0.0:
            return lp_t, np.ones_like(lp_t)
        lp_out = self._log_out_norm - 0.5 * (y - mu) ** 2 / c.outlier_scale ** 2
        a = lp_t + self._log_1m_eps
        b = lp_out + self._log_eps
        lp = np.logaddexp(a, b)
        return lp, np.exp(a - lp)

    def _prior_logpdf(self, y: float) -> float:
        """Prior predictive (new run, n = 0) — scalar version of :meth:`_predictive_logpdf`."""
        c = self.config
        dof = 2.0 * c.alpha0
        scale2 = c.prior_scale ** 2 * (c.kappa0 + 1.0) / c.kappa0
        d2 = (y - self._mu0) ** 2
        lp_t = (math.lgamma((dof + 1.0) / 2.0) - math.lgamma(dof / 2.0)
                - 0.5 * math.log(math.pi * dof * scale2) - (dof + 1.0) / 2.0 * math.log1p(d2 / (dof * scale2)))
        if c.outlier_prob <= 0.0:
            return lp_t
        lp_out = self._log_out_norm - 0.5 * d2 / c.outlier_scale ** 2
        return float(np.logaddexp(lp_t + self._log_1m_eps, lp_out + self._log_eps))

    def update(self, y: float) -> np.ndarray:
        c = self.config
        if self._mu0 is None:
            self._mu0 = float(y)
        if self.t == 0:
            # First observation: a run of length 0 that began now (posterior 1).
            self._log_joint = np.zeros(1)
            self._n = np.ones(1)
            self._mean = np.array([float(y)])
            self._m2 = np.zeros(1)
            self.t = 1
            return np.ones(1)
        # Predictive of y under every existing run (growth) and under a fresh run (change-point).
        pred_lp, resp = self._predictive_logpdf(y, self._n, self._mean, self._m2)
        new_run_lp = self._prior_logpdf(y)
        growth = self._log_joint + pred_lp + self.log_1m_hazard
        # self._log_joint is normalised, so sum_r P(r_{t-1}) * H = H (constant hazard).
        cp_mass = self.log_hazard + new_run_lp
        log_joint = np.concatenate(([cp_mass], growth))
        # Weighted (responsibility) update of the sufficient statistics: an observation the outlier
        # component explains barely moves the run's mean and variance.
        n_g = self._n + resp
        delta = y - self._mean
        mean_g = self._mean + resp * delta / n_g
        m2_g = self._m2 + resp * delta * (y - mean_g)
        n = np.concatenate(([1.0], n_g))
        mean = np.concatenate(([float(y)], mean_g))
        m2 = np.concatenate(([0.0], m2_g))
        if log_joint.size > c.max_run_length:
            # Fold the tail into the last kept run length (keeps the longest-run statistics).
            tail = _logsumexp(log_joint[c.max_run_length - 1 :])
            log_joint = log_joint[: c.max_run_length].copy()
            log_joint[-1] = tail
            n, mean, m2 = n[: c.max_run_length], mean[: c.max_run_length], m2[: c.max_run_length]
        log_joint -= _logsumexp(log_joint)  # normalise (Falcon Eq. 4); avoids underflow
        self._log_joint, self._n, self._mean, self._m2 = log_joint, n, mean, m2
        self.t += 1
        return np.exp(log_joint)


@dataclass
class ChangePoint:
    """One verified change-point (Falcon §4.2)."""

    index: int
    """Iteration index (0-based, into the observed series) of the first slow / recovered iteration."""
    detected_at: int
    """Iteration index at which it was confirmed (latency = detected_at - index)."""
    probability: float
    """Change-point probability at confirmation (>= threshold)."""
    level_before: float
    """Average (``BOCDConfig.average``) iteration time, seconds, before the change-point."""
    level_after: float
    """Average iteration time from the change-point to its confirmation."""
    kind: str
    """'onset' (healthy -> slow), 'relief' (slow -> healthy) or 'level' (slow level changed)."""
    by: str = "time"
    """What found it: "time" (BOCD on the iteration time, Falcon §4.2) or "replicas" (one DP replica
    slower than its peers from the start: :meth:`SlowIterationDetector.compare_replicas`)."""
    replica: int | None = None
    """With ``by == "replicas"``: the slow replica (its ``grid`` row)."""

    @property
    def relative_change(self) -> float:
        return self.level_after / self.level_before - 1.0

    def as_dict(self) -> dict:
        return {
            "index": self.index,
            "detected_at": self.detected_at,
            "probability": self.probability,
            "before_s": self.level_before,
            "after_s": self.level_after,
            "relative_change": self.relative_change,
            "kind": self.kind,
            "by": self.by,
            **({"replica": self.replica} if self.replica is not None else {}),
        }


@dataclass
class SlowIterationDetector:
    """Streaming fail-slow detector over iteration times: BOCD + 10 % verification (Falcon §4.2).

    ``observe(t_s)`` returns a verified :class:`ChangePoint` or ``None``. State: ``slow`` (a fail-slow
    is in progress) and ``healthy_mean_s`` (average iteration time before the onset).
    """

    config: BOCDConfig = field(default_factory=BOCDConfig)

    def __post_init__(self):
        instance_arg(self.config, "config", BOCDConfig)
        self.reset()

    def reset(self) -> None:
        self._bocd = OnlineBOCD(self.config)
        self.times: list[float] = []
        self.change_points: list[ChangePoint] = []
        self.rejected: int = 0
        self._cumsum: list[float] = [0.0]
        self._segment_start = 0  # index of the last confirmed change-point (or 0)
        self._pending: int | None = None  # change-point candidate awaiting verification
        self._pending_p = 0.0
        self._pending_since = 0
        self.slow = False
        self.healthy_mean_s: float | None = None
        self.last_probability = 0.0
        self._peer_run: list[tuple[int, float]] = []  # (slowest replica, slowest / fastest), in a row

    def _average(self, lo: int, hi: int) -> float:
        if self.config.average == "mean":
            return (self._cumsum[hi] - self._cumsum[lo]) / (hi - lo)
        return float(np.median(self.times[lo:hi]))

    def observe(self, iteration_time_s: float) -> ChangePoint | None:
        c = self.config
        real_arg(iteration_time_s, "iteration_time_s", positive=True)
        self.times.append(float(iteration_time_s))
        self._cumsum.append(self._cumsum[-1] + float(iteration_time_s))
        post = self._bocd.update(math.log(iteration_time_s))
        t = len(self.times) - 1
        # Runs that began within the last `window` observations *and* after the current segment's
        # start (early in a segment every run is "recent"; those must not count).
        w = min(c.window, post.size, t - self._segment_start)
        p_cp = float(post[:w].sum()) if w > 0 else 0.0
        self.last_probability = p_cp
        if p_cp >= c.threshold:
            r_star = int(np.argmax(post[:w]))
            if r_star + 1 >= c.min_segment:
                tau = t - r_star
                if tau > self._segment_start and tau != self._pending:
                    self._pending, self._pending_p, self._pending_since = tau, p_cp, t
        if self._pending is None:
            return None
        tau = self._pending
        # Keep re-verifying while the posterior still puts the current run's start near tau.
        tau_map = t - int(np.argmax(post))
        if abs(tau_map - tau) > c.window or t - self._pending_since > c.max_pending:
            self._pending = None
            self.rejected += 1
            return None
        return self._verify(tau, self._pending_p)

    def verify_proposed(self, tau: int, probability: float, excess_s: float) -> ChangePoint | None:
        """Falcon §4.2's verification at a change-point that another series located: a profiled
        group's time (the monitor's group tracking, :class:`~.monitor.FalconConfig`). Only a
        slowdown is taken (``onset`` / ``level``), and only when the group's added time
        ``excess_s`` is itself at least ``min_relative_change`` of the iteration time before
        ``tau``: the group explains the slowdown, not just moves with it."""
        if not self._segment_start < tau < len(self.times):
            return None
        return self._verify(tau, probability, excess_s)

    def _verify(self, tau: int, probability: float, excess_s: float | None = None) -> ChangePoint | None:
        """The verification (Falcon §4.2: a change of the average of ≥ 10 %) of a change-point at
        ``tau``; on success the state moves (onset / level / relief / speedup) and it is returned.
        ``excess_s`` given: a proposed change-point (:meth:`verify_proposed`), slowdowns only."""
        c = self.config
        t = len(self.times) - 1
        lo = max(self._segment_start, tau - c.max_baseline)
        # at the series' start (nothing confirmed yet) a shorter baseline is enough for a large change
        at_start = c.start_relative_change > 0 and not self.change_points and lo == 0 and 1 <= tau < c.min_segment
        if (tau - lo < c.min_segment and not at_start) or t + 1 - tau < c.min_segment:
            return None
        mean_before = self._average(lo, tau)
        mean_after = self._average(tau, t + 1)
        if at_start:  # a slowdown only, every iteration after it slower than every one before
            fastest_after, slowest_before = min(self.times[tau:t + 1]), max(self.times[lo:tau])
            if fastest_after / slowest_before - 1.0 < max(c.min_relative_change, c.start_relative_change):
                return None
        if abs(mean_after / mean_before - 1.0) < c.min_relative_change:
            return None  # jitter so far (Falcon §4.2 verification)
        if excess_s is not None and not (mean_after > mean_before
                                         and excess_s >= c.min_relative_change * mean_before):
            return None
        if not self.slow:
            if mean_after < mean_before:
                kind = "speedup"  # a faster healthy level, not a fail-slow
            else:
                kind = "onset"
        elif mean_after < self.healthy_mean_s * (1.0 + c.min_relative_change):
            kind = "relief"
        else:
            kind = "level"
        if excess_s is not None and kind == "relief":
            return None
        if kind == "onset":
            self.slow, self.healthy_mean_s = True, mean_before
        elif kind == "relief":
            self.slow = False
        cp = ChangePoint(tau, t, probability, mean_before, mean_after, kind)
        self.change_points.append(cp)
        self._segment_start = tau
        self._pending = None
        return cp

    def compare_replicas(self, replica_times_s, chunks=None) -> ChangePoint | None:
        """Falcon's cross-peer pinpointing on this iteration's per-replica times (each DP replica's
        time per micro-batch; call after :meth:`observe`): the same replica slowest over the last
        ``peer_window`` iterations, by a median of ``peer_ratio`` and at least ``peer_min_ratio`` times
        the fastest, is an ``onset`` of a fault present from the start (the iteration time alone has
        no healthy level to compare with). Its healthy level: the iteration time less what the slow
        replica's chunks (``chunks``: micro-batches per replica) took beyond the fastest's pace (without
        ``chunks``: scaled by fastest / slowest). Only while healthy and before any confirmed
        change-point."""
        c = self.config
        times = [float(v) for v in (replica_times_s or [])]
        if (c.peer_ratio <= 0 or self.slow or self.change_points or len(times) < 2 or not self.times
                or not all(v > 0 and math.isfinite(v) for v in times)):
            self._peer_run = []
            return None
        slowest = max(range(len(times)), key=times.__getitem__)
        self._peer_run = (self._peer_run + [(slowest, times[slowest] / min(times))])[-max(1, c.peer_window):]
        ratios = [r for _, r in self._peer_run]
        if (len(self._peer_run) < max(1, c.peer_window) or len({k for k, _ in self._peer_run}) != 1
                or min(ratios) < c.peer_min_ratio or float(np.median(ratios)) < c.peer_ratio):
            return None
        t = len(self.times) - 1
        tau = max(0, t - len(self._peer_run) + 1)
        after = float(np.median(self.times[tau:]))
        healthy = after / float(np.median(ratios))
        if chunks is not None and len(chunks) == len(times):
            healthy = max(healthy, after - (times[slowest] - min(times)) * chunks[slowest])
        cp = ChangePoint(tau, t, 1.0, healthy, after, "onset", by="replicas", replica=slowest)
        self.slow, self.healthy_mean_s = True, cp.level_before
        self.change_points.append(cp)
        self._segment_start, self._pending, self._peer_run = tau, None, []
        return cp

    @property
    def current_mean_s(self) -> float:
        seg = self.times[self._segment_start :]
        return float(np.mean(seg)) if seg else float("nan")
