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
#: (module, attribute) titan_ext patches or calls; a missing one fails registration loudly
HOOKS = (
    (PIPELINE, "get_schedule_class"),
    (PIPELINE, "build_pipeline_schedule"),
    (PIPELINE, "pipeline_module_split"),
    ("torchtitan.train", "Trainer"),
    ("torchtitan.train", "main"),
    ("torchtitan.components.metrics", "MetricsProcessor"),
    ("torchtitan.components.metrics", "build_metrics_processor"),
    ("torchtitan.components.metrics", "_get_metrics_rank"),
    ("torchtitan.hf_datasets.text_datasets", "DATASETS"),
    (CHECKPOINT, "CheckpointManager"),
    ("torchtitan.protocols.train_spec", "get_train_spec"),
)
#: (module, attribute) -> (parameters titan_ext's wrapper takes, by name; passed by position?): checked
#: at registration (adapters.signature_mismatches), so a changed hook is named, never a TypeError later
SIGNATURES = {
    (PIPELINE, "build_pipeline_schedule"): (("job_config", "stages", "loss_fn"), True),
    (PIPELINE, "pipeline_module_split"): (
        ("whole_model", "pp_mesh", "pp_schedule", "device", "module_names_per_stage"), True),
    ("torchtitan.components.metrics", "build_metrics_processor"): (
        ("job_config", "parallel_dims", "model_args"), True),
    ("torchtitan.components.metrics", "MetricsProcessor.log"): (
        ("step", "global_avg_loss", "global_max_loss", "grad_norm", "extra_metrics"), True),
    ("torchtitan.components.metrics", "_get_metrics_rank"): (("parallel_dims", "job_config"), True),
    ("torchtitan.protocols.train_spec", "get_train_spec"): (("name",), True),
    (CHECKPOINT, "CheckpointManager.dcp_save"): (
        ("state_dict", "checkpoint_id", "async_mode", "enable_garbage_collection", "to_hf"), True),
    (CHECKPOINT, "CheckpointManager.dcp_load"): (("state_dict", "checkpoint_id", "from_hf", "from_quantized"), True),
}
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


def install_replication_by_trainer(config: Any) -> None:  # noqa: ARG001 - 0.2 patches the train specs
    """DP x PP with Falcon: TorchTitan 0.2's parallelize functions skip DDP (the trainer syncs)."""
    from titan_ext.titan.falcon.dp import install_replication_by_trainer as install

    install()


def falcon_train_step(job: Any, run_step: Callable, data_iterator: Any) -> None:
    """One step of :class:`~titan_ext.titan.falcon.job.FalconJob`: 0.2's trainer reads one data-loader
    batch per forward/backward (a Falcon chunk)."""
    job.train_step(run_step, data_iterator)
