"""Freeze one rank of a 4-rank CPU training run (SIGSTOP) and measure how long the job takes to end.

    PYTHONPATH=$PWD python scripts/frozen_rank.py --rank 2 --step 5 --timeout 30

Runs ``torchrun --nproc_per_node 4 -m titan_ext.train --job.config_file train_configs/debug_cpu.toml
--comm.train_timeout_seconds T``; when rank 0 logs step K, sends SIGSTOP to the process of rank R and
times the job's end from there. Prints one JSON line: ``ended_after_s`` (SIGSTOP → torchrun's exit),
``timeout_s``, ``exit_code``, ``names_rank`` (whether the log says that rank R stopped answering) and the
line that says it. The job must end within ``timeout + 30 s`` with that message.
Nothing is left behind: the frozen process is killed if torchrun did not, and SIGTERM / SIGINT to this
script kill the whole job (torchrun runs in a session of its own) before it exits 143 / 130. The log and
the job's dump folder go to ``--log`` and its folder, by default a new private temporary folder.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "train_configs" / "debug_cpu.toml"
sys.path.insert(0, str(ROOT))

from titan_ext.testing import torchrun_command  # noqa: E402
from titan_ext.testing.cpu_setup import job_env  # noqa: E402


def _rank_pid(parent: int, rank: int) -> int | None:
    """The process below ``parent`` (torchrun) whose environment has RANK=rank."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and _descends(int(pid), parent):
            return int(pid)
    return None


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return False


def run(rank: int, step: int, timeout_s: float, schedule: str, steps: int, log: Path, cap_s: float,
        backend: str = "gloo", delegation: str = "off") -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=str(ROOT), TITAN_EXT_TEST_BACKEND=backend)
    env.pop("TITAN_EXT_NCCL_RULES_WATCHDOG", None)
    env.pop("TITAN_EXT_INJECT_DELAYS", None)
    env = job_env(env)  # the CPU shim's test set-up: the backend above for the trainer's groups
    cmd = torchrun_command(4, ["-m", "titan_ext.train", "--job.config_file", str(CONFIG),
                               "--comm.train_timeout_seconds", str(int(timeout_s)), "--training.steps", str(steps),
                               "--parallelism.pipeline_parallel_schedule", schedule,
                               "--job.dump_folder", str(log.parent / "dump"), "--titan_ext.gantt_every", "0",
                               "--titan_ext.delegation", delegation])
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    frozen: dict = {}
    pattern = re.compile(rf"step:\s*{step}\b")

    def read() -> None:
        with open(log, "w") as f:
            for line in proc.stdout:
                f.write(line)
                if not frozen and pattern.search(line):
                    pid = _rank_pid(proc.pid, rank)
                    if pid is not None:
                        os.kill(pid, signal.SIGSTOP)
                        frozen.update(pid=pid, t=time.monotonic())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=cap_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
    finally:
        if proc.poll() is None:  # a signal to this script: the job goes with it
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    ended = time.monotonic()
    reader.join(timeout=10)
    if frozen.get("pid"):
        try:  # torchrun kills its workers; make sure of it
            os.kill(frozen["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    text = log.read_text(errors="replace")
    named = [ln.strip() for ln in text.splitlines() if f"rank {rank} stopped answering" in ln]
    return {"frozen_rank": rank, "at_step": step, "timeout_s": timeout_s, "schedule": schedule, "backend": backend,
            "delegation": delegation,
            "froze": bool(frozen), "ended_after_s": round(ended - frozen["t"], 1) if frozen else None,
            "run_s": round(ended - started, 1), "exit_code": code, "names_rank": bool(named),
            "message": named[0][:300] if named else None, "log": str(log)}


def default_log() -> Path:
    """``run.log`` in a new temporary folder of this user's alone (mode 0700)."""
    return Path(tempfile.mkdtemp(prefix="titan_ext_frozen_rank.")) / "run.log"


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main() -> int:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_on_signal)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, default=2)
    p.add_argument("--step", type=int, default=5)
    p.add_argument("--timeout", type=float, default=30.0, help="comm.train_timeout_seconds")
    p.add_argument("--schedule", default="PipeMorph")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl_rules"],
                   help="the trainer's CPU backend (nccl_rules: NCCL's group timeout and watchdog)")
    p.add_argument("--delegation", default="off", choices=["off", "auto", "always"],
                   help="[titan_ext] delegation (PP messages through delegate processes)")
    p.add_argument("--log", type=Path, default=None,
                   help="the job's log (its dump folder goes beside it); default: a new private temporary folder")
    args = p.parse_args()
    if args.log is None:
        args.log = default_log()
    args.log.parent.mkdir(parents=True, exist_ok=True)
    cap = 600.0 + args.timeout
    print(json.dumps(run(args.rank, args.step, args.timeout, args.schedule, args.steps, args.log, cap, args.backend,
                                args.delegation)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
