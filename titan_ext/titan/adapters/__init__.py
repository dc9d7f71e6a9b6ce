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

Each adapter's ``CONTRACT`` lists every TorchTitan symbol titan_ext uses under that version, one row
``(module, name, kind, detail)`` each, ``name`` possibly dotted (``"Trainer.train_step"``), named where
titan_ext imports it from:

* ``attr`` (detail ``None``): ``module.name`` exists;
* ``callable`` (detail ``(parameters, positional)``): it exists and takes ``parameters`` by those
  names (:func:`contract_problems`; the wrapper titan_ext puts around a hook takes and passes them on);
* ``fields`` (detail: names): ``module.name`` is a config class (a dataclass: ``dataclasses.fields``;
  else its class annotations) with these fields;
* ``instance_attr`` (detail: names): the class sets these attributes on its instances. Heuristic: an
  assignment to ``self.<name>`` (plain, annotated, or one target of a tuple assignment) in the source
  of ``__init__`` of the class or of one of its bases; an attribute set elsewhere (a method ``__init__``
  calls) is not seen, so only attributes ``__init__`` itself sets are listed.

:func:`current` checks the installed version's contract when titan_ext registers (``import titan_ext``
under TorchTitan, ``titan_ext.titan.register()``, the 0.3 config registry), before any process group:
an unknown TorchTitan version, or any row that does not hold (a symbol renamed or removed in a point
release, a parameter renamed, a config field or trainer attribute gone) raises
:class:`TitanIntegrationError` naming the version and every broken row -- titan_ext never lets a job
train without its integration, nor fails later with an ImportError, TypeError or AttributeError.

Registration can run inside TorchTitan's own imports (``import titan_ext`` first: it registers once
TorchTitan's pipeline builder is imported, which a model package such as ``torchtitan.models.llama3``
does from its ``__init__``). A row whose module cannot be imported while a package on its path is still
being imported is left for later: :func:`current` checks the contract again at its next call, until
every row has been checked.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import sys
import textwrap
from types import ModuleType

__all__ = ["ADAPTERS", "KINDS", "TitanIntegrationError", "adapter_for", "check_adapter", "contract",
           "contract_problems", "current", "last_training_step", "malformed_rows", "missing_hooks", "signature_mismatches",
           "torchtitan_version"]

#: TorchTitan "major.minor" -> its adapter module
ADAPTERS = {
    "0.2": "titan_ext.titan.adapters.tt02",
    "0.3": "titan_ext.titan.adapters.tt03",
}
#: the kinds of a contract row
KINDS = ("attr", "callable", "fields", "instance_attr")

_current: ModuleType | None = None
_LATER = object()  # a row that cannot be checked yet (_lookup)


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


def contract(adapter: ModuleType) -> tuple:
    """The rows of ``adapter.CONTRACT``; an adapter without one gets rows from its ``HOOKS``
    (``(module, attribute)``: ``attr``) and ``SIGNATURES`` (``(module, attribute) -> detail``: ``callable``)."""
    rows = getattr(adapter, "CONTRACT", None)
    if rows is not None:
        return tuple(rows)
    return (tuple((module, name, "attr", None) for module, name in getattr(adapter, "HOOKS", ()))
            + tuple((module, name, "callable", detail)
                    for (module, name), detail in getattr(adapter, "SIGNATURES", {}).items()))


def _names(value) -> bool:
    return (isinstance(value, tuple) and bool(value) and len(set(value)) == len(value)
            and all(isinstance(v, str) and v.isidentifier() for v in value))


def _dotted(value) -> bool:
    return isinstance(value, str) and all(part.isidentifier() for part in value.split("."))


def malformed_rows(rows) -> list[str]:
    """One line per row of a contract table that is not well formed (no TorchTitan needed): a
    ``(module, name, kind, detail)`` tuple, ``module`` a ``torchtitan`` module path, ``name`` dotted
    identifiers, a known kind with its detail, no row twice."""
    out, seen = [], set()
    for row in rows:
        if not (isinstance(row, tuple) and len(row) == 4):
            out.append(f"{row!r}: not a (module, name, kind, detail) tuple")
            continue
        module, name, kind, detail = row
        if not (_dotted(module) and module.split(".")[0] == "torchtitan"):
            out.append(f"{row!r}: module {module!r} is not a torchtitan module path")
        if not _dotted(name):
            out.append(f"{row!r}: name {name!r} is not a dotted Python name")
        if kind == "attr":
            ok = detail is None
        elif kind == "callable":
            ok = (isinstance(detail, tuple) and len(detail) == 2 and _names(detail[0])
                  and isinstance(detail[1], bool))
        elif kind in ("fields", "instance_attr"):
            ok = _names(detail)
        else:
            out.append(f"{row!r}: kind {kind!r} is not one of {', '.join(KINDS)}")
            continue
        if not ok:
            out.append(f"{row!r}: detail {detail!r} does not fit kind {kind!r}")
        if (module, name, kind) in seen:
            out.append(f"{row!r}: listed twice")
        seen.add((module, name, kind))
    return out


def _importing(module: str) -> bool:
    """A package on ``module``'s path (or the module) is being imported now: its code still runs."""
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        loaded = sys.modules.get(".".join(parts[:i]))
        if loaded is not None and getattr(getattr(loaded, "__spec__", None), "_initializing", False):
            return True
    return False


def _lookup(module: str, name: str):
    """``(object, None)``, or ``(None, what is missing)``: the module, or the first attribute of
    ``name``'s path that it lacks (``module.Trainer`` when ``Trainer.train_step``'s class is gone);
    ``(_LATER, None)`` when it fails while a package on the module's path is still being imported."""
    try:
        obj = importlib.import_module(module)
    except ImportError:
        return (_LATER, None) if _importing(module) else (None, module)
    path = module
    for part in name.split("."):
        path = f"{path}.{part}"
        try:
            obj = getattr(obj, part)
        except AttributeError:
            return (_LATER, None) if _importing(module) else (None, path)
    return obj, None


def _signature_problems(where: str, hook, params: tuple, positional: bool) -> list[str]:
    """Each of ``params`` must be a parameter of ``hook``; with ``positional`` (the wrapper passes them
    by position) also its leading parameters, in that order. Other parameters (a new keyword with a
    default) do not matter."""
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):
        return [f"{where}: its signature cannot be read"]
    have = [p for p in signature.parameters.values() if p.name != "self"]
    names = [p.name for p in have]
    out = []
    for i, param in enumerate(params):
        if param not in names:
            out.append(f"{where} has no parameter {param!r} (its parameters: {', '.join(names)})")
        elif positional and (i >= len(names) or names[i] != param
                             or have[i].kind not in (inspect.Parameter.POSITIONAL_ONLY,
                                                     inspect.Parameter.POSITIONAL_OR_KEYWORD)):
            out.append(f"{where}: parameter {param!r} is not its positional parameter {i + 1} "
                       f"(its parameters: {', '.join(names)})")
    return out


def _field_names(cls) -> set[str]:
    """A dataclass's fields, else the annotated names of the class and its bases."""
    if isinstance(cls, type) and dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return {name for klass in getattr(cls, "__mro__", ()) for name in vars(klass).get("__annotations__", {})}


def _targets(node):
    if isinstance(node, (ast.Tuple, ast.List)):
        for element in node.elts:
            yield from _targets(element)
    elif isinstance(node, ast.Starred):
        yield from _targets(node.value)
    else:
        yield node


def _set_in_init(cls) -> set[str] | None:
    """The names ``n`` of every ``self.n = ...``, ``self.n: T = ...`` (or ``self.n`` among the targets of
    a tuple assignment) in the source of ``__init__`` of ``cls`` and of its bases (``self`` being the
    method's first parameter); None when a source cannot be read."""
    found: set[str] = set()
    for klass in getattr(cls, "__mro__", ()):
        init = vars(klass).get("__init__")
        if not inspect.isfunction(init):
            continue  # object's, a C type's
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        except (OSError, TypeError, SyntaxError):
            return None
        function = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
        if function is None or not function.args.args:
            continue
        me = function.args.args[0].arg
        for node in ast.walk(function):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AnnAssign) else [])
            for target in targets:
                for t in _targets(target):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == me:
                        found.add(t.attr)
    return found


def contract_problems(adapter: ModuleType) -> dict[str, list[str]]:
    """What of ``adapter``'s contract (:func:`contract`) this TorchTitan breaks, one line per problem:
    ``"missing"`` (``module.attribute`` or the module; each once, whichever rows name it), then per
    kind ``"callable"`` (a parameter the hook lacks or has elsewhere), ``"fields"`` (a field the config
    class lacks), ``"instance_attr"`` (an attribute ``__init__`` no longer sets); ``"later"``: the
    ``module.name`` of each row that cannot be checked yet (its module's package is still being imported)."""
    problems: dict[str, list[str]] = {"missing": [], "callable": [], "fields": [], "instance_attr": [],
                                      "later": []}
    for module, name, kind, detail in contract(adapter):
        obj, missing = _lookup(module, name)
        if obj is _LATER:
            problems["later"].append(f"{module}.{name}")
            continue
        if missing is not None:
            if missing not in problems["missing"]:
                problems["missing"].append(missing)
            continue
        where = f"{module}.{name}"
        if kind == "callable":
            problems["callable"] += _signature_problems(where, obj, *detail)
        elif kind == "fields":
            have = _field_names(obj)
            problems["fields"] += [f"{where} has no field {f!r}" for f in detail if f not in have]
        elif kind == "instance_attr":
            have = _set_in_init(obj)
            if have is None:
                problems["instance_attr"].append(f"{where}.__init__: its source cannot be read (to find "
                                                 f"{', '.join('self.' + a for a in detail)})")
            else:
                problems["instance_attr"] += [f"{where}.__init__ sets no self.{a}" for a in detail if a not in have]
    return problems


def missing_hooks(adapter: ModuleType) -> list[str]:
    """``module.attribute`` (or the module) of each symbol ``adapter``'s contract names that this
    TorchTitan lacks."""
    return contract_problems(adapter)["missing"]


def signature_mismatches(adapter: ModuleType) -> list[str]:
    """One line per parameter that a ``callable`` row's hook lacks or has elsewhere."""
    return contract_problems(adapter)["callable"]


#: what each kind of problem means, after its lines in TitanIntegrationError's message
_MEANING = {"callable": "the hook's signature changed", "fields": "a config class's fields changed",
            "instance_attr": "a class no longer sets that attribute"}


def check_adapter(adapter: ModuleType, version: str) -> bool:
    """TitanIntegrationError naming TorchTitan ``version`` and every broken row of ``adapter``'s contract;
    else whether every row could be checked (False: some are left for later, ``contract_problems``)."""
    problems = contract_problems(adapter)
    parts = [f"missing {', '.join(problems['missing'])} (renamed or removed?)"] if problems["missing"] else []
    parts += [f"{'; '.join(lines)} -- {meaning}" for kind, meaning in _MEANING.items()
              if (lines := problems[kind])]
    if parts:
        raise TitanIntegrationError(f"titan_ext cannot attach to TorchTitan {version}: {'; '.join(parts)}; "
                                    f"refusing to train without titan_ext's integration")
    return not problems["later"]


def current() -> ModuleType:
    """The adapter for the installed TorchTitan, its contract checked (cached once every row was)."""
    global _current
    if _current is None:
        version = torchtitan_version()
        adapter = importlib.import_module(adapter_for(version))
        if not check_adapter(adapter, version):
            return adapter  # rows left for later (a package still being imported): checked next call
        _current = adapter
    return _current


def last_training_step(trainer) -> int | None:
    """The job's ``training.steps`` through the installed version's adapter (None where the trainer has no
    such section: a test's stub)."""
    try:
        return int(current().trainer_training(trainer).steps)
    except (AttributeError, TypeError, ValueError):
        return None
