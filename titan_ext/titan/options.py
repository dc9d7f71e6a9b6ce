"""From a job's ``[titan_ext]`` section to runtime objects: schedule keywords and link delays."""

import inspect
import os
from typing import Any

from titan_ext.titan.config import TitanExt, validate_titan_ext

__all__ = ["titan_ext_section", "schedule_config", "schedule_kwargs", "install_link_delays", "delay_spec"]


_GIB = 1024**3

# [titan_ext] field -> (keyword of the runtime's schedules: a PipeMorphConfig field or one of its
# delegation keywords, converter). A converter returning None means "leave the schedule's default".
_DIRECT: dict[str, tuple[str, Any]] = {
    "memory_budget_gib": ("memory_budget_bytes", lambda v: float(v * _GIB) if v > 0 else None),
    "max_inflight": ("max_inflight", lambda v: int(v) if v > 0 else None),
    "adaptive": ("adaptive", bool),
    "slack_floor": ("slack_floor", int),
    "backward": ("backward", lambda v: v or None),
    "replan_interval": ("profile_every", int),
    "delegation": ("delegation", str),
    "delegation_slow_link_ms": ("slow_link_ms", float),
    "delegation_failover": ("failover", bool),
    "delegation_slot_mib": ("delegate_slot_bytes", lambda v: int(round(v * 2**20)) if v > 0 else None),
    "falcon": ("falcon", bool),
}
# [titan_ext] field -> field of the runtime's PolicySettings (``config.policy_settings``): the layout's
# policy is built from them, so several stages per rank run the multi-stage VirtualReplanPolicy.
_POLICY: dict[str, str] = {
    "profile_window": "window",
    "tolerance_margin": "rel_margin",
    "tolerance_margin_ms": "abs_margin_ms",
    "recover_patience": "recover_patience",
    "min_dwell": "min_dwell",
}


def titan_ext_section(job_config: Any) -> TitanExt:
    """The job's [titan_ext] section, or the defaults when the job has none."""
    section = getattr(job_config, "titan_ext", None)
    return section if section is not None else TitanExt()


def _params(schedule_cls: type) -> dict[str, inspect.Parameter]:
    """Keyword parameters of the constructor, following ``**kwargs`` up the class hierarchy."""
    out: dict[str, inspect.Parameter] = {}
    for klass in schedule_cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            params = inspect.signature(init).parameters
        except (TypeError, ValueError):
            break
        for name, p in params.items():
            if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL):
                out.setdefault(name, p)
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            break
    return out


def is_adaptive(schedule_cls: type) -> bool:
    """One of the runtime's adaptive schedules (configured by a ``PipeMorphConfig``)?"""
    from titan_ext.runtime import PipeMorph

    return isinstance(schedule_cls, type) and issubclass(schedule_cls, PipeMorph)


def supports_delegation(schedule_cls: type) -> bool:
    return is_adaptive(schedule_cls) or "delegation" in _params(schedule_cls)


def _keywords(section: TitanExt, job_config: Any, accepts: Any) -> dict[str, Any]:
    """The [titan_ext] settings as schedule keywords (those ``accepts(keyword)``)."""
    out: dict[str, Any] = {}
    for knob, (kw, convert) in _DIRECT.items():
        if accepts(kw):
            value = convert(getattr(section, knob))
            if value is not None:
                out[kw] = value
    timeout_s = _job_timeout_s(job_config)
    if timeout_s is not None and accepts("delegate_timeout_s"):  # delegate links: the job's timeout
        out["delegate_timeout_s"] = timeout_s
    return out


def schedule_config(schedule_cls: type, job_config: Any) -> Any:
    """The ``PipeMorphConfig`` (the class's own config class, e.g. ``CrossPipeConfig``) of an adaptive
    schedule from the job's ``[titan_ext]`` section."""
    from titan_ext.runtime.config import PolicySettings

    section = titan_ext_section(job_config)
    settings = PolicySettings(**{field: getattr(section, knob) for knob, field in _POLICY.items()})
    keywords = _keywords(section, job_config, lambda kw: True)
    return schedule_cls.spec.config_class(policy_settings=settings).updated(schedule_cls.__name__, **keywords)


def schedule_kwargs(schedule_cls: type, job_config: Any) -> dict[str, Any]:
    """Keywords for ``schedule_cls(...)`` from ``[titan_ext]``: ``config=`` for the runtime's adaptive
    schedules (:func:`schedule_config`); for any other class, the keywords its constructor takes."""
    if is_adaptive(schedule_cls):
        return {"config": schedule_config(schedule_cls, job_config)}
    section = titan_ext_section(job_config)
    params = _params(schedule_cls)
    out = _keywords(section, job_config, lambda kw: kw in params)
    if section.delegation != "off" and "delegation" not in params:
        raise ValueError(f"[titan_ext] delegation = {section.delegation!r}: schedule "
                         f"{schedule_cls.__name__} does not support delegation in this build")
    return out


def _job_timeout_s(job_config: Any) -> float | None:
    """TorchTitan's ``comm.train_timeout_seconds`` (the collectives' timeout after initialisation)."""
    value = getattr(getattr(job_config, "comm", None), "train_timeout_seconds", None)
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def delay_spec(job_config: Any) -> str:
    """The injected-straggler spec of the job ("" = none), in the runtime's grammar."""
    section = titan_ext_section(job_config)
    if section.inject_delays.strip():
        return section.inject_delays.strip()
    if section.inject_trace.strip():
        return "trace:" + section.inject_trace.strip()
    return ""


def install_link_delays(job_config: Any) -> bool:
    """Install ``[titan_ext] inject_delays`` / ``inject_trace`` on the PP links (any schedule).

    Without either, the environment variable ``TITAN_EXT_INJECT_DELAYS`` is honoured (the config
    wins when both are given).

    Called by the wrapped ``build_pipeline_schedule`` once the process group exists.
    Returns True if delays were installed.
    """
    spec = delay_spec(job_config)
    if not spec:
        if os.environ.get("TITAN_EXT_INJECT_DELAYS", "").strip():
            # the runtime's env-var path, for every schedule (torch's built-ins never import it)
            from titan_ext.runtime import install_from_env

            install_from_env()  # warns (start + periodic), naming the variable
            return True
        return False
    pp = getattr(getattr(job_config, "parallelism", None), "pipeline_parallel_degree", None)
    if pp and pp > 1:
        validate_titan_ext(titan_ext_section(job_config), num_pp_links=pp - 1)
    import time

    import torch.distributed as dist

    from titan_ext.runtime import inject_link_delays

    # one time origin for every rank (a trace's time_s axis), taken from rank 0
    origin = [time.time()]
    if dist.is_initialized():
        dist.broadcast_object_list(origin, src=0)
    section = titan_ext_section(job_config)
    key = "inject_delays" if section.inject_delays.strip() else "inject_trace"
    inject_link_delays(spec, t0=origin[0], origin=f"[titan_ext] {key}")  # warns (start + periodic)
    return True
