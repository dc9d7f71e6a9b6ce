"""Checks of a job's config that need more than one section, run before any process group exists
(by ``titan_ext.train`` and by :class:`~titan_ext.titan.trainer.TitanExtTrainer`); each error names its key.

A module of its own so that the trainer (which ``titan_ext.train`` runs) does not import its own entry
point (no import cycles).
"""

import importlib
import math
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
#: how the configs for real model sizes spell a path the user must set (refused, naming the key)
PLACEHOLDER_PREFIX = "/path/to/"

#: a TOML config larger than this is refused (read before the job starts; ``/dev/zero`` reads forever)
MAX_CONFIG_BYTES = 4 << 20
#: tokenizer files TorchTitan's HuggingFaceTokenizer loads (one must be in ``hf_assets_path``)
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt")

__all__ = ["JobConfigError", "check_job_config", "world_size", "check_config_file", "config_file_arg",
           "check_ascii_numbers", "check_paths", "check_env", "check_launcher_env"]


class JobConfigError(ValueError):
    """A config value that cannot work; raised before any process group exists."""


def _resolve_repo_path(value: str) -> str:
    """A relative asset path that is missing from the cwd but present in the repo: make absolute."""
    if not value or os.path.isabs(value) or os.path.exists(value):
        return value
    candidate = REPO_ROOT / value
    return str(candidate) if candidate.exists() else value


def check_job_config(config, world_size: int | None = None, assets: bool = True) -> None:
    """Cross-section checks; fills defaults titan_ext schedules need. Raises JobConfigError.
    ``assets=False``: the tokenizer and dataset paths are not checked (the dry run reads neither)."""
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
    _resolve_asset_paths(config, refuse_placeholder=assets)
    check_env(pp, config_delays=bool(section.inject_delays.strip() or section.inject_trace.strip()),
              config_emulation=(section.emulate_slow_device.strip(), section.emulate_slow_link.strip()))
    _check_emulation_and_world(section, par, world_size)
    check_paths(config, section, assets=assets)
    _check_against_timeout(config, section)
    check_wandb_available(config)
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


def check_wandb_available(config) -> None:
    """``[metrics] enable_wandb`` needs wandb, an optional package: refused before any process group exists
    (TorchTitan itself would log an error and train on without W&B)."""
    if not getattr(getattr(config, "metrics", None), "enable_wandb", False):
        return
    try:
        importlib.import_module("wandb")
    except ImportError as e:
        from titan_ext.titan.wandb_offline import WANDB_INSTALL_HINT

        raise JobConfigError(f"[metrics] enable_wandb = true needs wandb, which cannot be imported ({e}): "
                             f"{WANDB_INSTALL_HINT}") from None


def _check_emulation_and_world(section, par, world_size: int | None) -> None:
    """The emulated faults fit the mesh; the PP degree divides the world."""
    from titan_ext.titan.falcon_emulate import check_emulation

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
    if is_titan_ext_schedule(par.pipeline_parallel_schedule) and section.slack_floor > 2 \
            and 1 + (pp - 1) * section.slack_floor > n_microbatches:
        most = max(2, (n_microbatches - 1) // (pp - 1))
        raise JobConfigError(
            f"[titan_ext] slack_floor = {section.slack_floor}: that slackness on each of the {pp - 1} links "
            f"needs 1 + {pp - 1} x {section.slack_floor} = {1 + (pp - 1) * section.slack_floor} microbatches "
            f"in flight, the step has {n_microbatches} (use <= {most})")
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
    from titan_ext.runtime.comm.delegate._ext import missing_reason

    missing = missing_reason()
    if missing is not None:
        raise JobConfigError(f"[titan_ext] {key} = {value!r}: {missing}")
    _check_slot_size(config, section)


def _check_slot_size(config, section) -> None:
    """A set ``delegation_slot_mib`` holds one inter-stage message (else the first delegated send fails,
    after the delegates' start-up): at least microbatch x seq_len x dim x 2 bytes (bf16; fp32 is twice)."""
    if section.delegation_slot_mib <= 0:
        return
    try:
        dim = _model_args(config).dim
        tokens = config.parallelism.pipeline_parallel_microbatch_size * config.training.seq_len
    except Exception:  # noqa: BLE001 - a model without `dim` (or unknown): the runtime's own check, later
        return
    need = tokens * dim * 2
    if section.delegation_slot_mib * 2**20 < need:
        raise JobConfigError(
            f"[titan_ext] delegation_slot_mib = {section.delegation_slot_mib!r}: a slot must hold one inter-stage "
            f"activation, at least {need / 2**20:.3g} MiB here (microbatch {tokens // config.training.seq_len} x "
            f"seq_len {config.training.seq_len} x dim {dim} x 2 bytes); set it to 0 (derived from the messages) "
            f"or at least {need / 2**20:.3g}")


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


def _resolve_asset_paths(config, refuse_placeholder: bool = True) -> None:
    """Relative tokenizer / dataset paths missing from the cwd but present in the repo: made absolute
    (0.2 keeps them in ``[model]`` / ``[training]``, 0.3 on the config itself); a placeholder tokenizer
    path refused unless ``refuse_placeholder`` is False."""
    model = getattr(config, "model", None)
    if hasattr(model, "hf_assets_path"):  # TorchTitan 0.2
        model.hf_assets_path = _resolve_repo_path(model.hf_assets_path)
        if config.training.dataset_path:
            config.training.dataset_path = _resolve_repo_path(config.training.dataset_path)
    elif hasattr(config, "hf_assets_path"):  # TorchTitan 0.3
        config.hf_assets_path = _resolve_repo_path(config.hf_assets_path)
    key = "[model] hf_assets_path" if hasattr(model, "hf_assets_path") else "hf_assets_path"
    path = model.hf_assets_path if hasattr(model, "hf_assets_path") else getattr(config, "hf_assets_path", "")
    if refuse_placeholder and path and path.startswith(PLACEHOLDER_PREFIX):
        raise JobConfigError(
            f"{key} = {path!r} is a placeholder: download the model's tokenizer (TorchTitan's "
            f"`python scripts/download_hf_assets.py --repo_id meta-llama/{Path(path).name} --assets tokenizer`) "
            f"and set {key} to its directory (0.3: --hf_assets_path DIR)")


def check_env(pp: int, config_delays: bool = False, config_emulation: tuple[str, str] = ("", "")) -> None:
    """The environment variables the job reads, well-formed whichever source wins (a config value
    overrides them, but garbage there is still an error): ``TITAN_EXT_INJECT_DELAYS`` (and ``_T0``;
    its links must exist when it is the one used: the runtime installs it once the process group
    exists, ``options.install_link_delays``), ``TITAN_EXT_SLOW_DEVICE``, ``TITAN_EXT_SLOW_LINK``."""
    from titan_ext.runtime.emulate.delay_injection import ENV_VAR, DelaySpecError, schedule_from_env
    from titan_ext.runtime.falcon.emulation import EmulationSpecError, parse_slow_device, parse_slow_link

    try:
        parsed = schedule_from_env()
    except DelaySpecError as e:
        raise JobConfigError(str(e)) from None
    if parsed is not None and not config_delays and pp > 1 and parsed[0].max_link() >= pp - 1:
        raise JobConfigError(f"{ENV_VAR} = {parsed[0].source!r}: link {parsed[0].max_link()} "
                             f"does not exist with {pp} pipeline stages (links 0..{pp - 2})")
    from titan_ext.titan.falcon_s4 import resume_plan_from_env

    try:
        resume_plan_from_env()
    except ValueError as e:
        raise JobConfigError(str(e)) from None
    for var, parse in (("TITAN_EXT_SLOW_DEVICE", parse_slow_device), ("TITAN_EXT_SLOW_LINK", parse_slow_link)):
        value = os.environ.get(var, "")
        try:
            parse(value)
        except EmulationSpecError as e:
            raise JobConfigError(f"{var} = {value!r}: {e}") from None


# --- the files the job reads and writes ------------------------------------------------------------

def config_file_arg(argv: list[str]) -> str | None:
    """The ``--job.config_file`` of a command line (TorchTitan's rule, ConfigManager._maybe_load_toml)."""
    for i, arg in enumerate(argv):
        key, sep, value = arg.partition("=")
        if key in ("--job.config_file", "--job.config-file"):
            return value if sep else (argv[i + 1] if i + 1 < len(argv) else None)
    return None


def check_config_file(path: str) -> dict:
    """The TOML config: a regular file of at most :data:`MAX_CONFIG_BYTES`, UTF-8, valid TOML whose top
    level holds tables only (TorchTitan's sections: ``[[titan_ext]]`` or ``titan_ext = 5`` are refused).
    Returns the parsed document. Raises ValueError (``tomllib.TOMLDecodeError`` for a syntax error)."""
    import tomllib

    from titan_ext.args import read_input_text

    text = read_input_text(path, MAX_CONFIG_BYTES, f"--job.config_file {path}", "TOML", JobConfigError)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise tomllib.TOMLDecodeError(f"{path}: {e}") from None
    for key, value in doc.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            raise JobConfigError(f"{path}: [[{key}]] is an array of tables; write one [{key}] section")
        if not isinstance(value, dict):
            raise JobConfigError(f"{path}: top-level {key} = {value!r}: every top-level key is a section; "
                                 f"write [{key}] and its keys below it")
    return doc


def check_ascii_numbers(argv: list[str]) -> None:
    """No command-line value is a number in non-ASCII digits (``int('٣')`` is 3 for Python, and for
    TorchTitan's parser): JobConfigError naming the option."""
    key = None
    for arg in argv:
        if arg.startswith("--"):
            key, sep, value = arg.partition("=")
            if not sep:
                continue
        else:
            value = arg
        if value.isascii():
            continue
        text = value.strip().replace("_", "")
        try:
            float(text)
        except ValueError:
            if not any(c.isdigit() for c in text) or any(c.isalpha() for c in text):
                continue  # a path or a name with non-ASCII letters: not a number
        raise JobConfigError(f"{key or 'argument'} {value!r}: write numbers with ASCII digits (0-9)")


def _exists(path: Path) -> bool:
    try:
        path.lstat()
        return True
    except OSError:
        return False


def _writable_dir(path: Path, key: str) -> None:
    """``path`` is a writable directory, or can be created: its nearest existing ancestor is one."""
    probe = path
    while not _exists(probe):
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        where = "" if probe == path else f"cannot be created: {probe} "
        raise JobConfigError(f"{key} = {str(path)!r}: {where}is a file, not a directory")
    if not probe.exists():  # a dangling symlink on the way
        raise JobConfigError(f"{key} = {str(path)!r}: {probe} is a broken (dangling or looping) symbolic link")
    if not os.access(probe, os.W_OK | os.X_OK) or os.statvfs(probe).f_flag & os.ST_RDONLY:
        where = "is not writable" if probe == path else f"cannot be created: {probe} is not writable"
        raise JobConfigError(f"{key} = {str(path)!r}: {where}")


def _writable_file(path: Path, key: str) -> None:
    """A file the job appends to: absent, or a writable regular file."""
    if not _exists(path):
        return
    if path.is_dir():
        raise JobConfigError(f"{key}: {str(path)!r} is a directory, not a file")
    if not path.is_file():
        raise JobConfigError(f"{key}: {str(path)!r} is not a regular file")
    if not os.access(path, os.W_OK):
        raise JobConfigError(f"{key}: {str(path)!r} is not writable")


def check_paths(config, section=None, assets: bool = True) -> None:
    """Every path the job touches, before any process group: the dump folder and what is written under
    it (the metrics file, timelines, checkpoints, TensorBoard), the tokenizer (``hf_assets_path``:
    a directory with a tokenizer file) and the dataset path exist with the right type, writable where
    written; ``inject_trace`` is checked by the section itself (a regular CSV file, size-capped)."""
    from titan_ext.titan.options import titan_ext_section

    section = section if section is not None else titan_ext_section(config)
    job = getattr(config, "job", None)
    dump = getattr(job, "dump_folder", None) if job is not None else getattr(config, "dump_folder", None)
    if isinstance(dump, str) and dump:
        key = "[job] dump_folder" if job is not None else "dump_folder"
        dump_path = Path(dump)
        _writable_dir(dump_path, key)
        if section.metrics_file.strip():
            key = f"[titan_ext] metrics_file = {section.metrics_file!r}"
            taken = _names_the_job_writes(config)
            if section.metrics_file.strip() in taken:
                raise JobConfigError(f"{key}: the job writes {taken[section.metrics_file.strip()]} under that "
                                     f"name in the dump folder; choose another file name")
            _writable_file(dump_path / section.metrics_file, key)
        if section.gantt_every > 0 and _exists(dump_path / "timelines"):
            _writable_dir(dump_path / "timelines", "[titan_ext] gantt_every (timelines under the dump folder)")
        ckpt = getattr(config, "checkpoint", None)
        if getattr(ckpt, "enable", False) and isinstance(getattr(ckpt, "folder", None), str):
            _writable_dir(dump_path / ckpt.folder, "[checkpoint] folder")
        metrics = getattr(config, "metrics", None)
        if getattr(metrics, "enable_tensorboard", False) and isinstance(getattr(metrics, "save_tb_folder", None), str):
            _writable_dir(dump_path / metrics.save_tb_folder, "[metrics] save_tb_folder")
    if assets:
        _check_assets(config)


def _names_the_job_writes(config) -> dict[str, str]:
    """What the job itself creates directly in its dump folder: name -> what it is."""
    from titan_ext.runtime.falcon.restart import S4_PLAN_FILE, _PLAN_FILE
    from titan_ext.runtime.falcon.files import FALCON_EVENTS, FALCON_LOG

    names = {"timelines": "its timeline traces and images (a folder)", FALCON_LOG: "Falcon's decisions",
             FALCON_EVENTS: "Falcon's events", S4_PLAN_FILE: "the S4 relaunch plan",
             _PLAN_FILE: "Falcon's restart plan"}
    for section, field, what in (("checkpoint", "folder", "its checkpoints (a folder)"),
                                 ("metrics", "save_tb_folder", "TensorBoard's logs (a folder)"),
                                 ("profiling", "save_traces_folder", "the profiler's traces (a folder)"),
                                 ("profiling", "save_memory_snapshot_folder", "memory snapshots (a folder)"),
                                 ("comm", "save_traces_folder", "the flight recorder's traces (a folder)")):
        value = getattr(getattr(config, section, None), field, None)
        if isinstance(value, str) and value.strip() and "/" not in value.strip():
            names[value.strip()] = what
    return names


def _check_assets(config) -> None:
    model = getattr(config, "model", None)
    if hasattr(model, "hf_assets_path"):  # TorchTitan 0.2
        key, path = "[model] hf_assets_path", model.hf_assets_path
        training = getattr(config, "training", None)
        dataset_path = getattr(training, "dataset_path", None)
        if dataset_path and not _exists(Path(dataset_path)):
            raise JobConfigError(f"[training] dataset_path = {dataset_path!r}: no such file or directory")
        needs_tokenizer = _builds_tokenizer(model)
    elif hasattr(config, "hf_assets_path"):  # TorchTitan 0.3
        key, path, needs_tokenizer = "hf_assets_path", config.hf_assets_path, False
    else:
        return
    if not path:
        if needs_tokenizer:
            raise JobConfigError(f"{key} is empty: the model's tokenizer is loaded from it (a directory "
                                 f"with one of {', '.join(TOKENIZER_FILES)})")
        return
    p = Path(path)
    if not p.exists():
        raise JobConfigError(f"{key} = {path!r}: no such directory (the model's tokenizer is loaded from it)")
    if not p.is_dir():
        raise JobConfigError(f"{key} = {path!r}: not a directory (it holds {', '.join(TOKENIZER_FILES)})")
    if needs_tokenizer and not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise JobConfigError(f"{key} = {path!r}: holds none of {', '.join(TOKENIZER_FILES)} (the tokenizer)")


def _builds_tokenizer(model) -> bool:
    """TorchTitan 0.2: the model's train spec loads a tokenizer from ``hf_assets_path``."""
    try:
        from torchtitan.protocols.train_spec import get_train_spec

        return get_train_spec(model.name).build_tokenizer_fn is not None
    except Exception:  # noqa: BLE001 - an unknown model is TorchTitan's own error, later
        return False


def _check_against_timeout(config, section) -> None:
    """Injected delays and emulated passes shorter than the job's train timeout (longer ones end the
    job at its first delayed message, with the collective's timeout and not a word about why)."""
    from titan_ext.titan.options import _job_timeout_s, delay_spec

    timeout_s = _job_timeout_s(config)
    if timeout_s is None:
        return
    spec = delay_spec(config)
    if spec:  # the config's delays win over the environment's (options.install_link_delays)
        from titan_ext.titan.config import config_delay_schedule

        key = "inject_delays" if section.inject_delays.strip() else "inject_trace"
        schedule, source = config_delay_schedule(spec, key), f"[titan_ext] {key} = {getattr(section, key)!r}"
    else:
        from titan_ext.runtime.emulate.delay_injection import ENV_VAR, schedule_from_env

        parsed = schedule_from_env()  # well-formed: check_env ran first
        if parsed is None:
            schedule = None
        else:
            schedule, source = parsed[0], f"{ENV_VAR} = {parsed[0].source!r}"
    if schedule is not None:
        worst = max([d.latency_ms for _, step in schedule.steps for d in step.values()]
                    + [w.latency_ms for w in schedule.wildcard if w is not None], default=0.0)
        if worst / 1e3 >= timeout_s:
            raise JobConfigError(f"{source}: a delay of {worst:g} ms "
                                 f"is not shorter than [comm] train_timeout_seconds = {timeout_s:g}")
    if math.isfinite(section.emulate_device_pass_ms) and 2 * section.emulate_device_pass_ms / 1e3 >= timeout_s:
        raise JobConfigError(f"[titan_ext] emulate_device_pass_ms = {section.emulate_device_pass_ms!r}: a "
                             f"backward pass (2x) is not shorter than [comm] train_timeout_seconds = {timeout_s:g}")


def _model_args(config):
    """The model's arguments (``dim``, ``n_layers``, ...): 0.3's ``model_spec.model``, 0.2's train spec's."""
    if getattr(config, "model_spec", None) is not None:  # TorchTitan 0.3
        return config.model_spec.model
    from torchtitan.protocols.train_spec import get_train_spec

    return get_train_spec(config.model.name).model_args[config.model.flavor]


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
        n_layers = _model_args(config).n_layers
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


def check_launcher_env(environ=os.environ) -> None:
    """The variables torchrun gives each rank (TorchTitan reads ``LOCAL_RANK`` to pick its device)."""
    missing = [v for v in ("LOCAL_RANK", "RANK", "WORLD_SIZE") if not environ.get(v, "").strip()]
    if missing:
        raise JobConfigError(f"{', '.join(missing)} not set: start the trainer with torchrun (e.g. `torchrun "
                             f"--nproc_per_node 4 -m titan_ext.train --job.config_file ...`), scripts/run_local.sh "
                             f"or scripts/launch.sh")


def world_size() -> int | None:
    return int(os.environ.get("WORLD_SIZE", "0")) or None
