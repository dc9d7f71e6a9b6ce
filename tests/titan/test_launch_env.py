"""The environment scripts/launch.sh hands each node's torchrun: run without SLURM, with a stand-in
interpreter that records the environment torchrun would start the ranks with."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAKE_PYTHON = """#!/usr/bin/env bash
# launch_fit.py and the version probe: succeed; torchrun: record the environment instead of starting ranks
if [ "$1 $2" = "-m torch.distributed.run" ]; then env -0 > "$ENV_OUT"; fi
exit 0
"""


def _torchrun_env(tmp_path: Path, **extra: str) -> dict:
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    out = tmp_path / "env.bin"
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SLURM_", "CONFIG", "MODULE", "DRY_RUN", "TORCH_NCCL", "NCCL_", "PYTORCH_ALLOC_CONF",
                                  "PYTORCH_CUDA_ALLOC_CONF", "PYTHONFAULTHANDLER", "TORCHELASTIC_"))}
    env = {**clean, "PYTHON": str(fake), "ENV_OUT": str(out), "CONFIG_FILE": "train_configs/debug_cpu.toml",
           "NPROC_PER_NODE": "1", "LOG_DIR": str(tmp_path / "logs"), **extra}
    run = subprocess.run(["bash", str(ROOT / "scripts" / "launch.sh")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return dict(item.split("=", 1) for item in out.read_bytes().decode().split("\0") if "=" in item)


@pytest.mark.multiprocess
def test_launch_leaves_nccl_async_error_handling_to_torchtitan(tmp_path):
    """TorchTitan's init_distributed sets TORCH_NCCL_ASYNC_ERROR_HANDLING=3 itself and warns on every rank
    when the variable is already set (any value): the script exported 1, so every rank of every job
    logged that warning and the 1 never applied.  Now it is not set by the script; a caller's value
    still passes through."""
    seen = _torchrun_env(tmp_path)
    assert seen.get("NCCL_DEBUG") == "WARN" and seen.get("OMP_NUM_THREADS") == "1"  # the script's defaults
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in seen, seen.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    assert _torchrun_env(tmp_path, TORCH_NCCL_ASYNC_ERROR_HANDLING="3")["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


@pytest.mark.multiprocess
def test_launch_exports_the_allocator_and_fault_handler_settings(tmp_path):
    """expandable segments (PipeMorph changes its in-flight micro-batches at run time) and Python's fault
    handler, as TorchTitan's own scripts set them; a caller's allocator setting, under either name, is kept
    and none added."""
    seen = _torchrun_env(tmp_path)
    assert seen.get("PYTORCH_ALLOC_CONF") == "expandable_segments:True" and seen.get("PYTHONFAULTHANDLER") == "1"
    assert seen.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE") == "[rank${rank}]:"
    seen = _torchrun_env(tmp_path, PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:64")
    assert seen["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64" and "PYTORCH_ALLOC_CONF" not in seen
    seen = _torchrun_env(tmp_path, PYTORCH_ALLOC_CONF="expandable_segments:False", PYTHONFAULTHANDLER="0")
    assert seen["PYTORCH_ALLOC_CONF"] == "expandable_segments:False" and seen["PYTHONFAULTHANDLER"] == "0"
