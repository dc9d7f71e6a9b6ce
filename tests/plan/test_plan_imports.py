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
CROSSPIPE_ORDER = ("tuning", "problem", "greedy", "model", "search", "_compiled", "portfolio")


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
