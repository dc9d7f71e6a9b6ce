"""The one torchrun launcher of the tests and scripts: ``python -m torch.distributed.run`` on loopback.

:func:`torchrun_command` builds the command line (``--nproc_per_node``, ``--master_addr 127.0.0.1``,
a free ``--master_port``, optionally ``--local-ranks-filter`` and per-rank logs, then the job's own arguments, e.g.
``["-m", "titan_ext.train", "--job.config_file", ...]``); :func:`torchrun` runs it with stdout and
stderr in one log file.  The environment is the caller's (each job decides what it sets and drops), with
the tests' CPU set-up hook named for TorchTitan's CPU shim (:func:`~.cpu_setup.job_env`).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Mapping, Sequence

from .cpu_setup import job_env
from .ranks import free_port

__all__ = ["rank_stderr_tails", "torchrun", "torchrun_command"]


def torchrun_command(nproc: int, job: Sequence[str], *, master_port: int | None = None,
                     local_ranks_filter: int | None = None, python: str = sys.executable,
                     rank_logs: str | Path | None = None) -> list[str]:
    """``python -m torch.distributed.run`` with ``nproc`` ranks on 127.0.0.1 (``master_port``: a
    free port unless given), then ``job``; ``local_ranks_filter``: the one rank whose output torchrun shows;
    ``rank_logs``: a folder where torchrun also keeps every rank's stdout and stderr (``--log-dir``, ``--tee 3``)."""
    cmd = [python, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(master_port or free_port())]
    if local_ranks_filter is not None:
        cmd += ["--local-ranks-filter", str(local_ranks_filter)]
    if rank_logs is not None:
        cmd += ["--log-dir", str(rank_logs), "--tee", "3"]
    return cmd + list(job)


def rank_stderr_tails(rank_logs: str | Path, chars: int = 1500) -> str:
    """The end of each rank's stderr that torchrun kept under ``rank_logs`` (:func:`torchrun_command`), rank
    by rank: where a job failed on a rank whose output the console filter hid."""
    parts = []
    for f in sorted(Path(rank_logs).rglob("stderr.log")):
        text = f.read_text(errors="replace").strip()
        if text:
            parts.append(f"--- local rank {f.parent.name}, stderr ---\n{text[-chars:]}")  # <dir>/<run>/attempt_0/<rank>/
    return "\n".join(parts)


def torchrun(nproc: int, job: Sequence[str], *, log: str | Path, cwd: str | Path, env: Mapping[str, str],
             timeout: float | None = None, local_ranks_filter: int | None = None,
             check: bool = False, rank_logs: str | Path | None = None) -> subprocess.CompletedProcess:
    """Run :func:`torchrun_command` in ``cwd`` with ``env`` (plus the CPU set-up hook, :func:`~.cpu_setup.job_env`),
    its output (stdout and stderr) in ``log``."""
    with open(log, "w") as f:
        return subprocess.run(torchrun_command(nproc, job, local_ranks_filter=local_ranks_filter,
                                               rank_logs=rank_logs), cwd=cwd,
                              env=job_env(env), stdout=f, stderr=subprocess.STDOUT, timeout=timeout, check=check)
