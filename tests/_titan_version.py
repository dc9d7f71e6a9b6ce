"""The TorchTitan the titan tests run under: one marker for tests of TorchTitan 0.2-only APIs
and one parser for "the bundled CPU debug job" under either version.

Every titan test file either runs under both TorchTitan 0.2.x and 0.3.x (through :func:`debug_cpu`,
whose config comes from ``train_configs/debug_cpu.toml`` on 0.2 and from its 0.3 twin
``--module titan_ext.titan --config pipemorph_debugmodel`` on 0.3), or is marked :func:`tt02_only`
with the 0.2-only API it exercises -- so ``scripts/ci_versions.sh torchtitan-0.3`` runs the whole set
and a skip says why.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from titan_ext.testing import chosen_backend, torchrun
from titan_ext.testing.launch import rank_stderr_tails
from titan_ext.testing.nccl_rules import ENV_VAR as TEST_BACKEND_VAR
from titan_ext.titan import adapters

ROOT = Path(__file__).resolve().parent.parent
ADAPTER = adapters.current()
TT_VERSION = adapters.torchtitan_version()
IS_TT02 = ADAPTER.VERSION == "0.2"
IS_TT03 = ADAPTER.VERSION == "0.3"

#: the 0.2-only APIs, named once (the skip reason of every test that needs one)
TOML_CONFIG = ("TOML job configs (ConfigManager --job.config_file, job.custom_config_module, "
               "[titan_ext] parsed from TOML)")
TITAN_EXT_TRAIN = "titan_ext.train, the TOML entry point over torchtitan.train.main"
TRAIN_SPEC = "torchtitan.protocols.train_spec (model args per flavor; gone in 0.3: model_spec)"
POSITIONAL_BUILDER = "the positional build_pipeline_schedule(job_config, stages, loss_fn)"


def tt02_only(api: str):
    """Skip unless TorchTitan 0.2.x is installed, naming the 0.2-only ``api`` the test exercises."""
    return pytest.mark.skipif(
        not IS_TT02, reason=f"TorchTitan 0.2-only API: {api}; TorchTitan {TT_VERSION} installed "
                            f"(0.3's path: tests/titan/test_titan_tt03.py)")


def titan_toml(tmp_path: Path, body: str) -> str:
    """A TOML job config in ``tmp_path`` with our config module and ``body`` (its path)."""
    p = tmp_path / "c.toml"
    p.write_text('[job]\ncustom_config_module = "titan_ext.titan.config"\n' + body)
    return str(p)


def parse_titan_args(args: list[str]):
    """TorchTitan's own ``ConfigManager().parse_args`` of ``args``."""
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(args)


def debug_cpu(*extra: str):
    """The bundled CPU debug job's config (llama3 debug model, PP = 4, one stage per rank, PipeMorph)
    with ``--section.key value`` overrides ``extra``, parsed by the installed TorchTitan's ConfigManager."""
    from torchtitan.config import ConfigManager

    if IS_TT03:
        args = ["--module", "titan_ext.titan", "--config", "pipemorph_debugmodel"]
    else:
        args = ["--job.config_file", str(ROOT / "train_configs" / "debug_cpu.toml")]
    return ConfigManager().parse_args([*args, *extra])


FALCON_CONFIG = "train_configs/debug_cpu_dp2_pp2.toml"  # TorchTitan 0.3: config_registry.falcon_dp2_pp2_debugmodel


def falcon_job_args(dump: Path) -> list[str]:
    """The DP 2 x PP 2 debug job: the TOML file under TorchTitan 0.2, its Python twin under 0.3."""
    if IS_TT03:
        return ["-m", "torchtitan.train", "--module", "titan_ext.titan", "--config", "falcon_dp2_pp2_debugmodel",
                "--dump_folder", str(dump)]
    return ["-m", "titan_ext.train", "--job.config_file", FALCON_CONFIG, "--job.dump_folder", str(dump)]


def falcon_job(dump: Path, steps: int, args: list[str], backend: str | None = None) -> None:
    """The DP 2 x PP 2 debug job for ``steps`` steps (4 ranks under torchrun, rank 3's output in
    ``dump/train.log``) with the extra arguments ``args``; the test backend ``backend`` (default:
    :func:`titan_ext.testing.chosen_backend`). Used by the Falcon job tests (test_falcon_job.py, test_falcon_s3.py)."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "MASTER_ADDR": "127.0.0.1",
                "GLOO_SOCKET_IFNAME": "lo", "PYTHONWARNINGS": "ignore"})
    for var in ("TITAN_EXT_INJECT_DELAYS", "TITAN_EXT_SLOW_DEVICE", "TITAN_EXT_SLOW_LINK"):
        env.pop(var, None)
    env[TEST_BACKEND_VAR] = chosen_backend(backend)  # nccl_rules unless the caller or the environment names gloo
    log = dump / "train.log"
    p = torchrun(4, [*falcon_job_args(dump), "--training.steps", str(steps), "--training.local_batch_size", "2",
                     "--training.global_batch_size", "12", "--training.seq_len", "32", *args],
                 log=log, cwd=ROOT, env=env, timeout=600, local_ranks_filter=3, rank_logs=dump / "ranks")
    assert p.returncode == 0, log.read_text()[-3000:] + "\n" + rank_stderr_tails(dump / "ranks")


def falcon_log(dump: Path) -> list[dict]:
    """The per-step rows of the job's ``falcon.jsonl``."""
    import json

    with open(dump / "falcon.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]
