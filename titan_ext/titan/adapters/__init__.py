"""One thin adapter per TorchTitan version, chosen at import by the installed TorchTitan's version.

Everything TorchTitan-version specific lives in one adapter module: the hooks titan_ext patches (the
pipeline builder functions and their signatures), where the trainer class lives, where a config keeps
its dump folder, how the metrics processor picks its logging rank, which modules the CPU shim rebinds.
The ``TitanExt`` config dataclass (:mod:`titan_ext.titan.config`), the schedule registry
(:mod:`titan_ext.titan.registry`) and the trainer logic (:mod:`titan_ext.titan.trainer`) are shared.

======================  ============================================================================
TorchTitan              adapter
======================  ============================================================================
0.2.x (TOML configs)    :mod:`titan_ext.titan.adapters.tt02` (``[titan_ext]`` via custom_config_module)
0.3.x (Python configs)  :mod:`titan_ext.titan.adapters.tt03` (``--module titan_ext.titan --config ...``)
======================  ============================================================================

An unknown TorchTitan version, a known one whose hook is missing (renamed in a point release), or a
hook whose parameters are not the ones titan_ext's wrapper takes (``adapter.SIGNATURES``, checked by
name) raises :class:`TitanIntegrationError` at registration, naming the hook and the parameter --
titan_ext never lets a job train without its integration, nor fails later with a ``TypeError``.
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType

__all__ = ["ADAPTERS", "TitanIntegrationError", "adapter_for", "current", "missing_hooks",
           "signature_mismatches", "torchtitan_version"]

#: TorchTitan "major.minor" -> its adapter module
ADAPTERS = {
    "0.2": "titan_ext.titan.adapters.tt02",
    "0.3": "titan_ext.titan.adapters.tt03",
}

_current: ModuleType | None = None


class TitanIntegrationError(RuntimeError):
    """titan_ext cannot attach to this TorchTitan; the message names what is missing."""


def torchtitan_version() -> str:
    """The installed TorchTitan's version (its distribution metadata, else ``torchtitan.__version__``)."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("torchtitan")
    except PackageNotFoundError:
        import torchtitan

        return str(getattr(torchtitan, "__version__", "unknown"))


def adapter_for(version: str) -> str:
    """The adapter module for TorchTitan ``version`` (e.g. "0.3.0"); TitanIntegrationError if none."""
    key = ".".join(version.split("+")[0].split(".")[:2])
    if key not in ADAPTERS:
        raise TitanIntegrationError(
            f"titan_ext has no adapter for TorchTitan {version} (supported: "
            f"{', '.join(k + '.x' for k in ADAPTERS)}); refusing to train without titan_ext's "
            f"integration -- install a supported TorchTitan (see README, 'Supported versions')")
    return ADAPTERS[key]


def missing_hooks(adapter: ModuleType) -> list[str]:
    """``module.attribute`` of each hook ``adapter.HOOKS`` names that this TorchTitan lacks."""
    missing = []
    for module, attribute in adapter.HOOKS:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            missing.append(module)
            continue
        if not hasattr(mod, attribute):
            missing.append(f"{module}.{attribute}")
    return missing


def _resolve(module: str, attribute: str):
    obj = importlib.import_module(module)
    for part in attribute.split("."):
        obj = getattr(obj, part)
    return obj


def signature_mismatches(adapter: ModuleType) -> list[str]:
    """One line per parameter that a hook of ``adapter.SIGNATURES`` lacks or has elsewhere.

    ``SIGNATURES`` maps ``(module, attribute)`` to ``(parameters, positional)``: the parameter names the
    wrapper titan_ext puts around the hook takes and passes on. Each must be a parameter of the hook; with
    ``positional`` (the wrapper passes them by position) they must also be its leading parameters, in
    that order. The hook's other parameters (a new keyword with a default) do not matter."""
    out = []
    for (module, attribute), (params, positional) in getattr(adapter, "SIGNATURES", {}).items():
        name = f"{module}.{attribute}"
        try:
            hook = _resolve(module, attribute)
            signature = inspect.signature(hook)
        except (ImportError, AttributeError):
            continue  # reported by missing_hooks
        except (TypeError, ValueError):
            out.append(f"{name}: its signature cannot be read")
            continue
        have = [p for p in signature.parameters.values() if p.name != "self"]
        names = [p.name for p in have]
        for i, param in enumerate(params):
            if param not in names:
                out.append(f"{name} has no parameter {param!r} (its parameters: {', '.join(names)})")
            elif positional and (i >= len(names) or names[i] != param
                                 or have[i].kind not in (inspect.Parameter.POSITIONAL_ONLY,
                                                         inspect.Parameter.POSITIONAL_OR_KEYWORD)):
                out.append(f"{name}: parameter {param!r} is not its positional parameter {i + 1} "
                           f"(its parameters: {', '.join(names)})")
    return out


def check_adapter(adapter: ModuleType, version: str) -> None:
    """TitanIntegrationError naming every missing hook, else every parameter that does not fit."""
    missing = missing_hooks(adapter)
    if missing:
        raise TitanIntegrationError(
            f"titan_ext cannot attach to TorchTitan {version}: missing {', '.join(missing)} "
            f"(renamed or removed?); refusing to train without titan_ext's integration")
    mismatched = signature_mismatches(adapter)
    if mismatched:
        raise TitanIntegrationError(
            f"titan_ext cannot attach to TorchTitan {version}: {'; '.join(mismatched)} -- the hook's "
            f"signature changed; refusing to train without titan_ext's integration")


def current() -> ModuleType:
    """The adapter for the installed TorchTitan, its hooks checked (cached)."""
    global _current
    if _current is None:
        version = torchtitan_version()
        adapter = importlib.import_module(adapter_for(version))
        check_adapter(adapter, version)
        _current = adapter
    return _current
