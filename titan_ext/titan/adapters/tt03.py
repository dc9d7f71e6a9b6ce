"""TorchTitan 0.3.x (Python configs): ``--module titan_ext.titan --config <fn>`` loads
:mod:`titan_ext.titan.config_registry`, whose functions return a ``TitanExtTrainer.Config`` (a
``Trainer.Config`` subclass, ``slots=True``, with a ``titan_ext`` section); the keyword-only
``_build_pipeline_schedule(*, parallelism, local_batch_size, stages, loss_fn, ...)`` and
``_pipeline_module_split(..., get_mesh=...)`` of ``torchtitan.distributed.pipeline_parallel``; the trainer
in ``torchtitan.trainer``; metrics through its ``MetricsProcessor``."""


from collections.abc import Callable
from typing import Any

VERSION = "0.3"
PYTHON_CONFIGS = True
PIPELINE = "torchtitan.distributed.pipeline_parallel"
#: (module, attribute) titan_ext patches or calls; a missing one fails registration loudly
HOOKS = (
    (PIPELINE, "get_schedule_class"),
    (PIPELINE, "_build_pipeline_schedule"),
    (PIPELINE, "_pipeline_module_split"),
    ("torchtitan.trainer", "Trainer"),
    ("torchtitan.config", "ConfigManager"),
    ("torchtitan.components.metrics", "MetricsProcessor"),
    ("torchtitan.components.metrics", "_get_metrics_rank"),
    ("torchtitan.hf_datasets.text_datasets", "DATASETS"),
    ("torchtitan.models.llama3.config_registry", "llama3_debugmodel"),
)
BUILDER_MODULES = (PIPELINE,)
CPU_SHIM_MODULES = (
    "torchtitan.tools.utils",
    "torchtitan.components.metrics",
    "torchtitan.distributed.utils",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.tools.profiler",
)


def wrap_build_pipeline_schedule(original: Callable) -> Callable:
    """0.3's builder gets no job config: the active one (set by ``TitanExtTrainer``) is used. One of
    our schedules built without it would silently lose ``[titan_ext]``: that is an error."""
    from titan_ext.titan.adapters import TitanIntegrationError
    from titan_ext.titan.registry import active_config, build_with_titan_ext, is_titan_ext_schedule

    def _build_pipeline_schedule(*, parallelism, local_batch_size, stages, loss_fn, **kwargs):
        def build():
            return original(parallelism=parallelism, local_batch_size=local_batch_size, stages=stages,
                            loss_fn=loss_fn, **kwargs)

        config = active_config()
        if config is None:
            if is_titan_ext_schedule(parallelism.pipeline_parallel_schedule):
                raise TitanIntegrationError(
                    f"schedule {parallelism.pipeline_parallel_schedule!r} built outside titan_ext's trainer "
                    f"(its titan_ext section would be ignored): run with --module titan_ext.titan")
            return build()
        return build_with_titan_ext(config, stages, build)

    return _build_pipeline_schedule


def wrap_pipeline_module_split(original: Callable) -> Callable:
    from titan_ext.titan.registry import split_schedule_name

    def _pipeline_module_split(whole_model, pp_mesh, pp_schedule, device, module_names_per_stage, **kwargs):
        return original(whole_model, pp_mesh, split_schedule_name(pp_schedule), device, module_names_per_stage,
                        **kwargs)

    return _pipeline_module_split


#: builder-module attribute -> its wrapper factory
WRAPPERS = {"_build_pipeline_schedule": wrap_build_pipeline_schedule,
            "_pipeline_module_split": wrap_pipeline_module_split}


def trainer_base() -> type:
    from torchtitan.trainer import Trainer

    return Trainer


def dump_folder(config: Any) -> str:
    return config.dump_folder


def metrics_rank(processor: Any, job_config: Any) -> int:
    from torchtitan.components.metrics import _get_metrics_rank

    return _get_metrics_rank(parallel_dims=processor.parallel_dims,
                             pp_schedule=job_config.parallelism.pipeline_parallel_schedule)


def trainer_config(trainer: type) -> type:
    """``trainer.Config`` + a ``titan_ext`` section (the shared ``TitanExt`` dataclass): 0.3's
    Configurable requires ``kw_only=True, slots=True``; tyro parses ``--titan_ext.<knob>``."""
    from dataclasses import dataclass, field

    from titan_ext.titan.config import TitanExt

    @dataclass(kw_only=True, slots=True)
    class Config(trainer.Config):
        titan_ext: TitanExt = field(default_factory=TitanExt)
        """titan_ext's knobs (PipeMorph / CrossPipe, delay injection, metrics): see README."""

    Config.__qualname__ = "TitanExtTrainer.Config"
    return Config
