"""Loads the compiled data plane ``titan_ext._delegate_C`` (built from cpp_ext/ by scripts/setup.sh)."""

from __future__ import annotations

import importlib

_mod = None

#: what to do when the compiled data plane is missing (one line, shown by every check below)
MISSING_HINT = ("reinstall titan_ext into this environment with `pip install --no-build-isolation .` "
                "(torch must be importable at build time), or set delegation = \"off\"")


def missing_reason() -> str | None:
    """None when ``titan_ext._delegate_C`` loads, else one line naming the problem and the fix."""
    try:
        load_ext()
    except ImportError as exc:
        return f"titan_ext._delegate_C (the delegate data plane) is not built or does not load " \
               f"({exc.__cause__ or exc}): {MISSING_HINT}"
    return None


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
