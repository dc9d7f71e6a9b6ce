"""The layout (one stage per rank or several, placed "loop" or "v") is read once, by
``runtime/control/parts.build_parts``: the Parts it returns carry every choice that depends on it, and
no other runtime module branches on the layout (the placement model itself, ``decide/placement.py``'s
``Layout`` and ``read_layout``, excepted)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import titan_ext.runtime

RUNTIME = Path(titan_ext.runtime.__file__).resolve().parent
LAYOUT_ATTRS = {"virtual", "stages_per_rank", "placement"}
"""The layout's fields (and property) a branch would read."""
ALLOWED = {("control/parts.py", None), ("decide/placement.py", "Layout"), ("decide/placement.py", "read_layout")}
"""Where branching on the layout is the point: build_parts, and the placement model itself."""


def _reads_layout(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and sub.attr in LAYOUT_ATTRS:
            return True
        if isinstance(sub, ast.Name) and sub.id in {"stages_per_rank", "placement"}:
            return True
        if isinstance(sub, ast.Attribute) and sub.attr == "V" and isinstance(sub.value, ast.Name):
            return True  # self.V: a budget's stages per rank
        if isinstance(sub, ast.Constant) and sub.value in ("v", "loop"):
            return True
    return False


def _layout_branches(source: str) -> list[tuple[str | None, int]]:
    """(top-level definition, line) of every branch of ``source`` on the layout: an ``if`` / ``while`` /
    conditional expression / assert whose test reads it, or a comparison reading it (a flag computed
    for a later branch)."""
    tree = ast.parse(source)
    out = []
    for top in tree.body:
        name = getattr(top, "name", None)
        for node in ast.walk(top):
            test = None
            if isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
                test = node.test
            elif isinstance(node, ast.Compare):
                test = node
            elif isinstance(node, ast.match_case):
                test = node.pattern
            if test is not None and _reads_layout(test):
                out.append((name, node.lineno if hasattr(node, "lineno") else top.lineno))
    return sorted(set(out), key=lambda x: x[1])


def test_the_checker_finds_planted_branches():
    """The checker itself: each form of a layout branch is found, arithmetic with V is not."""
    assert _layout_branches("def f(layout):\n    if layout.virtual:\n        return 1") == [("f", 2)]
    assert _layout_branches("def f(n, stages_per_rank):\n    return None if stages_per_rank != 1 else n") == [("f", 2)]
    assert _layout_branches("def f(layout):\n    wave = layout.placement == 'v'\n    return wave")
    assert _layout_branches("class B:\n    def g(self, a):\n        return a[0] if self.V == 1 else max(a)")
    assert _layout_branches("def f(p):\n    return p == 'loop'")
    assert _layout_branches("def f(budgets, layout):\n    return [b // layout.stages_per_rank for b in budgets]") == []


def test_no_runtime_module_but_build_parts_branches_on_the_layout():
    found = {}
    for path in sorted(RUNTIME.rglob("*.py")):
        rel = path.relative_to(RUNTIME).as_posix()
        hits = [(name, line) for name, line in _layout_branches(path.read_text())
                if (rel, None) not in ALLOWED and (rel, name) not in ALLOWED]
        if hits:
            found[rel] = hits
    assert not found, found
    assert _layout_branches((RUNTIME / "control/parts.py").read_text()), "build_parts is where the layout is read"


def _parts(stages_per_rank: int, placement: str = "loop", spec=None):
    from titan_ext.plan.placement import stage_to_rank
    from titan_ext.runtime.control.parts import build_parts
    from titan_ext.runtime.decide.placement import Layout
    from titan_ext.runtime.schedules.pipemorph import PIPEMORPH

    spec = spec or PIPEMORPH
    layout = Layout(2, stages_per_rank, placement, tuple(stage_to_rank(2, stages_per_rank, placement)))
    return build_parts("Test", layout, 8, spec.config_class(), spec, lambda: None, lambda: None)


def test_one_stage_per_rank_parts_watch_only_the_links_that_can_hide_a_delay():
    parts = _parts(1)
    assert parts.extensions_refused is None
    assert parts.exact_links([0.1, 5.0], None, 1.0) == {1}


def test_several_stages_per_rank_parts_watch_every_link_and_refuse_falcon_and_delegation():
    parts = _parts(2)
    assert parts.exact_links([0.1, 5.0], None, 1.0) is None
    assert "one stage per rank only, got 2 stages per rank" in parts.extensions_refused


def test_the_extensions_follow_the_parts_verdict():
    """build_extensions takes the verdict, not the layout: an explicit delegation request is refused with
    the Parts' reason, Falcon's default switched off."""
    from titan_ext.runtime.control.config import AdaptiveConfig
    from titan_ext.runtime.control.extensions import build_extensions

    config = AdaptiveConfig(falcon=True)
    assert build_extensions(config, "Test", 4, 8, None).falcon is not None
    assert build_extensions(config, "Test", 4, 8, "not here").falcon is None
    with pytest.raises(ValueError, match="Test: not here"):
        build_extensions(AdaptiveConfig().updated(delegation="always"), "Test", 4, 8, "not here")


def test_crosswave_is_chosen_by_build_parts_for_two_stages_per_rank_placed_v():
    from titan_ext.runtime.schedules.crosspipe import CROSSPIPE

    assert _parts(2, "v", CROSSPIPE).planner.schedule == "crosspipe-wave"
    assert _parts(2, "loop", CROSSPIPE).planner.schedule == "pipemorph"
    assert _parts(3, "v", CROSSPIPE).planner.schedule == "pipemorph"
