"""From a job's ``[titan_ext]`` section to runtime objects: schedule keywords and link delays.

No table: a built-in knob names the config keyword it sets in its own field's metadata
(``titan/config.py``: ``sets(...)``), and a registered schedule's own config fields are knobs of the
same name (``config.schedule_knobs``), passed to that schedule's config as they are.
"""

import dataclasses
import inspect
import os
from typing import Any

from titan_ext.titan.config import TitanExt, schedule_knobs, validate_titan_ext

__all__ = ["titan_ext_section", "schedule_config", "schedule_kwargs", "install_link_delays", "delay_spec", "replica_peers"]


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
    """One of the runtime's adaptive schedules (configured by an ``AdaptiveConfig``)?"""
    from titan_ext.runtime import AdaptiveSchedule

    return isinstance(schedule_cls, type) and issubclass(schedule_cls, AdaptiveSchedule)


def supports_delegation(schedule_cls: type) -> bool:
    return is_adaptive(schedule_cls) or "delegation" in _params(schedule_cls)


def _builtin_knobs() -> list[tuple[str, str, Any]]:
    """(knob, config keyword, converter) of every built-in knob that sets a schedule keyword."""
    return [(f.name, f.metadata["sets"], f.metadata.get("convert") or (lambda v: v))
            for f in dataclasses.fields(TitanExt) if "sets" in f.metadata]


def _keywords(section: TitanExt, job_config: Any, accepts: Any) -> dict[str, Any]:
    """The built-in [titan_ext] settings as schedule keywords (those ``accepts(keyword)``; the
    ``policy_settings.*`` ones are read by :func:`schedule_config`)."""
    out: dict[str, Any] = {}
    for knob, kw, convert in _builtin_knobs():
        if not kw.startswith("policy_settings.") and accepts(kw):
            value = convert(getattr(section, knob))
            if value is not None:
                out[kw] = value
    timeout_s = _job_timeout_s(job_config)
    if timeout_s is not None and accepts("delegate_timeout_s"):  # delegate links: the job's timeout
        out["delegate_timeout_s"] = timeout_s
    return out


def schedule_config(schedule_cls: type, job_config: Any) -> Any:
    """The config (the class's own config class, e.g. ``CrossPipeConfig``) of an adaptive schedule
    from the job's ``[titan_ext]`` section: the built-in knobs through the keywords their metadata
    names, the schedule's own knobs (its config's added fields) under their own names."""
    from titan_ext.runtime.control.config import PolicySettings

    section = titan_ext_section(job_config)
    settings = PolicySettings(**{kw.split(".", 1)[1]: convert(getattr(section, knob))
                                 for knob, kw, convert in _builtin_knobs() if kw.startswith("policy_settings.")})
    keywords = _keywords(section, job_config, lambda kw: True)
    config_class = schedule_cls.spec.config_class
    for name, *_ in schedule_knobs(config_class):
        if hasattr(section, name):  # absent: the section was made before the schedule was registered
            keywords[name] = getattr(section, name)
    peers = replica_peers(job_config)
    if peers is not None:
        keywords["peers"] = peers
    return config_class(policy_settings=settings).updated(schedule_cls.__name__, **keywords)


def replica_peers(job_config: Any, world: int | None = None, rank: int | None = None) -> list[int] | None:
    """The PP groups this rank's schedule agrees its plans with (``AdaptiveConfig.peers``) in a DP x PP
    job whose replicas the trainer synchronises (``data_parallel_replicate_degree`` > 1 with PP, no FSDP:
    :mod:`titan_ext.titan.falcon_job`): the ranks at this PP position *of this replica* only.  Falcon's
    micro-batch redistribution (S2) runs a different number of schedule steps in each replica and its
    mitigations act per pipeline, so the replicas' checks cannot be merged step for step; the PP groups of
    one replica (its TP and CP peers) step together.  TorchTitan's mesh is (pp, dp_replicate, dp_shard,
    cp, tp), row-major: a rank's replica is ``(rank % (world / pp)) // (world / pp / dp_replicate)``.
    None (the schedule's own ``"auto"``) in any other job, or before torch.distributed is initialised.
    ``world`` / ``rank``: torch.distributed's (None) or given."""
    import torch.distributed as dist

    par = getattr(job_config, "parallelism", None)
    degree = lambda name: int(getattr(par, name, 1) or 1)  # noqa: E731
    pp, replicas = degree("pipeline_parallel_degree"), degree("data_parallel_replicate_degree")
    if pp <= 1 or replicas <= 1:
        return None
    if world is None or rank is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        world, rank = dist.get_world_size(), dist.get_rank()
    shard = degree("data_parallel_shard_degree")  # -1: the ranks left over (TorchTitan's default)
    if shard < 0:
        shard = world // max(pp * replicas * degree("context_parallel_degree") * degree("tensor_parallel_degree"), 1)
    if shard > 1:  # FSDP (HSDP) synchronises the replicas every step: they step together ("auto")
        return None
    block = world // pp  # ranks of one PP position
    inner = block // replicas  # ranks of one replica at one PP position
    if world % pp or block % replicas:
        return None
    return [r for r in range(world) if r // block == rank // block and (r % block) // inner == (rank % block) // inner]


def schedule_kwargs(schedule_cls: type, job_config: Any) -> dict[str, Any]:
    """Keywords for ``schedule_cls(...)`` from ``[titan_ext]``: ``config=`` for the runtime's adaptive
    schedules (:func:`schedule_config`; delegation is every adaptive schedule's); for any other class,
    the keywords its constructor takes."""
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
