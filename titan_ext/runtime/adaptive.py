"""The schedule-neutral coordinator of every adaptive schedule: step → boundary → check → deploy.

A schedule is a registry entry (``parts.ScheduleSpec``: a planner and a policy per layout, a config
class) made a class by ``registry.adaptive_schedule`` (``pipemorph.py``, ``crosspipe.py``); it is a torch
``PipelineScheduleMulti`` built and stepped like torch's.  :class:`AdaptiveSchedule` only calls its parts
in order (PipeMorph §6, Fig.13): time every iteration; at a check exchange the profiles (one control-plane
``all_gather``), let the policy decide (``regime.py``), plan → validate → lower in the background and swap
at the next agreed check (``lifecycle.py``), polish in the background (``anytime.py``).  A plan that fails
any step is never deployed.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.pipelining import schedules as _torch_schedules
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
from torch.profiler import record_function

from titan_ext.plan import PipelineProfile, PlanResult

from ._torch_compat import (check_runtime_kwargs, initialize_stages, lowering_options, runtime_kwargs_given,
                            with_loss_kwargs)
from .comm import peers as agreement, timeouts
from .comm.control_plane import ControlPlane, Gathering
from .control.anytime import AnytimePolish
from .control.cadence import CheckCadence
from .control.config import AdaptiveConfig, resolve_config
from .control.deploy import Candidate, external_candidate, external_plan, prepare_candidate
from .control.extensions import build_extensions
from .control.lifecycle import DecisionLog, PlanLifecycle
from .control.observers import Boundary, ScheduleContext
from .control.parts import ScheduleSpec, build_parts
from .control.regime import Regime
from .decide.placement import read_layout
from .decide.planning import PlanningContext, explicit_plan
from .decide.policy import Decision
from .execute.executor import Executor, RunContext, check_schedule_arguments, run_with_failover, uses_fsdp
from .execute.losses import MicrobatchLosses, sort_outputs
from .measure.metrics import IterationMetrics, MetricsRecord
from .measure.profiler import PROFILE_TAG, IterationProfile, encode_profile, now, profile_length

__all__ = ["AdaptiveSchedule"]

logger = logging.getLogger(__name__)


def _views(part: str, names: str) -> tuple[property, ...]:
    """Read-only attributes of a part: ``_views("lifecycle", "deployed planning")``."""
    return tuple(property(lambda self, n=n: getattr(getattr(self, part), n)) for n in names.split())


class AdaptiveSchedule(_PipelineScheduleRuntime):
    """An adaptive pipeline schedule running its registry entry's planner and policy (``spec``).  Beyond
    torch's arguments: ``config`` (the entry's config class) and any of its fields as a keyword
    (``AdaptiveConfig.updated``, with the delegation keywords of earlier releases)."""

    spec: ScheduleSpec  # the registry entry (set by registry.adaptive_schedule)
    backward_choices: tuple[str, ...]  # ``backward=`` values of the entry's planner (read by the config check)

    def __init__(self, stages: Any, n_microbatches: int, loss_fn: Callable | None = None, args_chunk_spec: Any = None,
                 kwargs_chunk_spec: Any = None, output_merge_spec: Any = None, scale_grads: bool = True,
                 backward_requires_autograd: bool = True, *, config: AdaptiveConfig | None = None,
                 max_active_stages: int | None = None, unshard_lookahead: Any = None,
                 defer_reduce_grad_wait: bool | None = None, max_outstanding_sends: int | None = None, **options: Any):
        name = type(self).__name__
        if not isinstance(getattr(type(self), "spec", None), ScheduleSpec):
            raise TypeError(f"{name} has no registry entry: make a schedule class with register_schedule(spec)")
        stages = check_schedule_arguments(name, stages, n_microbatches, loss_fn)  # before any side effect or group
        # torch >= 2.15's runtime keywords (None: not given), honoured by our lowering (_torch_compat.RUNTIME_KWARGS)
        torch_runtime_kwargs = check_runtime_kwargs(runtime_kwargs_given(
            max_active_stages=max_active_stages, unshard_lookahead=unshard_lookahead,
            defer_reduce_grad_wait=defer_reduce_grad_wait, max_outstanding_sends=max_outstanding_sends))
        self.config = config = resolve_config(name, config, self.spec.config_class, options)
        if config.timeout_s is not None:
            timeouts.set_timeout(config.timeout_s)  # checks the value
            timeouts.install_p2p_timeout()
        st0 = stages[0]
        #: R ranks × V stages per rank, placement read from the stage indices (runtime/decide/placement.py)
        layout = read_layout([st.stage_index for st in stages], st0.group_rank, st0.group_size, st0.num_stages)
        self.executor = Executor(torch.device(st0.device), activation_bytes=config.activation_bytes)
        self.parts = build_parts(name, layout, n_microbatches, config, self.spec, lambda: self.executor.device,
                                 lambda: self.executor.activation_bytes)
        self.extensions = build_extensions(config, name, st0.num_stages, n_microbatches,
                                           self.parts.extensions_refused)
        self.executor.transport = self.extensions.transport
        if config.backward not in self.parts.planner.backward_choices:
            raise ValueError(f"{name}: backward must be one of {self.parts.planner.backward_choices}, "
                             f"got {config.backward!r}")
        super().__init__(stages, n_microbatches, loss_fn=loss_fn, args_chunk_spec=args_chunk_spec,
                         kwargs_chunk_spec=kwargs_chunk_spec, output_merge_spec=output_merge_spec,
                         scale_grads=scale_grads, backward_requires_autograd=backward_requires_autograd,
                         **torch_runtime_kwargs)
        self.control = ControlPlane(st0.group)
        self.peers = agreement.connect_peers(config.peers, self.control.ranks, name, lambda: self._delegating(False))
        self.executor.device.set_backend(dist.get_backend(st0.group))
        self.adaptive, self.iteration, self.in_iteration = config.adaptive, 0, False
        self.cadence = CheckCadence.of(config, self.estimator.window.size, self.extensions.every_iteration)
        self._log = DecisionLog(config.decision_log_size, lambda: self.iteration)
        self.regime = Regime(self.parts, config, self._num_stages, self._log)
        self.lifecycle = PlanLifecycle(name, self.control, self._install, lambda: self.in_iteration, self._log)
        self.polish = AnytimePolish(config.polish_s, name, self._num_stages, self.lifecycle, self._preparer,
                                    self._log, warn=st0.group_rank == 0)
        self.record, self.losses = MetricsRecord(config.decision_log_size), MicrobatchLosses(name)
        self.context = ScheduleContext(name, st0.group, self._num_stages, self._n_microbatches, self.control,
                                       lambda: self.executor.device, lambda: self.stage_index_to_group_rank,
                                       lambda: self.iteration, lambda: self.in_iteration, self._log,
                                       lambda: self.adaptive, self._enable_adaptation)
        for observer in self.extensions.observers:
            observer.attach(self.context)
        what = "initial plan (Alg.1)"
        plan = self._plan(self.estimator.planning_profile(), Decision("initial", f"Alg.1 with x_max={self.memory.x_max}",
                                                                      mode="initial"))
        ops = self.regime.backward.initial_ops(plan.ops, self.adaptive)  # auto: mixed, to measure B too
        if not self.lifecycle.deploy_now(self._preparer(ops, plan.warmup_counts, "initial", what, plan.inflight_limit),
                                         "initial", what, check_agreement=False):
            raise RuntimeError(f"{name}: the initial plan failed validation: {self.decision_log[-1]['reason']}")
        if self.delegation is not None:
            self.delegation.start()

    def _enable_adaptation(self, by: str, reason: str) -> None:
        self.adaptive = True
        self._log(decision=by, reason=reason)

    # read-only views of the parts (and below, the settings a trainer may change between iterations)
    layout, planner, policy, estimator, memory = _views("parts", "layout planner policy estimator memory")
    delegation, observers = _views("extensions", "delegation observers")  # the Delegation transport or None
    deployed, plan_version, planning = _views("lifecycle", "deployed version planning")
    inflight_cap, rank_memory_limit = _views("memory", "inflight_cap rank_memory_limit")
    profile_every, profile_every_max = _views("cadence", "profile_every profile_every_max")
    last_metrics, metrics_history, last_profile = _views("record", "last history last_profile")
    (decision_log,), (initial_counts,) = _views("_log", "entries"), _views("regime", "initial_counts")
    (polish_s,) = _views("polish", "budget_s")
    last_timeline = property(lambda self: list(self.last_profile.actions) if self.last_profile else [])

    falcon = property(lambda self: self.extensions.falcon, lambda self, value: self.extensions.set_falcon(
        value, type(self).__name__, self.cadence, self.config.profile_every_max), doc="""The schedule's FalconMonitor,
        or None; set to None to take Falcon off (e.g. a job-level monitor decides instead, ``titan/falcon_job.py``).""")
    memory_budget_bytes = property(lambda self: self.memory.budget_bytes,
                                   lambda self, value: setattr(self.memory, "budget_bytes", value),
                                   doc="the activation budget; a new one is read at the next exchange")

    def _delegating(self, everywhere: bool = True) -> bool:  # everywhere: as decisions see it (comm/peers.py)
        return self.delegation is not None and self.delegation.delegating and (not everywhere or self.peers.everywhere)

    def _plan(self, profile: PipelineProfile, decision: Decision) -> PlanResult:
        """A compute-only plan for ``profile``: the decision's own plan, else the planner's."""
        variant = self.regime.backward.variant(decision, self.deployed)
        plan = explicit_plan(profile, decision, variant)
        return plan if plan is not None else self.planner.plan(profile, decision, PlanningContext(
            variant, self.memory.planning_x_max(), self.memory.adaptive_limit(self._delegating()), self.config.slack_floor,
            self.config.policy_settings.headroom_delay, self.memory.rank_memory_limit))

    # ---------------------------------------------------------------- deploy (iteration boundary only)
    def deploy(self, plan: PlanResult, reason: str = "external") -> bool | None:
        """Validate and deploy any planner's :class:`~titan_ext.plan.PlanResult` (collective: the same plan on every
        rank): now outside an iteration (returns whether accepted), else at the next boundary (returns None)."""
        plan = external_plan(plan, reason)
        if self.in_iteration:
            return self.lifecycle.queue(plan, reason)
        return self.lifecycle.deploy_now(self._external(plan, reason), "external", reason)

    def _external(self, plan: PlanResult | dict, reason: str) -> Callable[[], Candidate]:
        return external_candidate(plan, reason, self._preparer)

    def _preparer(self, ops: Mapping[int, list[Any]], counts: list[int] | None, kind: str, reason: str,
                  inflight_limit: list[int] | None = None) -> Callable[[], Candidate]:
        """validate + convert + lower the plan IR ``ops`` for this schedule's stages, deferred: every path ends here."""
        fsdp, lowering = any(map(uses_fsdp, self._stages)), lowering_options(self)
        return lambda: prepare_candidate(ops, counts, kind, reason, num_stages=self._num_stages,
                                         n_microbatches=self._n_microbatches, num_ranks=self.pp_group_size,
                                         fsdp=fsdp, inflight_limit=inflight_limit,
                                         stage_to_rank=self.layout.stage_to_rank, lowering=lowering)

    def _install(self, cand: Candidate) -> None:
        """torch's side of a swap: the action lists and the stage map; a new regime's counters."""
        with record_function("titan_ext:deploy"):
            self.pipeline_order = {r: list(a) for r, a in cand.actions.items()}
            self.pipeline_order_with_comms = cand.lowered
            self.stage_index_to_group_rank = dict(cand.mapping)
            for stage in self._stages:
                stage.stage_index_to_group_rank = self.stage_index_to_group_rank
            if cand.polish is None:  # a polish is the same regime in a faster order: the policy's clocks run on
                self.regime.installed(cand)

    # ---------------------------------------------------------------- one iteration
    def _step_microbatches(self, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None,
                           return_outputs: bool = True, loss_kwargs=None):
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        self.lifecycle.apply_pending(self._external)
        self.control.meet_once("first step")  # every rank, bounded by timeout_s; a rank that never comes is named
        initialize_stages(self, arg_mbs[0], kwarg_mbs[0], target_mbs[0] if target_mbs is not None else None, loss_kwargs)
        if self._has_backward:
            self.control.sync_clock()
            if self.cadence.posts_receives_at(self.iteration):  # posted now: the messages land as sent
                self.control.expect(profile_length(self.parts.message_slots, self.parts.local_stages), PROFILE_TAG)
        stages, actions_by_rank = {st.stage_index: st for st in self._stages}, self.pipeline_order_with_comms
        actions = actions_by_rank[self.rank]
        ctx, iteration_ms = run_with_failover(  # a failed attempt re-runs on the delegates (delegate/schedule.py)
            lambda: self._attempt(RunContext(self, stages, arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs,
                                             loss_kwargs, self._has_backward), actions),
            self.delegation.step_failover if self.delegation is not None else None, self._stages,
            lambda: [t.clear() for t in (self.fwd_recv_ops, self.bwd_recv_ops, self.unshard_ops)],  # unconsumed
            lambda exc: logger.error("%s: iteration %d failed; plan v%d:\n%s", type(self).__name__, self.iteration,
                                     self.plan_version, _torch_schedules._format_pipeline_order(actions_by_rank)))
        if len(self.unshard_ops) != 0:
            raise AssertionError("Unused unshard operations")
        last = any(st.is_last for st in self._stages) and self._loss_fn is not None
        self._internal_losses = self.losses.in_order(self._n_microbatches if last else None)
        self._update_losses(self._stages, losses)
        sort_outputs(self._stages, actions)
        if self._has_backward:
            act = self.executor.activation_bytes
            ctx.profile.activation_bytes = act if act else math.nan
            self.record.last_profile = ctx.profile
            with record_function("titan_ext:boundary"):
                self._iteration_boundary(ctx.profile, iteration_ms)
        self.lifecycle.apply_pending(self._external)  # plans pushed during the iteration: swapped in here

    def _attempt(self, ctx: RunContext, actions: list) -> tuple[RunContext, float]:
        self.in_iteration = True
        self.losses.by_mb.clear()
        try:
            return ctx, self.executor.run(actions, ctx)
        finally:
            self.in_iteration = False

    def _maybe_compute_loss(self, stage, output, target_mbs, mb_index, loss_kwargs=None):
        """torch's hook (our executor and custom functions call it), keyed by microbatch index."""
        if stage.is_last and self._loss_fn is not None:
            self.losses.compute(mb_index, lambda: with_loss_kwargs(
                self._compute_loss, output, target_mbs[mb_index], loss_kwargs=loss_kwargs))

    def _maybe_get_loss(self, stage, mb_index):
        """The loss of microbatch ``mb_index`` on the last stage (None elsewhere), whatever the forward order."""
        return self.losses.get(mb_index) if stage.is_last and self._loss_fn is not None else None

    # ---------------------------------------------------------------- the boundary and the check
    def _iteration_boundary(self, prof: IterationProfile, iteration_ms: float) -> None:
        t0, c0, due, check = now(), time.thread_time(), self.cadence.exchanges_at(self.iteration), self.cadence.take_posted()
        # device times, read once the device ran them: at an exchange now (its last event, never a synchronize)
        if self.executor.timer.resolve(block=due):
            iteration_ms = self.executor.timer.wall_ms
        m = IterationMetrics(self.iteration, iteration_ms, recv_wait_ms=sum(r.recv_wait_ms for r in prof.actions),
                             profile_every=self.cadence.period)
        links, ran_probe = [], self.regime.probe_running
        if due:  # a quiet check runs behind (control/cadence.py): its exchange travels during the next iteration
            gathering = self.control.start_all_gather(self._local_profile_vector(prof), PROFILE_TAG, self.cadence.backed_off)
            check = self.cadence.post(gathering, self.iteration, self.planning.running)
            if check is None:
                m.exchange_ms, m.check, m.decision_reason = 1e3 * (now() - t0), "posted", "decided at the next boundary"
        if check is not None:
            with record_function("titan_ext:check"):
                links = self._check(*check, m, t0)
        self.regime.since_deploy += 1
        self.record.fill_plan(m, links, self.parts, self.deployed, self.plan_version, self._delegating())
        self.executor.exact_links = self.parts.exact_links(m.eq1_tolerance_ms, self.regime.planned_for_ms,
            self.config.policy_settings.abs_margin_ms) if self.cadence.due(self.iteration + 1) else set()  # read if exchanged
        m.boundary_ms, m.boundary_cpu_ms, m.replan_ms = 1e3 * (now() - t0), 1e3 * (time.thread_time() - c0), m.swap_ms
        boundary = Boundary(self.context, self.iteration, iteration_ms, check is not None, m.timeline_span_ms, links, ran_probe)
        for observer in self.observers:
            boundary.metrics = m.as_dict()
            m.extra.update(observer.observe(boundary))
        self.record.publish(m)
        self.iteration += 1

    def _check(self, gathering: Gathering, exchanged_at: int, m: IterationMetrics, t0: float) -> list[dict]:
        """A check (PipeMorph §6 ④–⑥) on iteration ``exchanged_at``'s profiles (the previous one's if it ran behind):
        exchange → absorb → resolve the background plan → decide → start the next plan → schedule the next check."""
        ranks, offers = self.peers.decided(gathering.result(), self.parts.message_slots, self.parts.local_stages)
        m.exchange_ms, m.check = 1e3 * (now() - t0), "exchange" if exchanged_at == self.iteration else "decided"
        links, m.bubble_rate, m.timeline_span_ms = self.regime.absorb(ranks, self.rank, self.deployed.backward)
        res = self.lifecycle.resolve(offers, lambda c: self.memory.over_cap(c.kind, c.peak_inflight, c.actions, self._delegating()))
        self.regime.resolved(res)
        m.deployed, m.swap_ms = res.deployed, res.swap_ms
        if res.decision is not None or res.polished:
            m.plan_ms, m.plan_cpu_ms = res.plan_ms, res.plan_cpu_ms
        decision = self.regime.decide(self.deployed, self.adaptive, self._delegating(), self.iteration)
        if decision.replans:  # plan → validate → lower in the background, agreed and swapped at the next check
            job, reason = self.regime.replan(decision, self.deployed, self._plan, self._preparer)
            self.lifecycle.start(decision, job, reason)
        elif decision.action != "keep":
            self._log(decision=decision.action, reason=decision.reason)
        self.polish.start(res, decision)
        m.decision, m.decision_reason = decision.action, decision.reason
        settled = not res.deployed and self.regime.settled(decision, self.planning.running, self.adaptive)
        # the window estimates (the medians the policy decides on), not this check's readings (cadence.links_moved)
        self.cadence.after_check(exchanged_at, settled, self.estimator.window.median("C", len(links)), self.iteration)
        return links

    def _local_profile_vector(self, prof: IterationProfile) -> torch.Tensor:
        """This rank's contribution to the one control-plane all_gather (override point for tests)."""
        return encode_profile(prof.landed(), self.iteration, self.deployed.hash if self.deployed else 0,
                              self.parts.message_slots, *self.control.clock, self.lifecycle.candidate_hash(),
                              self.memory.local_budget_bytes(), self.parts.stage_ms(prof, self.rank))
