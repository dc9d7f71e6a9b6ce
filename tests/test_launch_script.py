"""scripts/launch.sh without SLURM: usage without a config, DRY_RUN for both config systems, a model
too big for the machine refused; the real-size configs refuse their placeholder tokenizer path."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _launch(env, *args):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CONFIG", "MODULE", "DRY_RUN"))}
    return subprocess.run(["bash", str(ROOT / "scripts" / "launch.sh"), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**clean, "PYTHON": sys.executable, **env})


def test_no_config_prints_usage_and_fails():
    run = _launch({})
    assert run.returncode == 2 and "MODULE=" in run.stderr and "CONFIG_FILE=" in run.stderr


def test_dry_run_tt03_prints_the_torchtitan_command():
    run = _launch({"DRY_RUN": "1", "MODULE": "titan_ext.titan", "CONFIG": "pipemorph_debugmodel"})
    assert run.returncode == 0, run.stderr
    assert "-m torchtitan.train --module titan_ext.titan --config pipemorph_debugmodel" in run.stdout
    assert "torch.distributed.run" in run.stdout


def test_dry_run_toml_passes_extra_arguments():
    run = _launch({"DRY_RUN": "1", "CONFIG_FILE": "train_configs/debug_cpu.toml", "NPROC_PER_NODE": "4"},
                  "--training.steps", "3")
    assert run.returncode == 0, run.stderr
    assert "--nproc_per_node 4" in run.stdout
    assert "-m titan_ext.train --job.config_file train_configs/debug_cpu.toml --training.steps 3" in run.stdout


def test_a_model_too_big_for_this_machine_is_refused():
    run = _launch({"DRY_RUN": "1", "MODULE": "titan_ext.titan", "CONFIG": "llama3_405b_pipemorph"})
    assert run.returncode == 2 and "405b" in run.stderr and "GiB" in run.stderr


def test_real_size_configs_refuse_the_placeholder_tokenizer():
    pytest.importorskip("torchtitan")
    from titan_ext.titan.adapters import current

    if current().PYTHON_CONFIGS:
        pytest.skip("TOML configs: TorchTitan 0.2")
    from titan_ext.titan.jobcheck import JobConfigError, _resolve_asset_paths
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args(["--job.config_file", "train_configs/llama3_8b_pipemorph.toml"])
    assert config.training.dataset == "c4"
    with pytest.raises(JobConfigError, match=r"\[model\] hf_assets_path = '/path/to/Llama-3.1-8B' is a placeholder"):
        _resolve_asset_paths(config)
