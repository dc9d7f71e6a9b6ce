"""The one torchrun launcher of the tests and scripts: ``python -m torch.distributed.run`` on loopback.

:func:`torchrun_command` builds the command line (``--nproc_per_node``, ``--master_addr 127.0.0.1``,
a free ``--master_port``, optionally ``--local-ranks-filter``, then the job's own arguments, e.g.
``["-m", "titan_ext.train", "--job.config_file", ...]``); :func:`torchrun` runs it with stdout and
stderr in one log file.  The environment is the caller's (each job decides what it sets and drops).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Mapping, Sequence

from .ranks import free_port

__all__ = ["torchrun", "torchrun_command"]


def torchrun_command(nproc: int, job: Sequence[str], *, master_port: int | None = None,
                     local_ranks_filter: int | None = None, python: str = sys.executable) -> list[str]:
    """``python -m torch.distributed.run`` with ``nproc`` ranks on 127.0.0.1 (``master_port``: a
    free port unless given), then ``job``; ``local_ranks_filter``: the one rank whose output torchrun shows."""
    cmd = [python, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(master_port or free_port())]
    if local_ranks_filter is not None:
        cmd += ["--local-ranks-filter", str(local_ranks_filter)]
    return cmd + list(job)


def torchrun(nproc: int, job: Sequence[str], *, log: str | Path, cwd: str | Path, env: Mapping[str, str],
             timeout: float | None = None, local_ranks_filter: int | None = None,
             check: bool = False) -> subprocess.CompletedProcess:
    """Run :func:`torchrun_command` in ``cwd`` with ``env``, its output (stdout and stderr) in ``log``."""
    with open(log, "w") as f:
        return subprocess.run(torchrun_command(nproc, job, local_ranks_filter=local_ranks_filter), cwd=cwd,
                              env=dict(env), stdout=f, stderr=subprocess.STDOUT, timeout=timeout, check=check)
