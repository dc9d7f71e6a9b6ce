"""CPU/gloo shim for TorchTitan's CUDA assumptions (0.2.x and 0.3.x alike).

TorchTitan decides its device once, at import time, in ``torchtitan.tools.utils``:
``device_type = _get_available_device_type() or "cuda"`` and ``device_module = torch.cuda``, and several
modules copy those two names into their own namespace (``from torchtitan.tools.utils import
device_type, device_module``). On a machine without an accelerator the trainer would therefore call
``torch.cuda.set_device`` and build a NCCL process group.

:func:`apply` rebinds ``device_type = "cpu"`` and ``device_module`` = :class:`CpuDeviceModule` in every
TorchTitan module that holds a copy. With ``device_type = "cpu"`` TorchTitan itself picks the gloo
backend (``Backend.default_device_backend_map["cpu"]``) and a CPU device mesh. The trainer reads
``utils.device_type`` when it is constructed, so applying the shim from ``custom_import`` (which runs
at the very start of ``Trainer.__init__``) is early enough.

:class:`CpuDeviceModule` implements the subset of the ``torch.cuda`` API the trainer uses. Memory
numbers are the process's peak resident set size (``getrusage``), reported as both "active" and
"reserved" peak; the peak cannot be reset on Linux, so ``reset_peak_memory_stats`` is a no-op.

With ``TITAN_EXT_TEST_BACKEND=nccl_rules`` the shim also installs the NCCL-rules test backend
(:mod:`titan_ext.testing.nccl_rules`) and makes it TorchTitan's CPU backend, so the trainer's PP and
DP groups obey NCCL's rules (the control plane still asks for gloo); with ``TITAN_EXT_TEST_DEVICE=lag``
it installs the simulated device that runs behind the host (:mod:`titan_ext.testing.lagdevice`).
"""

import os
import platform
import resource
import sys
from types import SimpleNamespace

import torch

__all__ = ["apply", "is_applied", "CpuDeviceModule"]

_TORCHTITAN_MODULES = (
    "torchtitan.tools.utils",
    "torchtitan.components.metrics",
    "torchtitan.distributed.utils",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.tools.profiling",
)
_applied = False


def _total_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


class _CpuMemory:
    @staticmethod
    def _record_memory_history(*args, **kwargs):
        raise RuntimeError(
            "[profiling] enable_memory_snapshot needs a CUDA device; it is not available in "
            "titan_ext's CPU mode"
        )

    @staticmethod
    def _snapshot(*args, **kwargs):
        raise RuntimeError("memory snapshots need a CUDA device (titan_ext CPU mode)")


class CpuDeviceModule:
    """The part of the ``torch.cuda`` API that TorchTitan's trainer calls, for the CPU."""

    memory = _CpuMemory()

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def set_device(device) -> None:
        return None

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def synchronize(device=None) -> None:
        return None

    @staticmethod
    def get_device_name(device=None) -> str:
        return f"CPU ({platform.machine()}, {os.cpu_count()} cores)"

    @staticmethod
    def get_device_properties(device=None):
        return SimpleNamespace(total_memory=_total_memory_bytes(), name="CPU")

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        return None  # ru_maxrss cannot be reset

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def memory_stats(device=None) -> dict:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return {
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    def __getattr__(self, name):  # anything else: torch.cpu's version, if it has one
        return getattr(torch.cpu, name)


def apply(modules: tuple[str, ...] = _TORCHTITAN_MODULES) -> None:
    """Point TorchTitan at the CPU (gloo backend): rebind ``device_type`` / ``device_module`` in
    ``modules`` (the TorchTitan adapter's ``CPU_SHIM_MODULES``). Idempotent; skips modules that do not
    import."""
    global _applied
    import importlib

    _use_test_backend()
    device_module = CpuDeviceModule()
    for name in modules:
        mod = sys.modules.get(name)
        if mod is None:
            try:
                mod = importlib.import_module(name)
            except ImportError:
                continue
        if hasattr(mod, "device_type"):
            mod.device_type = "cpu"
        if hasattr(mod, "device_module"):
            mod.device_module = device_module
    _applied = True


def _use_test_backend() -> None:
    """``TITAN_EXT_TEST_BACKEND=nccl_rules``: TorchTitan's CPU groups get NCCL's rules;
    ``TITAN_EXT_TEST_DEVICE=lag``: the stages' device is the simulated one that runs behind the host
    (:mod:`titan_ext.testing.lagdevice`, installed on this thread: the trainer's)."""
    from titan_ext.testing import lagdevice
    from titan_ext.testing.nccl_rules import BACKEND, ENV_VAR, install

    if os.environ.get(ENV_VAR) == BACKEND:
        install()
        torch.distributed.Backend.default_device_backend_map["cpu"] = BACKEND
    lagdevice.install_from_env()


def is_applied() -> bool:
    return _applied
