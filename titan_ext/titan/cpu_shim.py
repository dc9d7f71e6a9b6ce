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

Before it rebinds anything the shim calls the set-up hooks the environment names (:data:`SETUP_ENV`,
``module:function`` entries separated by commas): a caller's CPU process-group backend or simulated
device is installed there, before TorchTitan builds its groups. The tests name theirs (the NCCL-rules
backend, the lagging device; ``testing/cpu_setup.py``); the shim knows none of them.
"""

import os
import platform
import resource
import sys
from types import SimpleNamespace

import torch

__all__ = ["SETUP_ENV", "apply", "is_applied", "CpuDeviceModule", "run_setup_hooks"]

SETUP_ENV = "TITAN_EXT_CPU_SETUP"
"""``module:function,...``: called in order by :func:`apply` before TorchTitan builds its process groups
(``function`` defaults to ``setup``)."""

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

    run_setup_hooks()
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


def run_setup_hooks(environ=os.environ) -> list[str]:
    """Call every ``module:function`` of :data:`SETUP_ENV` (idempotence is the hook's); returns them.
    A hook that does not import or is not a callable fails the job, naming the entry."""
    import importlib

    done = []
    for entry in filter(None, (e.strip() for e in environ.get(SETUP_ENV, "").split(","))):
        module, _, name = entry.partition(":")
        try:
            hook = getattr(importlib.import_module(module), name or "setup")
        except (ImportError, AttributeError) as e:
            raise RuntimeError(f"{SETUP_ENV}: {entry!r}: {e}") from e
        if not callable(hook):
            raise RuntimeError(f"{SETUP_ENV}: {entry!r} is not a callable")
        hook()
        done.append(entry)
    return done


def is_applied() -> bool:
    return _applied
