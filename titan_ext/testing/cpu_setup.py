"""The tests' set-up hook of the CPU shim (``titan/cpu_shim.py``, :data:`SETUP_ENV`): in a TorchTitan
job on CPU, ``TITAN_EXT_TEST_BACKEND=nccl_rules`` installs the NCCL-rules backend (:mod:`.nccl_rules`)
and makes it TorchTitan's CPU backend, so the trainer's PP and DP groups obey NCCL's rules (the
control plane still asks for gloo); ``TITAN_EXT_TEST_DEVICE=lag`` installs the simulated device that
runs behind the host (:mod:`.lagdevice`, on the calling thread: the trainer's).

The shim names no test module: a job's environment names this hook (:func:`job_env`, which the one
torchrun launcher of the tests, :func:`~.launch.torchrun`, applies)."""

from __future__ import annotations

import os
from typing import Mapping

__all__ = ["SETUP", "SETUP_ENV", "job_env", "setup"]

SETUP_ENV = "TITAN_EXT_CPU_SETUP"
"""The shim's variable (``titan/cpu_shim.SETUP_ENV``; the same name, checked by the tests)."""
SETUP = f"{__name__}:setup"


def setup() -> None:
    """Install the test backend and device the environment asks for (idempotent)."""
    import torch.distributed as dist

    from . import lagdevice
    from .nccl_rules import BACKEND, ENV_VAR, install

    if os.environ.get(ENV_VAR) == BACKEND:
        install()
        dist.Backend.default_device_backend_map["cpu"] = BACKEND
    lagdevice.install_from_env()


def job_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with this hook among the shim's set-up hooks (once)."""
    out = dict(env)
    hooks = [h for h in out.get(SETUP_ENV, "").split(",") if h.strip()]
    if SETUP not in hooks:
        out[SETUP_ENV] = ",".join([*hooks, SETUP])
    return out
