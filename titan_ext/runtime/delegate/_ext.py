"""Loads the compiled data plane ``titan_ext._delegate_C`` (built from cpp_ext/ by scripts/setup.sh)."""

from __future__ import annotations

import importlib

_mod = None


def load_ext():
    global _mod
    if _mod is None:
        import torch  # noqa: F401  (loads libc10/libtorch the extension links against)

        try:
            _mod = importlib.import_module("titan_ext._delegate_C")
        except ImportError as exc:
            raise ImportError(
                "titan_ext._delegate_C (cpp_ext/) is not built: run scripts/setup.sh "
                f"(pip install --no-build-isolation -e .) — {exc}") from exc
    return _mod


def cuda_available() -> bool:
    """The data plane's CUDA kernels were compiled in and a GPU is present."""
    import torch

    return bool(load_ext().cuda_compiled()) and torch.cuda.is_available()
