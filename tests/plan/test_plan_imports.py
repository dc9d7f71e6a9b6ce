"""Import graphs (every import, module level and inside functions, read from the source with ast).

plan/: acyclic, the crosspipe package imports only downward (problem → greedy → model → search →
_compiled → portfolio; tuning a leaf), and the by-name dispatch (plan/schedules.py) sits above all.
The whole of titan_ext: acyclic, and the layers of DESIGN.md import only downward (plan/ ← runtime/ ←
titan/ ← the entry points; the test backends testing/ on runtime/, beside titan/)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import titan_ext
import titan_ext.plan

ROOT = Path(titan_ext.plan.__file__).resolve().parent
PKG = "titan_ext.plan"
TOP_ROOT, TOP = Path(titan_ext.__file__).resolve().parent, "titan_ext"
CROSSPIPE_ORDER = ("tuning", "variants", "greedy", "retime", "search", "_compiled", "portfolio")


def _modules(root: Path = ROOT, pkg: str = PKG) -> dict[str, Path | None]:
    """Module name → source; the C extensions (``PyInit_<name>`` in a .c file) as leaves (None),
    whether built or not."""
    out: dict[str, Path | None] = {}
    for path in root.rglob("*.c"):
        for init in re.findall(r"PyInit_(\w+)", path.read_text()):
            out[".".join([pkg, *path.parent.relative_to(root).parts, init])] = None
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([pkg, *parts])] = path
    return out


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _graph(root: Path = ROOT, pkg: str = PKG) -> dict[str, set[str]]:
    mods = _modules(root, pkg)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps = set()
        if path is None:
            graph[name] = deps
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(name, path.name == "__init__.py", node)
                targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t in mods and t != name)
        graph[name] = deps
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` (depth-first search), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        state[v] = 2
        stack.pop()
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_cycle_finder_finds_a_planted_cycle():
    """The checker itself: it must report a cycle where there is one (and none in a DAG)."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_plan_import_graph_is_acyclic():
    graph = _graph()
    assert f"{PKG}.crosspipe.portfolio" in graph and f"{PKG}.schedules" in graph
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"


def test_crosspipe_modules_import_only_downward():
    graph = _graph()
    pkg = f"{PKG}.crosspipe"
    for i, mod in enumerate(CROSSPIPE_ORDER):
        inside = {d.rsplit(".", 1)[1] for d in graph[f"{pkg}.{mod}"] if d.startswith(pkg + ".")}
        assert inside <= set(CROSSPIPE_ORDER[:i]), (mod, inside - set(CROSSPIPE_ORDER[:i]))
        outside = {d for d in graph[f"{pkg}.{mod}"] if not d.startswith(pkg)}
        assert not outside & {f"{PKG}.optimal", f"{PKG}.schedules", pkg}, (mod, outside)
    assert graph[f"{PKG}.optimal"] <= {f"{pkg}.{m}" for m in CROSSPIPE_ORDER} | {
        d for d in graph[f"{PKG}.optimal"] if not d.startswith(pkg) and d != f"{PKG}.schedules"}
    assert not [m for m, deps in graph.items() if f"{PKG}.schedules" in deps], "nothing in plan/ imports schedules"


def test_titan_ext_import_graph_is_acyclic():
    graph = _graph(TOP_ROOT, TOP)
    assert f"{TOP}.runtime.schedules.pipemorph" in graph and f"{TOP}.titan.trainer" in graph
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"


def test_layers_import_only_downward():
    """plan/ imports nothing of runtime/ or titan/; runtime/ nothing of titan/ (DESIGN.md "Layers");
    the test backends (testing/) sit on runtime/: neither plan/ nor runtime/ imports them, and they
    import nothing of titan/ or the entry points."""
    graph = _graph(TOP_ROOT, TOP)
    assert f"{TOP}.testing.nccl_rules" in graph and f"{TOP}.testing.ranks" in graph
    above = {"plan": (f"{TOP}.runtime", f"{TOP}.titan", f"{TOP}.train", f"{TOP}.cli", f"{TOP}.testing"),
             "runtime": (f"{TOP}.titan", f"{TOP}.train", f"{TOP}.cli", f"{TOP}.testing"),
             "testing": (f"{TOP}.titan", f"{TOP}.train", f"{TOP}.cli")}
    for layer, forbidden in above.items():
        for mod, deps in graph.items():
            if mod.startswith(f"{TOP}.{layer}"):
                bad = sorted(d for d in deps if d.startswith(forbidden))
                assert not bad, f"{mod} imports a higher layer: {bad}"


def test_the_shared_leaves_import_nothing_of_titan_ext():
    """``titan_ext.args`` (every layer's argument checks) and ``titan_ext._flags`` are leaves: every layer
    may import them because they import nothing of the package."""
    graph = _graph(TOP_ROOT, TOP)
    for leaf in (f"{TOP}.args", f"{TOP}._flags"):
        assert leaf in graph and not graph[leaf], (leaf, graph.get(leaf))
    assert f"{TOP}.args" in graph[f"{TOP}.plan.profile"], "the plan layer's own checks come from the leaf"


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of a module, its classes and functions (documentation may name a
    test module; code may not)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
        if isinstance(node, (ast.Module, ast.ClassDef)):  # attribute docstrings: a string after an assignment
            for before, after in zip(node.body, node.body[1:]):
                if (isinstance(before, (ast.Assign, ast.AnnAssign)) and isinstance(after, ast.Expr)
                        and isinstance(after.value, ast.Constant)):
                    out.add(id(after.value))
    return out


def _names_testing(source: str, testing_modules: set[str]) -> list[str]:
    """The string constants of ``source`` outside docstrings that name the test package or one of its
    modules as a module path (``titan_ext.testing...``, ``titan_ext/testing/...``, ``testing.<module>``)."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    pattern = re.compile(r"titan_ext[./]testing\b|(?<![\w.])testing[./](" + "|".join(sorted(testing_modules)) + r")\b")
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
            and pattern.search(node.value)]


def _testing_modules() -> set[str]:
    return {p.stem for p in (TOP_ROOT / "testing").glob("*.py") if p.stem != "__init__"}


def test_the_testing_checker_finds_a_planted_name():
    """The checker itself: a module path in code is found, the same words in a docstring are not."""
    mods = {"nccl_rules", "lagdevice"}
    assert _names_testing('x = sys.modules.get("titan_ext.testing.nccl_rules")', mods)
    assert _names_testing('path = ROOT / "titan_ext/testing/lagdevice.py"', mods)
    assert _names_testing('m = "testing.lagdevice"', mods) == ["testing.lagdevice"]
    assert _names_testing('"""Uses titan_ext.testing.nccl_rules in tests."""\ndef f():\n    """testing.lagdevice"""', mods) == []
    assert _names_testing('msg = "run the testing suite"', mods) == []


def test_the_product_neither_imports_nor_names_the_test_package():
    """Nothing outside titan_ext/testing/ imports it (module level or inside functions), and no product
    source names it or one of its modules in code (a string given to ``sys.modules`` or ``importlib``):
    test code registers itself into the product (e.g. ``comm/delegate/ring.register_host_marker``,
    ``titan/cpu_shim.SETUP_ENV``), the product never reaches into it."""
    graph = _graph(TOP_ROOT, TOP)
    testing = f"{TOP}.testing"
    product = {m: deps for m, deps in graph.items() if m != testing and not m.startswith(testing + ".")}
    assert f"{TOP}.titan.cpu_shim" in product and f"{TOP}.runtime.comm.delegate.ring" in product
    importers = sorted(f"{m} -> {d}" for m, deps in product.items() for d in deps
                       if d == testing or d.startswith(testing + "."))
    assert not importers, importers
    mods = _testing_modules()
    assert {"nccl_rules", "lagdevice", "faults"} <= mods
    named = {str(p.relative_to(TOP_ROOT)): found for p in sorted(TOP_ROOT.rglob("*.py"))
             if p.relative_to(TOP_ROOT).parts[0] != "testing" and (found := _names_testing(p.read_text(), mods))}
    assert not named, named
