"""TorchTitan 0.3's config registry for titan_ext: ``--module titan_ext.titan --config <function>``.

TorchTitan 0.3 configures a job in Python: ``torchrun ... -m torchtitan.train --module M --config F``
imports ``M.config_registry`` and calls ``F()``, which returns a ``Trainer.Config``; ``--section.key
value`` overrides any field (tyro), e.g. ``--titan_ext.replan_interval 5``. The functions here return a
:class:`~titan_ext.titan.trainer.TitanExtTrainer` config -- 0.3's ``Trainer.Config`` plus the shared
``titan_ext`` section (:class:`~titan_ext.titan.config.TitanExt`) -- whose ``build()`` makes
titan_ext's trainer, so our schedules, delay injection, metrics and V placement are attached.

Importing this module registers titan_ext with TorchTitan (schedules, the ``titan_ext_tiny`` dataset,
the CPU shim on machines without an accelerator); on a TorchTitan other than 0.3.x it fails at once.

* :func:`pipemorph_debugmodel` -- TorchTitan's llama3 debug model (6 layers, dim 256), PP = 4 with one
  stage per rank, PipeMorph, the bundled tokenizer and corpus (nothing is downloaded): the 0.3 twin of
  ``train_configs/debug_cpu.toml``.
* :func:`falcon_dp2_pp2_debugmodel` -- the same model as DP 2 x PP 2 (4 ranks) with Falcon, the trainer
  summing the DP replicas itself (:mod:`titan_ext.titan.falcon_job`): the 0.3 twin of
  ``train_configs/debug_cpu_dp2_pp2.toml``; fail-slow emulation with ``--titan_ext.emulate_slow_device``.
* :func:`llama3_8b_pipemorph`, :func:`llama3_70b_pipemorph` -- Llama-3.1 8B / 70B on a GPU cluster, PP = 8
  with PipeMorph, TorchTitan's own model, optimizer and dataset (C4); the tokenizer path is a placeholder
  the job refuses until it is set (``--hf_assets_path DIR``). Only the debug configs use the bundled assets.

Each function is the twin of its TOML file: every value the file sets, this config sets alike, where both
TorchTitan versions can say it (tests/titan/test_config_twins.py, which names the exceptions).
"""

from titan_ext.titan import adapters as _adapters
from titan_ext.titan.data import DATASET_NAME, TOKENIZER_DIR

if _adapters.current().VERSION != "0.3":
    raise _adapters.TitanIntegrationError(
        f"titan_ext.titan.config_registry is TorchTitan 0.3's Python config path; TorchTitan "
        f"{_adapters.torchtitan_version()} is installed (use the TOML path: README 'Use it from TorchTitan')")

from titan_ext.titan.registry import register as _register  # noqa: E402

_register()

__all__ = ["pipemorph_debugmodel", "falcon_dp2_pp2_debugmodel", "llama3_8b_pipemorph", "llama3_70b_pipemorph",
           "one_stage_per_rank"]


def one_stage_per_rank(pp: int, num_layers: int = 6) -> list[list[str]]:
    """The llama3 module split with one stage per PP rank (what PipeMorph plans for), TorchTitan's own
    balanced split: the embeddings and the head (norm + lm_head) count as one layer each, every stage
    gets ``units // pp`` of the units and the first ``units % pp`` one more -- the split of the TOML twins
    (``train_configs/*.toml``, whose 0.2 head is ``output``)."""
    units = [["tok_embeddings"]] + [[f"layers.{j}"] for j in range(num_layers)] + [["norm", "lm_head"]]
    if not 1 <= pp <= len(units):
        raise ValueError(f"pipeline degree {pp}: needs 1..{len(units)} (one unit per stage at least)")
    size, extra = divmod(len(units), pp)
    bounds = [i * size + min(i, extra) for i in range(pp + 1)]
    return [sum(units[bounds[i]:bounds[i + 1]], []) for i in range(pp)]


def _causal_sdpa(model_spec):
    """The model with torch's SDPA (causal) as inner attention: FlexAttention has no backward on the
    CPU. TorchTitan 0.3 passes no attention masks to a maskless backend (it relies on ``is_causal``);
    packed documents then attend across their boundaries, which a debug run does not mind."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    for _, _, parent, attr in list(model_spec.model.traverse(FlexAttention.Config)):
        if isinstance(parent, list):
            parent[attr] = ScaledDotProductAttention.Config()
        elif parent is not None:
            setattr(parent, attr, ScaledDotProductAttention.Config())
    return model_spec


def pipemorph_debugmodel():
    """llama3 debug model, PP = 4 (one stage per rank), PipeMorph, CPU-friendly sizes, 20 steps."""
    from titan_ext.titan.config import TitanExt

    return _debugmodel(pp=4, dp_replicate=1, local_batch_size=16, global_batch_size=-1,
                       dump_folder="./outputs/debug_cpu_tt03",
                       titan_ext=TitanExt(adaptive=True, replan_interval=1, profile_window=3, gantt_every=10))


def falcon_dp2_pp2_debugmodel():
    """llama3 debug model, DP 2 x PP 2 (pipelines = ranks {0, 2} and {1, 3}), PipeMorph, Falcon: a step
    is 3 chunks of 4 sequences per replica (one PipeMorph step of 4 microbatches each), 24 in all. The
    trainer sums the replicas' gradients (titan/falcon_job.py), so DTensor stays on model-parallel axes
    (``spmd_backend = "partial_dtensor"``: 0.3's default reduces over DP inside the backward)."""
    from titan_ext.titan.config import TitanExt

    return _debugmodel(pp=2, dp_replicate=2, dp_shard=1, local_batch_size=4, global_batch_size=24,
                       dump_folder="./outputs/debug_cpu_dp2_pp2_tt03", spmd_backend="partial_dtensor",
                       titan_ext=TitanExt(adaptive=True, replan_interval=1, profile_window=3, gantt_every=0,
                                          falcon=True))


def _debugmodel(*, pp: int, dp_replicate: int, local_batch_size: int, global_batch_size: int,
                dump_folder: str, titan_ext, spmd_backend: str = "spmd_types", dp_shard: int = -1):
    """TorchTitan's llama3 debug model on the CPU: the bundled tokenizer and corpus, SDPA attention,
    float32, one stage per PP rank, PipeMorph, the given DP replicas and ``titan_ext`` section; the
    optimizer and learning-rate schedule of the TOML twins (AdamW at 3e-3, 2 warm-up steps, linear decay
    to 0.1 of it), whose runs the README reports."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.config.configs import DebugConfig
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from titan_ext.titan.metrics import pipeline_metrics_processor
    from titan_ext.titan.trainer import TitanExtTrainer

    base = llama3_debugmodel()
    fields = {name: getattr(base, name) for name in base.__dataclass_fields__ if not name.startswith("_")}
    fields.update(
        model_spec=_causal_sdpa(base.model_spec),
        hf_assets_path=str(TOKENIZER_DIR),
        dump_folder=dump_folder,
        metrics=pipeline_metrics_processor().Config(log_freq=1, disable_color_printing=True),
        optimizer=default_adamw(lr=3e-3, eps=1e-8),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                                  min_lr_factor=0.1),
        training=TrainingConfig(local_batch_size=local_batch_size, global_batch_size=global_batch_size,
                                seq_len=64, steps=20, max_norm=1.0, dtype="float32",
                                mixed_precision_param="float32", disable_cuda_graphs=True),
        dataloader=HuggingFaceTextDataLoader.Config(dataset=DATASET_NAME),
        parallelism=ParallelismConfig(pipeline_parallel_degree=pp, data_parallel_replicate_degree=dp_replicate,
                                      data_parallel_shard_degree=dp_shard,
                                      pipeline_parallel_schedule="PipeMorph", pipeline_parallel_microbatch_size=1,
                                      module_fqns_per_model_part=one_stage_per_rank(pp), spmd_backend=spmd_backend),
        activation_checkpoint=None,
        compile=CompileConfig(enable=False),
        checkpoint=CheckpointManager.Config(enable=False),
        debug=DebugConfig(seed=42),
        titan_ext=titan_ext,
    )
    return TitanExtTrainer.Config(**fields)


def llama3_8b_pipemorph():
    """Llama-3.1 8B, PP = 8 (one stage per rank, PipeMorph) and FSDP over the GPUs left: the 0.3 twin of
    ``train_configs/llama3_8b_pipemorph.toml``. TorchTitan's own ``llama3_8b`` with the C4 dataset; the
    tokenizer path is a placeholder to set (``--hf_assets_path DIR``), refused until it is."""
    return _cluster_model("llama3_8b", "8B", num_layers=32, local_batch_size=32,
                          dump_folder="./outputs/llama3_8b_pipemorph")


def llama3_70b_pipemorph():
    """Llama-3.1 70B, PP = 8 (one stage per rank, PipeMorph) x TP = 8 on 64+ GPUs, FSDP over the rest:
    the 0.3 twin of ``train_configs/llama3_70b_pipemorph.toml``; tokenizer path as for 8B."""
    return _cluster_model("llama3_70b", "70B", num_layers=80, local_batch_size=32,
                          dump_folder="./outputs/llama3_70b_pipemorph", tensor_parallel=8)


def _cluster_model(base_name: str, flavor: str, *, num_layers: int, local_batch_size: int, dump_folder: str,
                   pp: int = 8, tensor_parallel: int = 1):
    """TorchTitan's llama3 ``base_name`` config for a GPU cluster (its model, optimizer, activation
    checkpointing and real dataset, C4) with what the TOML twin sets: PipeMorph over ``pp`` stages (one per
    rank, TorchTitan's balanced split), micro-batches of 1, W&B metrics, asynchronous checkpoints, the
    cosine learning-rate schedule, seed 42, and the ``[titan_ext]`` section of a cluster: an activation
    budget per PP rank and a policy check every 5 iterations (tests/titan/test_config_twins.py)."""
    import importlib
    from dataclasses import replace

    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed.activation_checkpoint import FullAC

    from titan_ext.titan.config import TitanExt
    from titan_ext.titan.jobcheck import PLACEHOLDER_PREFIX
    from titan_ext.titan.metrics import pipeline_metrics_processor
    from titan_ext.titan.trainer import TitanExtTrainer

    base = getattr(importlib.import_module("torchtitan.models.llama3.config_registry"), base_name)()
    fields = {name: getattr(base, name) for name in base.__dataclass_fields__ if not name.startswith("_")}
    fields["training"].local_batch_size = local_batch_size
    fields["training"].disable_cuda_graphs = True  # 0.3 refuses CUDA graphs with PP (Trainer.Config)
    fields.update(
        hf_assets_path=f"{PLACEHOLDER_PREFIX}Llama-3.1-{flavor}",
        dump_folder=dump_folder,
        metrics=pipeline_metrics_processor().Config(log_freq=10, enable_tensorboard=False, enable_wandb=True),
        lr_scheduler=replace(base.lr_scheduler, decay_ratio=0.8, decay_type="cosine", min_lr_factor=0.1),
        checkpoint=replace(base.checkpoint, enable=True, folder="checkpoint", interval=500, async_mode="async"),
        debug=replace(base.debug, seed=42),
        parallelism=ParallelismConfig(pipeline_parallel_degree=pp, tensor_parallel_degree=tensor_parallel,
                                      data_parallel_shard_degree=-1, pipeline_parallel_schedule="PipeMorph",
                                      pipeline_parallel_microbatch_size=1,
                                      module_fqns_per_model_part=one_stage_per_rank(pp, num_layers)),
        titan_ext=TitanExt(memory_budget_gib=12.0, replan_interval=5, profile_window=5, gantt_every=100),
    )
    # full activation checkpointing, as the TOML twins: under selective checkpointing the 8B's 12 GiB
    # budget holds fewer microbatches than 1F1B's on stages 0 and 1 (titan_ext.titan.dryrun)
    fields["activation_checkpoint"] = FullAC.Config()
    return TitanExtTrainer.Config(**fields)
