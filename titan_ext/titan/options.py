"""From a job's ``[titan_ext]`` section to runtime objects: schedule keywords and link delays."""

import inspect
import logging
from typing import Any

from titan_ext.titan.config import TitanExt, validate_titan_ext

__all__ = ["titan_ext_section", "schedule_kwargs", "install_link_delays", "delay_spec"]

log = logging.getLogger(__name__)

# [titan_ext] field -> candidate constructor keyword names of the runtime's schedule classes
# (first match wins). Converters turn the TOML unit into the runtime's.
_GIB = 1024**3
_KWARG_MAP: dict[str, tuple[tuple[str, Any], ...]] = {
    "memory_budget_gib": (
        ("memory_budget_bytes", lambda v: int(v * _GIB) if v > 0 else None),
        ("memory_budget_gib", lambda v: v if v > 0 else None),
    ),
    "extra_inflight": (("extra_inflight", None),),
    "planner": (("planner", None), ("mode", None), ("planner_mode", None)),
    "slack_floor": (("slack_floor", None),),
    "replan_interval": (("replan_interval", None), ("replan_every", None)),
    "profile_window": (("profile_window", None), ("window", None)),
    "warmup_iterations": (("warmup_iterations", None), ("profile_warmup", None)),
    "delay_change_threshold": (("delay_change_threshold", None), ("min_change", None)),
    "change_point_threshold": (("change_point_threshold", None), ("cp_threshold", None)),
    "hysteresis_iterations": (("hysteresis_iterations", None), ("hysteresis", None)),
    "delegation": (("delegation", None), ("delegation_mode", None)),
}


def titan_ext_section(job_config: Any) -> TitanExt:
    """The job's [titan_ext] section, or the defaults when the job has none."""
    section = getattr(job_config, "titan_ext", None)
    return section if section is not None else TitanExt()


def schedule_kwargs(schedule_cls: type, job_config: Any) -> dict[str, Any]:
    """Keywords for ``schedule_cls(...)`` taken from ``[titan_ext]``, by its constructor signature.

    Only keywords the constructor accepts are passed; a knob the class cannot take is logged once.
    """
    section = titan_ext_section(job_config)
    try:
        params = inspect.signature(schedule_cls.__init__).parameters
    except (TypeError, ValueError):
        return {}
    accepts_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    out: dict[str, Any] = {}
    unused = []
    for knob, candidates in _KWARG_MAP.items():
        for kw, convert in candidates:
            if kw in params:
                value = getattr(section, knob)
                value = convert(value) if convert else value
                if value is not None:
                    out[kw] = value
                break
        else:
            if not accepts_var_kw:
                unused.append(knob)
    if unused:
        log.info("[titan_ext] %s does not take: %s", schedule_cls.__name__, ", ".join(unused))
    return out


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

    Called by the wrapped ``build_pipeline_schedule`` once the process group exists.
    Returns True if delays were installed.
    """
    spec = delay_spec(job_config)
    if not spec:
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
    inject_link_delays(spec, t0=origin[0])
    log.info("[titan_ext] injected link delays: %s", spec)
    return True
