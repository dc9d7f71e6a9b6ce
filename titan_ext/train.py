"""Train with TorchTitan + titan_ext: ``torchrun ... -m titan_ext.train --job.config_file X.toml``.

Same command line as ``torchtitan.train`` (TOML file plus ``--section.key value`` overrides). On top:

* registration of titan_ext's schedules / dataset / CPU shim before anything else;
* the ``[titan_ext]`` section is always available (``job.custom_config_module`` defaults to
  ``titan_ext.titan.config``);
* checks that need more than one section run before any process group is created
  (:func:`check_job_config`), each error names its key;
* titan_ext schedules take TorchTitan's stage split as it is (a PipelineScheduleMulti: two stages per
  rank by default, or ``module_fqns_per_model_part`` / ``pipeline_parallel_layers_per_stage``);
  what needs one stage per rank (delegation) or two (``[titan_ext] placement = "v"``) is checked;
* then TorchTitan's own ``main`` with :class:`titan_ext.titan.trainer.TitanExtTrainer` (seed
  checkpoints and local_tensor mode work as in ``torchtitan.train``). Pipeline metrics, timeline
  images and W&B extras come from the schedule (:mod:`titan_ext.titan.metrics`), also under stock
  ``torchtitan.train``.
"""

import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CUSTOM_CONFIG_MODULE = "titan_ext.titan.config"


class JobConfigError(ValueError):
    """A config value that cannot work; raised before any process group exists."""


def _with_custom_config_module(args: list[str]) -> list[str]:
    """Add ``--job.custom_config_module titan_ext.titan.config`` unless the CLI or TOML sets one."""
    from torchtitan.config import ConfigManager

    toml_values = ConfigManager()._maybe_load_toml(args) or {}
    on_cli = any(a.split("=")[0] in ("--job.custom_config_module", "--job.custom-config-module")
                 for a in args)
    in_toml = isinstance(toml_values.get("job"), dict) and toml_values["job"].get(
        "custom_config_module")
    if on_cli or in_toml:
        return args
    return [*args, "--job.custom_config_module", CUSTOM_CONFIG_MODULE]


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
    from titan_ext.titan.registry import get_schedule_class, is_titan_ext_schedule

    par = config.parallelism
    pp = par.pipeline_parallel_degree
    section = titan_ext_section(config)
    if pp > 1:
        validate_titan_ext(section, num_pp_links=pp - 1)
    else:
        validate_titan_ext(section)
    config.model.hf_assets_path = _resolve_repo_path(config.model.hf_assets_path)
    if config.training.dataset_path:
        config.training.dataset_path = _resolve_repo_path(config.training.dataset_path)
    if not (section.inject_delays.strip() or section.inject_trace.strip()):
        _check_env_straggler(pp)
    from titan_ext.titan.falcon_job import check_emulation

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
    if pp <= 1:
        return
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
    if section.delegation != "off" or section.delegation_failover:
        from titan_ext.titan.options import supports_delegation
        from titan_ext.titan.registry import schedule_class_for

        key = "delegation" if section.delegation != "off" else "delegation_failover"
        value = getattr(section, key)
        if not is_titan_ext_schedule(par.pipeline_parallel_schedule):
            raise JobConfigError(
                f"[titan_ext] {key} = {value!r}: schedule {par.pipeline_parallel_schedule!r} is not "
                f"a titan_ext schedule; delegation needs one (e.g. \"PipeMorph\")")
        try:
            cls = schedule_class_for(par.pipeline_parallel_schedule, config)
        except (ImportError, ValueError) as e:
            raise JobConfigError(f"[titan_ext] {key} = {value!r}: {e}") from None
        if not supports_delegation(cls):
            raise JobConfigError(
                f"[titan_ext] {key} = {value!r}: schedule {par.pipeline_parallel_schedule!r} does "
                f"not support delegation in this build (use delegation = \"off\")")
    if section.backward:
        from titan_ext.titan.registry import schedule_class_for

        cls = schedule_class_for(par.pipeline_parallel_schedule, config) \
            if is_titan_ext_schedule(par.pipeline_parallel_schedule) else None
        choices = getattr(cls, "backward_choices", ())
        if section.backward not in choices:
            raise JobConfigError(
                f"[titan_ext] backward = {section.backward!r}: schedule {par.pipeline_parallel_schedule!r} "
                f"takes " + (", ".join(repr(c) for c in choices) if choices else "no backward option")
                + " (leave it empty for the schedule's default)")
    if is_titan_ext_schedule(par.pipeline_parallel_schedule):
        _check_stage_split(config, pp)
    if not config.experimental.custom_import:
        config.experimental.custom_import = "titan_ext"


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


def _config_error(e: Exception) -> None:
    """One line from rank 0 (the others exit quietly: no process group exists yet), exit 2 everywhere."""
    import tomllib

    what = "malformed TOML" if isinstance(e, tomllib.TOMLDecodeError) else "configuration error"
    if os.environ.get("RANK", "0") == "0":
        print(f"titan_ext: {what}: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
    raise SystemExit(2) from None


def _check_toml_file(argv: list[str]) -> None:
    """The ``--job.config_file`` TOML exists and parses (TorchTitan would log a traceback first):
    raises ValueError (TOMLDecodeError for a syntax error or a duplicate key)."""
    import tomllib

    path = None
    for i, arg in enumerate(argv):  # TorchTitan's rule (ConfigManager._maybe_load_toml)
        key, sep, value = arg.partition("=")
        if key in ("--job.config_file", "--job.config-file"):
            path = value if sep else (argv[i + 1] if i + 1 < len(argv) else None)
            break
    if path is None:
        return
    try:
        with open(path, "rb") as f:
            tomllib.load(f)
    except OSError as e:
        raise ValueError(f"--job.config_file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"--job.config_file {path}: not UTF-8 text (a TOML file)") from None
    except tomllib.TOMLDecodeError as e:
        raise tomllib.TOMLDecodeError(f"{path}: {e}") from None


def _stages_per_rank(config, pp: int) -> int:
    """Stages per PP rank TorchTitan's ``pipeline_llm`` will build for a PipelineScheduleMulti."""
    import math

    par = config.parallelism
    if par.module_fqns_per_model_part is not None:
        return max(1, len(par.module_fqns_per_model_part) // pp)
    if par.pipeline_parallel_layers_per_stage is None:
        return 2
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


def main(args: list[str] | None = None) -> None:
    """``torchtitan.train.main(TitanExtTrainer)`` with the ``[titan_ext]`` section always available.

    The config is parsed and checked once first, so that a bad value, an unknown key or a malformed
    TOML prints one line and exits 2 (before any process group)."""
    import titan_ext

    titan_ext.DEFER_ENV_STRAGGLER = True  # checked below, installed once the process group exists
    import torchtitan.train
    from torchtitan.config import ConfigManager

    from titan_ext.titan import register
    from titan_ext.titan.trainer import TitanExtTrainer

    register()
    try:
        _check_toml_file(list(sys.argv[1:] if args is None else args))
        argv = _with_custom_config_module(list(sys.argv[1:] if args is None else args))
        check_job_config(ConfigManager().parse_args(argv), world_size=_world_size())
    except ValueError as e:  # TitanExtConfigError, JobConfigError, TOMLDecodeError, unknown keys
        _config_error(e)
    sys.argv = [sys.argv[0], *argv]
    torchtitan.train.main(TitanExtTrainer)


def _world_size() -> int | None:
    return int(os.environ.get("WORLD_SIZE", "0")) or None


if __name__ == "__main__":
    main()
