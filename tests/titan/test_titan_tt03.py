"""TorchTitan 0.3's Python-config path: ``--module titan_ext.titan --config pipemorph_debugmodel``.

Runs where TorchTitan 0.3.x is installed (scripts/ci_versions.sh torchtitan-0.3); skipped elsewhere."""

import pytest

from titan_ext.titan import adapters

if adapters.current().VERSION != "0.3":
    pytest.skip(f"TorchTitan {adapters.torchtitan_version()} installed; these test the 0.3 adapter",
                allow_module_level=True)

from dataclasses import fields  # noqa: E402

from torchtitan.config import ConfigManager  # noqa: E402

ARGS = ["--module", "titan_ext.titan", "--config", "pipemorph_debugmodel"]


def test_config_registry_gives_titan_ext_trainer_config_with_its_section():
    from titan_ext.titan.config import TitanExt
    from titan_ext.titan.trainer import TitanExtTrainer

    cfg = ConfigManager().parse_args([*ARGS, "--titan_ext.replan_interval", "5", "--training.steps", "3"])
    assert type(cfg) is TitanExtTrainer.Config and type(cfg)._owner is TitanExtTrainer
    assert "__slots__" in type(cfg).__dict__  # 0.3's Configurable rule
    assert isinstance(cfg.titan_ext, TitanExt) and cfg.titan_ext.replan_interval == 5
    assert cfg.training.steps == 3 and cfg.parallelism.pipeline_parallel_schedule == "PipeMorph"
    assert [f.name for f in fields(cfg.titan_ext)] == [f.name for f in fields(TitanExt())]


@pytest.mark.parametrize("key, value, says", [
    ("delegation", "sometimes", "invalid choice 'sometimes'"),  # a Literal knob: tyro knows its choices
    ("replan_interval", "0", "[titan_ext] replan_interval = 0: must be >= 1"),  # TitanExt.__post_init__
])
def test_bad_titan_ext_value_is_refused_at_parse_time(capsys, key, value, says):
    """tyro prints the message (naming the key) and exits 2."""
    with pytest.raises(SystemExit) as exc:
        ConfigManager().parse_args([*ARGS, f"--titan_ext.{key}", value])
    assert exc.value.code == 2
    out = " ".join(capsys.readouterr().err.replace("│", " ").split())
    assert says in out and key in out, out


def test_one_stage_per_rank_split_equals_torchtitans_own_weighted_split():
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

    from titan_ext.titan.config_registry import one_stage_per_rank

    for pp in (2, 4):
        assert one_stage_per_rank(pp) == _generate_llm_fqn_per_model_part(pp, 6, 1, 1)


def test_our_schedule_built_outside_our_trainer_is_an_error_not_a_silent_default():
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import pipeline_parallel as pp

    from titan_ext.titan import register

    register(cpu_shim=False)
    with pytest.raises(adapters.TitanIntegrationError, match="outside titan_ext's trainer"):
        pp._build_pipeline_schedule(parallelism=ParallelismConfig(pipeline_parallel_schedule="PipeMorph"),
                                    local_batch_size=8, stages=[], loss_fn=None)


def test_pipemorph_resolves_through_torchtitans_lookup():
    from torchtitan.distributed import pipeline_parallel as pp

    from titan_ext.runtime import PipeMorph
    from titan_ext.titan import register

    register(cpu_shim=False)
    assert issubclass(pp.get_schedule_class("pipemorph"), PipeMorph)


@pytest.mark.parametrize("name", ["llama3_8b_pipemorph", "llama3_70b_pipemorph"])
def test_cluster_configs_parse_with_a_real_dataset_and_refuse_the_placeholder_tokenizer(name):
    """The 8B / 70B config functions make a valid 0.3 config (TorchTitan's own checks: PP without CUDA
    graphs), on C4, with titan_ext's metrics processor; the tokenizer placeholder is refused."""
    from titan_ext.titan.jobcheck import JobConfigError, _resolve_asset_paths
    from titan_ext.titan.metrics import pipeline_metrics_processor

    cfg = ConfigManager().parse_args(["--module", "titan_ext.titan", "--config", name])
    assert cfg.parallelism.pipeline_parallel_schedule == "PipeMorph" and cfg.training.disable_cuda_graphs
    assert cfg.dataloader.dataset == "c4" and type(cfg.metrics) is pipeline_metrics_processor().Config
    with pytest.raises(JobConfigError, match="placeholder"):
        _resolve_asset_paths(cfg)
