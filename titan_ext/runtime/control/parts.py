"""The parts of an adaptive schedule, one-stage vs multi-stage chosen once, and the registry entry that
names a schedule's planner and policy.

An adaptive schedule is the coordinator (``runtime/adaptive.py``) plus a :class:`ScheduleSpec`: its
name, config class, the planner it runs with one stage per rank and with several, and the policy
(default: ``ReplanPolicy`` / ``VirtualReplanPolicy`` from the config's ``PolicySettings``).
:func:`build_parts` reads the layout once and returns the :class:`Parts` that differ between one stage
per rank (PipeMorph §4.2 Eq.1 per link, the backward chooser, per-stage memory cap) and several
(stage-level estimate over rank links, the virtual Eq.1, per-rank memory cap K_r).  Nothing
else in the runtime branches on the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from titan_ext.plan import PipelineProfile, link_tolerances_ms
from titan_ext.args import ArgumentTypeError, callable_arg, sequence_arg

from ..decide.budget import MemoryBudget, RankMemoryBudget, StageMemoryBudget
from ..decide.placement import Layout, VirtualEstimator, VirtualReplanPolicy, virtual_tolerances
from ..decide.planning import Planner
from ..decide.policy import Policy, ReplanPolicy, exact_arrival_links
from ..measure.estimator import Estimator
from .config import AdaptiveConfig, PolicySettings

__all__ = ["Parts", "ScheduleSpec", "build_parts"]


def _one_stage_policy(settings: PolicySettings) -> Policy:
    return ReplanPolicy.from_settings(settings)


def _multi_stage_policy(layout: Layout, settings: PolicySettings) -> Policy:
    return VirtualReplanPolicy.from_settings(settings, layout=layout)


@dataclass(frozen=True)
class ScheduleSpec:
    """A registry entry of an adaptive schedule: everything that makes one differ from another."""

    name: str
    one_stage_planner: Callable[[AdaptiveConfig], Planner]
    multi_stage_planner: Callable[[Layout, AdaptiveConfig], Planner]
    config_class: type[AdaptiveConfig] = AdaptiveConfig
    backward_choices: tuple[str, ...] = ("auto", "measure", "split", "full")  # what ``backward=`` may be
    one_stage_policy: Callable[[PolicySettings], Policy] = _one_stage_policy
    multi_stage_policy: Callable[[Layout, PolicySettings], Policy] = _multi_stage_policy
    v_pair_planner: Callable[[Layout, AdaptiveConfig], Planner] | None = None
    """The planner with two stages per rank placed "v" (CrossPipe: CrossWave); None: ``multi_stage_planner``."""

    def __post_init__(self) -> None:
        """Every field checked when the entry is made, not when a schedule is first built."""
        if not (isinstance(self.name, str) and self.name.strip()):
            raise ArgumentTypeError(f"ScheduleSpec name must be a non-empty schedule name, got {self.name!r}")
        callable_arg(self.one_stage_planner, "one_stage_planner", "a callable (config) -> Planner")
        callable_arg(self.multi_stage_planner, "multi_stage_planner", "a callable (layout, config) -> Planner")
        callable_arg(self.one_stage_policy, "one_stage_policy", "a callable (PolicySettings) -> Policy")
        callable_arg(self.multi_stage_policy, "multi_stage_policy", "a callable (layout, PolicySettings) -> Policy")
        callable_arg(self.v_pair_planner, "v_pair_planner", "a callable (layout, config) -> Planner", optional=True)
        if not (isinstance(self.config_class, type) and issubclass(self.config_class, AdaptiveConfig)):
            raise ArgumentTypeError(f"schedule {self.name!r}: config_class must be an AdaptiveConfig subclass, "
                                    f"got {self.config_class!r}")
        choices = sequence_arg(self.backward_choices, "backward_choices", "a tuple of backward variants")
        if not choices or any(c not in ("auto", "measure", "split", "full") for c in choices):
            raise ValueError(f"backward_choices must be some of ('auto', 'measure', 'split', 'full'), got {choices!r}")


@dataclass(frozen=True)
class Parts:
    """What differs between one stage per rank and several (built once by :func:`build_parts`)."""

    layout: Layout
    planner: Planner  # ``config.planner`` if given, else the entry's for the layout
    policy: Policy  # ``config.policy`` if given, else the entry's, from ``config.policy_settings``
    estimator: Estimator
    memory: MemoryBudget
    choose_backward: bool  # ``backward="auto"``/``"measure"`` choose the variant (one stage per rank only)
    local_stages: int  # stage rows per rank in the exchanged profile (0: one stage, no rows)
    message_slots: int  # most messages one direction of a rank link carries per iteration: V·N
    stage_ms: Callable[[Any, int], list | None]  # (iteration profile, rank) → per-local-stage rows
    link_estimates_ms: Callable[[], list[float]]  # per (rank) link delay estimates, for the metrics
    tolerances: Callable[[PipelineProfile, PipelineProfile, Any], list[float]]  # (split, full, deployed)
    #: (Eq.1 tolerances, delays planned for, the policy's absolute margin) → the links whose arrivals need
    #: the watcher's exact stamps (None: every link)
    exact_links: Callable[[Sequence[float] | None, Sequence[float] | None, float], set[int] | None]
    extensions_refused: str | None  # why Falcon and delegation do not run with this layout (None: they do)


def build_parts(name: str, layout: Layout, n_microbatches: int, config: AdaptiveConfig, spec: ScheduleSpec,
                device: Callable[[], Any], activation_bytes: Callable[[], float | None]) -> Parts:
    """The parts for ``layout``: one stage per rank or several, decided here once.  ``device`` and
    ``activation_bytes`` are read when needed (the device layer exists once torch's constructor ran)."""
    build = _multi_stage if layout.virtual else _one_stage
    return build(name, layout, n_microbatches, config, spec, device, activation_bytes)


def _memory(cls: type[MemoryBudget], name: str, layout: Layout, n: int, config: AdaptiveConfig,
            device: Callable[[], Any],
            activation_bytes: Callable[[], float | None]) -> MemoryBudget:
    return cls(name, layout.num_stages, n, layout.stages_per_rank, config.memory_budget_bytes, config.max_inflight,
               config.adaptive_memory_limit, device, activation_bytes)


def _one_stage(name: str, layout: Layout, n: int, config: AdaptiveConfig, spec: ScheduleSpec, device: Callable[[], Any],
               activation_bytes: Callable[[], float | None]) -> Parts:
    S = layout.num_stages
    if n < S:  # as torch's Schedule1F1B; Interleaved1F1B and ZBV take N < S
        raise ValueError(f"{name} with one stage per rank needs n_microbatches >= num_stages, got {n} < {S}")
    policy = config.policy if config.policy is not None else spec.one_stage_policy(config.policy_settings)
    estimator = Estimator(S, n, max(1, int(policy.window)), config.initial_times_ms)

    def tolerances(split: PipelineProfile, full: PipelineProfile, deployed: Any) -> list[float]:
        return link_tolerances_ms(full if deployed.backward == "full" else split, deployed.warmup_counts)

    planner = config.planner if config.planner is not None else spec.one_stage_planner(config)
    memory = _memory(StageMemoryBudget, name, layout, n, config, device, activation_bytes)
    return Parts(layout, planner, policy, estimator, memory, choose_backward=config.backward in ("auto", "measure"),
                 local_stages=0, message_slots=n, stage_ms=lambda prof, rank: None,
                 link_estimates_ms=lambda: list(estimator.profile().delays_ms), tolerances=tolerances,
                 exact_links=exact_arrival_links, extensions_refused=None)


def _multi_stage(name: str, layout: Layout, n: int, config: AdaptiveConfig, spec: ScheduleSpec,
                 device: Callable[[], Any],
                 activation_bytes: Callable[[], float | None]) -> Parts:
    policy = config.policy if config.policy is not None else spec.multi_stage_policy(layout, config.policy_settings)
    estimator = VirtualEstimator(layout, n, max(1, int(policy.window)), config.initial_times_ms)

    def stage_ms(prof: Any, rank: int) -> list:
        return prof.stage_times_ms(layout.local_stages(rank))

    def tolerances(split: PipelineProfile, full: PipelineProfile, deployed: Any) -> list[float]:  # noqa: ARG001
        return virtual_tolerances(split, layout, deployed.warmup_counts)  # per rank link (docs/multistage.md)

    if config.planner is not None:
        planner = config.planner
    elif spec.v_pair_planner is not None and layout.placement == "v" and layout.stages_per_rank == 2:
        planner = spec.v_pair_planner(layout, config)
    else:
        planner = spec.multi_stage_planner(layout, config)
    return Parts(layout, planner, policy, estimator,
                 _memory(RankMemoryBudget, name, layout, n, config, device, activation_bytes),
                 choose_backward=False,  # the portfolio picks the backward variant of every plan
                 local_stages=layout.stages_per_rank, message_slots=layout.stages_per_rank * n, stage_ms=stage_ms,
                 link_estimates_ms=estimator.rank_link_delays_ms, tolerances=tolerances,
                 exact_links=lambda tolerance_ms, planned_for_ms, abs_margin_ms: None,  # every link
                 extensions_refused=f"Falcon and delegation run with one stage per rank only, got "
                                    f"{layout.stages_per_rank} stages per rank")


