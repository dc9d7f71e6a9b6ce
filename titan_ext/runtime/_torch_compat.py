"""Fail fast, with a clear message, on a torch without the pipelining internals the runtime uses.

The runtime extends private parts of ``torch.distributed.pipelining`` (its action IR, lowering
passes and ``_PipelineScheduleRuntime``), which change between torch releases without notice. They
are tested with the torch range pinned in pyproject.toml (:data:`TESTED`); :func:`check_torch`
names every missing internal instead of letting the first ``from ... import _X`` fail somewhere deep.

Internals are gated by version (:data:`SINCE`): torch 2.15 added explicit waits to the lowered IR
(``WAIT_REDUCE_GRAD`` after each ``REDUCE_GRAD``, ``WAIT_SEND_F`` / ``WAIT_SEND_B`` after each send,
the passes ``_add_wait_send``, ``_add_wait_send_budget`` and ``_validate_send_waits``, FSDP's
start/wait gradient reduction and ``step(finalize_gradients=False)``). On torch >= 2.15 those names
are required too and :func:`has_wait_actions` turns the runtime's handling of them on; on 2.13/2.14
they are neither required nor used.
"""

import functools
import importlib
import inspect

TESTED = ">=2.11,<2.16"  # keep equal to pyproject.toml's torch requirement
#: every torch (major, minor) whose pipelining loop the executor tracks (runtime/execute/executor.py)
TRACKED = ((2, 11), (2, 12), (2, 13), (2, 14), (2, 15))
# torch 2.12 added ``target`` to ``_initialize_stages``, 2.13 ``loss_kwargs`` there and in
# ``_compute_loss`` and a start-up handshake without messages to the same rank (the GPU machines' image
# has torch 2.11): :func:`initialize_stages` and :func:`compute_loss` bridge them
LOSS_KWARGS_SINCE = (2, 13)
WAIT_ACTIONS_SINCE = (2, 15)

_SCHEDULES = "torch.distributed.pipelining.schedules"
_STAGE = "torch.distributed.pipelining.stage"

# module -> private names the runtime (and plan/ir.py, plan/validate.py) use on every tested torch
REQUIRED = {
    _SCHEDULES: (
        "_Action", "_ComputationType", "_PipelineContext", "_PipelineScheduleRuntime",
        "_wait_batch_p2p", "_batch_p2p", "_validate_schedule", "_add_send_recv",
        "_add_reduce_grad", "_add_unshard_reshard", "_simulate_comms_compute",
        "_format_pipeline_order", "_get_profiler_function_name",
        "_PipelineScheduleRuntime._prepare_schedule_with_comms",
        "_PipelineScheduleRuntime._step_microbatches",
    ),
    _STAGE: ("_PipelineStageBase",),
}

#: (major, minor) -> module -> names required from that torch on (the version gate)
SINCE = {
    WAIT_ACTIONS_SINCE: {
        _SCHEDULES: (
            "_ComputationType.WAIT_REDUCE_GRAD", "_ComputationType.WAIT_SEND_F",
            "_ComputationType.WAIT_SEND_B", "_add_wait_send", "_add_wait_send_budget",
            "_validate_send_waits", "_resolve_unshard_lookahead",
            "_PipelineScheduleRuntime._validate_deferred_gradient_reduction",
        ),
        _STAGE: (
            "_PipelineStageBase.release_fwd_send_outputs", "_PipelineStageBase.start_gradient_reduction",
            "_PipelineStageBase.wait_for_gradient_reduction",
        ),
    },
}


def torch_version(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``version`` (default: the installed torch), e.g. "2.15.0+cpu" -> (2, 15)."""
    if version is None:
        import torch

        version = torch.__version__
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def required_internals(version: tuple[int, int] | None = None) -> dict[str, tuple[str, ...]]:
    """module -> names the runtime needs on torch ``version`` (default: the installed one)."""
    version = torch_version() if version is None else version
    needed = {m: list(names) for m, names in REQUIRED.items()}
    for since, modules in SINCE.items():
        if version >= since:
            for module, names in modules.items():
                needed.setdefault(module, []).extend(names)
    return {m: tuple(names) for m, names in needed.items()}


def has_wait_actions(version: tuple[int, int] | None = None) -> bool:
    """True where torch's lowering emits WAIT_REDUCE_GRAD / WAIT_SEND_F / WAIT_SEND_B (torch >= 2.15)."""
    return (torch_version() if version is None else version) >= WAIT_ACTIONS_SINCE


def _has(obj, dotted: str) -> bool:
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def missing_internals(version: tuple[int, int] | None = None) -> list[str]:
    """Fully qualified names of the internals torch ``version`` needs that the installed torch lacks."""
    missing = []
    for module, names in required_internals(version).items():
        try:
            mod = importlib.import_module(module)
        except ImportError:
            missing.append(module)
            continue
        missing += [f"{module}.{name}" for name in names if not _has(mod, name)]
    return missing


def check_torch() -> None:
    """Raise ImportError naming the missing internals (and the tested torch range)."""
    missing = missing_internals()
    if missing:
        import torch

        raise ImportError(
            f"titan_ext.runtime needs torch{TESTED} (tested); torch {torch.__version__} lacks "
            f"{', '.join(missing)}")


def _params(method) -> frozenset:
    """The parameter names of ``method`` (a bound method's function's, cached: the executor asks once
    per forward, and ``inspect.signature`` is not free)."""
    return _function_params(getattr(method, "__func__", method))


@functools.lru_cache(maxsize=None)
def _function_params(fn) -> frozenset:
    params = inspect.signature(fn).parameters
    return frozenset(name for name in params if name != "self")


class _Landed:
    """The work of a message matched in place (its peer is this rank)."""

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - torch's Work API
        return True

    def is_completed(self) -> bool:
        return True


def is_send(op) -> bool:
    """Whether a ``P2POp`` sends (``dist.isend``) rather than receives."""
    return getattr(op.op, "__name__", "") == "isend"


def p2p_peer(op) -> int:
    """The global rank of a ``P2POp``'s peer (torch fills ``peer`` or, given ``group_peer``, not)."""
    import torch.distributed as dist

    return op.peer if op.peer is not None else dist.get_global_rank(op.group, op.group_peer)


def match_self_p2p(p2p_ops: list, rank: int) -> dict:
    """The ops of a batch whose peer is ``rank`` itself, matched in place: each receive takes the next
    send's data, sends before receives, in issue order (the pair's FIFO). Returns {index: work}.
    torch < 2.13's start-up handshake (``_get_init_p2p_neighbors_ops``) sends from every local stage to
    its neighbours, also to one on the same rank (V or loop placements): NCCL allows a send to self,
    gloo (and the ``nccl_rules`` backend over it) refuses it ("Pair is not connected")."""
    import torch

    sent, done = [], {}
    for i, op in enumerate(p2p_ops):
        if p2p_peer(op) == rank and is_send(op):
            sent.append(op.tensor.detach().clone())
            done[i] = _Landed()
    for i, op in enumerate(p2p_ops):
        if p2p_peer(op) == rank and i not in done:
            with torch.no_grad():
                op.tensor.copy_(sent.pop(0))
            done[i] = _Landed()
    return done


def _without_self_p2p(batch_p2p):
    def batch(p2p_ops: list, desc=None) -> list:
        import torch.distributed as dist

        done = match_self_p2p(p2p_ops, dist.get_rank())
        rest = [op for i, op in enumerate(p2p_ops) if i not in done]
        works = iter(batch_p2p(rest, desc) if rest else [])
        return [done[i] if i in done else next(works) for i in range(len(p2p_ops))]

    return batch


def initialize_stages(schedule, args, kwargs, target, loss_kwargs) -> None:
    """``schedule._initialize_stages`` in the installed torch's form: torch >= 2.12 also takes the first
    microbatch's target (backward metadata inferred from the loss), >= 2.13 the loss keywords; 2.11
    infers that metadata at the first backward. Before 2.13 the start-up handshake's messages between
    two stages of one rank are matched in place (:func:`match_self_p2p`)."""
    from torch.distributed.pipelining import schedules

    params = _params(schedule._initialize_stages)
    extra = {name: value for name, value in (("target", target), ("loss_kwargs", loss_kwargs)) if name in params}
    if loss_kwargs and "loss_kwargs" not in extra:
        raise TypeError(f"loss_kwargs needs torch >= 2.13 (installed: {'.'.join(map(str, torch_version()))})")
    if torch_version() >= LOSS_KWARGS_SINCE:
        schedule._initialize_stages(args, kwargs, **extra)
        return
    installed = schedules._batch_p2p
    schedules._batch_p2p = _without_self_p2p(installed)
    try:
        schedule._initialize_stages(args, kwargs, **extra)
    finally:
        schedules._batch_p2p = installed


def with_loss_kwargs(method, *args, loss_kwargs=None):
    """``method(*args, loss_kwargs)`` where the installed torch takes ``loss_kwargs`` (2.13 on: the
    schedules' ``_compute_loss`` / ``_maybe_compute_loss``), else ``method(*args)``; loss keywords on an
    older torch are refused, as torch's own ``step`` there has none."""
    if "loss_kwargs" in _params(method):
        return method(*args, loss_kwargs)
    if loss_kwargs:
        raise TypeError(f"loss_kwargs needs torch >= 2.13 (installed: {'.'.join(map(str, torch_version()))})")
    return method(*args)


def mirrored_loop() -> str:
    """The loop runtime/execute/executor.py mirrors, normalised: torch's
    ``_PipelineScheduleRuntime._step_microbatches`` without docstrings, comments and formatting
    (``ast.unparse``), so that only a change in what the code does shows up in a diff."""
    import ast
    import inspect
    import textwrap

    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    tree = ast.parse(textwrap.dedent(inspect.getsource(_PipelineScheduleRuntime._step_microbatches)))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.unparse(tree) + "\n"


# ------------------------------------------------------------------ torch 2.15's runtime keywords

RUNTIME_KWARGS_SINCE = (2, 15)
#: torch 2.15's ``_PipelineScheduleRuntime`` keywords that shape the lowering -> their defaults there.
#: Our schedules take them too (torch >= 2.15) and honour them in ``runtime/deploy.lower`` -- the
#: lowering torch's ``_prepare_schedule_with_comms`` does -- on every plan they deploy, including the
#: adaptive re-plans: ``max_active_stages`` / ``unshard_lookahead`` place FSDP's UNSHARD/RESHARD
#: (``_add_unshard_reshard``; no effect on stages FSDP does not wrap, as in torch),
#: ``defer_reduce_grad_wait`` moves each WAIT_REDUCE_GRAD past the next stage's compute
#: (``_add_reduce_grad``), ``max_outstanding_sends`` caps the sends a rank has pending
#: (``_add_wait_send_budget``). torch's own ``defer_pp_recv`` is not taken: our executor already
#: waits for a receive just before its consumer (runtime/execute/executor.py, ``_awaited_input``).
RUNTIME_KWARGS = {"max_active_stages": 3, "unshard_lookahead": "full", "defer_reduce_grad_wait": False,
                  "max_outstanding_sends": None}


def check_runtime_kwargs(kwargs: dict, version: tuple[int, int] | None = None) -> dict:
    """``kwargs`` (torch 2.15's runtime keywords given to one of our schedules), checked: an unknown
    name is a TypeError listing the known ones; any of them on torch < 2.15 is a TypeError naming the
    torch it needs (there, torch's lowering has no such option: ignoring it would be silent). Values
    are checked by torch's own constructor and ``_resolve_unshard_lookahead``. Returns ``kwargs``."""
    unknown = sorted(set(kwargs) - set(RUNTIME_KWARGS))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {', '.join(unknown)} (torch's runtime keywords "
                        f"our schedules take: {', '.join(RUNTIME_KWARGS)})")
    version = torch_version() if version is None else version
    if kwargs and version < RUNTIME_KWARGS_SINCE:
        raise TypeError(f"{', '.join(sorted(kwargs))}: torch {'.'.join(map(str, RUNTIME_KWARGS_SINCE))}'s "
                        f"runtime options; torch {version[0]}.{version[1]} has no such lowering option")
    return kwargs


def runtime_kwargs_given(**kwargs) -> dict:
    """The runtime keywords a caller gave (None = not given: torch's default)."""
    return {name: value for name, value in kwargs.items() if value is not None}


def lowering_options(schedule) -> dict:
    """The runtime keywords in force on ``schedule`` (what torch 2.15's constructor stored; the
    defaults on older torch), ``unshard_lookahead`` resolved per rank by torch's
    ``_resolve_unshard_lookahead`` (ValueError on a bad value), for ``runtime/deploy.lower``; empty
    before torch 2.15 (its passes have no such options: torch's defaults)."""
    if torch_version() < RUNTIME_KWARGS_SINCE:
        return {}
    from torch.distributed.pipelining.schedules import _resolve_unshard_lookahead

    options = {name: getattr(schedule, f"_{name}", default) for name, default in RUNTIME_KWARGS.items()}
    options["unshard_lookahead"] = _resolve_unshard_lookahead(
        options["unshard_lookahead"], num_pp_ranks=schedule.pp_group_size,
        max_active_stages=options["max_active_stages"])
    if options["defer_reduce_grad_wait"]:
        schedule._validate_deferred_gradient_reduction()  # torch's: one FSDP comm context per stage
    return options
