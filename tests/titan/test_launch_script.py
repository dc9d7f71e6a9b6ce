"""scripts/launch.sh: usage without a config, DRY_RUN for both config systems (the ranks each config
needs, the console's rank filter, the environment exported, srun's CPUs under SLURM), a model too big for
the machine refused; the real-size configs refuse their placeholder tokenizer path."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _launch(env, *args):
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SLURM_", "CONFIG", "MODULE", "DRY_RUN", "NNODES", "NPROC_PER_NODE", "LOG_RANK",
                                  "CPUS_PER_TASK", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "TORCH_NCCL"))}
    return subprocess.run(["bash", str(ROOT / "scripts" / "launch.sh"), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**clean, "PYTHON": sys.executable, **env})


@pytest.mark.multiprocess
def test_no_config_prints_usage_and_fails():
    run = _launch({})
    assert run.returncode == 2 and "MODULE=" in run.stderr and "CONFIG_FILE=" in run.stderr


@pytest.mark.multiprocess
def test_dry_run_tt03_prints_the_torchtitan_command():
    run = _launch({"DRY_RUN": "print", "MODULE": "titan_ext.titan", "CONFIG": "pipemorph_debugmodel"})
    assert run.returncode == 0, run.stderr
    assert "-m torchtitan.train --module titan_ext.titan --config pipemorph_debugmodel" in run.stdout
    assert "torch.distributed.run" in run.stdout


@pytest.mark.multiprocess
def test_dry_run_toml_passes_extra_arguments():
    run = _launch({"DRY_RUN": "print", "CONFIG_FILE": "train_configs/debug_cpu.toml", "NPROC_PER_NODE": "4"},
                  "--training.steps", "3")
    assert run.returncode == 0, run.stderr
    assert "--nproc_per_node 4" in run.stdout
    assert "-m titan_ext.train --job.config_file train_configs/debug_cpu.toml --training.steps 3" in run.stdout


@pytest.mark.multiprocess
def test_a_model_too_big_for_this_machine_is_refused(tmp_path):
    run = _launch({"MODULE": "titan_ext.titan", "CONFIG": "llama3_405b_pipemorph", "LOG_DIR": str(tmp_path / "logs")})
    assert run.returncode == 2 and "405b" in run.stderr and "GiB" in run.stderr
    assert not (tmp_path / "logs").exists()  # refused before anything started


def _command(run) -> str:
    """The command line DRY_RUN printed (its last line, after a comment and the exports), its words
    unquoted and joined by spaces."""
    assert run.returncode == 0, run.stderr
    return " ".join(shlex.split(run.stdout.strip().splitlines()[-1]))


@pytest.mark.multiprocess
@pytest.mark.parametrize("config, nnodes, nproc, shown", [
    ({"MODULE": "titan_ext.titan", "CONFIG": "pipemorph_debugmodel"}, 1, 4, "3"),  # PP 4: the loss on rank 3
    ({"MODULE": "titan_ext.titan", "CONFIG": "falcon_dp2_pp2_debugmodel"}, 1, 4, "2"),  # DP 2 x PP 2: ranks 2, 3
    ({"CONFIG_FILE": "train_configs/debug_cpu.toml"}, 1, 4, "3"),
    ({"CONFIG_FILE": "train_configs/debug_cpu_dp2_pp4.toml"}, 1, 8, "6"),
    # the real-size configs outside SLURM: the command for the nodes they need, not a refusal
    ({"MODULE": "titan_ext.titan", "CONFIG": "llama3_8b_pipemorph"}, 1, 8, "7"),  # PP 8 x FSDP
    ({"CONFIG_FILE": "train_configs/llama3_8b_pipemorph.toml"}, 1, 8, "7"),
    ({"MODULE": "titan_ext.titan", "CONFIG": "llama3_70b_pipemorph"}, 8, 8, "0"),  # PP 8 x TP 8: rank 56
    ({"CONFIG_FILE": "train_configs/llama3_70b_pipemorph.toml"}, 8, 8, "0"),
])
def test_dry_run_runs_the_ranks_the_config_needs_and_shows_its_loss_rank(config, nnodes, nproc, shown):
    cmd = _command(_launch({"DRY_RUN": "print", **config}))
    assert f"--nnodes {nnodes} --nproc_per_node {nproc} " in cmd
    assert f" --role rank --tee 3 --local-ranks-filter {shown} -m " in cmd


@pytest.mark.multiprocess
def test_dry_run_prints_the_environment_it_exports():
    run = _launch({"DRY_RUN": "print", "MODULE": "titan_ext.titan", "CONFIG": "pipemorph_debugmodel"})
    exports = [line for line in run.stdout.splitlines() if line.startswith("export ")]
    for line in ("export PYTORCH_ALLOC_CONF=expandable_segments:True", "export PYTHONFAULTHANDLER=1",
                 "export OMP_NUM_THREADS=1", "export PYTHONUNBUFFERED=1"):
        assert line in exports, run.stdout
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in run.stdout
    assert run.stdout.startswith("# 1 node(s) x 4 ranks, the console shows local rank(s) 3")
    # a caller's allocator settings (either name) are theirs: no PYTORCH_ALLOC_CONF added
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        run = _launch({"DRY_RUN": "print", "CONFIG_FILE": "train_configs/debug_cpu.toml", name: "max_split_size_mb:64"})
        exports = [line for line in run.stdout.splitlines() if "ALLOC_CONF" in line]
        assert exports == [f"export {name}=max_split_size_mb:64"], run.stdout


@pytest.mark.multiprocess
@pytest.mark.parametrize("log_rank, shown", [("1", "--local-ranks-filter 1 "), ("0,3", "--local-ranks-filter 0,3 "),
                                             ("all", "--tee 3 -m ")])
def test_log_rank_picks_the_ranks_the_console_shows(log_rank, shown):
    cmd = _command(_launch({"DRY_RUN": "print", "CONFIG_FILE": "train_configs/debug_cpu.toml", "LOG_RANK": log_rank}))
    assert shown in cmd and (log_rank != "all" or "--local-ranks-filter" not in cmd)


@pytest.mark.multiprocess
@pytest.mark.parametrize("log_rank", ["x", "1,", "-1", "01", "3;touch pwned"])
def test_a_bad_log_rank_is_refused(log_rank, tmp_path):
    run = _launch({"DRY_RUN": "print", "CONFIG_FILE": "train_configs/debug_cpu.toml", "LOG_RANK": log_rank})
    assert run.returncode == 2 and "LOG_RANK" in run.stderr and len(run.stderr.strip().splitlines()) == 1


@pytest.mark.multiprocess
def test_parallelism_arguments_on_the_command_line_change_the_world():
    cmd = _command(_launch({"DRY_RUN": "print", "CONFIG_FILE": "train_configs/debug_cpu.toml"},
                           "--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_replicate_degree=3"))
    assert "--nnodes 1 --nproc_per_node 6 " in cmd and "--local-ranks-filter 3 " in cmd  # rank 3: PP rank 1


@pytest.mark.multiprocess
def test_an_unreadable_config_function_keeps_the_defaults():
    cmd = _command(_launch({"DRY_RUN": "print", "MODULE": "titan_ext.titan", "CONFIG": "no_such_config"}))
    assert "--nnodes 1 --nproc_per_node 8 " in cmd and "--local-ranks-filter 0 " in cmd


@pytest.mark.multiprocess
def test_under_slurm_srun_gets_the_node_cpus_and_every_node_filters_its_local_ranks():
    slurm = {"DRY_RUN": "print", "MODULE": "titan_ext.titan", "CONFIG": "pipemorph_debugmodel", "SLURM_JOB_ID": "42",
             "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "2", "SLURM_CPUS_ON_NODE": "96"}
    run = _launch(slurm)
    cmd = _command(run)
    assert cmd.startswith("srun --nodes=2 --ntasks-per-node=1 --cpus-per-task=96 ")
    # 4 ranks on 2 nodes x 2: the loss on rank 3, local rank 1 of its node; every node shows its local rank 1
    assert "--nnodes 2 --nproc_per_node 2 " in cmd and "--local-ranks-filter 1 " in cmd
    assert "each node" in run.stdout.splitlines()[0]
    assert "export TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE=" in run.stdout  # lines carry the global rank
    assert "--cpus-per-task=7 " in _command(_launch({**slurm, "SLURM_CPUS_PER_TASK": "7"}))  # sbatch -c 7
    assert "--cpus-per-task=20 " in _command(_launch({**slurm, "SLURM_CPUS_PER_TASK": "7", "CPUS_PER_TASK": "20"}))


@pytest.mark.multiprocess
def test_under_slurm_an_allocation_smaller_than_the_config_is_noted():
    run = _launch({"DRY_RUN": "print", "MODULE": "titan_ext.titan", "CONFIG": "llama3_70b_pipemorph", "SLURM_JOB_ID": "42",
                   "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "8"})
    assert "--nnodes 2 --nproc_per_node 8 " in _command(run)
    assert "runs on a multiple of 64 ranks" in run.stderr


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
