"""The instrumented action loop: runs one rank's lowered action list for one iteration.

Tracks ``_PipelineScheduleRuntime._step_microbatches`` (torch/distributed/pipelining/schedules.py) of
torch **2.11**, **2.12**, **2.13**, **2.14** and **2.15** (``_torch_compat.TRACKED``; a copy of each
loop lies in tests/torch_loops/ and ``tests/runtime/test_torch_loops.py`` fails when the installed torch's loop
differs from it; 2.11's and 2.12's differ from 2.13's only in the arguments of
``_initialize_stages`` / ``_compute_loss`` — 2.12 added ``target``, 2.13 ``loss_kwargs`` — which
``_torch_compat.initialize_stages`` / ``with_loss_kwargs`` pass as the installed torch takes them): the same action semantics (SEND/RECV, UNSHARD/RESHARD, REDUCE_GRAD, OVERLAP_F_B, custom
functions, local stage-to-stage hand-off when neighbouring stages share a rank — so it runs several
local stages per rank, as the multi-stage runtime needs), and from torch 2.15 on
(``_torch_compat.has_wait_actions``) its explicit waits: WAIT_SEND_F / WAIT_SEND_B retire one send
(a forward send's outputs are released then, ``release_fwd_send_outputs``; without waits, 2.13/2.14,
sends are waited at the end of the step), FSDP gradient reduction split into REDUCE_GRAD (start) and
WAIT_REDUCE_GRAD (wait + scale), and ``step(finalize_gradients=False)`` keeping FSDP stages unsharded
with their gradients unreduced until a later step finalizes them. With three additions:

* timing, arrival stamps and waits go through the device layer (``runtime/execute/device.py``): every compute
  action is timed (host clock on CPU, CUDA events on the compute stream on GPU, resolved off the critical
  path) and the time its stream stalled on its input is recorded apart (``recv_wait_ms``); a receive's
  wait is placed just before its consumer, as torch does (``_awaited_input``), never when it is posted;
* SEND/RECV ops go through a :class:`~titan_ext.runtime.comm.transport.Transport` (torch P2P, delegates),
  sends are stamped when handed over (on the compute stream's time), receives when their data has
  landed (the device layer's arrival watcher, from the receive's completion);
* losses are kept by microbatch index (the schedule's ``_maybe_compute_loss`` / ``_maybe_get_loss``,
  which custom functions registered with torch's ``register_custom_function`` call too), and the last
  stage's outputs are merged in microbatch order (:func:`forward_order`), so a plan may order the last
  stage's forwards freely.

The per-iteration state travels in a :class:`RunContext` (torch's ``_PipelineContext`` plus ours), not
in long parameter lists.  torch-owned per-step state (receive tables, backward counters, unshard ops,
loss computation, custom functions) stays on the schedule object, as in torch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.distributed.pipelining.schedules import (
    _Action,
    _ComputationType,
    _get_profiler_function_name,
    _PipelineContext,
    _PipelineScheduleRuntime,
    _wait_batch_p2p,
)
from torch.distributed.pipelining.stage import _PipelineStageBase
from torch.autograd import _profiler_enabled
from torch.autograd import profiler as _autograd_profiler
from torch.profiler import record_function

from titan_ext.args import ArgumentTypeError, int_arg
from titan_ext.plan.placement import rank_link

from .._torch_compat import has_wait_actions, with_loss_kwargs
from ..comm.transport import TorchP2P, Transport
from ..measure.profiler import ActionRecord, IterationProfile
from .device import DeviceLayer, device_layer
from .memory import ActivationMeter, LiveStorages, parameter_storages, selective_checkpointing

__all__ = ["Executor", "RunContext", "Step", "BACKWARD_TYPES", "check_schedule_arguments", "forward_order", "run_with_failover"]

F = _ComputationType.FORWARD
I = _ComputationType.BACKWARD_INPUT
W = _ComputationType.BACKWARD_WEIGHT
B = _ComputationType.FULL_BACKWARD
SEND_F = _ComputationType.SEND_F
SEND_B = _ComputationType.SEND_B
RECV_F = _ComputationType.RECV_F
RECV_B = _ComputationType.RECV_B
UNSHARD = _ComputationType.UNSHARD
RESHARD = _ComputationType.RESHARD
REDUCE_GRAD = _ComputationType.REDUCE_GRAD
OVERLAP_F_B = _ComputationType.OVERLAP_F_B
#: torch >= 2.15 only (None before): see the module docstring
WAIT_SEND_F = getattr(_ComputationType, "WAIT_SEND_F", None)
WAIT_SEND_B = getattr(_ComputationType, "WAIT_SEND_B", None)
WAIT_REDUCE_GRAD = getattr(_ComputationType, "WAIT_REDUCE_GRAD", None)
WAITS = has_wait_actions()
#: skipped when the step runs without backward (evaluation)
BACKWARD_TYPES = (I, W, B, SEND_B, RECV_B, REDUCE_GRAD) + ((WAIT_SEND_B, WAIT_REDUCE_GRAD) if WAITS else ())


@dataclass
class RunContext:
    """One iteration's inputs and what it produces."""

    schedule: _PipelineScheduleRuntime
    stages: dict[int, Any]  # stage index → this rank's stage
    arg_mbs: list
    kwarg_mbs: list
    target_mbs: list | None
    losses: list | None
    return_outputs: bool = True
    loss_kwargs: dict | None = None
    training: bool = True
    profile: IterationProfile = field(default_factory=IterationProfile)
    #: (SEND_F or SEND_B, stage, microbatch) → (handles, what to run once sent) until its wait
    pending_sends: dict[tuple[Any, int, int], tuple[list[Any], Any]] = field(default_factory=dict)

    def torch_context(self) -> _PipelineContext:
        return _PipelineContext(self.schedule, self.arg_mbs, self.kwarg_mbs, self.target_mbs, self.losses)


#: one action prepared for the action loop (:meth:`Executor.prepare`), called with the iteration's context
Step = Callable[[RunContext], None]


def profiler_enabled() -> bool:
    """Whether a profiler records this thread's ``record_function`` spans: ``torch.profiler.profile`` sets
    ``_is_profiler_enabled`` (also with ``profile_all_threads``, which leaves the thread's state off);
    ``emit_nvtx`` and the autograd profiler set the thread's state. A span costs an op dispatch whether
    or not anything records it, so the executor opens one only then."""
    return getattr(_autograd_profiler, "_is_profiler_enabled", True) or _profiler_enabled()


class Executor:
    """Runs lowered action lists; holds the device layer (timer, arrival watcher) and the transport."""

    def __init__(self, device: torch.device, transport: Transport | None = None,
                 activation_bytes: float | None = None, layer: DeviceLayer | None = None):
        self.use_device(layer if layer is not None else device_layer(device))
        self.transport: Transport = transport if transport is not None else TorchP2P()
        #: M^F of Alg.1 (bytes autograd saves for one microbatch); None: measured in the next forward
        self.activation_bytes = activation_bytes
        #: PP links (i: ranks i, i+1) whose receives the arrival watcher stamps; the others' consumers
        #: stamp them (:meth:`DeviceLayer.watch`).  None: every link (the schedule sets it)
        self.exact_links: set[int] | None = None
        self._makers = self._maker_table()
        #: (what the steps were made for, the actions, the steps): :meth:`prepared`
        self._prepared: tuple[Any, list[_Action], list[tuple[_Action, Step]]] | None = None

    def use_device(self, layer: DeviceLayer) -> None:
        """Time, stamp and wait through ``layer`` (e.g. the simulation of ``testing/simdevice.py``)."""
        self.device = layer
        self.timer = layer.timer()

    def run(self, actions: list[_Action], ctx: RunContext) -> float:
        """Run one iteration's actions; returns its wall time (ms) as the device ran it, NaN while the
        device has not finished it (then ``timer.resolve()`` fills it later; no host sync here).

        Each action (and each sub-action of an OVERLAP_F_B) runs inside ``record_function("PP:<action>")``,
        torch's name for it (``_get_profiler_function_name``), and each send still pending at the end is
        waited inside ``titan_ext:wait_send <send action>``: both show in a torch.profiler trace."""
        ctx.schedule.backward_counter.clear()
        if WAITS:
            ctx.schedule._finalized_stages.clear()
        steps = self.prepared(actions, ctx)
        self.timer.begin_iteration()
        traced = profiler_enabled()
        with self.device.context():
            if traced:
                for action, step in steps:
                    with record_function(_get_profiler_function_name(action)):
                        step(ctx)
            else:
                for _, step in steps:
                    step(ctx)
            unmatched = list(ctx.pending_sends)
            for key in unmatched:  # 2.13/2.14: every send; 2.15: none (each has its WAIT_SEND)
                if traced:
                    with record_function(f"titan_ext:wait_send {_Action(key[1], key[0], key[2])}"):
                        self._wait_send(key, ctx)
                else:
                    self._wait_send(key, ctx)
            if WAITS and unmatched:
                raise AssertionError(f"Pipeline sends have no matching wait: {unmatched}")
        self.timer.end_iteration()
        self.timer.resolve(block=False)
        return self.timer.wall_ms

    def prepared(self, actions: list[_Action], ctx: RunContext) -> list[tuple[_Action, Step]]:
        """``actions`` as prepared steps (:meth:`prepare`), made once per plan and reused while the actions,
        this rank's stages, the stage-to-rank mapping, the custom functions and training stay the same: what
        an action needs that does not change between iterations (its handler, stage, peer, link, the
        receive its compute waits for) is looked up once, not per action per iteration."""
        sched = ctx.schedule
        key = (sched, ctx.training, tuple(ctx.stages.items()), tuple(sched.stage_index_to_group_rank.items()),
               tuple(sched._comp_type_to_function_map.items()))
        cached = self._prepared
        if cached is None or cached[0] != key or cached[1] != actions:
            steps = [(a, self.prepare(a, ctx)) for a in actions
                     if ctx.training or a.computation_type not in BACKWARD_TYPES]
            cached = self._prepared = (key, list(actions), steps)
        return cached[2]

    def prepare(self, action: _Action, ctx: RunContext) -> Step:
        """The step that runs ``action`` in an iteration (called with that iteration's context): a custom
        function torch's ``register_custom_function`` registered for its type, or our handler's."""
        ct = action.computation_type
        custom = ctx.schedule._comp_type_to_function_map.get(ct)
        if custom is not None:
            return lambda c: custom(action, c.torch_context())
        make = self._makers.get(ct)
        if make is None:
            raise ValueError(f"{action=} is unknown or unsupported")
        return make(action, ctx)

    def _maker_table(self) -> dict[Any, Any]:
        """Each action type's step maker (``maker(action, ctx) -> step``)."""
        def plain(handler: Any) -> Any:  # a handler that looks everything up when it runs
            return lambda action, ctx: lambda c: handler(action, c)

        table = {F: self._compute_step, I: self._compute_step, W: self._compute_step, B: self._compute_step,
                 SEND_F: self._send_step, SEND_B: self._send_step, RECV_F: self._recv_step, RECV_B: self._recv_step,
                 UNSHARD: plain(self._fsdp), RESHARD: plain(self._fsdp), OVERLAP_F_B: self._overlap_step}
        if WAITS:
            table.update({WAIT_SEND_F: self._wait_send_step, WAIT_SEND_B: self._wait_send_step,
                          REDUCE_GRAD: plain(self._start_reduce_grad), WAIT_REDUCE_GRAD: plain(self._wait_reduce_grad)})
        else:
            table[REDUCE_GRAD] = plain(self._reduce_grad)
        return table

    def _overlap_step(self, action: _Action, ctx: RunContext) -> Step:
        subs = [(sub, self.prepare(sub, ctx)) for sub in action.sub_actions or ()]

        def step(c: RunContext) -> None:
            for sub, run in subs:
                if profiler_enabled():
                    with record_function(_get_profiler_function_name(sub)):
                        run(c)
                else:
                    run(c)
        return step

    def _wait_send_step(self, action: _Action, ctx: RunContext) -> Step:  # noqa: ARG002
        key = (SEND_F if action.computation_type == WAIT_SEND_F else SEND_B, action.stage_index,
               action.microbatch_index)
        return lambda c: self._wait_send(key, c)

    @staticmethod
    def _reduce_grad(action: _Action, ctx: RunContext) -> None:
        sched = ctx.schedule
        ctx.stages[action.stage_index].perform_reduce_grad(sched._n_microbatches if sched.scale_grads else 1)

    # -- communication ----------------------------------------------------------------------------
    @staticmethod
    def peer(action: _Action, schedule: _PipelineScheduleRuntime) -> int:
        ct, s = action.computation_type, action.stage_index
        other = s + 1 if ct in (SEND_F, RECV_B) else s - 1
        return schedule.stage_index_to_group_rank[other]

    def _send_step(self, action: _Action, ctx: RunContext) -> Step:
        ct, s, mb = action.computation_type, action.stage_index, action.microbatch_index
        stage, forward, key = ctx.stages[s], ct == SEND_F, (ct, s, mb)
        get_ops = stage.get_fwd_send_ops if forward else stage.get_bwd_send_ops
        # stamps per rank link (plan.placement.rank_link: ranks r, r±1), whatever the direction in the
        # model: with several stages per rank a "v" placement sends forwards to rank r−1 too; the loop
        # wrap-around is not a link. The stamp is the compute stream's time at hand-over (when the data
        # is ready on the device).
        peer, rank = self.peer(action, ctx.schedule), ctx.schedule.rank
        link = rank_link(rank, peer)
        to_next, to_prev = link is not None and peer > rank, link is not None and peer < rank
        retire = stage.release_fwd_send_outputs if forward and WAITS else None

        def step(c: RunContext) -> None:
            if key in c.pending_sends:
                raise AssertionError(f"Duplicate pipeline send {action}")
            ops, prof = get_ops(mb), c.profile
            if to_next:
                self.timer.mark(prof.sends_next)
                prof.send_bytes_next += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
            elif to_prev:
                self.timer.mark(prof.sends_prev)
            c.pending_sends[key] = (self.transport.issue(action, ops), retire)
        return step

    @staticmethod
    def _wait_send(key: tuple[Any, int, int], ctx: RunContext) -> None:
        """Wait for one send; on torch >= 2.15 a forward send's outputs are released once sent."""
        if key not in ctx.pending_sends:
            raise AssertionError(f"No pending pipeline send for {key}")
        handles, retire = ctx.pending_sends.pop(key)
        _wait_batch_p2p(handles)
        if retire is not None:
            retire(key[2])

    def _recv_step(self, action: _Action, ctx: RunContext) -> Step:
        s, mb, sched = action.stage_index, action.microbatch_index, ctx.schedule
        forward = action.computation_type == RECV_F
        get_ops = ctx.stages[s].get_fwd_recv_ops if forward else ctx.stages[s].get_bwd_recv_ops
        peer = self.peer(action, sched)
        link = rank_link(peer, sched.rank)
        from_prev = peer < sched.rank

        def step(c: RunContext) -> None:
            table = sched.fwd_recv_ops if forward else sched.bwd_recv_ops
            if (s, mb) in table:
                raise AssertionError(f"Recv twice for {s=} {mb=} without executing compute")
            ops = get_ops(mb)
            exact = self.exact_links is None or link is None or link in self.exact_links
            handle = self.device.watch(peer, self.transport.issue(action, ops), exact=exact)
            table[(s, mb)] = [handle]
            if link is not None:
                (c.profile.arrivals_prev if from_prev else c.profile.arrivals_next).append(handle)
        return step

    @staticmethod
    def _fsdp(action: _Action, ctx: RunContext) -> None:
        stage, s, sched = ctx.stages[action.stage_index], action.stage_index, ctx.schedule
        if not uses_fsdp(stage):
            return
        if WAITS and _deferred_fsdp(action, ctx):
            return
        from torch.distributed.fsdp import FSDPModule

        modules = [m for m in stage.submod.modules() if isinstance(m, FSDPModule)]
        if action.computation_type == UNSHARD:
            sched.unshard_ops[s].extend(m.unshard(async_op=True) for m in modules)
        else:
            for m in modules:
                m.reshard()
            sched.unsharded_stages.discard(s)

    @staticmethod
    def _start_reduce_grad(action: _Action, ctx: RunContext) -> None:
        """torch >= 2.15 REDUCE_GRAD: FSDP starts its reduction (waited in WAIT_REDUCE_GRAD), or defers
        it under ``step(finalize_gradients=False)``; other stages reduce at once, as before."""
        stage, s, sched = ctx.stages[action.stage_index], action.stage_index, ctx.schedule
        fsdp = uses_fsdp(stage)
        if fsdp and not sched._finalize_gradients:
            sched._deferred_stages.add(s)
        elif fsdp:
            stage.start_gradient_reduction()
            sched.unsharded_stages.discard(s)
            sched._deferred_stages.discard(s)
            sched._finalized_stages.add(s)
        else:
            stage.perform_reduce_grad(sched._n_microbatches if sched.scale_grads else 1)

    @staticmethod
    def _wait_reduce_grad(action: _Action, ctx: RunContext) -> None:
        stage, sched = ctx.stages[action.stage_index], ctx.schedule
        if uses_fsdp(stage) and sched._finalize_gradients:
            stage.wait_for_gradient_reduction(sched._n_microbatches if sched.scale_grads else 1)

    # -- compute ------------------------------------------------------------------------------------
    @staticmethod
    def _awaited_input(action: _Action, ctx: RunContext) -> tuple[bool, str] | None:
        """Which receive a compute action waits for, just before it reads it: (True: the forward receive
        table, False: the backward one; what it would be computing without it), None: no cross-rank input.
        On CUDA the wait is a stream wait on the compute stream, on gloo a host wait.

        torch's placement (before F, B, I), except on the first stage: torch's ``backward_one_chunk``
        computes nothing there in a split backward's I (no input gradient is needed; the whole backward
        runs in W), so the gradient's consumer is W and the wait moves there — before I, it would stall
        the forwards the plan put between I and W."""
        ct, s = action.computation_type, action.stage_index
        stage = ctx.stages[s]
        grad_from_peer = not stage.is_last and s + 1 not in ctx.stages
        if ct == F and not stage.is_first and s - 1 not in ctx.stages:
            return True, "before receiving input"
        if grad_from_peer and (ct == B or (ct == I and not stage.is_first) or (ct == W and stage.is_first)):
            return False, "before receiving its gradient"
        return None

    def _compute_step(self, action: _Action, ctx: RunContext) -> Step:
        ct, s, mb, sched = action.computation_type, action.stage_index, action.microbatch_index, ctx.schedule
        if mb is None or mb < 0:
            raise AssertionError(f"{action=} missing mb_index")
        stage, kind, needs = ctx.stages[s], ct.value, self._awaited_input(action, ctx)
        forward, backward_input, full = self._forward, self._backward_input, ct == B

        def step(c: RunContext) -> None:
            rec, timer = ActionRecord(kind, s, mb), self.timer
            sched._assert_unsharded(stage)
            if needs is None:
                token = timer.start(rec)
            else:
                table = sched.fwd_recv_ops if needs[0] else sched.bwd_recv_ops
                if (s, mb) not in table:
                    raise AssertionError(f"Computing {action=} {needs[1]}")
                wait_token = timer.recv_wait_begin()
                self.device.wait_recv(table.pop((s, mb)))
                token = timer.start(rec)
                timer.recv_wait_ms(rec, wait_token)
            if ct == F:
                forward(stage, mb, c)
            elif ct == W:
                sched.backward_counter[s] += 1
                stage.backward_weight_one_chunk(mb, last_backward=sched.backward_counter[s] == sched._n_microbatches)
            else:
                backward_input(stage, mb, full, c)
            timer.stop(rec, token)
            c.profile.actions.append(rec)
        return step

    def _forward(self, stage: Any, mb: int, ctx: RunContext) -> None:
        sched = ctx.schedule

        def forward() -> Any:
            output = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb],
                                             save_forward_output=ctx.return_outputs)
            with_loss_kwargs(sched._maybe_compute_loss, stage, output, ctx.target_mbs, mb, loss_kwargs=ctx.loss_kwargs)
            return output

        if self.activation_bytes is None and ctx.training:
            output, nbytes = measured_forward(stage, forward)
            self.activation_bytes = float(nbytes)
        else:
            output = forward()
        if stage.stage_index + 1 in ctx.stages:
            ctx.stages[stage.stage_index + 1].set_local_fwd_input(output, mb)

    @staticmethod
    def _backward_input(stage: Any, mb: int, full: bool, ctx: RunContext) -> None:
        sched, s = ctx.schedule, stage.stage_index
        loss = sched._maybe_get_loss(stage, mb)
        last_backward = False
        if full:
            sched.backward_counter[s] += 1
            last_backward = sched.backward_counter[s] == sched._n_microbatches
        stage.backward_one_chunk(mb, loss=loss, full_backward=full, last_backward=last_backward)
        if s - 1 in ctx.stages:
            ctx.stages[s - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)


def uses_fsdp(stage: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(stage.submod, FSDPModule)


def _deferred_fsdp(action: _Action, ctx: RunContext) -> bool:
    """torch 2.15's UNSHARD/RESHARD bookkeeping of ``finalize_gradients``; True when the action is
    consumed by it: an UNSHARD of a stage left unsharded by a non-finalizing step, a RESHARD that the
    finalizing REDUCE_GRAD already did, or a RESHARD skipped because this step does not finalize."""
    s, sched = action.stage_index, ctx.schedule
    if action.computation_type == UNSHARD:
        if s in sched._deferred_stages:
            sched._deferred_stages.remove(s)
            return True
        return False
    if s in sched._finalized_stages:
        sched._finalized_stages.remove(s)
        return True
    if not sched._finalize_gradients and sched.backward_counter[s] == sched._n_microbatches:
        sched._deferred_stages.add(s)
        return True
    return False


def forward_order(actions: list[_Action], stage_index: int) -> list[int]:
    """Microbatch indices of ``stage_index``'s forwards in the order ``actions`` runs them (the order
    ``stage.output_chunks`` is appended in, whether our loop or a custom function runs them)."""
    order = []
    for action in actions:
        for a in (action.sub_actions or ()) if action.computation_type == OVERLAP_F_B else (action,):
            if a.computation_type == F and a.stage_index == stage_index:
                order.append(a.microbatch_index)
    return order


def measured_forward(stage: Any, forward: Any) -> tuple[Any, int]:
    """``forward()`` (one microbatch's forward and, on the last stage, its loss) and PipeMorph Alg.1's
    M^F: the bytes autograd still holds for it when it returns (``memory.ActivationMeter``, counted by
    ``memory.saved_bytes_key``: a view its own elements, once; parameters never; a tensor saved and
    released within the forward, as by a loss that runs its backward chunk by chunk, not at all), and
    its output, which torch's stage keeps (``fwd_cache``) until the microbatch's backward (the logits
    on the last stage). Under selective activation checkpointing (``memory.selective_checkpointing``),
    whose saved ops those hooks cannot see, M^F is also measured as the bytes the forward leaves alive
    (``memory.LiveStorages``, parameters excluded: FSDP's gathered weights are parameters) and the
    larger count holds: the cap must not let such a stage hold more than fits."""
    meter = ActivationMeter(stage.submod.parameters())
    live = LiveStorages() if selective_checkpointing(stage.submod) else contextlib.nullcontext()
    with live, meter:
        output = forward()
    total = meter.held_with(output)
    if isinstance(live, LiveStorages):
        total = max(total, live.alive_bytes(parameter_storages(stage.submod.parameters())))
    return output, max(total, 1)


def check_schedule_arguments(name: str, stages: Any, n_microbatches: Any, loss_fn: Any) -> list:
    """A schedule's first arguments checked: this rank's stages (one torch pipeline stage or a non-empty
    list of them; a ``torch.nn.Module`` is not a stage), ``n_microbatches`` >= 1, ``loss_fn`` callable or
    None.  Returns the stages as a list."""
    int_arg(n_microbatches, "n_microbatches", 1)
    if loss_fn is not None and not callable(loss_fn):
        raise ArgumentTypeError(f"{name}: loss_fn must be callable or None, got {type(loss_fn).__name__}")
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


def run_with_failover(attempt: Any, failover: Any, stages: list, reset: Any, on_error: Any) -> Any:
    """``attempt()`` (one iteration), re-run from the start while ``failover`` (the delegates' step
    failover on an NCCL PP group, ``delegate/schedule.py``; None: none) says a rank failed and moved its
    traffic to the delegates; ``reset()`` drops what a failed attempt left, ``on_error(exc)`` reports an
    error that is not recovered before it propagates."""
    if failover is not None:
        failover.begin(stages)
    while True:
        result = None
        try:
            result = attempt()
        except Exception as exc:
            if failover is None or not failover.failed(exc):
                on_error(exc)
                raise
        if failover is None or not failover.settle(stages):  # every PP rank votes here
            return result
        reset()
