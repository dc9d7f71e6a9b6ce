"""Checks of a job's config that need more than one section, run before any process group exists
(by ``titan_ext.train`` and by :class:`~titan_ext.titan.trainer.TitanExtTrainer`); each error names its key.

A module of its own so that the trainer (which ``titan_ext.train`` runs) does not import its own entry
point (no import cycles).
"""

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
#: how the configs for real model sizes spell a path the user must set (refused, naming the key)
PLACEHOLDER_PREFIX = "/path/to/"

__all__ = ["JobConfigError", "check_job_config", "world_size"]


class JobConfigError(ValueError):
    """A config value that cannot work; raised before any process group exists."""


def _resolve_repo_path(value: str) -> str:
    """A relative asset path that is missing from the cwd but present in the repo: make absolute."""
    if not value or os.path.isabs(value) or os.path.exists(value):
        return value
    candidate = REPO_ROOT / value
    return str(candidate) if candidate.exists() else value


def check_job_config(config, world_size: int | None = None) -> None:
    """Cross-section checks; fills defaults titan_ext schedules need. Raises JobConfigError."""
    from titan_ext.titan.config import validate_titan_ext
    from titan_ext.titan.options import titan_ext_section
    from titan_ext.titan.registry import is_titan_ext_schedule

    par = config.parallelism
    pp = par.pipeline_parallel_degree
    section = titan_ext_section(config)
    if pp > 1:
        validate_titan_ext(section, num_pp_links=pp - 1)
    else:
        validate_titan_ext(section)
    _resolve_asset_paths(config)
    if not (section.inject_delays.strip() or section.inject_trace.strip()):
        _check_env_straggler(pp)
    _check_emulation_and_world(section, par, world_size)
    if pp <= 1:
        return
    _check_schedule_and_microbatches(config, section, pp)
    if section.delegation != "off" or section.delegation_failover:
        _check_delegation(config, section)
    if section.backward:
        _check_backward(config, section)
    if is_titan_ext_schedule(par.pipeline_parallel_schedule):
        _check_stage_split(config, pp)
    experimental = getattr(config, "experimental", None)  # TorchTitan 0.2 (TOML) only
    if experimental is not None and not experimental.custom_import:
        experimental.custom_import = "titan_ext"


def _check_emulation_and_world(section, par, world_size: int | None) -> None:
    """The emulated faults fit the mesh; the PP degree divides the world."""
    from titan_ext.titan.falcon.emulate import check_emulation

    pp = par.pipeline_parallel_degree
    try:
        check_emulation(section, pp, par.data_parallel_replicate_degree, par.data_parallel_shard_degree,
                        world_size)
    except ValueError as e:
        raise JobConfigError(str(e)) from None
    if world_size is not None and pp > 1 and world_size % pp != 0:
        raise JobConfigError(
            f"[parallelism] pipeline_parallel_degree = {pp} does not divide the world size "
            f"{world_size} (torchrun --nproc_per_node x --nnodes)"
        )


def _check_schedule_and_microbatches(config, section, pp: int) -> None:
    """A known schedule, micro-batches that divide the local batch (at least one per stage for
    ours), and an in-flight cap PipeMorph Alg.1 can keep."""
    from titan_ext.titan.registry import get_schedule_class, is_titan_ext_schedule

    par = config.parallelism
    try:
        get_schedule_class(par.pipeline_parallel_schedule)
    except ValueError as e:
        raise JobConfigError(f"[parallelism] pipeline_parallel_schedule = "
                             f"{par.pipeline_parallel_schedule!r}: {e}") from None
    mb = par.pipeline_parallel_microbatch_size
    if mb <= 0 or config.training.local_batch_size % mb != 0:
        raise JobConfigError(
            f"[parallelism] pipeline_parallel_microbatch_size = {mb} must divide "
            f"[training] local_batch_size = {config.training.local_batch_size}"
        )
    n_microbatches = config.training.local_batch_size // mb
    if is_titan_ext_schedule(par.pipeline_parallel_schedule) and n_microbatches < pp:
        raise JobConfigError(
            f"[training] local_batch_size = {config.training.local_batch_size} / [parallelism] "
            f"pipeline_parallel_microbatch_size = {mb} gives {n_microbatches} microbatches, fewer "
            f"than the {pp} pipeline stages ({par.pipeline_parallel_schedule} needs >= {pp})")
    if 0 < section.max_inflight < pp:
        raise JobConfigError(
            f"[titan_ext] max_inflight = {section.max_inflight}: stage 0 must hold at least one "
            f"microbatch per stage (PipeMorph Alg.1: x_0 >= S = {pp}); use >= {pp} or 0")


def _check_delegation(config, section) -> None:
    """Delegation (or its failover) asks for a titan_ext schedule that supports it."""
    from titan_ext.titan.options import supports_delegation
    from titan_ext.titan.registry import is_titan_ext_schedule, schedule_class_for

    name = config.parallelism.pipeline_parallel_schedule
    key = "delegation" if section.delegation != "off" else "delegation_failover"
    value = getattr(section, key)
    if not is_titan_ext_schedule(name):
        raise JobConfigError(
            f"[titan_ext] {key} = {value!r}: schedule {name!r} is not "
            f"a titan_ext schedule; delegation needs one (e.g. \"PipeMorph\")")
    try:
        cls = schedule_class_for(name, config)
    except (ImportError, ValueError) as e:
        raise JobConfigError(f"[titan_ext] {key} = {value!r}: {e}") from None
    if not supports_delegation(cls):
        raise JobConfigError(
            f"[titan_ext] {key} = {value!r}: schedule {name!r} does "
            f"not support delegation in this build (use delegation = \"off\")")
    from titan_ext.runtime.delegate._ext import missing_reason

    missing = missing_reason()
    if missing is not None:
        raise JobConfigError(f"[titan_ext] {key} = {value!r}: {missing}")


def _check_backward(config, section) -> None:
    """``backward`` is one of the schedule's own choices."""
    from titan_ext.titan.registry import is_titan_ext_schedule, schedule_class_for

    name = config.parallelism.pipeline_parallel_schedule
    cls = schedule_class_for(name, config) if is_titan_ext_schedule(name) else None
    choices = getattr(cls, "backward_choices", ())
    if section.backward not in choices:
        raise JobConfigError(
            f"[titan_ext] backward = {section.backward!r}: schedule {name!r} "
            f"takes " + (", ".join(repr(c) for c in choices) if choices else "no backward option")
            + " (leave it empty for the schedule's default)")


def _resolve_asset_paths(config) -> None:
    """Relative tokenizer / dataset paths missing from the cwd but present in the repo: made absolute
    (0.2 keeps them in ``[model]`` / ``[training]``, 0.3 on the config itself)."""
    model = getattr(config, "model", None)
    if hasattr(model, "hf_assets_path"):  # TorchTitan 0.2
        model.hf_assets_path = _resolve_repo_path(model.hf_assets_path)
        if config.training.dataset_path:
            config.training.dataset_path = _resolve_repo_path(config.training.dataset_path)
    elif hasattr(config, "hf_assets_path"):  # TorchTitan 0.3
        config.hf_assets_path = _resolve_repo_path(config.hf_assets_path)
    key = "[model] hf_assets_path" if hasattr(model, "hf_assets_path") else "hf_assets_path"
    path = model.hf_assets_path if hasattr(model, "hf_assets_path") else getattr(config, "hf_assets_path", "")
    if path and path.startswith(PLACEHOLDER_PREFIX):
        raise JobConfigError(
            f"{key} = {path!r} is a placeholder: download the model's tokenizer (TorchTitan's "
            f"`python scripts/download_hf_assets.py --repo_id meta-llama/{Path(path).name} --assets tokenizer`) "
            f"and set {key} to its directory (0.3: --hf_assets_path DIR)")


def _check_env_straggler(pp: int) -> None:
    """TITAN_EXT_INJECT_DELAYS (and _T0) well-formed and naming existing links; the runtime installs
    it once the process group exists (``options.install_link_delays``)."""
    from titan_ext.runtime.delay_injection import ENV_VAR, DelaySpecError, schedule_from_env

    try:
        parsed = schedule_from_env()
    except DelaySpecError as e:
        raise JobConfigError(str(e)) from None
    if parsed is not None and pp > 1 and parsed[0].max_link() >= pp - 1:
        raise JobConfigError(f"{ENV_VAR} = {parsed[0].source!r}: link {parsed[0].max_link()} "
                             f"does not exist with {pp} pipeline stages (links 0..{pp - 2})")


def _stages_per_rank(config, pp: int) -> int:
    """Stages per PP rank TorchTitan's ``pipeline_llm`` will build for a PipelineScheduleMulti."""
    import math

    par = config.parallelism
    if par.module_fqns_per_model_part is not None:
        return max(1, len(par.module_fqns_per_model_part) // pp)
    if par.pipeline_parallel_layers_per_stage is None:
        return 2
    if getattr(config, "model_spec", None) is not None:  # TorchTitan 0.3
        n_layers = len(config.model_spec.model.layers)
    else:
        from torchtitan.protocols.train_spec import get_train_spec

        n_layers = get_train_spec(config.model.name).model_args[config.model.flavor].n_layers
    units = n_layers + par.pipeline_parallel_first_stage_less_layers + par.pipeline_parallel_last_stage_less_layers
    return max(1, math.ceil(units / par.pipeline_parallel_layers_per_stage) // pp)


def _check_stage_split(config, pp: int) -> None:
    """Delegation runs one stage per rank; ``placement = "v"`` two (TorchTitan's V-style split)."""
    from titan_ext.titan.options import titan_ext_section

    section, par = titan_ext_section(config), config.parallelism
    v = _stages_per_rank(config, pp)
    if v > 1 and (section.delegation != "off" or section.delegation_failover):
        raise JobConfigError(
            f"[titan_ext] delegation = {section.delegation!r}: delegation runs one stage per PP rank, but "
            f"{par.pipeline_parallel_schedule} gets {v} stages per rank here; set "
            f"module_fqns_per_model_part with {pp} parts")
    if section.placement == "v" and v != 2:
        raise JobConfigError(f"[titan_ext] placement = 'v' needs two stages per PP rank, got {v}")


def world_size() -> int | None:
    return int(os.environ.get("WORLD_SIZE", "0")) or None
