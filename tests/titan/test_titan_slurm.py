"""scripts/launch.sh under a real single-node SLURM (Debian slurm-wlm + munge).

The test brings SLURM up itself with scripts/ci_slurm_setup.sh (apt install + munged, slurmctld,
slurmd; idempotent), which needs root and apt. Without both it is skipped, saying why.
The job runs the CPU config (train_configs/debug_cpu.toml, PP=4 on CPU/gloo) to completion with
sbatch, exactly as a user submits it; only the GPU/CPU request is adapted to a CPU-only node.
"""

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from _titan_version import TITAN_EXT_TRAIN, tt02_only

pytestmark = [pytest.mark.slow, tt02_only(TITAN_EXT_TRAIN + " (scripts/launch.sh runs a TOML config)")]
STEPS = 8
"""Steps of the config's job (its own 20 take ~40 s more and show nothing more of the launch)."""

ROOT = Path(__file__).resolve().parents[2]


def _slurm_up() -> None:
    if shutil.which("sbatch") and subprocess.run(["sinfo", "-h"], capture_output=True).returncode == 0:
        states = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True).stdout
        if re.search(r"idle|mix|alloc", states):
            return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("no running SLURM, and installing one needs root + apt (scripts/ci_slurm_setup.sh)")
    p = subprocess.run(["bash", str(ROOT / "scripts" / "ci_slurm_setup.sh")], capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]


def _job_field(job_id: str, name: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    m = re.search(rf"\b{name}=(\S+)", out)
    return m.group(1) if m else ""


def test_sbatch_launch_runs_cpu_config_to_completion(tmp_path):
    _slurm_up()
    dump = tmp_path / "dump"
    slurm_log = tmp_path / "job-%j.out"
    env = dict(os.environ)
    env.update({
        "CONFIG_FILE": "train_configs/debug_cpu.toml",
        "NPROC_PER_NODE": "4",
        "LOG_DIR": str(tmp_path / "logs"),
        "MASTER_PORT": str(29000 + os.getpid() % 900),
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHON": str(ROOT / ".venv" / "bin" / "python"),
    })
    env.pop("TITAN_EXT_INJECT_DELAYS", None)
    cmd = ["sbatch", "--parsable", "--wait",
           "--gpus-per-node=0", "--cpus-per-task=1", "--no-requeue",
           "--job-name=titan_ext_ci", f"--output={slurm_log}", "--time=00:10:00",
           str(ROOT / "scripts" / "launch.sh"), "--job.dump_folder", str(dump), "--training.steps", str(STEPS)]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=660)
    job_id = p.stdout.strip().split(";")[0]
    logs = list(tmp_path.glob("job-*.out"))
    text = logs[0].read_text() if logs else "(no job log)"
    assert p.returncode == 0, f"sbatch rc={p.returncode}\n{p.stderr}\n{text[-4000:]}"
    assert job_id.isdigit(), p.stdout
    assert logs and logs[0].name == f"job-{job_id}.out"
    assert _job_field(job_id, "JobState") == "COMPLETED"
    assert _job_field(job_id, "ExitCode") == "0:0"
    assert f"[launch] job {job_id}: 1 node(s) x 4 ranks" in text
    assert "rendezvous c10d at" in text
    assert f"[launch] job {job_id} finished" in text
    # the config ran to its last step, with PipeMorph, and its loss fell
    with open(dump / "pipeline_metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[0]["schedule"] == "PipeMorph"
    assert rows[-1]["loss"] < rows[0]["loss"]
    # per-job, per-launch (the rendezvous id: the job id, or its S4 relaunch's), per-rank logs from torchrun
    assert list((tmp_path / "logs").glob(f"titan_ext_ci-{job_id}/{job_id}/*/attempt_0/3/*"))
    print(f"slurm job {job_id} took {time.monotonic() - t0:.0f} s")
