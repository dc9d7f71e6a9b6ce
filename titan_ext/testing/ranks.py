"""Ranks on loopback for multi-process tests and benchmarks: ``run_ranks`` and the one ``free_port``.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes (torch.multiprocessing, spawn),
initialises a process group on 127.0.0.1 with a free port, calls ``fn(rank, world_size, *args)``
and returns the per-rank return values (which must be picklable).  The backend is ``backend=``, else
``$TITAN_EXT_TEST_BACKEND``, else :data:`DEFAULT_BACKEND` (``nccl_rules``: NCCL's rules enforced on
CPU over gloo, :mod:`titan_ext.testing.nccl_rules`; ``gloo``: plain gloo).  ``timeout_s=`` bounds
the run; ``outcomes=True`` lets ranks fail on purpose (fault tests) and returns ``(result, error)``
per rank.  The one ``run_ranks`` / ``free_port`` of the project's tests and scripts (torchrun jobs:
:mod:`titan_ext.testing.launch`).
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it; a rendezvous binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: the backend of ``run_ranks`` when neither ``backend=`` nor ``$TITAN_EXT_TEST_BACKEND`` names one
DEFAULT_BACKEND = "nccl_rules"


def chosen_backend(backend: str | None = None) -> str:
    """The backend a multi-process test uses: ``backend``, ``$TITAN_EXT_TEST_BACKEND``, the default."""
    from .nccl_rules import ENV_VAR

    return backend or os.environ.get(ENV_VAR) or DEFAULT_BACKEND


def _entry(rank: int, fn: Callable, world_size: int, port: int, outdir: str, args: tuple, env: dict,
           backend: str, outcomes: bool = False) -> None:
    os.environ.update(env)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    path = os.path.join(outdir, f"rank{rank}.pkl")
    try:
        if backend == "nccl_rules":
            from .nccl_rules import install

            install()
        # outcomes: ranks may fail on purpose (fault tests), so the group's waits end after 2 minutes
        dist.init_process_group(backend, rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}",
                                **({"timeout": timedelta(seconds=120)} if outcomes else {}))
        result = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent, which stops the other ranks
        _write_result(path, ("error", traceback.format_exc()))
        os._exit(0 if outcomes else 1)  # outcomes: a failure is a result; the other ranks go on
    from titan_ext.runtime.emulate.delay_injection import remove_link_delays

    remove_link_delays()
    if not outcomes:  # outcomes: another rank may have failed on purpose; nobody waits for it
        dist.barrier()
    dist.destroy_process_group()
    _write_result(path, result)
    # Skip interpreter finalisation (daemon threads, C++ destructors of process-group objects): the
    # result is on disk and the process group is already destroyed.
    os._exit(0)


def _write_result(path: str, result: tuple) -> None:
    """Atomically (a rank being terminated never leaves half a file)."""
    with open(path + ".tmp", "wb") as fh:
        pickle.dump(result, fh)
    os.replace(path + ".tmp", path)


def run_ranks(fn: Callable, world_size: int, *args: Any, env: dict | None = None,
              backend: str | None = None, timeout_s: float | None = None, outcomes: bool = False) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return the results by rank.
    ``backend``: see the module docstring (:func:`chosen_backend`).  ``timeout_s``: the ranks are
    killed and ``TimeoutError`` raised after this long (None: no limit).

    If a rank fails, the others are terminated and the failing rank's traceback is raised — unless
    ``outcomes``: then every rank runs to its end and each returns ``(result, None)`` or
    ``(None, traceback)`` (tests whose ranks fail on purpose, e.g. a killed delegate).
    """
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_entry, args=(fn, world_size, free_port(), outdir, args, env or {},
                                               chosen_backend(backend), outcomes),
                                 nprocs=world_size, join=False, start_method="spawn")
        try:
            _join(ctx, timeout_s)
        except TimeoutError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise RuntimeError("\n".join(f"rank {r} failed:\n{v}" for r, (s, v) in enumerate(_read_results(outdir, world_size))
                                         if s == "error") or str(exc)) from None
        results = _read_results(outdir, world_size)
    if outcomes:
        return [(value, None) if status == "ok" else (None, value) for status, value in results]
    for rank, (status, value) in enumerate(results):
        if status is None:
            raise RuntimeError(f"rank {rank} produced no result")
        if status != "ok":
            raise RuntimeError(f"rank {rank} failed:\n{value}")
    return [value for _, value in results]


def _join(ctx: Any, timeout_s: float | None) -> None:
    """Wait for every rank (``ProcessContext.join`` raises when one fails); kill them all past the deadline."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):
        if deadline is not None and time.monotonic() > deadline:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
            raise TimeoutError(f"rank processes did not finish in {timeout_s} s")


def _read_results(outdir: str, world_size: int) -> list[tuple[str | None, Any]]:
    """(status, value) by rank; (None, None) for a rank without a result file."""
    out: list[tuple[str | None, Any]] = []
    for rank in range(world_size):
        path = os.path.join(outdir, f"rank{rank}.pkl")
        if not os.path.exists(path):
            out.append((None, None))
            continue
        with open(path, "rb") as fh:
            out.append(pickle.load(fh))
    return out
