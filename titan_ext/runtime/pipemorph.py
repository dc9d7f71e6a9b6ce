"""PipeMorph: an adaptive PP schedule for ``torch.distributed.pipelining`` (PipeMorph §4, §6).

``PipeMorph`` is a ``PipelineScheduleMulti`` (through torch's ``_PipelineScheduleRuntime``) and is
constructed exactly like torch's built-in multi-stage schedules::

    schedule = PipeMorph([stage], n_microbatches, loss_fn=loss_fn, scale_grads=False)
    schedule.step(x, target=y, losses=losses)
    metrics = schedule.last_metrics          # plain dict, ``IterationMetrics.as_dict()``

The class only wires small parts, each usable and tested on its own (docs/runtime.md):

==================  ===========================================================================
``executor``        the instrumented action loop (``runtime/executor.py``) over a ``transport``
``control``         the gloo control plane over the PP ranks (``runtime/control.py``)
``estimator``       windows of exchanged measurements → the profile estimate (``estimator.py``)
``policy``          keep / adapt / shrink / hold with hysteresis (``policy.py``)
``planner``         profile + decision → plan (``planning.py``: PipeMorph, CrossPipe, any)
``deploy``          candidate → validate → lower → agree → swap (``deploy.py``)
``observers``       boundary observers: Falcon, delegation's slow-link switch (``observers.py``)
==================  ===========================================================================

Life cycle (PipeMorph §6, Fig.13): (1) the initial plan (Alg.1) from a memory budget; (2) every
iteration is timed; at a check (every ``profile_every`` iterations, up to ``profile_every_max`` while
nothing changes) the ranks exchange their profiles in one control-plane ``all_gather`` so every rank
holds identical data; (3) the policy decides; (4) a new plan is planned, validated and lowered in the
background while the next iteration runs, its hash agreed at the next check, and swapped at that
boundary.  A plan that fails any step is never deployed.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.pipelining import schedules as _torch_schedules
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
from torch.distributed.pipelining.stage import _PipelineStageBase

from titan_ext.plan import PipelineProfile, PlanResult, initial_warmup_counts, slackness
from titan_ext.plan.result import peak_memory_per_rank

from ._torch_compat import check_runtime_kwargs, lowering_options, runtime_kwargs_given
from .backward import BackwardChooser
from . import timeouts
from .control import ControlPlane
from .deploy import (
    Candidate,
    DeployedPlan,
    plan_hash,
    prepare_candidate,
    warmup_counts_of,
)
from .estimator import Estimator
from .executor import Executor, RunContext, forward_order
from .memory import PENDING, activation_budget_bytes, inflight_cap, rank_memory_limits
from .metrics import IterationMetrics
from .observers import Boundary, FalconObserver
from .placement import VirtualEstimator, VirtualPlanner, policy_for, read_layout, virtual_tolerances
from .planning import BackgroundPlanning, PipeMorphPlanner, Planner, PlanningContext, explicit_plan
from .policy import Decision, ReplanPolicy, eq1_tolerances
from .profiler import (
    ActionRecord,
    IterationProfile,
    decode_profiles,
    encode_profile,
    link_delay_estimates,
    now,
    timeline_bubble_rate,
)

__all__ = ["PipeMorph", "plan_hash", "warmup_counts_of"]

logger = logging.getLogger(__name__)

#: decisions whose new plan keeps the memory regime of Alg.1 ("initial") or forces a plan
_KIND_OF_DECISION = {"calibrate": "initial", "force": "forced"}


class PipeMorph(_PipelineScheduleRuntime):
    """Straggler-resilient adaptive pipeline schedule (PipeMorph §4 planning, §6 runtime).

    Args (beyond torch's ``PipelineScheduleMulti`` ones):
        memory_budget_bytes: per-stage budget for activations (Alg.1's M); with ``activation_bytes``
            (M^F, measured in the first forward when not given) it fixes x_max = ⌊M / M^F⌋ and caps
            adaptive plans.  Without it, on GPU the cap comes from free device memory (``memory.py``).
        max_inflight: x_max directly (activations stage 0 may hold); overrides the budget for Alg.1.
        adaptive: re-plan from live profiling (False: keep the initial plan; profiling still runs).
        policy: the re-planning policy (default ``ReplanPolicy()``).
        profile_every: exchange profiles / check the policy every k iterations.
        profile_every_max: while nothing changes, the period doubles up to this (adaptive k); any
            decision other than keep/hold, a running background plan or a probe resets it.  With
            Falcon on, the period stays ``profile_every`` (its detector needs every iteration).
        slack_floor: Alg.2's minimum slackness.
        adaptive_memory_limit: a further cap on warm-up forwards of adaptive plans (lifted while
            delegating: the paper's §5.2 "virtually no memory constraint").
        initial_times_ms: (F, I, W) assumed before the first measurement.
        backward: ``"split"``, ``"full"`` or ``"auto"`` (measure both, keep the faster;
            ``titan_ext.runtime.backward``).
        planner: the :class:`~titan_ext.runtime.planning.Planner` (default PipeMorph Alg.1/2).
        falcon: False, True (a default FalconMonitor) or a FalconMonitor — a boundary observer.
        observers: further boundary observers (``observe(Boundary) -> dict``).
        delegation / failover / slow_link_ms / detector / delegate_*: the transport — direct torch P2P,
            or the delegate data plane (``titan_ext.runtime.delegate.schedule.Delegation``).
            ``delegate_slot_bytes=None`` sizes the delegate slots from the stage's messages.
        timeout_s: PP message waits and control-plane collectives end after this many seconds with an
            error naming the rank that stopped answering (process-wide, ``titan_ext.runtime.timeouts``);
            None: the job's (TorchTitan: ``comm.*_timeout_seconds``) or the process groups' own.
    """

    #: ``backward=`` values of the default planner (read by the [titan_ext] config check before any
    #: process group exists); a ``planner=`` argument is checked against its own.
    backward_choices = PipeMorphPlanner.backward_choices

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
        memory_budget_bytes: float | None = None,
        max_inflight: int | None = None,
        activation_bytes: float | None = None,
        adaptive: bool = True,
        policy: Any = None,
        profile_every: int = 1,
        profile_every_max: int = 4,
        slack_floor: int = 2,
        adaptive_memory_limit: int | None = None,
        initial_times_ms: tuple[float, float, float] = (1.0, 1.0, 1.0),
        decision_log_size: int = 10_000,
        falcon: Any = False,
        backward: str = "auto",
        backward_margin: float = 0.02,
        planner: Planner | None = None,
        observers: tuple = (),
        delegation: str = "off",
        failover: bool = False,
        slow_link_ms: float = 5.0,
        detector: Callable[[dict], bool] | None = None,
        delegate_lanes: int | dict = 1,
        delegate_slots: int = 16,
        delegate_slot_bytes: int | None = None,
        recv_timeout_s: float = 30.0,
        delegate_timeout_s: float = 300.0,
        faults: Any = None,
        timeout_s: float | None = None,
        max_active_stages: int | None = None,
        unshard_lookahead: Any = None,
        defer_reduce_grad_wait: bool | None = None,
        max_outstanding_sends: int | None = None,
    ):
        # torch >= 2.15's runtime keywords (None: not given), honoured by our lowering (_torch_compat.RUNTIME_KWARGS)
        torch_runtime_kwargs = check_runtime_kwargs(runtime_kwargs_given(
            max_active_stages=max_active_stages, unshard_lookahead=unshard_lookahead,
            defer_reduce_grad_wait=defer_reduce_grad_wait, max_outstanding_sends=max_outstanding_sends))
        if timeout_s is not None:
            timeouts.set_timeout(timeout_s)  # checks the value
            timeouts.install_p2p_timeout()
        if isinstance(stages, _PipelineStageBase):
            stages = [stages]
        if not stages:
            raise ValueError(f"{type(self).__name__} needs this rank's stages, got none")
        st0 = stages[0]
        #: R ranks × V stages per rank, placement read from the stage indices (runtime/placement.py)
        self.layout = read_layout([st.stage_index for st in stages], st0.group_rank, st0.group_size, st0.num_stages)
        if self.layout.virtual and (falcon not in (False, True, None) or delegation != "off" or failover):
            raise ValueError(f"{type(self).__name__}: Falcon and delegation run with one stage per rank only, "
                             f"got {self.layout.stages_per_rank} stages per rank")
        if self.layout.virtual and falcon is True:  # the [titan_ext] default: not an explicit request
            logger.warning("%s: Falcon runs with one stage per rank only; off with %d stages per rank",
                           type(self).__name__, self.layout.stages_per_rank)
            falcon = False
        self.planner: Planner = planner if planner is not None else self._default_planner(backward)
        _check_options(type(self).__name__, self.planner, profile_every, profile_every_max,
                       max_inflight, memory_budget_bytes, backward, backward_margin, delegation)
        super().__init__(stages, n_microbatches, loss_fn=loss_fn, args_chunk_spec=args_chunk_spec,
                         kwargs_chunk_spec=kwargs_chunk_spec, output_merge_spec=output_merge_spec,
                         scale_grads=scale_grads, backward_requires_autograd=backward_requires_autograd,
                         **torch_runtime_kwargs)
        S, N = self._num_stages, n_microbatches
        if N < S and not self.layout.virtual:  # as torch's Schedule1F1B; Interleaved1F1B and ZBV take N < S
            raise ValueError(f"{type(self).__name__} with one stage per rank needs n_microbatches >= num_stages, "
                             f"got {N} < {S}")
        #: losses by microbatch index (torch keeps a list in forward order: see _maybe_compute_loss)
        self._losses_by_mb: dict[int, torch.Tensor] = {}
        self.backward = backward
        self.adaptive = adaptive
        self.policy = policy_for(self.layout, policy)
        self.profile_every, self.profile_every_max = profile_every, max(profile_every, profile_every_max)
        self.slack_floor = slack_floor
        self.adaptive_memory_limit = adaptive_memory_limit
        self.memory_budget_bytes = memory_budget_bytes
        self._max_inflight_arg = max_inflight
        self._group = stages[0].group
        self._device = torch.device(stages[0].device)

        self.control = ControlPlane(self._group)
        self.executor = Executor(self._device, activation_bytes=activation_bytes)
        self.executor.device.set_backend(dist.get_backend(self._group))
        window = max(1, int(getattr(self.policy, "window", 3)))
        self.estimator = (VirtualEstimator(self.layout, N, window, initial_times_ms) if self.layout.virtual
                          else Estimator(S, N, window, initial_times_ms))
        self.planning = BackgroundPlanning()
        # several stages per rank: the portfolio picks the backward variant of every plan
        auto = backward == "auto" and not self.layout.virtual
        self._chooser = BackwardChooser(window, backward_margin, enabled=auto, log=self._log,
                                        delay_rel_margin=getattr(self.policy, "rel_margin", 0.10),
                                        delay_abs_margin_ms=getattr(self.policy, "abs_margin_ms", 1.0))
        falcon_observer = FalconObserver.create(falcon, S, N)
        self.falcon = falcon_observer.monitor if falcon_observer else None
        self.observers: list = ([falcon_observer] if falcon_observer else []) + list(observers)
        if falcon_observer:  # Falcon's change-point detection needs every iteration's agreed time
            self.profile_every_max = self.profile_every

        self.iteration = 0
        self.decision_log: deque[dict] = deque(maxlen=decision_log_size)
        self.metrics_history: deque[dict] = deque(maxlen=decision_log_size)
        self.last_metrics: dict = {}
        self.last_profile: IterationProfile | None = None
        self.last_timeline: list[ActionRecord] = []
        self.deployed: DeployedPlan | None = None
        self.plan_version = 0
        self.inflight_cap: int | None = None  # measured memory cap of adaptive plans
        self.rank_memory_limit: tuple[float, ...] | None = None  # several stages per rank: K_r (memory.py)
        self._activation_bytes_all: list[float] | None = None
        self._pending: list[tuple[dict, str]] = []
        self._in_iteration = False
        self._since_deploy = 0
        self._calibrated = False
        self._probe_running = False
        self._plan_cpu_ms = math.nan
        self._clock = (math.nan, math.nan)
        self._clock_synced = False
        self._period, self._quiet, self._next_check = profile_every, 0, 0
        self._last_delays: list[float] = []

        self.delegation = None
        if delegation != "off" or failover:
            from .delegate.schedule import Delegation

            self.delegation = Delegation(self, delegation, failover=failover, slow_link_ms=slow_link_ms,
                                         detector=detector, lanes=delegate_lanes, slots=delegate_slots,
                                         slot_bytes=delegate_slot_bytes, recv_timeout_s=recv_timeout_s,
                                         delegate_timeout_s=delegate_timeout_s, faults=faults)
            self.executor.transport = self.delegation.transport
            self.observers.append(self.delegation)
            if self.falcon is not None:  # Falcon's re-plan strategy may now come with delegation (§5)
                self.falcon.config.delegation_available = delegation != "off"

        self._x_max = self._initial_x_max()
        self.initial_counts = initial_warmup_counts(S, self._x_max)
        decision = Decision("initial", f"Alg.1 with x_max={self._x_max}", mode="initial")
        plan = self._plan(self.estimator.profile(), decision)
        if not self._try_deploy(plan.actions, plan.warmup_counts, "initial", "initial plan (Alg.1)",
                                check_agreement=False, inflight_limit=plan.inflight_limit):
            raise RuntimeError(f"{type(self).__name__}: the initial plan failed validation: "
                               f"{self.decision_log[-1]['reason']}")
        if self.delegation is not None:
            self.delegation.start()

    # ------------------------------------------------------------------------------------------
    # planning
    # ------------------------------------------------------------------------------------------
    def _default_planner(self, backward: str) -> Planner:
        """PipeMorph Alg.1/2 (one stage per rank); the ``plan_virtual`` portfolio (several)."""
        return VirtualPlanner(self.layout, backward=backward) if self.layout.virtual else PipeMorphPlanner()

    def _initial_x_max(self) -> int:
        S, N = self._num_stages, self._n_microbatches
        if self._max_inflight_arg is not None:
            x = self._max_inflight_arg
        elif self.memory_budget_bytes is not None:
            act = self.executor.activation_bytes
            if self._activation_bytes_all is not None:
                act = max(self._activation_bytes_all)
            # until M^F is measured (first forward), hold 1F1B's memory (x_max = S): fits any budget
            # that 1F1B fits
            x = int(self.memory_budget_bytes // act) if act else S
            if x < S:
                logger.warning("%s: budget %.3g B holds only %d activations of %.3g B (< S=%d); using S", type(self).__name__,
                               self.memory_budget_bytes, x, act or 0, S)
                x = S
        else:
            x = 2 * S - 1
        return max(S, min(int(x), N))

    def _variant(self, decision: Decision | None = None) -> str:
        """The backward variant a new plan gets: the decision's, else that of the deployed planner-made
        plan (the variant ``auto`` chose), else the configured one (``auto`` starts split)."""
        if decision is not None and decision.backward is not None:
            return decision.backward
        if self.deployed is not None and self.deployed.kind in ("initial", "adaptive"):
            return self.deployed.backward
        return "full" if self.backward == "full" else "split"

    def _adaptive_limit(self) -> int | None:
        """Cap on in-flight activations of adaptive plans: the measured memory cap and the configured
        ``adaptive_memory_limit`` (the latter lifted while delegating)."""
        limits = [self.inflight_cap]
        if not (self.delegation is not None and self.delegation.delegating):
            limits.append(self.adaptive_memory_limit)
        limits = [x for x in limits if x is not None]
        return min(limits) if limits else None

    def planning_context(self, decision: Decision | None = None) -> PlanningContext:
        headroom = self.policy.headroom_delay if isinstance(self.policy, ReplanPolicy) else (lambda c: c)
        x_max = self._x_max if self.inflight_cap is None else max(1, min(self._x_max, self.inflight_cap))
        return PlanningContext(self._variant(decision), x_max, self._adaptive_limit(), self.slack_floor, headroom,
                               self.rank_memory_limit)

    def _over_memory(self, actions) -> str | None:
        """Why a background candidate no longer fits the current per-rank cap (it may have shrunk while
        the candidate was planned), or None."""
        if self.rank_memory_limit is None:
            return None
        peaks = peak_memory_per_rank(actions)
        over = {r: p for r, p in peaks.items() if p > self.rank_memory_limit[r] + 1e-9}
        if not over:
            return None
        return (f"holds {max(over.values()):g} activations on rank {max(over, key=over.get)}, above the current "
                f"per-rank cap {list(self.rank_memory_limit)}")

    def _plan(self, profile: PipelineProfile, decision: Decision) -> PlanResult:
        """A compute-only plan for ``profile``: the decision's own plan, else the planner's."""
        plan = explicit_plan(profile, decision, self._variant(decision))
        return plan if plan is not None else self.planner.plan(profile, decision, self.planning_context(decision))

    # ------------------------------------------------------------------------------------------
    # deployment (iteration boundary only)
    # ------------------------------------------------------------------------------------------
    def deploy(self, actions: Mapping[int, list[Any]], reason: str = "external") -> bool | None:
        """Validate and deploy a compute-only plan (collective: call it on every rank with the same plan).

        Outside an iteration the plan is deployed now (returns whether it was accepted); during an
        iteration it is queued and deployed at the next boundary (returns None).
        """
        plan = {r: list(a) for r, a in actions.items()}
        if self._in_iteration:
            self._pending.append((plan, reason))
            return None
        return self._try_deploy(plan, None, "external", reason)

    def _log(self, **entry: Any) -> dict:
        entry = {"iteration": self.iteration, **entry}
        self.decision_log.append(entry)
        return entry

    def _prepare(self, actions: Mapping[int, list[Any]], counts: list[int] | None, kind: str, reason: str,
                 inflight_limit: list[int] | None = None) -> Candidate:
        from torch.distributed.fsdp import FSDPModule

        fsdp = any(isinstance(st.submod, FSDPModule) for st in self._stages)
        return prepare_candidate(actions, counts, kind, reason, num_stages=self._num_stages,
                                 n_microbatches=self._n_microbatches, num_ranks=self.pp_group_size,
                                 fsdp=fsdp, inflight_limit=inflight_limit, stage_to_rank=self.layout.stage_to_rank,
                                 lowering=lowering_options(self))

    def _swap(self, cand: Candidate) -> None:
        """Install a prepared plan (iteration boundary only): an O(1) pointer swap."""
        if self._in_iteration:
            raise RuntimeError(f"{type(self).__name__}: a plan may only be swapped at an iteration boundary")
        self.pipeline_order = {r: list(a) for r, a in cand.actions.items()}
        self.pipeline_order_with_comms = cand.lowered
        self.stage_index_to_group_rank = dict(cand.mapping)
        for stage in self._stages:
            stage.stage_index_to_group_rank = self.stage_index_to_group_rank
        self.plan_version += 1
        self.deployed = DeployedPlan(self.pipeline_order, cand.counts, self.plan_version, cand.hash, cand.reason,
                                     cand.kind, cand.backward)
        self._since_deploy = 0
        self._probe_running = cand.trigger == "probe"
        if cand.trigger not in ("probe", "select"):  # a new regime: compare the backward variants afresh
            self._chooser.new_regime()
        self._log(decision="deploy", kind=cand.kind, reason=cand.reason, plan_version=self.plan_version,
                  plan_hash=hex(cand.hash), warmup_counts=cand.counts, slackness=slackness(cand.counts),
                  backward=cand.backward, prepare_ms=cand.prepare_ms, plan_ms=cand.plan_ms,
                  plan_cpu_ms=cand.plan_cpu_ms)

    def _reject(self, kind: str, reason: str) -> None:
        self._log(decision="reject", kind=kind, reason=reason, plan_version=self.plan_version)
        logger.warning("%s: rejected plan: %s", type(self).__name__, reason)

    def _try_deploy(self, actions: dict, counts: list[int] | None, kind: str, reason: str,
                    check_agreement: bool = True, inflight_limit: list[int] | None = None) -> bool:
        """Synchronous path: validate → lower → agree (hash on the control plane) → swap; any failure
        keeps the deployed plan and logs why."""
        if self._in_iteration:
            raise RuntimeError(f"{type(self).__name__}: a plan may only be swapped at an iteration boundary")
        try:
            cand = self._prepare(actions, counts, kind, reason, inflight_limit)
        except Exception as exc:  # noqa: BLE001 - validation or torch's lowering refused it
            self._reject(kind, f"{reason}: validation failed: {exc}")
            return False
        if self.deployed is not None and cand.hash == self.deployed.hash:
            self._log(decision="unchanged", kind=kind, reason=f"{reason}: identical to the deployed plan",
                      plan_version=self.plan_version)
            return True
        if check_agreement:
            agreed, seen = self.control.agree(cand.hash)
            if not agreed:
                self._reject(kind, f"{reason}: ranks disagree on the plan (hashes {[hex(x) for x in seen]})")
                return False
        self._swap(cand)
        return True

    def _apply_pending(self) -> None:
        pending, self._pending = self._pending, []
        for actions, reason in pending:
            self._try_deploy(actions, None, "external", reason)

    # -- asynchronous re-planning: planned during the next iteration, agreed and swapped after it --
    def _start_planning(self, decision: Decision) -> None:
        estimate = self.estimator.profile(self._variant(decision))
        kind = _KIND_OF_DECISION.get(decision.action, decision.mode or "adaptive")
        reason = f"{decision.action}: {decision.reason}"

        def job() -> Candidate:
            t0 = now()
            plan = self._plan(estimate, decision)
            plan_ms = 1e3 * (now() - t0)
            cand = self._prepare(plan.actions, plan.warmup_counts, kind, reason, plan.inflight_limit)
            cand.plan_ms, cand.trigger = plan_ms, decision.action
            return cand

        self.planning.start(decision, job, reason)

    def _over_memory_cap(self, cand: Candidate) -> str:
        """Why a planner-made candidate no longer fits the *current* memory cap (empty: it fits).

        A background candidate was planned under the cap of the boundary that started it; the cap
        is re-read at every exchange (free memory shrinks, e.g. once AdamW's state exists), so it is
        checked again before the swap (issue 20, defect 10) — the policy re-plans under the new cap."""
        if cand.kind not in ("initial", "adaptive"):
            return ""
        if self.rank_memory_limit is not None:  # several stages per rank: the per-rank cap (issue 21)
            return self._over_memory(cand.actions) or ""
        limit = self._adaptive_limit() if cand.kind == "adaptive" else self.inflight_cap
        if limit is None or cand.peak_inflight <= limit:
            return ""
        return (f"holds {cand.peak_inflight} in-flight activations on a stage, above the current memory cap "
                f"of {limit} (the cap shrank while it was planned)")

    def _resolve_planning(self, candidate_hashes: list[int]) -> tuple[bool, float, float]:
        """After the exchange: swap the background plan if every rank made the same one.

        Returns (deployed, critical-path ms, background planning ms)."""
        if not self.planning.running:
            return False, 0.0, 0.0
        t0 = now()
        cand, decision, error, bg_ms, self._plan_cpu_ms = self.planning.take()
        deployed = False
        if cand is None:
            self._reject("", error)
        elif len(set(candidate_hashes)) != 1:
            self._reject(cand.kind, f"{cand.reason}: ranks disagree on the plan "
                         f"(hashes {sorted(hex(h) for h in set(candidate_hashes))})")
        elif self._over_memory_cap(cand):
            self._reject(cand.kind, f"{cand.reason}: {self._over_memory_cap(cand)}")
        elif self.deployed is not None and cand.hash == self.deployed.hash:
            self._log(decision="unchanged", kind=cand.kind, reason=f"{cand.reason}: identical to the deployed plan",
                      plan_version=self.plan_version)
        else:
            self._swap(cand)
            deployed = True
        if cand is not None and decision.action == "calibrate":
            self._calibrated = True
        return deployed, 1e3 * (now() - t0), bg_ms

    # ------------------------------------------------------------------------------------------
    # one iteration
    # ------------------------------------------------------------------------------------------
    def _step_microbatches(self, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None,
                           return_outputs: bool = True, loss_kwargs=None):
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        self._apply_pending()
        self._initialize_stages(arg_mbs[0], kwarg_mbs[0], target_mbs[0] if target_mbs is not None else None,
                                loss_kwargs)
        training = self._has_backward
        if training and not self._clock_synced:
            self._clock = self.control.clock_offsets()
            self._clock_synced = True
        ctx = RunContext(self, {st.stage_index: st for st in self._stages}, arg_mbs, kwarg_mbs, target_mbs,
                         losses, return_outputs, loss_kwargs, training)
        self._in_iteration = True
        self._losses_by_mb.clear()
        actions = self.pipeline_order_with_comms[self.rank]
        try:
            iteration_ms = self.executor.run(actions, ctx)
        except Exception:
            logger.error("%s: iteration %d failed; plan v%d:\n%s", type(self).__name__, self.iteration,
                         self.plan_version, _torch_schedules._format_pipeline_order(self.pipeline_order_with_comms))
            raise
        finally:
            self._in_iteration = False
        if len(self.unshard_ops) != 0:
            raise AssertionError("Unused unshard operations")
        # losses and outputs in microbatch order whatever the plan's order of last-stage forwards
        self._internal_losses = [self._losses_by_mb[m] for m in sorted(self._losses_by_mb)]
        self._losses_by_mb.clear()
        has_last = any(st.is_last for st in self._stages)
        if has_last and self._loss_fn is not None and len(self._internal_losses) != self._n_microbatches:
            raise RuntimeError(f"{type(self).__name__}: {len(self._internal_losses)} losses for "
                               f"{self._n_microbatches} microbatches")
        self._update_losses(self._stages, losses)
        self._sort_outputs(actions)
        if training:
            act = self.executor.activation_bytes
            ctx.profile.activation_bytes = act if act else math.nan
            self.last_profile = ctx.profile
            self.last_timeline = list(ctx.profile.actions)
            self._iteration_boundary(ctx.profile, iteration_ms)
        self._apply_pending()  # plans pushed during the iteration: swapped in at this boundary

    def _maybe_compute_loss(self, stage, output, target_mbs, mb_index, loss_kwargs=None):
        """torch's hook (our executor and custom functions call it), keyed by microbatch index."""
        if stage.is_last and self._loss_fn is not None:
            if mb_index in self._losses_by_mb:
                raise AssertionError(f"{type(self).__name__}: microbatch {mb_index} forwarded twice on the last stage")
            self._losses_by_mb[mb_index] = self._compute_loss(output, target_mbs[mb_index], loss_kwargs)

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
    # the iteration boundary: exchange, estimate, decide, (re-)plan, deploy, observe, metrics
    # ------------------------------------------------------------------------------------------
    def _local_profile_vector(self, prof: IterationProfile) -> torch.Tensor:
        """This rank's contribution to the one control-plane all_gather (override point for tests)."""
        arrivals_prev = [h.arrival_time() for h in prof.arrivals_prev]
        arrivals_next = [h.arrival_time() for h in prof.arrivals_next]
        local = IterationProfile(prof.actions, prof.sends_next, prof.sends_prev, arrivals_prev, arrivals_next,
                                 prof.send_bytes_next, prof.activation_bytes)
        stage_ms = prof.stage_times_ms(self.layout.local_stages(self.rank)) if self.layout.virtual else None
        return encode_profile(local, self.iteration, self.deployed.hash if self.deployed else 0,
                              self._message_slots(), self._clock[0], self._clock[1],
                              candidate_hash=self.planning.candidate_hash(),
                              memory_budget_bytes=activation_budget_bytes(self.executor.device, self.memory_budget_bytes),
                              stage_ms=stage_ms)

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
            self._activation_bytes_all = [r.activation_bytes for r in ranks]
            budgets = [r.memory_budget_bytes for r in ranks]
            if self.layout.virtual and PENDING not in budgets:  # per rank; the planner splits it by need
                self.rank_memory_limit = rank_memory_limits(budgets, self._activation_bytes_all,
                                                            self.layout.stages_per_rank, self._n_microbatches)
                self.inflight_cap = None
            else:
                self.rank_memory_limit = None
                self.inflight_cap = inflight_cap(budgets, self._activation_bytes_all, self._n_microbatches,
                                                 pending_cap=self._x_max)
                if self.inflight_cap is not None and self.layout.virtual:  # pending: the initial regime
                    self.inflight_cap = max(1, self.inflight_cap // self.layout.stages_per_rank)
            self._warn_small_budget(ranks)
        self.estimator.push(ranks, [lk["c_ms"] for lk in links])
        if math.isfinite(span_ms):
            self._chooser.record(self.deployed.backward, span_ms)
        return links, bubble, span_ms

    def _warn_small_budget(self, ranks: list) -> None:
        """Once, from PP rank 0: a memory budget that holds fewer activations than stages (below 1F1B's
        memory: an absurd budget, e.g. ``memory_budget_gib = 1e-9``) is applied, but said (issue 26)."""
        S = self._num_stages
        if self.inflight_cap is None or self.inflight_cap >= S or getattr(self, "_budget_warned", False):
            return
        self._budget_warned = True
        if self.rank == 0:
            budgets = [r.memory_budget_bytes for r in ranks]
            logger.warning("PipeMorph: the memory budget (%s B per rank) holds only %d activation(s) of %.3g B "
                           "per stage, fewer than the %d stages (1F1B holds %d): plans are capped at %d in-flight "
                           "activations and will be slow; raise [titan_ext] memory_budget_gib (0 = no budget)",
                           ", ".join(f"{b:.3g}" for b in budgets), self.inflight_cap,
                           max(self._activation_bytes_all), S, S, self.inflight_cap)

    def _check_now(self) -> bool:
        return self.iteration >= self._next_check

    def _links_moved(self, links: list[dict]) -> bool:
        """Whether a link's delay of this check differs from the previous check's by more than the
        policy's margins (10 % + 1 ms by default): news the window has not absorbed yet."""
        delays = [lk["c_ms"] for lk in links]
        previous, self._last_delays = self._last_delays, delays
        rel, abs_ms = getattr(self.policy, "rel_margin", 0.10), getattr(self.policy, "abs_margin_ms", 1.0)
        return len(previous) != len(delays) or any(
            not (math.isfinite(a) and math.isfinite(b)) or abs(a - b) > rel * max(a, b) + abs_ms
            for a, b in zip(previous, delays))

    def _schedule_next_check(self, decision: Decision | None, links: list[dict]) -> None:
        """Adaptive k: the period doubles after 2 × ``window`` quiet checks (keep or hold, nothing
        planning, no probe, no link delay moved beyond the policy's margins since the last check: the
        window refreshed twice without news), up to ``profile_every_max``; anything else resets it
        to ``profile_every``.  The price is detection latency: a new straggler is seen at
        the next check, at most ``profile_every_max`` iterations later."""
        moved = self._links_moved(links)
        quiet = decision is not None and decision.action in ("keep", "hold") and not self.planning.running \
            and not self._probe_running and (self._calibrated or not self.adaptive) and not moved
        self._quiet = self._quiet + 1 if quiet else 0
        if not quiet:
            self._period = self.profile_every
        elif self._quiet >= 2 * self.estimator.window.size:
            self._period, self._quiet = min(2 * self._period, self.profile_every_max), 0
        self._next_check = self.iteration + self._period

    def _iteration_boundary(self, prof: IterationProfile, iteration_ms: float) -> None:
        t0 = now()
        exchanged = self._check_now()
        # device times are read only once the device ran them: at an exchange the profile is needed now
        # (wait for the iteration's last event — never a device synchronize); otherwise only if done
        if self.executor.timer.resolve(block=exchanged):
            iteration_ms = self.executor.timer.wall_ms
        m = IterationMetrics(self.iteration, iteration_ms, recv_wait_ms=sum(r.recv_wait_ms for r in prof.actions),
                             profile_every=self._period)
        links: list[dict] = []
        ran_probe = self._probe_running
        decision: Decision | None = None
        if exchanged:
            local_stages = self.layout.stages_per_rank if self.layout.virtual else 0
            ranks = decode_profiles(self.control.all_gather(self._local_profile_vector(prof)), self._message_slots(),
                                    local_stages)
            m.exchange_ms = 1e3 * (now() - t0)
            links, m.bubble_rate, m.timeline_span_ms = self._absorb(ranks)
            resolving = self.planning.running
            m.deployed, m.swap_ms, bg_ms = self._resolve_planning([r.candidate_hash for r in ranks])
            if resolving:
                m.plan_ms, m.plan_cpu_ms = bg_ms, self._plan_cpu_ms
            decision = self._decide()
            if not self._chooser.probing:  # the verdict kept the probed variant: no swap marks the end
                self._probe_running = False
            if decision.replans:
                self._start_planning(decision)
            elif decision.action != "keep":
                self._log(decision=decision.action, reason=decision.reason)
            m.decision, m.decision_reason = decision.action, decision.reason
            self._schedule_next_check(decision, links)
        m.boundary_ms = 1e3 * (now() - t0)
        m.replan_ms = m.swap_ms  # critical path only: planning ran in the background (plan_ms)
        self._since_deploy += 1
        self._fill_plan_metrics(m, links)
        boundary = Boundary(self, self.iteration, iteration_ms, exchanged, m.timeline_span_ms, links, ran_probe)
        for observer in self.observers:
            boundary.metrics = m.as_dict()
            m.extra.update(observer.observe(boundary))
        self.last_metrics = m.as_dict()
        self.metrics_history.append(self.last_metrics)
        self.iteration += 1

    def _fill_plan_metrics(self, m: IterationMetrics, links: list[dict]) -> None:
        est, est_full = self.estimator.profile(), self.estimator.profile("full")
        dep = self.deployed
        m.link_delay_ms = {i: lk["c_ms"] for i, lk in enumerate(links)}
        m.link_delay_fwd_ms = {i: lk["fwd_ms"] for i, lk in enumerate(links)}
        m.link_delay_bwd_ms = {i: lk["bwd_ms"] for i, lk in enumerate(links)}
        m.link_delay_estimate_ms = dict(enumerate(est.delays_ms))
        if self.layout.virtual:  # per rank link, and the virtual Eq.1 tolerance (docs/multistage.md)
            m.link_delay_estimate_ms = dict(enumerate(self.estimator.rank_link_delays_ms()))
        m.compute_ms = {"F": list(est.f_ms), "I": list(est.b_ms), "W": list(est.w_ms), "B": list(est_full.b_ms)}
        m.backward, m.plan_version, m.plan_hash = dep.backward, self.plan_version, hex(dep.hash)
        m.warmup_counts, m.slackness = list(dep.warmup_counts), slackness(dep.warmup_counts)
        m.eq1_tolerance_ms = (virtual_tolerances(est, self.layout, dep.warmup_counts) if self.layout.virtual
                              else eq1_tolerances(est_full if dep.backward == "full" else est, dep.warmup_counts))
        m.inflight_cap = self._adaptive_limit()
        m.memory_budget_bytes = self.memory_budget_bytes if self.memory_budget_bytes is not None else math.nan

    def _decide(self) -> Decision:
        """Run the policy (identical inputs on every rank → identical decision)."""
        est = self.estimator.profile(self.deployed.backward)
        counts = self.deployed.warmup_counts
        if not self.adaptive and not getattr(self.policy, "forces", False):
            decision = Decision("keep", "adaptation disabled")
        else:
            decision = self.policy.decide(est, counts, self.initial_counts, self._since_deploy,
                                          slack_floor=self.slack_floor)
        if decision.action in ("keep", "hold") and not self._calibrated and self.adaptive:
            if self.memory_budget_bytes is not None and self._max_inflight_arg is None:
                self._x_max = self._initial_x_max()
                self.initial_counts = initial_warmup_counts(self._num_stages, self._x_max)
            if self.deployed.kind == "initial":
                return Decision("calibrate", f"initial plan regenerated with measured times "
                                f"(Alg.1, x_max={self._x_max})", mode="initial")
            self._calibrated = True
        if self.adaptive and self._calibrated and self.deployed.kind in ("initial", "adaptive"):
            mode = "initial" if self.deployed.kind == "initial" else "adaptive"
            return self._chooser.step(decision, self.deployed.backward, counts, mode, est.delays_ms, self.iteration)
        return decision


def _check_options(name: str, planner: Planner, profile_every: int, profile_every_max: int,
                   max_inflight: int | None, memory_budget_bytes: float | None, backward: str,
                   backward_margin: float, delegation: str) -> None:
    """One-line errors for bad options, before torch's constructor or any process-group call."""
    if profile_every < 1 or profile_every_max < 1:
        raise ValueError(f"profile_every and profile_every_max must be >= 1, got {profile_every}, {profile_every_max}")
    if max_inflight is not None and not 1 <= max_inflight:
        raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
    if memory_budget_bytes is not None and not memory_budget_bytes > 0:
        raise ValueError(f"memory_budget_bytes must be > 0, got {memory_budget_bytes}")
    if backward not in planner.backward_choices:
        raise ValueError(f"{name}: backward must be one of {planner.backward_choices}, got {backward!r}")
    if not 0 <= backward_margin < 1:
        raise ValueError(f"backward_margin must be within [0, 1), got {backward_margin}")
    if delegation not in ("off", "auto", "always"):
        raise ValueError(f"delegation must be one of ('off', 'auto', 'always'), got {delegation!r}")
