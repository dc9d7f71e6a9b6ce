"""PipeMorph: an adaptive PP schedule for ``torch.distributed.pipelining`` (PipeMorph §4, §6).

``PipeMorph`` is a ``PipelineScheduleMulti`` (through torch's ``_PipelineScheduleRuntime``) and is
constructed exactly like torch's built-in multi-stage schedules, its settings in one config::

    schedule = PipeMorph([stage], n_microbatches, loss_fn=loss_fn, config=PipeMorphConfig(adaptive=False))
    schedule = PipeMorph([stage], n_microbatches, loss_fn=loss_fn, adaptive=False)   # the same
    schedule.step(x, target=y, losses=losses)
    metrics = schedule.last_metrics          # plain dict, ``IterationMetrics.as_dict()``

The class is a short coordinator in the style of torch's runtime: it calls small parts in order, each
usable and tested on its own (docs/ARCHITECTURE.md, "Runtime"):

==================  ===========================================================================
``config``          the settings (``config.py``: ``PipeMorphConfig``, ``PolicySettings``, ``DelegationConfig``)
``parts``           policy, estimator, memory budget … for one stage or several per rank (``parts.py``)
``executor``        the instrumented action loop (``executor.py``) over a ``transport``
``control``         the gloo control plane over the PP ranks (``control.py``)
``cadence``         when the ranks exchange profiles and the policy runs (``cadence.py``)
``planner``         profile + decision → plan (``planning.py``, ``placement.py``)
``lifecycle``       candidate → validate → agree → swap (``lifecycle.py``, ``deploy.py``)
``extensions``      Falcon, delegation, the user's observers: built outside (``extensions.py``), seen
                    through a narrow ``ScheduleContext`` (``observers.py``)
==================  ===========================================================================

Life cycle (PipeMorph §6, Fig.13): (1) the initial plan (Alg.1) from a memory budget; (2) every
iteration is timed; at a check the ranks exchange their profiles in one control-plane ``all_gather``
so every rank holds identical data; (3) the policy decides; (4) a new plan is planned, validated and
lowered in the background while the next iteration runs, its hash agreed at the next check, and
swapped at that boundary; (5) with ``polish_s``, the deployed planner-made plan is polished in another
background thread (CP-SAT + CrossPipe's search) and the faster plan swapped at a later check once every
rank is done — the anytime polish (``lifecycle.py``).  A plan that fails any step is never deployed.

Another adaptive schedule is a :class:`~titan_ext.runtime.parts.ScheduleSpec` (its planner and policy)
made a class by :func:`adaptive_schedule` (``runtime/crosspipe.py`` is the example).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import deque
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.pipelining import schedules as _torch_schedules
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
from torch.distributed.pipelining.stage import _PipelineStageBase
from torch.profiler import record_function

from titan_ext.plan import PipelineProfile, PlanResult, initial_warmup_counts, slackness
from titan_ext.plan.result import make_result
from titan_ext.plan.args import ArgumentTypeError, int_arg, plan_arg
from titan_ext.plan.polish import NO_SOLVER, load_solver, polish_plan

from . import _torch_compat, timeouts
from ._torch_compat import check_runtime_kwargs, lowering_options, runtime_kwargs_given
from .backward import VARIANTS, BackwardChooser, faster_by_model, mixed_backward
from .cadence import CheckCadence
from .config import PipeMorphConfig
from .control import ControlPlane
from .deploy import Candidate, plan_hash, prepare_candidate, warmup_counts_of
from .executor import Executor, RunContext, forward_order
from .extensions import build_extensions
from .lifecycle import DecisionLog, PlanLifecycle
from .metrics import IterationMetrics
from .observers import Boundary, ScheduleContext
from .parts import PIPEMORPH, ScheduleSpec, build_parts
from .placement import read_layout
from .planning import PlanningContext, explicit_plan
from .policy import Decision, exact_arrival_links
from .profiler import (
    ActionRecord,
    IterationProfile,
    decode_profiles,
    encode_profile,
    link_delay_estimates,
    now,
    timeline_bubble_rate,
)

__all__ = ["PipeMorph", "adaptive_schedule", "plan_hash", "warmup_counts_of"]

logger = logging.getLogger(__name__)

#: decisions whose new plan keeps the memory regime of Alg.1 ("initial") or forces a plan
_KIND_OF_DECISION = {"calibrate": "initial", "force": "forced"}


def _check_stages(name: str, stages: Any) -> list:
    """This rank's stages: one torch pipeline stage or a non-empty list of them (TypeError naming the
    argument otherwise: a ``torch.nn.Module`` is not a stage)."""
    if isinstance(stages, _PipelineStageBase):
        return [stages]
    if isinstance(stages, (str, bytes)) or not isinstance(stages, (list, tuple)):
        raise ArgumentTypeError(f"{name}: stages must be a torch PipelineStage or a list of them, got "
                                f"{type(stages).__name__}")
    if not stages:
        raise ValueError(f"{name} needs this rank's stages, got none")
    for i, st in enumerate(stages):
        if not isinstance(st, _PipelineStageBase):
            raise ArgumentTypeError(f"{name}: stages[{i}] must be a torch PipelineStage, got {type(st).__name__}")
    return list(stages)


class PipeMorph(_PipelineScheduleRuntime):
    """Straggler-resilient adaptive pipeline schedule (PipeMorph §4 planning, §6 runtime).

    Args (beyond torch's ``PipelineScheduleMulti`` ones):
        config: a :class:`~titan_ext.runtime.config.PipeMorphConfig` (its fields are documented there).
        **options: any field of the config as a keyword (applied on top of ``config``), and the delegation
            keywords of earlier releases (``delegation``, ``failover``, ``slow_link_ms``, ``detector``,
            ``delegate_lanes``, ``delegate_slots``, ``delegate_slot_bytes``, ``recv_timeout_s``,
            ``delegate_timeout_s``, ``faults``); ``PipeMorphConfig.updated`` maps them.
    """

    #: the registry entry: planner and policy of this schedule (``parts.py``)
    spec: ScheduleSpec = PIPEMORPH
    #: ``backward=`` values of the default planner (read by the [titan_ext] config check before any
    #: process group exists); a ``planner=`` argument is checked against its own.
    backward_choices = PIPEMORPH.backward_choices

    def __init__(
        self,
        stages: list[_PipelineStageBase] | _PipelineStageBase,
        n_microbatches: int,
        loss_fn: Callable | None = None,
        args_chunk_spec: Any = None,
        kwargs_chunk_spec: Any = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        *,
        config: PipeMorphConfig | None = None,
        max_active_stages: int | None = None,
        unshard_lookahead: Any = None,
        defer_reduce_grad_wait: bool | None = None,
        max_outstanding_sends: int | None = None,
        **options: Any,
    ):
        name = type(self).__name__
        stages = _check_stages(name, stages)  # the arguments first: before any side effect or process group
        int_arg(n_microbatches, "n_microbatches", 1)
        if loss_fn is not None and not callable(loss_fn):
            raise ArgumentTypeError(f"{name}: loss_fn must be callable or None, got {type(loss_fn).__name__}")
        # torch >= 2.15's runtime keywords (None: not given), honoured by our lowering (_torch_compat.RUNTIME_KWARGS)
        torch_runtime_kwargs = check_runtime_kwargs(runtime_kwargs_given(
            max_active_stages=max_active_stages, unshard_lookahead=unshard_lookahead,
            defer_reduce_grad_wait=defer_reduce_grad_wait, max_outstanding_sends=max_outstanding_sends))
        if config is not None and not isinstance(config, self.spec.config_class):
            raise TypeError(f"{name} takes config={self.spec.config_class.__name__}(...), got {type(config).__name__}")
        self.config = config = (config or self.spec.config_class()).updated(name, **options)
        if config.timeout_s is not None:
            timeouts.set_timeout(config.timeout_s)  # checks the value
            timeouts.install_p2p_timeout()
        st0 = stages[0]
        #: R ranks × V stages per rank, placement read from the stage indices (runtime/placement.py)
        self.layout = read_layout([st.stage_index for st in stages], st0.group_rank, st0.group_size, st0.num_stages)
        self.extensions = build_extensions(config, name, st0.num_stages, n_microbatches, self.layout.stages_per_rank)
        self.executor = Executor(torch.device(st0.device), activation_bytes=config.activation_bytes)
        self.executor.transport = self.extensions.transport
        self.parts = build_parts(name, self.layout, n_microbatches, config, self.spec, lambda: self.executor.device,
                                 lambda: self.executor.activation_bytes)
        self.planner, self.policy, self.estimator, self.memory = (self.parts.planner, self.parts.policy,
                                                                  self.parts.estimator, self.parts.memory)
        if config.backward not in self.planner.backward_choices:
            raise ValueError(f"{name}: backward must be one of {self.planner.backward_choices}, got {config.backward!r}")
        super().__init__(stages, n_microbatches, loss_fn=loss_fn, args_chunk_spec=args_chunk_spec,
                         kwargs_chunk_spec=kwargs_chunk_spec, output_merge_spec=output_merge_spec,
                         scale_grads=scale_grads, backward_requires_autograd=backward_requires_autograd,
                         **torch_runtime_kwargs)
        self._setup_parts(stages, n_microbatches)
        self._planned_for_ms: list[float] | None = None  # the deployed plan's absorbed delays (_install)
        self._plan_metrics: tuple = (None,)  # (key, estimates, tolerances, compute, slackness): _fill_plan_metrics
        self._deploy_initial_plan()

    def _setup_parts(self, stages: list[_PipelineStageBase], n_microbatches: int) -> None:
        config, name = self.config, type(self).__name__
        self._group = stages[0].group
        self.control = ControlPlane(self._group)
        self.executor.device.set_backend(dist.get_backend(self._group))
        self.adaptive, self.backward = config.adaptive, config.backward
        settings = config.policy_settings
        self.cadence = CheckCadence(config.profile_every, config.profile_every_max, self.estimator.window.size,
                                    settings.rel_margin, settings.abs_margin_ms)
        if self.extensions.every_iteration:
            self.cadence.fixed()
        self.iteration = 0
        self.in_iteration = False
        self._log = DecisionLog(config.decision_log_size, lambda: self.iteration)
        self.decision_log = self._log.entries
        #: backward="auto": both variants planned at every re-plan, the model keeps the faster (backward.py)
        self._model_backward = self.parts.choose_backward and config.backward == "auto"
        self._chooser = BackwardChooser(self.estimator.window.size, config.backward_margin,
                                        enabled=self.parts.choose_backward and config.backward == "measure",
                                        log=self._log,
                                        delay_rel_margin=settings.rel_margin,
                                        delay_abs_margin_ms=settings.abs_margin_ms)
        self.lifecycle = PlanLifecycle(name, self.control, self._install, lambda: self.in_iteration, self._log)
        #: the anytime polish's budget (None: off); the solver is imported here, not in the middle of training;
        #: without OR-Tools the polish is off, said once here
        self.polish_s = config.polish_s
        if self.polish_s is not None and not load_solver():
            self.polish_s = None
            self._log(decision="polish", reason=f"polish_s={config.polish_s:g}: {NO_SOLVER}", status=NO_SOLVER)
            if stages[0].group_rank == 0:
                logger.warning("%s: polish_s=%g: %s", name, config.polish_s, NO_SOLVER)
        self.metrics_history: deque[dict] = deque(maxlen=config.decision_log_size)
        self.last_metrics: dict = {}
        self.last_profile: IterationProfile | None = None
        self.last_timeline: list[ActionRecord] = []
        #: losses by microbatch index (torch keeps a list in forward order: see _maybe_compute_loss)
        self._losses_by_mb: dict[int, torch.Tensor] = {}
        self._since_deploy, self._calibrated, self._probe_running = 0, False, False
        self._clock, self._clock_synced = (math.nan, math.nan), False
        self._met = False  # the ranks met before the first step (_step_microbatches)
        self.context = self._context()
        for observer in self.extensions.observers:
            observer.attach(self.context)

    def _context(self) -> ScheduleContext:
        """The narrow view observers and the transport get (no private attribute of the schedule)."""
        def enable_adaptation(by: str, reason: str) -> None:
            self.adaptive = True
            self._log(decision=by, reason=reason)

        return ScheduleContext(type(self).__name__, self._group, self._num_stages, self._n_microbatches,
                               self.control, lambda: self.executor.device, lambda: self.stage_index_to_group_rank,
                               lambda: self.iteration, lambda: self.in_iteration, self._log,
                               lambda: self.adaptive, enable_adaptation)

    def _deploy_initial_plan(self) -> None:
        self.initial_counts = initial_warmup_counts(self._num_stages, self.memory.x_max)
        decision = Decision("initial", f"Alg.1 with x_max={self.memory.x_max}", mode="initial")
        plan = self._plan(self.estimator.planning_profile(), decision)
        ops = mixed_backward(plan.ops) if self._model_backward and self.adaptive else plan.ops
        if not self.lifecycle.deploy_now(self._preparer(ops, plan.warmup_counts, "initial",
                                                        "initial plan (Alg.1)", plan.inflight_limit),
                                         "initial", "initial plan (Alg.1)", check_agreement=False):
            raise RuntimeError(f"{type(self).__name__}: the initial plan failed validation: "
                               f"{self.decision_log[-1]['reason']}")
        if self.delegation is not None:
            self.delegation.start()

    # ------------------------------------------------------------------------------------------
    # read-only views (and the two settings a trainer may change between iterations)
    # ------------------------------------------------------------------------------------------
    delegation = property(lambda self: self.extensions.delegation, doc="the Delegation transport, or None")
    observers = property(lambda self: self.extensions.observers, doc="the boundary observers, in call order")
    deployed = property(lambda self: self.lifecycle.deployed, doc="the deployed plan (DeployedPlan)")
    plan_version = property(lambda self: self.lifecycle.version, doc="plans deployed so far")
    planning = property(lambda self: self.lifecycle.planning, doc="the background planning job")
    inflight_cap = property(lambda self: self.memory.inflight_cap, doc="measured cap of adaptive plans")
    rank_memory_limit = property(lambda self: self.memory.rank_memory_limit, doc="several stages per rank: K_r")
    profile_every = property(lambda self: self.cadence.profile_every)
    profile_every_max = property(lambda self: self.cadence.profile_every_max)

    @property
    def falcon(self) -> Any:
        """The schedule's FalconMonitor, or None; set to None to take Falcon off (e.g. a job-level
        monitor decides instead, ``titan/falcon/job.py``)."""
        return self.extensions.falcon

    @falcon.setter
    def falcon(self, value: None) -> None:
        if value is not None:
            raise ValueError(f"{type(self).__name__}.falcon can only be set to None (off); pass falcon= at construction")
        self.extensions.drop_falcon()
        if not self.extensions.every_iteration:  # Falcon's need of every iteration's check went with it
            self.cadence.adaptive(self.config.profile_every_max)

    @property
    def memory_budget_bytes(self) -> float | None:
        return self.memory.budget_bytes

    @memory_budget_bytes.setter
    def memory_budget_bytes(self, value: float | None) -> None:
        """A new budget, read at the next exchange (between iterations)."""
        self.memory.budget_bytes = value

    # ------------------------------------------------------------------------------------------
    # planning
    # ------------------------------------------------------------------------------------------
    def _variant(self, decision: Decision | None = None) -> str:
        """The backward variant a new plan gets: the decision's, else that of the deployed planner-made
        plan (the variant ``auto`` chose), else the configured one (``auto`` starts split)."""
        if decision is not None and decision.backward is not None:
            return decision.backward
        if self.deployed is not None and self.deployed.kind in ("initial", "adaptive") \
                and self.deployed.backward != "mixed":
            return self.deployed.backward
        return "full" if self.backward == "full" else "split"

    def _delegating(self) -> bool:
        return self.delegation is not None and self.delegation.delegating

    def planning_context(self, decision: Decision | None = None) -> PlanningContext:
        return PlanningContext(self._variant(decision), self.memory.planning_x_max(),
                               self.memory.adaptive_limit(self._delegating()), self.config.slack_floor,
                               self.config.policy_settings.headroom_delay, self.memory.rank_memory_limit)

    def _plan(self, profile: PipelineProfile, decision: Decision) -> PlanResult:
        """A compute-only plan for ``profile``: the decision's own plan, else the planner's."""
        plan = explicit_plan(profile, decision, self._variant(decision))
        return plan if plan is not None else self.planner.plan(profile, decision, self.planning_context(decision))

    # ------------------------------------------------------------------------------------------
    # deployment (iteration boundary only): the lifecycle's ends on this schedule
    # ------------------------------------------------------------------------------------------
    def deploy(self, plan: PlanResult, reason: str = "external") -> bool | None:
        """Validate and deploy a compute-only plan, a :class:`~titan_ext.plan.PlanResult` (any planner's, e.g.
        ``plan_by_name(profile, "crosspipe-ud")``; collective: call it on every rank with the same plan).

        The plan goes through the one lowering of every runtime plan (``deploy.prepare_candidate``: its
        ``ops`` validated, converted to torch's actions, lowered with torch's passes), with its warm-up
        counts and in-flight limit. Outside an iteration the plan is deployed now (returns whether it was
        accepted); during an iteration it is queued and deployed at the next boundary (returns None).

        A raw mapping rank → list of torch ``_Action`` or ``(stage, kind, microbatch)`` tuples is still
        accepted, kept for compatibility with earlier releases: it is made a ``PlanResult`` with
        ``make_result`` (warm-up counts read off the plan, no in-flight limit) when it is deployed, so a
        malformed one is rejected and logged like any invalid plan.
        """
        if isinstance(plan, PlanResult):
            pending: PlanResult | dict = plan
        elif isinstance(plan, Mapping):
            plan_arg(plan, "plan")
            pending = {r: list(a) for r, a in plan.items()}  # the caller's lists as they are now
        else:
            raise ArgumentTypeError(f"plan must be a PlanResult (or, kept for compatibility, a mapping rank → "
                                    f"list of actions), got {type(plan).__name__}")
        if not isinstance(reason, str):
            raise ArgumentTypeError(f"reason must be text, got {type(reason).__name__}")
        if self.in_iteration:
            self.lifecycle.queue(pending, reason)
            return None
        return self.lifecycle.deploy_now(self._external(pending, reason), "external", reason)

    def _external(self, plan: PlanResult | dict, reason: str) -> Callable[[], Candidate]:
        """The deferred candidate of an external plan: a raw mapping becomes a ``PlanResult`` (``make_result``)
        inside it, so its errors are rejections too."""
        def prepare() -> Candidate:
            result = plan if isinstance(plan, PlanResult) else make_result(
                plan, schedule="external", predicted_makespan_ms=math.nan, plan_ms=0.0)
            return self._preparer(result.ops, result.warmup_counts, "external", reason, result.inflight_limit)()

        return prepare

    def _preparer(self, ops: Mapping[int, list[Any]], counts: list[int] | None, kind: str, reason: str,
                  inflight_limit: list[int] | None = None) -> Callable[[], Candidate]:
        """validate + convert + lower the plan IR ``ops`` (a ``PlanResult``'s) for this schedule's stages
        (``deploy.prepare_candidate``), deferred: every runtime path ends here."""
        from torch.distributed.fsdp import FSDPModule

        fsdp = any(isinstance(st.submod, FSDPModule) for st in self._stages)
        lowering = lowering_options(self)
        return lambda: prepare_candidate(ops, counts, kind, reason, num_stages=self._num_stages,
                                         n_microbatches=self._n_microbatches, num_ranks=self.pp_group_size,
                                         fsdp=fsdp, inflight_limit=inflight_limit,
                                         stage_to_rank=self.layout.stage_to_rank, lowering=lowering)

    def _install(self, cand: Candidate) -> None:
        """torch's side of a swap: the action lists and the stage map; a new plan's counters."""
        with record_function("titan_ext:deploy"):
            self.pipeline_order = {r: list(a) for r, a in cand.actions.items()}
            self.pipeline_order_with_comms = cand.lowered
            self.stage_index_to_group_rank = dict(cand.mapping)
            for stage in self._stages:
                stage.stage_index_to_group_rank = self.stage_index_to_group_rank
            if cand.polish is not None:  # the same regime in a faster order: the policy's clocks run on
                return
            plan = cand.plan
            self._planned_for_ms = plan.profile.delays_ms if plan is not None and plan.profile is not None else None
            note = getattr(self.policy, "note_deployed", None)  # optional hook of a Policy
            if note is not None:
                note(self._planned_for_ms)
            self._since_deploy = 0
            self._probe_running = cand.trigger == "probe"
            if cand.trigger not in ("probe", "select"):  # a new regime: compare the backward variants afresh
                self._chooser.new_regime()

    def _apply_pending(self) -> None:
        self.lifecycle.apply_pending(self._external)

    def _start_planning(self, decision: Decision) -> None:
        """Plan → validate → lower in the background (agreed and swapped at the next check)."""
        kind = _KIND_OF_DECISION.get(decision.action, decision.mode or "adaptive")
        reason = f"{decision.action}: {decision.reason}"
        # the variants to plan (estimates read here, on the training thread): backward="auto" plans both
        # once full backwards were measured, and keeps the faster by the model (backward.py)
        both = (self._model_backward and decision.backward is None and decision.warmup_counts is None
                and decision.actions is None and not any(map(math.isnan, self.estimator.window.median(
                    "B", self._num_stages))))
        variants = VARIANTS if both else (self._variant(decision),)
        work = [(self.estimator.planning_profile(v), dataclasses.replace(decision, backward=v)) for v in variants]
        margin, running = self.config.backward_margin, self.deployed.backward if self.deployed else None

        def job() -> Candidate:
            with record_function("titan_ext:plan"):  # on the planning thread
                t0 = now()
                plans = [self._plan(estimate, d) for estimate, d in work]
                plan = faster_by_model(*plans, margin, running) if both else plans[0]
                plan_ms = 1e3 * (now() - t0)
                cand = self._preparer(plan.ops, plan.warmup_counts, kind, reason, plan.inflight_limit)()
                cand.plan_ms, cand.trigger = plan_ms, decision.action
                if plan.schedule != "explicit":
                    cand.plan = plan  # planner-made: what the anytime polish starts from
                return cand

        self.lifecycle.start(decision, job, reason)

    def _start_polish(self, res: Any, decision: Decision) -> None:
        """The anytime polish (``polish_s``) of the plan just resolved, when it is the deployed one (swapped
        or unchanged), planner-made (with the profile it was planned for: ``PlanResult.profile``, head-room
        delays included), of the calibrated initial or an adaptive regime, not a backward probe, and no
        re-plan starts now (that would make the polish stale).  Every input is agreed, so every rank
        starts the same polish (deterministic: ``titan_ext.plan.polish``)."""
        cand = res.candidate
        if (self.polish_s is None or cand is None or decision.replans or cand.plan is None
                or cand.plan.profile is None or cand.kind not in ("initial", "adaptive") or cand.trigger == "probe"
                or self.deployed is None or self.deployed.hash != cand.hash):
            return
        plan, budget, version = cand.plan, self.polish_s, self.plan_version
        what = f"polish of plan v{version} ({cand.kind}, {budget:g} s)"
        # the per-stage in-flight limit the plan was made under; a planner that records none (CrossPipe's
        # greedy holds its own per-rank limit) gets the plan's own peaks: the polish reorders, it never
        # trades memory for speed behind the user's back
        given = plan.inflight_limit
        limit = ([int(given)] * self._num_stages if isinstance(given, (int, float)) else list(given)
                 if given is not None else [max(1, plan.peak_inflight.get(s, 0)) for s in range(self._num_stages)])

        def job() -> tuple[Candidate | None, dict]:
            with record_function("titan_ext:plan"):  # on the polishing thread
                t0 = now()
                out = polish_plan(plan.profile, plan, budget_s=budget, memory_limit=limit)
                report = dict(out.info.get("polish") or {})
                if report.get("status") != "improved":
                    return None, report
                reason = (f"{what}: simulated {report['sim_before_ms']:.3f} -> {report['sim_after_ms']:.3f} ms "
                          f"(warm-up counts {out.warmup_counts})")
                # the regime's counts stay the deployed plan's: the policy judges the regime it planned (Eq.1 on
                # Alg.1/2's counts), and a faster order of the same regime must not look like a new one
                polished = self._preparer(out.ops, list(cand.counts), cand.kind, reason, limit)()
                polished.trigger, polished.polish, polished.plan_ms = "polish", report, 1e3 * (now() - t0)
                return polished, report

        self.lifecycle.start_polish(job, what)

    def _over_memory_cap(self, cand: Candidate) -> str:
        return self.memory.over_cap(cand.kind, cand.peak_inflight, cand.actions, self._delegating())

    # ------------------------------------------------------------------------------------------
    # one iteration
    # ------------------------------------------------------------------------------------------
    def _step_microbatches(self, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None,
                           return_outputs: bool = True, loss_kwargs=None):
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        self._apply_pending()
        if not self._met:
            # the first step's start-up messages (torch's shape handshake) wait with the PP group's creation
            # timeout and name nobody: every rank meets here first, bounded by ``timeout_s`` (the control
            # plane's), and a rank that never comes is named
            self.control.meet("first step")
            self._met = True
        _torch_compat.initialize_stages(self, arg_mbs[0], kwarg_mbs[0],
                                        target_mbs[0] if target_mbs is not None else None, loss_kwargs)
        training = self._has_backward
        if training and not self._clock_synced:
            self._clock = self.control.clock_offsets()
            self._clock_synced = True
        # failover on an NCCL PP group: a failed attempt is re-run from the start on the delegates
        # (runtime/delegate/schedule.py, StepFailover); None otherwise
        failover = self.delegation.step_failover if self.delegation is not None else None
        if failover is not None:
            failover.begin(self._stages)
        while True:
            ctx = RunContext(self, {st.stage_index: st for st in self._stages}, arg_mbs, kwarg_mbs, target_mbs,
                             losses, return_outputs, loss_kwargs, training)
            self.in_iteration = True
            self._losses_by_mb.clear()
            actions = self.pipeline_order_with_comms[self.rank]
            try:
                iteration_ms = self.executor.run(actions, ctx)
            except Exception as exc:
                if failover is None or not failover.failed(exc):
                    logger.error("%s: iteration %d failed; plan v%d:\n%s", type(self).__name__, self.iteration,
                                 self.plan_version,
                                 _torch_schedules._format_pipeline_order(self.pipeline_order_with_comms))
                    raise
            finally:
                self.in_iteration = False
            if failover is None or not failover.settle(self._stages):  # every PP rank votes here
                break
            # re-run: the failed attempt's receives (and FSDP unshards) were never consumed
            self.fwd_recv_ops.clear()
            self.bwd_recv_ops.clear()
            self.unshard_ops.clear()
        self._finish_iteration(actions, losses)
        if training:
            act = self.executor.activation_bytes
            ctx.profile.activation_bytes = act if act else math.nan
            self.last_profile = ctx.profile
            self.last_timeline = list(ctx.profile.actions)
            with record_function("titan_ext:boundary"):
                self._iteration_boundary(ctx.profile, iteration_ms)
        self._apply_pending()  # plans pushed during the iteration: swapped in at this boundary

    def _finish_iteration(self, actions: list, losses: list | None) -> None:
        """torch's end of an iteration: losses and outputs in microbatch order whatever the plan's order."""
        if len(self.unshard_ops) != 0:
            raise AssertionError("Unused unshard operations")
        self._internal_losses = [self._losses_by_mb[m] for m in sorted(self._losses_by_mb)]
        self._losses_by_mb.clear()
        has_last = any(st.is_last for st in self._stages)
        if has_last and self._loss_fn is not None and len(self._internal_losses) != self._n_microbatches:
            raise RuntimeError(f"{type(self).__name__}: {len(self._internal_losses)} losses for "
                               f"{self._n_microbatches} microbatches")
        self._update_losses(self._stages, losses)
        self._sort_outputs(actions)

    def _maybe_compute_loss(self, stage, output, target_mbs, mb_index, loss_kwargs=None):
        """torch's hook (our executor and custom functions call it), keyed by microbatch index."""
        if stage.is_last and self._loss_fn is not None:
            if mb_index in self._losses_by_mb:
                raise AssertionError(f"{type(self).__name__}: microbatch {mb_index} forwarded twice on the last stage")
            self._losses_by_mb[mb_index] = _torch_compat.with_loss_kwargs(
                self._compute_loss, output, target_mbs[mb_index], loss_kwargs=loss_kwargs)

    def _maybe_get_loss(self, stage, mb_index):
        """The loss of microbatch ``mb_index`` on the last stage (None elsewhere), whatever the forward order."""
        if not (stage.is_last and self._loss_fn is not None):
            return None
        if mb_index not in self._losses_by_mb:
            raise RuntimeError(f"{type(self).__name__}: backward of microbatch {mb_index} before its loss "
                               f"(losses so far: microbatches {sorted(self._losses_by_mb)})")
        return self._losses_by_mb[mb_index]

    def _sort_outputs(self, actions: list) -> None:
        """Put the last stage's ``output_chunks`` in microbatch order (torch's ``step()`` merges them as
        appended, i.e. in the plan's forward order)."""
        for stage in self._stages:
            order = forward_order(actions, stage.stage_index)
            if stage.is_last and len(stage.output_chunks) == len(order) and order != sorted(order):
                by_mb = dict(zip(order, stage.output_chunks))
                stage.output_chunks[:] = [by_mb[m] for m in sorted(by_mb)]

    # ------------------------------------------------------------------------------------------
    # the iteration boundary: exchange, absorb, resolve, decide, plan, observe, metrics — in order
    # ------------------------------------------------------------------------------------------
    def _iteration_boundary(self, prof: IterationProfile, iteration_ms: float) -> None:
        t0 = now()
        exchanged = self.cadence.due(self.iteration)
        # device times are read only once the device ran them: at an exchange the profile is needed now
        # (wait for the iteration's last event — never a device synchronize); otherwise only if done
        if self.executor.timer.resolve(block=exchanged):
            iteration_ms = self.executor.timer.wall_ms
        m = IterationMetrics(self.iteration, iteration_ms, recv_wait_ms=sum(r.recv_wait_ms for r in prof.actions),
                             profile_every=self.cadence.period)
        links: list[dict] = []
        ran_probe = self._probe_running
        if exchanged:
            with record_function("titan_ext:check"):
                links = self._check(prof, m, t0)
        m.boundary_ms = 1e3 * (now() - t0)
        m.replan_ms = m.swap_ms  # critical path only: planning ran in the background (plan_ms)
        self._since_deploy += 1
        self._fill_plan_metrics(m, links)
        self.executor.exact_links = exact_arrival_links(m.eq1_tolerance_ms, self._planned_for_ms,
                                                        self.config.policy_settings.abs_margin_ms,
                                                        self.layout.stages_per_rank)
        boundary = Boundary(self.context, self.iteration, iteration_ms, exchanged, m.timeline_span_ms, links, ran_probe)
        for observer in self.observers:
            boundary.metrics = m.as_dict()
            m.extra.update(observer.observe(boundary))
        self.last_metrics = m.as_dict()
        self.metrics_history.append(self.last_metrics)
        self.iteration += 1

    def _check(self, prof: IterationProfile, m: IterationMetrics, t0: float) -> list[dict]:
        """A check (PipeMorph §6 ④–⑥): exchange → absorb → resolve the background plan → decide →
        start the next plan → schedule the next check.  Returns the per-link delay estimates."""
        ranks = decode_profiles(self.control.all_gather(self._local_profile_vector(prof)), self._message_slots(),
                                self.parts.local_stages)
        m.exchange_ms = 1e3 * (now() - t0)
        links, m.bubble_rate, m.timeline_span_ms = self._absorb(ranks)
        res = self.lifecycle.resolve([r.candidate_hash for r in ranks], self._over_memory_cap)
        if res.produced and res.decision.action == "calibrate":
            self._calibrated = True
        m.deployed, m.swap_ms = res.deployed, res.swap_ms
        if res.decision is not None or res.polished:
            m.plan_ms, m.plan_cpu_ms = res.plan_ms, res.plan_cpu_ms
        decision = self._decide()
        if not self._chooser.probing:  # the verdict kept the probed variant: no swap marks the end
            self._probe_running = False
        if decision.replans:
            self._start_planning(decision)
        elif decision.action != "keep":
            self._log(decision=decision.action, reason=decision.reason)
        self._start_polish(res, decision)
        m.decision, m.decision_reason = decision.action, decision.reason
        settled = decision.action in ("keep", "hold") and not self.planning.running \
            and not self._probe_running and (self._calibrated or not self.adaptive)
        # the window estimates (the medians the policy decides on), not this check's readings (cadence.links_moved)
        self.cadence.after_check(self.iteration, settled, self.estimator.window.median("C", len(links)))
        return links

    def _local_profile_vector(self, prof: IterationProfile) -> torch.Tensor:
        """This rank's contribution to the one control-plane all_gather (override point for tests)."""
        arrivals_prev = [h.arrival_time() for h in prof.arrivals_prev]
        arrivals_next = [h.arrival_time() for h in prof.arrivals_next]
        local = IterationProfile(prof.actions, prof.sends_next, prof.sends_prev, arrivals_prev, arrivals_next,
                                 prof.send_bytes_next, prof.activation_bytes)
        return encode_profile(local, self.iteration, self.deployed.hash if self.deployed else 0,
                              self._message_slots(), self._clock[0], self._clock[1],
                              candidate_hash=self.lifecycle.candidate_hash(),
                              memory_budget_bytes=self.memory.local_budget_bytes(),
                              stage_ms=self.parts.stage_ms(prof, self.rank))

    def _message_slots(self) -> int:
        """Most messages one direction of a rank link carries per iteration: V·N."""
        return self.layout.stages_per_rank * self._n_microbatches

    def _absorb(self, ranks: list) -> tuple[list[dict], float, float]:
        """Gathered profiles → windows, activation bytes, memory cap; returns (links, bubble, span)."""
        hashes = {r.plan_hash for r in ranks}
        if len(hashes) != 1:
            self._log(decision="error", reason=f"ranks ran different plans this iteration: {sorted(hashes)}")
        links = link_delay_estimates(ranks)
        bubble, span_ms = timeline_bubble_rate(ranks)
        if all(not math.isnan(r.activation_bytes) for r in ranks):
            self.memory.absorb([r.memory_budget_bytes for r in ranks], [r.activation_bytes for r in ranks], self.rank)
        self.estimator.push(ranks, [lk["c_ms"] for lk in links])
        if math.isfinite(span_ms) and self.deployed.backward in VARIANTS:
            self._chooser.record(self.deployed.backward, span_ms)
        return links, bubble, span_ms

    def _fill_plan_metrics(self, m: IterationMetrics, links: list[dict]) -> None:
        dep = self.deployed
        m.link_delay_ms = {i: lk["c_ms"] for i, lk in enumerate(links)}
        m.link_delay_fwd_ms = {i: lk["fwd_ms"] for i, lk in enumerate(links)}
        m.link_delay_bwd_ms = {i: lk["bwd_ms"] for i, lk in enumerate(links)}
        # what the estimator's windows and the deployed plan give: rebuilt only when either changed (a check
        # pushed rows, a plan was deployed), not at every boundary — its profiles are most of a boundary
        key = (self.estimator.version, self.plan_version, dep.hash)
        if self._plan_metrics[0] != key:
            est, est_full = self.estimator.profile(), self.estimator.profile("full")  # compute times as measured
            tolerances = self.parts.tolerances(self.estimator.planning_profile("split"),  # the policy's
                                               self.estimator.planning_profile("full"), dep)
            self._plan_metrics = (key, list(self.parts.link_estimates_ms()), tolerances,
                                  {"F": list(est.f_ms), "I": list(est.b_ms), "W": list(est.w_ms), "B": list(est_full.b_ms)},
                                  slackness(dep.warmup_counts))
        _, estimates, tolerances, compute, slack = self._plan_metrics
        m.link_delay_estimate_ms = dict(enumerate(estimates))
        m.compute_ms = {k: list(v) for k, v in compute.items()}
        m.backward, m.plan_version, m.plan_hash = dep.backward, self.plan_version, hex(dep.hash)
        m.warmup_counts, m.slackness = list(dep.warmup_counts), list(slack)
        m.eq1_tolerance_ms = list(tolerances)
        m.inflight_cap = self.memory.adaptive_limit(self._delegating())
        m.memory_budget_bytes = self.memory_budget_bytes if self.memory_budget_bytes is not None else math.nan

    def _decide(self) -> Decision:
        """Run the policy (identical inputs on every rank → identical decision)."""
        est = self.estimator.planning_profile(self.deployed.backward)
        if self.layout.stages_per_rank == 1:
            est = self.memory.capped(est, self._delegating())
        counts = self.deployed.warmup_counts
        if not self.adaptive and not self.policy.forces:
            decision = Decision("keep", "adaptation disabled")
        else:
            decision = self.policy.decide(est, counts, self.initial_counts, self._since_deploy,
                                          slack_floor=self.config.slack_floor)
        if decision.action in ("keep", "hold") and not self._calibrated and self.adaptive:
            if self.memory.recalibrate():
                self.initial_counts = initial_warmup_counts(self._num_stages, self.memory.x_max)
            if self.deployed.kind == "initial":
                return Decision("calibrate", f"initial plan regenerated with measured times "
                                f"(Alg.1, x_max={self.memory.x_max})", mode="initial")
            self._calibrated = True
        if self.adaptive and self._calibrated and self.deployed.kind in ("initial", "adaptive"):
            mode = "initial" if self.deployed.kind == "initial" else "adaptive"
            return self._chooser.step(decision, self.deployed.backward, counts, mode, est.delays_ms, self.iteration,
                                      self.deployed.inflight_limit)
        return decision


def adaptive_schedule(spec: ScheduleSpec, doc: str | None = None, module: str | None = None) -> type[PipeMorph]:
    """The schedule class of a registry entry: PipeMorph's coordinator running ``spec``'s planner and
    policy with ``spec.config_class`` (its keywords included).  No code of its own: TorchTitan finds it
    by name (``titan/registry.py``) and its settings through the config (``titan/options.py``)."""
    return type(spec.name, (PipeMorph,), {"spec": spec, "backward_choices": spec.backward_choices,
                                          "__doc__": doc or PipeMorph.__doc__,
                                          "__module__": module or PipeMorph.__module__})
