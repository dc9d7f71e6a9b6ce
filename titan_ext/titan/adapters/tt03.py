"""TorchTitan 0.3.x (Python configs): ``--module titan_ext.titan --config <fn>`` loads
:mod:`titan_ext.titan.config_registry`, whose functions return a ``TitanExtTrainer.Config`` (a
``Trainer.Config`` subclass, ``slots=True``, with a ``titan_ext`` section); the keyword-only
``_build_pipeline_schedule(*, parallelism, local_batch_size, stages, loss_fn, ...)`` and
``_pipeline_module_split(..., get_mesh=...)`` of ``torchtitan.distributed.pipeline_parallel``; the trainer
in ``torchtitan.trainer``; metrics through its configurable ``Trainer.Config.metrics`` (a
``MetricsProcessor`` subclass, :func:`use_pipeline_metrics`)."""


from collections.abc import Callable
from typing import Any

VERSION = "0.3"
PYTHON_CONFIGS = True
PIPELINE = "torchtitan.distributed.pipeline_parallel"
#: TorchTitan's DCP checkpoint manager: titan_ext wraps its dcp_save / dcp_load (titan/checkpoint_guard.py)
CHECKPOINT = "torchtitan.components.checkpointer"
METRICS = "torchtitan.components.metrics"
#: every TorchTitan symbol titan_ext uses under 0.3, one ``(module, name, kind, detail)`` row each,
#: checked at registration (``adapters.check_adapter``: the row kinds are described there); e.g. a
#: builder called with ``num_microbatches`` instead of ``local_batch_size``, or a trainer without
#: ``num_pipeline_parallel_microbatches``, is named there, not met in the first step
CONTRACT = (
    # the pipeline builder: get_schedule_class rebound, the two builders wrapped (titan/registry.py)
    (PIPELINE, "get_schedule_class", "attr", None),
    (PIPELINE, "_build_pipeline_schedule", "callable", (("parallelism", "local_batch_size", "stages", "loss_fn"),
                                                        False)),
    (PIPELINE, "_pipeline_module_split", "callable", (
        ("whole_model", "pp_mesh", "pp_schedule", "device", "module_names_per_stage"), True)),
    # the trainer TitanExtTrainer extends, its config, and what titan_ext (Falcon's job) reads of it
    ("torchtitan.trainer", "Trainer", "instance_attr", (
        "config", "device", "parallel_dims", "metrics_processor", "gradient_accumulation_steps",
        "num_pipeline_parallel_microbatches", "pp_schedule", "model_parts", "step", "checkpointer")),
    ("torchtitan.trainer", "Trainer.train", "attr", None),
    ("torchtitan.trainer", "Trainer.train_step", "callable", (("data_iterator",), True)),
    ("torchtitan.trainer", "Trainer.forward_backward_step", "attr", None),
    ("torchtitan.trainer", "Trainer.close", "attr", None),
    ("torchtitan.trainer", "Trainer.Config", "fields", (
        "model_spec", "hf_assets_path", "dump_folder", "metrics", "training", "dataloader", "parallelism",
        "activation_checkpoint", "compile", "checkpoint", "comm", "debug")),
    # the config sections titan_ext builds (titan/config_registry.py) and reads (titan/jobcheck.py)
    ("torchtitan.config", "ConfigManager.parse_args", "callable", (("args",), True)),
    ("torchtitan.config", "TrainingConfig", "fields", (
        "local_batch_size", "global_batch_size", "seq_len", "steps", "max_norm", "dtype",
        "mixed_precision_param", "disable_cuda_graphs")),
    ("torchtitan.config", "ParallelismConfig", "fields", (
        "pipeline_parallel_degree", "pipeline_parallel_schedule", "pipeline_parallel_microbatch_size",
        "module_fqns_per_model_part", "pipeline_parallel_layers_per_stage",
        "pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers",
        "data_parallel_replicate_degree", "data_parallel_shard_degree", "tensor_parallel_degree",
        "spmd_backend")),
    ("torchtitan.config", "CompileConfig", "fields", ("enable",)),
    ("torchtitan.config", "CommConfig", "fields", ("init_timeout_seconds", "train_timeout_seconds",
                                                   "save_traces_folder")),
    ("torchtitan.config.configs", "DebugConfig", "fields", ("seed",)),
    ("torchtitan.config", "Configurable.Config.traverse", "attr", None),
    # the model: its spec's parallelize_fn replaced (Falcon's DP x PP job), the debug configs' base
    ("torchtitan.protocols.model_spec", "ModelSpec", "fields", ("model", "parallelize_fn")),
    ("torchtitan.models.common.decoder", "Decoder.Config", "fields", ("dim", "layers")),
    ("torchtitan.models.common.attention", "FlexAttention.Config", "attr", None),
    ("torchtitan.models.common.attention", "ScaledDotProductAttention.Config", "attr", None),
    ("torchtitan.models.llama3.config_registry", "llama3_debugmodel", "attr", None),
    ("torchtitan.models.llama3.config_registry", "llama3_8b", "attr", None),
    ("torchtitan.models.llama3.config_registry", "llama3_70b", "attr", None),
    # metrics (titan/metrics.py: PipelineMetricsProcessor, the metrics rank, Falcon's W&B rows)
    (METRICS, "MetricsProcessor", "instance_attr", ("parallel_dims", "logger")),
    (METRICS, "MetricsProcessor.__init__", "callable", (("config",), True)),
    (METRICS, "MetricsProcessor.log", "callable", (
        ("step", "global_avg_loss", "global_max_loss", "grad_norm", "extra_metrics"), True)),
    (METRICS, "MetricsProcessor.Config", "fields", (
        "log_freq", "disable_color_printing", "enable_wandb", "enable_tensorboard", "save_tb_folder")),
    (METRICS, "_get_metrics_rank", "callable", (("parallel_dims", "pp_schedule"), False)),
    (METRICS, "WandBLogger", "instance_attr", ("wandb",)),
    # checkpoints: dcp_save / dcp_load wrapped (titan/checkpoint_guard.py), S4's save; the debug
    # configs' CheckpointManager.Config comes from the compatibility module
    (CHECKPOINT, "CheckpointManager", "instance_attr", ("enable", "interval")),
    (CHECKPOINT, "CheckpointManager.dcp_save", "callable", (
        ("state_dict", "checkpoint_id", "async_mode", "enable_garbage_collection", "to_hf"), True)),
    (CHECKPOINT, "CheckpointManager.dcp_load", "callable", (
        ("state_dict", "checkpoint_id", "from_hf", "from_quantized"), True)),
    (CHECKPOINT, "CheckpointManager.save", "callable", (("curr_step", "last_step"), True)),
    (CHECKPOINT, "CheckpointManager.maybe_wait_for_saving", "attr", None),
    (CHECKPOINT, "CheckpointManager.Config", "fields", ("enable", "folder", "exclude_from_loading")),
    ("torchtitan.components.checkpoint", "CheckpointManager.Config", "fields", ("enable",)),
    # the titan_ext_tiny dataset (titan/data.py) and the debug configs' data loader
    ("torchtitan.hf_datasets", "DatasetConfig", "fields", ("path", "loader", "sample_processor")),
    ("torchtitan.hf_datasets.text_datasets", "DATASETS", "attr", None),
    ("torchtitan.hf_datasets.text_datasets", "HuggingFaceTextDataLoader.Config", "fields", ("dataset",)),
    # parallel dims (Falcon's DP x PP job), the CPU shim, logging
    ("torchtitan.distributed.parallel_dims", "ParallelDims.pp_enabled", "attr", None),
    ("torchtitan.distributed.parallel_dims", "ParallelDims.dp_replicate_enabled", "attr", None),
    ("torchtitan.distributed.parallel_dims", "ParallelDims.fsdp_enabled", "attr", None),
    ("torchtitan.distributed.parallel_dims", "ParallelDims.get_mesh", "attr", None),
    ("torchtitan.distributed.parallel_dims", "ParallelDims.get_optional_mesh", "attr", None),
    ("torchtitan.tools.utils", "device_type", "attr", None),
    ("torchtitan.tools.utils", "device_module", "attr", None),
    ("torchtitan.tools.logging", "logger", "attr", None),
    # the dry run's build (build_pipeline below) and the cluster configs' activation checkpointing
    ("torchtitan.distributed", "ParallelDims.from_config", "callable", (("parallelism_config", "world_size"), True)),
    ("torchtitan.tools.utils", "set_default_dtype", "attr", None),
    ("torchtitan.components.loss", "ChunkedLossWrapper.set_lm_head", "callable", (("lm_head",), True)),
    ("torchtitan.distributed.activation_checkpoint", "FullAC.Config", "attr", None),
    ("torchtitan.models.common.attention", "VarlenAttention.Config", "attr", None),
    ("torchtitan.models.common.decoder", "Decoder.get_attention_masks", "callable", (("positions",), False)),
)
#: views of CONTRACT: the module attributes it names, and its ``callable`` rows'
#: ``(module, name) -> (parameters, positional)``
HOOKS = tuple(dict.fromkeys((module, name.split(".")[0]) for module, name, _, _ in CONTRACT))
SIGNATURES = {(module, name): detail for module, name, kind, detail in CONTRACT if kind == "callable"}
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


def install_metrics_processor(builder: Callable[[Callable], Callable]) -> bool:  # noqa: ARG001
    """True: 0.3's extension point is the trainer config's ``metrics`` (a ``Configurable``: its
    ``build()`` makes the processor). titan_ext's trainer config builds
    :func:`~titan_ext.titan.metrics.pipeline_metrics_processor`'s subclass (:func:`use_pipeline_metrics`);
    nothing is patched, ``MetricsProcessor`` and ``WandBLogger`` stay TorchTitan's own."""
    return True


def use_pipeline_metrics(config: Any) -> None:
    """``config`` (a ``TitanExtTrainer.Config``) builds titan_ext's metrics processor: a plain
    ``MetricsProcessor.Config`` becomes a ``PipelineMetricsProcessor.Config`` with the same values; a
    user's own processor config is kept. Only this config changes."""
    from titan_ext.titan.metrics import pipeline_metrics_config

    config.metrics = pipeline_metrics_config(config.metrics)


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


def trainer_dump_folder(trainer: Any) -> str:
    """The running trainer's dump folder (0.3's trainer keeps its ``Trainer.Config`` as ``config``)."""
    return trainer.config.dump_folder


def trainer_training(trainer: Any) -> Any:
    """The running trainer's training section (``local_batch_size``, ``steps``, ...)."""
    return trainer.config.training


def install_replication_by_trainer(config: Any) -> None:
    """DP x PP with Falcon (:mod:`titan_ext.titan.falcon_job`): the trainer syncs the DP replicas itself.

    TorchTitan 0.3's model ``parallelize_fn`` always applies FSDP, over ``(dp_replicate, fsdp)`` (HSDP)
    when DP replicas exist. Where :func:`~titan_ext.titan.falcon_dp.replicated_by_trainer`, the
    config's ``model_spec`` gets a ``parallelize_fn`` that sees no ``dp_replicate``: FSDP over the
    size-1 ``fsdp`` mesh (no gradient traffic), and the replicas are summed by FalconJob, whose S2 acts
    there (Falcon §5.3). That needs ``spmd_backend = "partial_dtensor"`` (DTensor on model-parallel
    axes only): 0.3's default ``spmd_types`` reduces the gradients over the DP axes in every backward
    itself -- refused, naming the key. Idempotent."""
    import dataclasses

    from titan_ext.titan.falcon_dp import WithoutReplicate, replicated_by_trainer

    original = config.model_spec.parallelize_fn
    if getattr(original, "titan_ext_replicated", False):
        return

    def parallelize_fn(model, *, parallel_dims, **kwargs):
        if replicated_by_trainer(parallel_dims):
            backend = kwargs["parallelism"].spmd_backend
            if backend != "partial_dtensor":
                from titan_ext.titan.adapters import TitanIntegrationError

                raise TitanIntegrationError(
                    f"DP replicas with PP, summed by titan_ext's trainer (Falcon), need parallelism.spmd_backend "
                    f"= 'partial_dtensor' (got {backend!r}: its gradients are reduced over dp_replicate "
                    f"inside every backward, which Falcon's micro-batch redistribution cannot change)")
            parallel_dims = WithoutReplicate(parallel_dims)
        return original(model, parallel_dims=parallel_dims, **kwargs)

    parallelize_fn.titan_ext_replicated = True
    config.model_spec = dataclasses.replace(config.model_spec, parallelize_fn=parallelize_fn)


def falcon_train_step(job: Any, run_step: Callable, data_iterator: Any) -> None:
    """One step of :class:`~titan_ext.titan.falcon_job.FalconJob` under 0.3's trainer.

    0.3's ``train_step`` reads ``num_pipeline_parallel_microbatches`` data-loader items (one per
    pipeline microbatch) for each of its ``gradient_accumulation_steps`` forward/backward calls. A
    Falcon chunk is what one forward/backward consumes -- as under 0.2, one local batch -- so
    FalconJob gets those items joined into one ``(input_dict, labels)`` pair, and the trainer gets its
    chunks back split into the items again."""
    from itertools import chain, islice

    per_chunk = job.trainer.num_pipeline_parallel_microbatches

    class Chunks:  # next() = the joined items of one forward/backward
        def __iter__(self):
            return self

        def __next__(self):
            items = list(islice(data_iterator, per_chunk))
            if len(items) < per_chunk:
                raise StopIteration
            return _join(items)

    job.train_step(lambda chunks: run_step(chain.from_iterable(_split(c, per_chunk) for c in chunks)),
                   Chunks())


def _join(items: list) -> tuple[dict, Any]:
    """``(input_dict, labels)`` items -> one pair, every tensor concatenated along the batch dim."""
    import torch

    inputs = items[0][0]
    if not all(torch.is_tensor(v) for v in inputs.values()):
        raise TypeError(f"Falcon's chunks exchange tensors only; the data loader's input dict has "
                        f"{sorted(k for k, v in inputs.items() if not torch.is_tensor(v))}")
    return ({k: torch.cat([item[0][k] for item in items]) for k in inputs},
            torch.cat([item[1] for item in items]))


def _split(chunk: tuple[dict, Any], n: int) -> list[tuple[dict, Any]]:
    """Inverse of :func:`_join`: ``n`` equal ``(input_dict, labels)`` items."""
    inputs, labels = chunk
    parts = {k: v.chunk(n) for k, v in inputs.items()}
    return [({k: parts[k][i] for k in inputs}, label) for i, label in enumerate(labels.chunk(n))]


def attention_kwargs(model_config: Any, model: Any, tokens: Any) -> dict:
    """What 0.3's ``post_dataloading_process`` hands every stage for a microbatch of ``tokens``: the
    positions (one document: 0 .. seq - 1) and, for the masked backends (Flex, Varlen), the masks the
    model builds from them (``Decoder.get_attention_masks``); other models and backends: nothing."""
    import torch
    from torchtitan.models.common.attention import FlexAttention, VarlenAttention
    from torchtitan.models.common.decoder import Decoder

    first = getattr(model_config, "first_attention", None) if isinstance(model_config, Decoder.Config) else None
    if not isinstance(getattr(first, "inner_attention", None), (FlexAttention.Config, VarlenAttention.Config)):
        return {}
    positions = torch.arange(tokens.shape[-1]).expand(tokens.shape)
    return {"positions": positions, "attention_masks": model.get_attention_masks(positions=positions)}


def build_pipeline(config: Any, world_size: int, device: Any) -> dict:
    """The trainer's model build up to its pipeline (``Trainer.__init__`` of 0.3, in its order: parallel
    dims, the config's model spec, model on the meta device, loss, ``pipelining_fn``), on the process
    group that exists (the dry run's fake one), without weights, data or optimizer
    (:mod:`titan_ext.titan.dryrun`)."""
    import torch
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed import ParallelDims
    from torchtitan.tools import utils

    dims = ParallelDims.from_config(config.parallelism, world_size)
    spec = config.model_spec
    model_config = spec.model
    model_config.update_from_config(config=config)
    with torch.device("meta"), utils.set_default_dtype(TORCH_DTYPE_MAP[config.training.dtype]):
        model = model_config.build()
    _, flops_per_token = model_config.get_nparams_and_flops(model, config.training.seq_len)
    loss_fn = config.loss.build(compile_config=config.compile)
    schedule, parts, first, last = spec.pipelining_fn(
        model, parallel_dims=dims, training=config.training, parallelism=config.parallelism,
        compile_config=config.compile, ac_config=config.activation_checkpoint, dump_folder=config.dump_folder,
        device=device, model_config=model_config, parallelize_fn=spec.parallelize_fn, loss_fn=loss_fn)
    from torchtitan.components.loss import ChunkedLossWrapper

    if isinstance(loss_fn, ChunkedLossWrapper) and last:  # as the trainer: the loss runs the last stage's lm_head
        loss_fn.set_lm_head(parts[-1].lm_head)
        parts[-1]._skip_lm_head = True
    dim = getattr(model_config, "dim", None) or getattr(model_config, "hidden_size", None)

    return {"schedule": schedule, "parts": parts, "first": first, "last": last, "dims": dims, "loss_fn": loss_fn,
            "dim": dim, "vocab": getattr(model_config, "vocab_size", None), "flops_per_token": flops_per_token,
            "forward_kwargs": lambda tokens: attention_kwargs(model_config, parts[0], tokens)}
