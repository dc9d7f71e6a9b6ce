"""Rules written once: the bubble rate (1 − Σ busy / (P · T)) has one definition, ``plan.timing.bubble_rate``,
which the simulator, the runtime's exchanged timeline and TorchTitan's step monitor all call."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import titan_ext
from titan_ext.plan.timing import bubble_rate

PKG = Path(titan_ext.__file__).resolve().parent


def _is_one_minus_ratio_of_product(node: ast.AST) -> bool:
    """``1 - a / (b * c)``: the shape of a bubble rate."""
    return (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub) and isinstance(node.left, ast.Constant)
            and node.left.value == 1 and isinstance(node.right, ast.BinOp) and isinstance(node.right.op, ast.Div)
            and isinstance(node.right.right, ast.BinOp) and isinstance(node.right.right.op, ast.Mult))


def test_the_bubble_rate_is_computed_in_one_place():
    hits = [f"{p.relative_to(PKG)}:{n.lineno}" for p in sorted(PKG.rglob("*.py"))
            for n in ast.walk(ast.parse(p.read_text())) if _is_one_minus_ratio_of_product(n)]
    assert len(hits) == 1 and hits[0].startswith("plan/timing.py:"), hits
    callers = {p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py") if "bubble_rate(" in p.read_text()}
    assert {"plan/simulate.py", "runtime/measure/profiler.py", "titan/monitor.py"} <= callers, callers


@pytest.mark.parametrize("busy, ranks, span, expected", [(6.0, 2, 4.0, 0.25), (8.0, 2, 4.0, 0.0), (0.0, 3, 1.0, 1.0)])
def test_the_definition(busy, ranks, span, expected):
    assert bubble_rate(busy, ranks, span) == pytest.approx(expected)


def test_an_empty_span_has_no_bubble_rate():
    assert bubble_rate(1.0, 2, 0.0) != bubble_rate(1.0, 2, 0.0)  # NaN
