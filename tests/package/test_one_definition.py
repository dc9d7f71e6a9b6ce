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


# ---------------------------------------------------------------- the other rules written once
def _sources():
    return {p.relative_to(PKG).as_posix(): p.read_text() for p in sorted(PKG.rglob("*.py"))}


def _trees():
    return {name: ast.parse(text) for name, text in _sources().items()}


def _kind_letters(node: ast.AST) -> str | None:
    """The letters of a tuple/list/set of one-letter strings or of a string constant, else None."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts and all(
            isinstance(e, ast.Constant) and isinstance(e.value, str) and len(e.value) == 1 for e in node.elts):
        return "".join(e.value for e in node.elts)
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and 3 <= len(node.value) <= 4:
        return node.value
    return None


def test_the_op_kind_alphabet_is_written_once():
    """F, I, W, B spelled out (as a tuple or a string holding all four, or F, I, W) only in plan/ir.py's
    ``COMPUTE_KINDS``; every other list of kinds is derived from it."""
    hits = []
    for name, tree in _trees().items():
        for n in ast.walk(tree):
            letters = _kind_letters(n)
            if letters is not None and (sorted(letters) == sorted("FIWB") or letters in ("FIW",)):
                hits.append(f"{name}:{n.lineno}")
    files = [h.partition(":")[0] for h in hits]
    assert files == ["plan/ir.py"], hits
    from titan_ext.plan import deps, export, ir
    from titan_ext.runtime.measure.estimator import Window

    assert ir.COMPUTE_KINDS == ("F", "I", "W", "B")
    assert deps.KINDS == ("F", "I", "W") and deps.KIND_INDEX == {"F": 0, "I": 1, "W": 2, "B": 1}
    assert export.LEGEND_ORDER == ("F", "I", "B", "W") and Window.KEYS[:4] == ir.COMPUTE_KINDS
    users = {name for name, text in _sources().items() if "COMPUTE_KINDS" in text}
    assert {"plan/deps.py", "plan/export.py", "runtime/measure/profiler.py", "runtime/measure/estimator.py",
            "runtime/decide/placement.py"} <= users, users


def _dataclasses_with(fields: set[str]):
    """(module, class name, base names) of every class whose annotated fields include ``fields``."""
    out = []
    for name, tree in _trees().items():
        for n in ast.walk(tree):
            if isinstance(n, ast.ClassDef):
                own = {s.target.id for s in n.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
                if fields <= own:
                    out.append((name, n.name))
    return out


def test_the_timed_action_record_is_defined_once():
    """One class declares (stage, kind, microbatch) with a start and an end: ``plan.ir.TimedAction``; the
    simulator's, the runtime profiler's and TorchTitan's monitor's records are subclasses of it, with
    their constructors and time attributes as before."""
    owners = _dataclasses_with({"stage", "kind", "microbatch"})
    assert owners == [("plan/ir.py", "TimedAction")], owners
    from titan_ext.plan.ir import TimedAction
    from titan_ext.plan.simulate import ActionEvent
    from titan_ext.runtime.measure.profiler import ActionRecord
    from titan_ext.titan.monitor import Action

    e, r, a = ActionEvent(1, 2, "F", 3, 0.5, 1.5), ActionRecord("I", 2, 3), Action(2, "W", 3, 10, 20)
    assert all(isinstance(x, TimedAction) for x in (e, r, a))
    assert (e.rank, e.op, e.start_ms, e.end_ms) == (1, (2, "F", 3), 0.5, 1.5)
    assert r.op == (2, "I", 3) and r.start != r.start and r.recv_wait_ms == 0.0
    assert (a.op, a.start_ns, a.end_ns) == ((2, "W", 3), 10, 20)
    assert ActionEvent(rank=0, stage=0, kind="F", microbatch=0, start_ms=0.0, end_ms=1.0) == ActionEvent(0, 0, "F", 0, 0.0, 1.0)
    assert len({ActionEvent(0, 0, "F", 0, 0.0, 1.0), ActionEvent(0, 0, "F", 0, 0.0, 1.0)}) == 1


def test_the_link_model_is_defined_once():
    """The FIFO send (start = max(ready, the channel's free time)) is written in plan/timing.py only, apart
    from crosspipe's documented Python reference of ``_search.c``; the injector and the delegates' arrival
    send through ``LinkQueues``; the α + size/bandwidth delay of a lone message has no other copy in the
    runtime."""
    hits = []
    for name, tree in _trees().items():
        for n in ast.walk(tree):
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "max" and len(n.args) == 2
                    and any(isinstance(a, ast.Call) and isinstance(a.func, ast.Attribute) and a.func.attr == "get"
                            and isinstance(a.func.value, ast.Attribute) and "free" in a.func.value.attr
                            for a in n.args)):
                hits.append(name)
    assert set(hits) - {"plan/crosspipe/retime.py"} == {"plan/timing.py"}, hits
    src = _sources()["runtime/emulate/delay_injection.py"]
    assert "LinkQueues" in src and "send_timed(" in src and "_link_free" not in src
    assert "def delay_ms" not in src


def test_the_rank_pair_to_link_rule_is_defined_once():
    """``plan.placement.rank_link`` is the rule; ``boundary_link``, the executor's stamps and the delay
    injector call it, and nothing else compares two ranks' distance to 1 or names the wrap-around link."""
    srcs = _sources()
    for name in ("plan/placement.py", "runtime/execute/executor.py", "runtime/emulate/delay_injection.py"):
        assert "rank_link(" in srcs[name], name
    assert "def rank_link" in srcs["plan/placement.py"]
    assert not [name for name, text in srcs.items() if "def link_of_ranks" in text or "group_size - 1\n" in text]
    mine = ("runtime/execute/executor.py", "runtime/emulate/delay_injection.py", "plan/simulate.py",
            "runtime/decide/placement.py")
    for name in mine:
        assert "abs(peer - " not in srcs[name] and "abs(op.group_peer - " not in srcs[name], name


def test_the_1f1b_order_is_written_once_and_is_torchs():
    """``pipemorph.one_f_one_b_order`` is the one hand-written 1F1B order (its counts from
    ``warmup.one_f_one_b_warmup_counts``), equal to torch's own Schedule1F1B (``builtin_plan``)."""
    srcs = _sources()
    assert [n for n, t in srcs.items() if "def one_f_one_b_order" in t] == ["plan/pipemorph.py"]
    assert "min(S - i, N)" not in srcs["plan/pipemorph.py"] and "min(num_stages - i" not in srcs["plan/pipemorph.py"]
    from titan_ext.plan.builtin import builtin_plan
    from titan_ext.plan.ir import as_ops
    from titan_ext.plan.pipemorph import one_f_one_b_order

    for S in range(1, 7):
        for N in range(1, 13):
            if N < S:
                continue  # torch's Schedule1F1B refuses fewer microbatches than stages
            torch_ops = as_ops(builtin_plan("1F1B", S, N)[0])
            assert one_f_one_b_order(S, N) == {r: list(v) for r, v in torch_ops.items()}, (S, N)


def test_the_measured_link_delay_is_defined_once():
    """``runtime.measure.profiler.one_way_delay_ms`` reduces a link's one-way samples for both the
    runtime's estimate (send → arrival stamps) and TorchTitan's monitor (producer end → consumer start);
    no other module reduces samples to a delay."""
    srcs = _sources()
    assert [n for n, t in srcs.items() if "def one_way_delay_ms" in t] == ["runtime/measure/profiler.py"]
    assert "one_way_delay_ms(" in srcs["titan/monitor.py"]
    body = srcs["runtime/measure/profiler.py"].split("def link_delay_estimates", 1)[1].split("\ndef ", 1)[0]
    assert "one_way_delay_ms(" in body and "/ 2" not in body
    assert "min(gaps)" not in srcs["titan/monitor.py"]
    from titan_ext.runtime.measure.profiler import one_way_delay_ms

    theta = 0.25  # the downstream clock runs 250 ms ahead: it cancels with both directions
    assert one_way_delay_ms([0.010 + theta, 0.012 + theta], [0.020 - theta]) == pytest.approx(15.0)
    assert one_way_delay_ms([0.010 + theta], [], theta) == pytest.approx(10.0)
    assert one_way_delay_ms([], [0.020 - theta], theta) == pytest.approx(20.0)
    assert one_way_delay_ms([], []) != one_way_delay_ms([], [])  # NaN
    assert one_way_delay_ms([-0.002], []) == 0.0
