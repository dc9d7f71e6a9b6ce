"""The monitor's explicit input and output: frozen dataclasses.

:class:`IterationObservation` is everything the trainer measured in one iteration (Falcon §4.2's
iteration time, §4.3's per-group times, §5.3's per-replica micro-batch times t_i with the split
they were measured at); :class:`FalconDecision` is what the monitor concluded from it — the
``falcon/*`` metrics (a read-only mapping, so it merges into the trainer's metrics and W&B as
before) with typed accessors for what a trainer acts on (validate now, strategies to apply and
their plans). Neither is changed after it is made: a trainer that adds its own entries makes a new
decision (:meth:`FalconDecision.with_metrics`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Iterator

from titan_ext.args import counts_arg, int_arg, mapping_arg, real_arg, reals_arg

__all__ = ["IterationObservation", "FalconDecision"]


def _frozen_mapping(m: Mapping | None, name: str = "metrics") -> Mapping:
    return MappingProxyType(dict(mapping_arg(m, name) if m is not None else {}))


def _listed(value):
    """A numpy array as the list it holds (the checks take sequences)."""
    return value.tolist() if hasattr(value, "tolist") and not isinstance(value, (list, tuple)) else value


@dataclass(frozen=True)
class IterationObservation:
    """One iteration as the trainer measured it.

    ``iteration_time_s``: the iteration time (§4.2; the same on every rank, e.g. the slowest rank's);
    None only with a :class:`~.hooks.CallRecorder`, whose ACF period then gives the times.
    ``per_group_times``: group name → transfer time / link delay, seconds (§4.3 profiling).
    ``replica_microbatch_s``: per DP replica (``grid`` row) its measured time per micro-batch this
    iteration (§5.3's t_i, "profiled by Falcon-Detect"); ``split``: the micro-batches each replica ran
    (given together)."""

    iteration_time_s: float | None = None
    per_group_times: Mapping[str, float] = field(default_factory=dict)
    replica_microbatch_s: tuple[float, ...] | None = None
    split: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        """Every field checked: TypeError / ValueError naming it. An iteration time is > 0;
        a group time is any finite number (a link delay estimate may read slightly below 0; the
        monitor floors it); a replica's time per micro-batch is >= 0 (0: not measured)."""
        if self.iteration_time_s is not None:
            object.__setattr__(self, "iteration_time_s", real_arg(self.iteration_time_s, "iteration_time_s", positive=True))
        groups = mapping_arg({} if self.per_group_times is None else self.per_group_times, "per_group_times",
                             "group -> seconds")
        object.__setattr__(self, "per_group_times",
                           MappingProxyType({str(g): real_arg(t, f"per_group_times[{g!r}]") for g, t in groups.items()}))
        if (self.replica_microbatch_s is None) != (self.split is None):
            raise ValueError("IterationObservation: replica_microbatch_s and split are given together")
        if self.split is not None:
            t = tuple(reals_arg(_listed(self.replica_microbatch_s), "replica_microbatch_s", minimum=0))
            s = tuple(counts_arg(_listed(self.split), "split", minimum=0))
            if len(t) != len(s):
                raise ValueError(f"IterationObservation: {len(t)} replica times for a split of {len(s)}")
            object.__setattr__(self, "replica_microbatch_s", t)
            object.__setattr__(self, "split", s)


@dataclass(frozen=True, eq=False)
class FalconDecision(Mapping):
    """The monitor's answer for one iteration: ``metrics`` (``falcon/*`` → number or string, the
    table in docs/falcon.md) read-only; a :class:`~collections.abc.Mapping` over them (equal to a
    dict of the same entries). ``iteration``: the monitor's iteration index (-1: none consumed)."""

    iteration: int
    metrics: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        int_arg(self.iteration, "iteration", -1)
        object.__setattr__(self, "metrics", _frozen_mapping(self.metrics))

    # Mapping over the metrics
    def __getitem__(self, key: str) -> Any:
        return self.metrics[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.metrics)

    def __len__(self) -> int:
        return len(self.metrics)

    def __repr__(self) -> str:
        return f"FalconDecision(iteration={self.iteration}, metrics={dict(self.metrics)!r})"

    def with_metrics(self, extra: Mapping[str, Any]) -> "FalconDecision":
        """A new decision with ``extra`` entries added (or replaced)."""
        return FalconDecision(self.iteration, {**self.metrics, **extra})

    # what a trainer acts on
    @property
    def validate(self) -> bool:
        """Run validation now (§4.3: onset, or a further slowdown during an event)."""
        return bool(self.metrics.get("falcon/validate"))

    @property
    def apply(self) -> tuple[str, ...]:
        """Strategies Alg. 1 (§5.2) switched to at this iteration, in ladder order."""
        return tuple(filter(None, str(self.metrics.get("falcon/apply", "")).split(",")))

    @property
    def event(self) -> str | None:
        return self.metrics.get("falcon/event")

    @property
    def root_cause(self) -> str | None:
        return self.metrics.get("falcon/root_cause")

    @property
    def microbatch_split(self) -> tuple[int, ...] | None:
        """S2's Eq. 1 split (per DP replica), when S2 is applied with a plan."""
        s = self.metrics.get("falcon/plan/microbatch_split")
        return tuple(json.loads(s)) if s else None

    @property
    def topology_grid(self) -> tuple[tuple[int, ...], ...] | None:
        """S3's planned ``grid[dp][pp]``, when S3 is applied with a plan."""
        s = self.metrics.get("falcon/plan/topology_grid")
        return tuple(tuple(r) for r in json.loads(s)) if s else None
