"""Register titan_ext's pipeline schedules, dataset and CPU shim with stock TorchTitan (0.2.x or 0.3.x).

How TorchTitan resolves ``pipeline_parallel_schedule``: its pipeline builder
(``torchtitan.distributed.pipeline_parallel``) calls torch's
``torch.distributed.pipelining.schedules.get_schedule_class``, imported into its own module namespace.
That function looks the name up in a dict local to the function, so there is no registry to add to.
:func:`register` therefore rebinds the *name* ``get_schedule_class`` in those modules (torch's
``schedules`` and TorchTitan's builders) to :func:`get_schedule_class` here, which answers our names
(case-insensitive, like torch) and defers every other name to torch's original function. No TorchTitan
file is edited.

It also wraps the schedule builder and the module split (their names and signatures differ per
TorchTitan version: :mod:`titan_ext.titan.adapters`, chosen by the installed version) so that the
schedule is built knowing the job's ``titan_ext`` section (:func:`build_with_titan_ext`): our schedule
classes receive its knobs as their config (titan/options.py), an injected straggler (``inject_delays`` or
``inject_trace``) is installed for whatever schedule is built -- the baselines included --, and the
built schedule is measured (:mod:`titan_ext.titan.metrics`, which also patches TorchTitan's metrics
processor so that any trainer reports the pipeline metrics). An unknown TorchTitan version or a
missing hook raises ``TitanIntegrationError`` here, before any training.

Everything here is idempotent; :func:`register` is called by ``import titan_ext`` whenever torchtitan
is already imported (TorchTitan 0.2's ``[experimental] custom_import = "titan_ext"``), by
``python -m titan_ext.train`` and by the 0.3 config registry (:mod:`titan_ext.titan.config_registry`).
"""

import contextlib
import importlib
import sys
import threading
from collections.abc import Callable
from typing import Any

from titan_ext.titan import adapters

__all__ = [
    "register",
    "register_schedule",
    "registered_schedules",
    "get_schedule_class",
    "resolve_schedule_name",
    "is_titan_ext_schedule",
]

_CONFIGURED: dict[type, type] = {}  # a registered schedule class -> its [titan_ext]-configured subclass
_lock = threading.Lock()
_registered = False
_torch_get_schedule_class: Callable[[str], type] | None = None
_active = threading.local()  # .job_config while build_pipeline_schedule runs


def _runtime_registry() -> Any:
    """The runtime's schedule registry (``runtime/control/registry.py``): the one table of schedule names.
    Imported when a name is first resolved, never by :func:`register` (``import titan_ext`` stays light)."""
    return importlib.import_module("titan_ext.runtime.control.registry")


def register_schedule(spec: Any, schedule_class: type | None = None, **kwargs: Any) -> type:
    """The runtime's :func:`~titan_ext.runtime.control.registry.register_schedule`: register a ``ScheduleSpec``
    so that ``pipeline_parallel_schedule = spec.name`` finds it, its config's own fields become
    ``[titan_ext]`` knobs and ``[titan_ext] delegation`` works (every adaptive schedule has it)."""
    return _runtime_registry().register_schedule(spec, schedule_class, **kwargs)


def registered_schedules() -> list[str]:
    return _runtime_registry().registered_schedules()


def resolve_schedule_name(name: str) -> str | None:
    """Our canonical spelling of ``name`` (case-insensitive), or None if it is not one of ours."""
    return _runtime_registry().resolve_schedule_name(name)


def is_titan_ext_schedule(name: str) -> bool:
    return resolve_schedule_name(name) is not None


def _wants_delegation(job_config: Any) -> bool:
    section = getattr(job_config, "titan_ext", None) if job_config is not None else None
    return section is not None and (getattr(section, "delegation", "off") != "off"
                                    or bool(getattr(section, "delegation_failover", False)))


def _require_delegate_extension() -> None:
    """A job that asks for delegation stops here, with one line, when ``titan_ext._delegate_C`` is
    missing (an install built without torch, or for another torch) -- not later, in a delegate process."""
    from titan_ext.runtime.comm.delegate._ext import missing_reason

    missing = missing_reason()
    if missing is not None:
        raise SystemExit(f"[titan_ext] delegation asked for by the job's titan_ext section: {missing}")


def _configured_class(name: str) -> type:
    """Subclass of our schedule class that takes its knobs (the config, delegation included) from the
    active job's [titan_ext]."""
    base = _runtime_registry().schedule_class(name)
    with _lock:
        if base in _CONFIGURED:
            return _CONFIGURED[base]

    def __init__(self, *args, **kwargs):
        job_config = getattr(_active, "job_config", None)
        if job_config is not None:
            from titan_ext.titan.options import schedule_kwargs

            for k, value in schedule_kwargs(base, job_config).items():
                kwargs.setdefault(k, value)
        base.__init__(self, *args, **kwargs)

    cls = type(base.__name__, (base,), {"__init__": __init__, "__module__": base.__module__,
                                         "__qualname__": base.__qualname__,
                                         "__doc__": base.__doc__})
    with _lock:
        return _CONFIGURED.setdefault(base, cls)


def get_schedule_class(schedule_name: str) -> type:
    """torch's ``get_schedule_class`` plus titan_ext's registered schedules (case-insensitive).

    A titan_ext schedule comes configured by the active job's ``[titan_ext]`` (its config, delegation
    included: every adaptive schedule has it; a job asking for delegation without the compiled
    ``titan_ext._delegate_C`` stops here).
    """
    ours = resolve_schedule_name(schedule_name)
    if ours is not None:
        if _wants_delegation(getattr(_active, "job_config", None)):
            _require_delegate_extension()
        return _configured_class(ours)
    torch_lookup = _torch_get_schedule_class
    if torch_lookup is None:  # register() not called yet: torch's function is still in place
        import torch.distributed.pipelining.schedules as torch_schedules

        torch_lookup = torch_schedules.get_schedule_class
    try:
        return torch_lookup(schedule_name)
    except ValueError as e:
        raise ValueError(f"{e} (titan_ext adds: {registered_schedules()})") from None


def schedule_class_for(schedule_name: str, job_config: Any) -> type:
    """The class ``job_config`` will get for ``schedule_name`` (no process group needed)."""
    with active_job_config(job_config):
        return get_schedule_class(schedule_name)


@contextlib.contextmanager
def active_job_config(job_config: Any):
    """Our schedules built inside this context read their knobs from ``job_config.titan_ext``."""
    previous = getattr(_active, "job_config", None)
    _active.job_config = job_config
    try:
        yield
    finally:
        _active.job_config = previous


def active_config() -> Any:
    """The job config of the schedule being built (``active_job_config``), or None."""
    return getattr(_active, "job_config", None)


def build_with_titan_ext(job_config: Any, stages: list, build: Callable[[], Any]) -> Any:
    """What every TorchTitan version's wrapped schedule builder does: install an injected straggler
    (``[titan_ext] inject_delays`` / ``inject_trace``, any schedule, the baselines included), build with
    the job's ``[titan_ext]`` knobs active, and attach the pipeline metrics to the built schedule."""
    from titan_ext.titan import metrics
    from titan_ext.titan.options import install_link_delays

    install_link_delays(job_config)
    _install_timeouts(job_config)  # after the delay injection: it wraps what the schedules call
    with active_job_config(job_config):
        schedule = build()
    _train_timeout_after_first_step(schedule, job_config)
    metrics.attach(schedule, job_config, stages)  # metrics follow the schedule, any trainer
    return schedule


def _train_timeout_after_first_step(schedule: Any, job_config: Any) -> None:
    """TorchTitan's rule, under any trainer (ours or the stock ``torchtitan.train``): once the first step
    is done, PP waits and titan_ext's groups end after ``comm.train_timeout_seconds``."""
    from titan_ext.runtime.comm import timeouts

    train_s = getattr(getattr(job_config, "comm", None), "train_timeout_seconds", 0)
    if not train_s or train_s <= 0:
        return
    step, switched = schedule.step, []

    def step_then_train_timeout(*args: Any, **kwargs: Any) -> Any:
        out = step(*args, **kwargs)
        if not switched:  # stays wrapped: other wrappers (the metrics') may sit on top of this one
            timeouts.set_timeout(train_s)
            switched.append(True)
        return out

    schedule.step = step_then_train_timeout


def split_schedule_name(pp_schedule: str) -> str:
    """The schedule name TorchTitan's module split is asked with. TorchTitan picks the V-style stage
    indices (rank r holds r and 2R−1−r) only for its own ZBV / DualPipeV classes; for our schedules with
    ``[titan_ext] placement = "v"`` the split is asked for as ZBV's (the name only selects the style
    there), else TorchTitan's looped default."""
    job_config = active_config()
    section = getattr(job_config, "titan_ext", None) if job_config is not None else None
    if is_titan_ext_schedule(pp_schedule) and getattr(section, "placement", "") == "v":
        return "ZBVZeroBubble"
    return pp_schedule


def _install_timeouts(job_config: Any) -> None:
    """PP message waits and titan_ext's groups follow the job's timeouts (TorchTitan's rule:
    ``comm.init_timeout_seconds`` until the first step is done, then ``comm.train_timeout_seconds``,
    :func:`_train_timeout_after_first_step`): without it a frozen peer holds a gloo receive for the
    groups' creation timeout."""
    from titan_ext.runtime.comm import timeouts

    comm = getattr(job_config, "comm", None)
    if comm is not None and getattr(comm, "init_timeout_seconds", 0) > 0:
        timeouts.set_timeout(comm.init_timeout_seconds)
    timeouts.install_p2p_timeout()
    if torch_distributed_ready():
        timeouts.publish_identity()


def torch_distributed_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _wrapped(original: Callable, factory: Callable[[Callable], Callable]) -> Callable:
    if getattr(original, "_titan_ext_wrapped", False):
        return original
    wrapper = factory(original)
    wrapper.__doc__ = original.__doc__
    wrapper._titan_ext_wrapped = True  # type: ignore[attr-defined]
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


def _patch_loaded_builders(adapter: Any) -> None:
    """Rebind ``get_schedule_class`` and wrap the adapter's builder hooks in every loaded builder module."""
    for modname in adapter.BUILDER_MODULES:
        mod = sys.modules.get(modname)
        if mod is None:
            continue
        if hasattr(mod, "get_schedule_class"):
            mod.get_schedule_class = get_schedule_class
        for name, factory in adapter.WRAPPERS.items():
            if hasattr(mod, name):
                setattr(mod, name, _wrapped(getattr(mod, name), factory))


def register(cpu_shim: bool | None = None) -> None:
    """Register schedules, the local dataset and (on CPU-only machines) the CPU/gloo shim.

    ``cpu_shim``: None = apply when torch sees no accelerator; True/False to force.
    Safe to call many times.
    """
    global _registered, _torch_get_schedule_class
    import torch.distributed.pipelining.schedules as torch_schedules

    with _lock:
        if not _registered:
            _torch_get_schedule_class = torch_schedules.get_schedule_class
            torch_schedules.get_schedule_class = get_schedule_class
            vis = sys.modules.get("torch.distributed.pipelining._schedule_visualizer")
            if vis is not None:
                vis.get_schedule_class = get_schedule_class
            _registered = True
    adapter = adapters.current()  # TitanIntegrationError names an unknown version or a missing hook
    for modname in adapter.BUILDER_MODULES[:1]:
        importlib.import_module(modname)
    _patch_loaded_builders(adapter)

    from titan_ext.titan import data, metrics

    data.register_dataset()
    metrics.install()
    if cpu_shim is None:
        cpu_shim = not has_accelerator()
    if cpu_shim:
        importlib.import_module("titan_ext.titan.cpu_shim").apply(adapter.CPU_SHIM_MODULES)


def has_accelerator() -> bool:
    """True if torch sees an accelerator (then TorchTitan's own device handling is used)."""
    from torch._utils import _get_available_device_type

    return _get_available_device_type() is not None
