"""TorchTitan 0.2.x (TOML configs): the ``[titan_ext]`` section through ``job.custom_config_module``,
``[experimental] custom_import = "titan_ext"``, the positional ``build_pipeline_schedule(job_config,
stages, loss_fn)`` and ``pipeline_module_split(...)`` of ``torchtitan.distributed.pipeline_parallel``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

VERSION = "0.2"
PYTHON_CONFIGS = False
PIPELINE = "torchtitan.distributed.pipeline_parallel"
#: TorchTitan's DCP checkpoint manager: titan_ext wraps its dcp_save / dcp_load (titan/checkpoint_guard.py)
CHECKPOINT = "torchtitan.components.checkpoint"
METRICS = "torchtitan.components.metrics"
CONFIG = "torchtitan.config.job_config"
#: every TorchTitan symbol titan_ext uses under 0.2, one ``(module, name, kind, detail)`` row each,
#: checked at registration (``adapters.check_adapter``: the row kinds are described there); a broken
#: row is named there, never met as an ImportError, TypeError or AttributeError in a running job
CONTRACT = (
    # the pipeline builder: get_schedule_class rebound, the two builders wrapped (titan/registry.py)
    (PIPELINE, "get_schedule_class", "attr", None),
    (PIPELINE, "build_pipeline_schedule", "callable", (("job_config", "stages", "loss_fn"), True)),
    (PIPELINE, "pipeline_module_split", "callable", (
        ("whole_model", "pp_mesh", "pp_schedule", "device", "module_names_per_stage"), True)),
    # the trainer TitanExtTrainer extends, and what titan_ext (Falcon's job, S3, S4) reads of it
    ("torchtitan.train", "Trainer", "instance_attr", (
        "job_config", "device", "parallel_dims", "train_spec", "tokenizer", "dataloader", "model_args",
        "metrics_processor", "loss_fn", "gradient_accumulation_steps", "pp_schedule", "model_parts",
        "pp_has_first_stage", "pp_has_last_stage", "optimizers", "lr_schedulers", "step", "checkpointer")),
    ("torchtitan.train", "Trainer.train", "attr", None),
    ("torchtitan.train", "Trainer.train_step", "callable", (("data_iterator",), True)),
    ("torchtitan.train", "Trainer.forward_backward_step", "attr", None),
    ("torchtitan.train", "Trainer.batch_generator", "callable", (("data_iterable",), True)),
    ("torchtitan.train", "Trainer.close", "attr", None),
    ("torchtitan.train", "main", "callable", (("trainer_class",), True)),
    # the config (titan_ext.train, titan/entry.py, titan/jobcheck.py, the S4 relaunch's overrides)
    ("torchtitan.config", "ConfigManager.parse_args", "callable", (("args",), True)),
    ("torchtitan.config", "ConfigManager._maybe_load_toml", "callable", (("args",), True)),
    ("torchtitan.config", "TORCH_DTYPE_MAP", "attr", None),
    (CONFIG, "JobConfig", "fields", (
        "job", "model", "training", "parallelism", "checkpoint", "metrics", "comm", "experimental")),
    (CONFIG, "Job", "fields", ("config_file", "dump_folder", "custom_config_module")),
    (CONFIG, "Model", "fields", ("name", "flavor", "hf_assets_path")),
    (CONFIG, "Training", "fields", (
        "local_batch_size", "global_batch_size", "seq_len", "steps", "dtype", "dataset_path")),
    (CONFIG, "Parallelism", "fields", (
        "pipeline_parallel_degree", "pipeline_parallel_schedule", "pipeline_parallel_microbatch_size",
        "module_fqns_per_model_part", "pipeline_parallel_layers_per_stage",
        "pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers",
        "data_parallel_replicate_degree", "data_parallel_shard_degree")),
    (CONFIG, "Checkpoint", "fields", ("enable", "folder", "exclude_from_loading")),
    (CONFIG, "Metrics", "fields", ("enable_wandb", "enable_tensorboard", "save_tb_folder")),
    (CONFIG, "Comm", "fields", ("init_timeout_seconds", "train_timeout_seconds", "save_traces_folder")),
    (CONFIG, "Experimental", "fields", ("custom_import",)),
    # train specs: the metrics builder and Falcon's DDP-less parallelize_fn plugged in, S3's rebuild
    ("torchtitan.protocols.train_spec", "get_train_spec", "callable", (("name",), True)),
    ("torchtitan.protocols.train_spec", "TrainSpec", "fields", (
        "model_cls", "model_args", "parallelize_fn", "pipelining_fn", "build_optimizers_fn",
        "build_lr_schedulers_fn", "build_dataloader_fn", "build_tokenizer_fn", "build_metrics_processor_fn")),
    # metrics (titan/metrics.py, the metrics rank, Falcon's W&B rows)
    (METRICS, "MetricsProcessor", "instance_attr", ("parallel_dims", "job_config", "logger", "optimizers",
                                                    "model_parts")),
    (METRICS, "MetricsProcessor.log", "callable", (
        ("step", "global_avg_loss", "global_max_loss", "grad_norm", "extra_metrics"), True)),
    (METRICS, "build_metrics_processor", "callable", (("job_config", "parallel_dims", "model_args"), True)),
    (METRICS, "_get_metrics_rank", "callable", (("parallel_dims", "job_config"), True)),
    (METRICS, "WandBLogger", "instance_attr", ("wandb",)),
    # checkpoints: dcp_save / dcp_load wrapped (titan/checkpoint_guard.py), S4's save, S3's states
    (CHECKPOINT, "CheckpointManager", "instance_attr", ("enable", "interval", "states")),
    (CHECKPOINT, "CheckpointManager.dcp_save", "callable", (
        ("state_dict", "checkpoint_id", "async_mode", "enable_garbage_collection", "to_hf"), True)),
    (CHECKPOINT, "CheckpointManager.dcp_load", "callable", (
        ("state_dict", "checkpoint_id", "from_hf", "from_quantized"), True)),
    (CHECKPOINT, "CheckpointManager.save", "callable", (("curr_step", "last_step"), True)),
    (CHECKPOINT, "CheckpointManager._async_wait", "attr", None),
    (CHECKPOINT, "ModelWrapper", "attr", None),
    (CHECKPOINT, "MODEL", "attr", None),
    (CHECKPOINT, "OPTIMIZER", "attr", None),
    (CHECKPOINT, "DATALOADER", "attr", None),
    (CHECKPOINT, "LR_SCHEDULER", "attr", None),
    # the titan_ext_tiny dataset (titan/data.py)
    ("torchtitan.hf_datasets", "DatasetConfig", "fields", ("path", "loader", "sample_processor")),
    ("torchtitan.hf_datasets.text_datasets", "DATASETS", "attr", None),
    # parallel dims (Falcon's DP x PP job), the CPU shim, S3's meta-device model, logging
    ("torchtitan.distributed.parallel_dims", "ParallelDims.pp_enabled", "attr", None),
    ("torchtitan.distributed.parallel_dims", "ParallelDims.dp_replicate_enabled", "attr", None),
    ("torchtitan.distributed.parallel_dims", "ParallelDims.fsdp_enabled", "attr", None),
    ("torchtitan.distributed.parallel_dims", "ParallelDims.get_mesh", "attr", None),
    ("torchtitan.distributed.parallel_dims", "ParallelDims.get_optional_mesh", "attr", None),
    ("torchtitan.tools.utils", "device_type", "attr", None),
    ("torchtitan.tools.utils", "device_module", "attr", None),
    ("torchtitan.tools.utils", "set_default_dtype", "attr", None),
    ("torchtitan.tools.logging", "logger", "attr", None),
    # the dry run's build (build_pipeline below)
    ("torchtitan.distributed", "ParallelDims", "fields",
     ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "etp", "world_size")),
    ("torchtitan.models.llama3.model.model", "Transformer.get_attention_masks", "callable",
     (("input_batch", "tokenizer"), False)),
)
#: views of CONTRACT: the module attributes it names, and its ``callable`` rows'
#: ``(module, name) -> (parameters, positional)``
HOOKS = tuple(dict.fromkeys((module, name.split(".")[0]) for module, name, _, _ in CONTRACT))
SIGNATURES = {(module, name): detail for module, name, kind, detail in CONTRACT if kind == "callable"}
BUILDER_MODULES = (PIPELINE, "torchtitan.experiments.transformers_modeling_backend.infra.pipeline")
CPU_SHIM_MODULES = (
    "torchtitan.tools.utils",
    "torchtitan.components.metrics",
    "torchtitan.distributed.utils",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.tools.profiling",
)


def wrap_build_pipeline_schedule(original: Callable) -> Callable:
    from titan_ext.titan.registry import build_with_titan_ext

    def build_pipeline_schedule(job_config, stages, loss_fn):
        return build_with_titan_ext(job_config, stages, lambda: original(job_config, stages, loss_fn))

    return build_pipeline_schedule


def wrap_pipeline_module_split(original: Callable) -> Callable:
    from titan_ext.titan.registry import split_schedule_name

    def pipeline_module_split(whole_model, pp_mesh, pp_schedule, device, module_names_per_stage):
        return original(whole_model, pp_mesh, split_schedule_name(pp_schedule), device, module_names_per_stage)

    return pipeline_module_split


#: builder-module attribute -> its wrapper factory
WRAPPERS = {"build_pipeline_schedule": wrap_build_pipeline_schedule,
            "pipeline_module_split": wrap_pipeline_module_split}


_metrics_installed = False


def install_metrics_processor(builder: Callable[[Callable], Callable]) -> bool:
    """TorchTitan 0.2's extension point for the metrics processor: every TrainSpec that
    ``get_train_spec`` returns gets ``build_metrics_processor_fn = builder(its own or TorchTitan's
    build_metrics_processor)``; the trainer (``train_spec_module.get_train_spec``) builds through it."""
    global _metrics_installed
    if _metrics_installed:
        return True
    import dataclasses

    import torchtitan.protocols.train_spec as train_spec
    from torchtitan.components.metrics import build_metrics_processor

    original = train_spec.get_train_spec

    def get_train_spec(name: str):
        spec = original(name)
        build = spec.build_metrics_processor_fn or build_metrics_processor
        if getattr(build, "_titan_ext_wrapped", False):
            return spec
        return dataclasses.replace(spec, build_metrics_processor_fn=builder(build))

    get_train_spec.__wrapped__ = original  # type: ignore[attr-defined]
    get_train_spec.__dict__.update({k: v for k, v in original.__dict__.items() if k != "__wrapped__"})
    train_spec.get_train_spec = get_train_spec
    _metrics_installed = True
    return True


def use_pipeline_metrics(config: Any) -> None:  # noqa: ARG001 - 0.2: through the TrainSpec builder
    """Nothing to do under 0.2: every TrainSpec's metrics builder already instruments its processor
    (:func:`install_metrics_processor`)."""


def trainer_base() -> type:
    from torchtitan.train import Trainer

    return Trainer


def dump_folder(config: Any) -> str:
    return config.job.dump_folder


def metrics_rank(processor: Any, job_config: Any) -> int:  # noqa: ARG001 - 0.2 reads the processor's
    from torchtitan.components.metrics import _get_metrics_rank

    return _get_metrics_rank(processor.parallel_dims, processor.job_config)


def trainer_dump_folder(trainer: Any) -> str:
    """The running trainer's dump folder (0.2's trainer keeps its TOML-parsed ``job_config``)."""
    return trainer.job_config.job.dump_folder


def trainer_training(trainer: Any) -> Any:
    """The running trainer's ``[training]`` section (``local_batch_size``, ``steps``, ...)."""
    return trainer.job_config.training


def install_replication_by_trainer(config: Any) -> None:  # noqa: ARG001 - 0.2 patches the train specs
    """DP x PP with Falcon: TorchTitan 0.2's parallelize functions skip DDP (the trainer syncs)."""
    from titan_ext.titan.falcon_dp import install_replication_by_trainer as install

    install()


def falcon_train_step(job: Any, run_step: Callable, data_iterator: Any) -> None:
    """One step of :class:`~titan_ext.titan.falcon_job.FalconJob`: 0.2's trainer reads one data-loader
    batch per forward/backward (a Falcon chunk)."""
    job.train_step(run_step, data_iterator)


def build_pipeline(config: Any, world_size: int, device: Any) -> dict:
    """The trainer's model build up to its pipeline (``Trainer.__init__`` of 0.2.2, in its order: parallel
    dims, train spec, model on the meta device, loss, ``pipelining_fn``), on the process group that
    exists (the dry run's fake one), without weights, data or optimizer: the schedule, this rank's model
    parts and the model's shape (:mod:`titan_ext.titan.dryrun`)."""
    import torch
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols import train_spec as train_spec_module
    from torchtitan.tools import utils

    p = config.parallelism
    dims = ParallelDims(dp_shard=p.data_parallel_shard_degree, dp_replicate=p.data_parallel_replicate_degree,
                        cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
                        ep=p.expert_parallel_degree, etp=p.expert_tensor_parallel_degree, world_size=world_size)
    spec = train_spec_module.get_train_spec(config.model.name)
    model_args = spec.model_args[config.model.flavor]
    model_args.update_from_config(config)
    with torch.device("meta"), utils.set_default_dtype(TORCH_DTYPE_MAP[config.training.dtype]):
        model = spec.model_cls(model_args)
    _, flops_per_token = model_args.get_nparams_and_flops(model, config.training.seq_len)
    loss_fn = spec.build_loss_fn(config, parallel_dims=dims)
    schedule, parts, first, last = spec.pipelining_fn(model, dims, config, device, model_args,
                                                      spec.parallelize_fn, loss_fn)

    def forward_kwargs(tokens: torch.Tensor) -> dict:
        """What 0.2's ``post_dataloading_process`` hands every stage for a microbatch of ``tokens``: the
        attention masks under ``attn_type`` flex or varlen (one document: an end-of-sequence id no token
        of the dry run's batch has), else nothing."""
        if getattr(model_args, "attn_type", "sdpa") not in ("flex", "varlen"):
            return {}
        from types import SimpleNamespace

        tokenizer = SimpleNamespace(eos_id=model_args.vocab_size - 1)
        return {"attention_masks": parts[0].get_attention_masks(input_batch=tokens, tokenizer=tokenizer)}

    return {"schedule": schedule, "parts": parts, "first": first, "last": last, "dims": dims, "loss_fn": loss_fn,
            "dim": model_args.dim, "vocab": model_args.vocab_size, "flops_per_token": flops_per_token,
            "forward_kwargs": forward_kwargs}
