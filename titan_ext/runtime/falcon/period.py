"""Framework-agnostic iteration time from communication-call records (Falcon §4.2, Fig. 8).

Training issues the same sequence of communication calls every iteration. Given the sequence of call
*signatures* X = {x_1, x_2, ...} (op name, group, size — whatever identifies a call), Falcon picks the
recurring period as the first lag k whose autocorrelation reaches M = 0.95:

    ACF(X)_k = sum_{t=1}^{L-k} (X_t - mu)(X_{t+k} - mu) / sum_{t=1}^{L} (X_t - mu)^2,
    Period   = argmin_k (ACF(X)_k >= M),

and derives the iteration time as the time between a call and its occurrence one period earlier.

Two documented choices:

* Signatures are categorical, so X is one-hot encoded (one indicator series per distinct signature)
  and the ACF is pooled: numerator and denominator are summed over the indicator series. This makes
  the value independent of how signatures are numbered; for a single numeric series it is the
  formula above.
* The paper's (biased) estimator is at most (L-k)/L on an exactly periodic record, so M = 0.95
  would need L >= 20k calls. :func:`acf` therefore rescales lag k by L/(L-k) (``unbiased=True``,
  the default), so an exactly periodic record scores 1.0 at its period for any L >= 2k.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from titan_ext.args import ArgumentTypeError, bool_arg, int_arg, real_arg, reals_arg

__all__ = ["acf", "estimate_period", "iteration_times_from_calls"]


def _signatures_arg(signatures) -> None:
    """A record of call signatures: a numpy array or a sequence (not one text, not a number)."""
    if isinstance(signatures, (str, bytes)) or not (isinstance(signatures, np.ndarray) or isinstance(signatures, Sequence)):
        raise ArgumentTypeError(f"signatures must be a sequence of call signatures (or a numpy array), "
                                f"got {type(signatures).__name__}")


def _one_hot(signatures: Sequence[Hashable]) -> np.ndarray:
    codes: dict[Hashable, int] = {}
    idx = np.fromiter((codes.setdefault(s, len(codes)) for s in signatures), dtype=np.int64,
                      count=len(signatures))
    onehot = np.zeros((len(signatures), max(len(codes), 1)))
    onehot[np.arange(len(signatures)), idx] = 1.0
    return onehot


def acf(signatures: Sequence[Hashable] | np.ndarray, max_lag: int, unbiased: bool = True) -> np.ndarray:
    """Pooled autocorrelation ``ACF_k`` for ``k = 1..max_lag`` (index 0 of the result is lag 1).

    ``signatures``: a numeric 1-D array (used as is) or a sequence of hashable call signatures
    (one-hot encoded). Lags with fewer than 1 overlapping element get ACF 0.
    """
    _signatures_arg(signatures)
    max_lag = int_arg(max_lag, "max_lag", 0)
    bool_arg(unbiased, "unbiased")
    arr = np.asarray(signatures) if isinstance(signatures, np.ndarray) else None
    if arr is not None and arr.ndim == 1 and np.issubdtype(arr.dtype, np.number):
        x = arr.astype(np.float64)[:, None]
    else:
        x = _one_hot(list(signatures))
    length = x.shape[0]
    x = x - x.mean(axis=0, keepdims=True)
    denom = float((x * x).sum())
    out = np.zeros(max_lag)
    if denom == 0.0 or length < 2:
        return out
    for k in range(1, min(max_lag, length - 1) + 1):
        num = float((x[: length - k] * x[k:]).sum())
        out[k - 1] = num / denom * (length / (length - k) if unbiased else 1.0)
    return out


def estimate_period(signatures: Sequence[Hashable] | np.ndarray, threshold: float = 0.95,
                    max_lag: int | None = None, unbiased: bool = True) -> int | None:
    """First lag k with ``ACF_k >= threshold`` (Falcon §4.2, M = 0.95); None if there is none.

    ``max_lag`` defaults to half the record (a period must repeat at least twice to be seen).
    """
    _signatures_arg(signatures)
    real_arg(threshold, "threshold", positive=True, maximum=1.0)
    int_arg(max_lag, "max_lag", 0, optional=True)
    bool_arg(unbiased, "unbiased")
    n = len(signatures)
    if max_lag is None:
        max_lag = n // 2
    if max_lag < 1:
        return None
    values = acf(signatures, max_lag, unbiased=unbiased)
    hits = np.nonzero(values >= threshold)[0]
    return int(hits[0]) + 1 if hits.size else None


def iteration_times_from_calls(timestamps_s: Sequence[float], period: int, phase: int = 0) -> np.ndarray:
    """Iteration times: time between call ``phase + j*period`` and its previous occurrence.

    ``timestamps_s[i]`` is the start time of call i. Returns one duration per full period after the
    first; any fixed ``phase`` gives the same durations shifted by the phase's offset.
    """
    period = int_arg(period, "period", 1)
    phase = int_arg(phase, "phase", 0)
    if not isinstance(timestamps_s, np.ndarray):
        reals_arg(timestamps_s, "timestamps_s")
    ts = np.asarray(timestamps_s, dtype=np.float64)
    if ts.ndim != 1 or not np.isfinite(ts).all():
        raise ValueError(f"timestamps_s must be one finite start time per call, got an array of shape {ts.shape}")
    anchors = ts[phase::period]
    return np.diff(anchors)
