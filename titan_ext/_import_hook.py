"""Register with TorchTitan whatever the import order (no torch import here).

``import titan_ext`` registers at once when torchtitan is already loaded (TorchTitan's
``custom_import``). When ``titan_ext`` comes first, :func:`install` adds a meta-path finder that
waits for TorchTitan's pipeline builder (``torchtitan.distributed.pipeline_parallel``) and registers
right after that module has executed, so ``get_schedule_class("PipeMorph")`` resolves in both orders.
"""

import importlib.abc
import sys

TRIGGER = "torchtitan.distributed.pipeline_parallel"


class _Loader(importlib.abc.Loader):
    """Runs the real loader, then titan_ext's registration."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        from titan_ext.titan.registry import register

        register()


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TRIGGER:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from finding us
        for finder in sys.meta_path:
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """Register after TorchTitan's pipeline builder loads (idempotent)."""
    if not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
