"""The dependency rule as data: ``plan.deps.table`` is ``deps.producers`` as flat int
tuples, and every evaluator — Python and C — walks it instead of writing its own rule.

The table is checked against ``producers`` op by op; then each evaluator is handed a table for a
*different* rule (an independent backward per stage: I(s) waits for its own F(s) only) and must follow
it: the compiled generators, checks, greedy and search agree with their Python references under that
rule and disagree with the standard one, and the Python walkers agree with ``simulate`` run under the
same rule. A C module with the rule written in would fail here.
"""

from __future__ import annotations

import importlib
import math
import random
import re
from pathlib import Path

import pytest

from titan_ext.plan import LinkProfile, PipelineProfile, deps, simulate

pm = importlib.import_module("titan_ext.plan.pipemorph")
sim_mod = importlib.import_module("titan_ext.plan.simulate")  # (titan_ext.plan.simulate is also the function)
val_mod = importlib.import_module("titan_ext.plan.validate")
virt = importlib.import_module("titan_ext.plan.virtual")
from titan_ext.plan.deps import ABSENT, KINDS, ROOT, class_of, done_key, producers, table  # noqa: E402
from titan_ext.plan.timing import to_ns  # noqa: E402

ROOT_DIR = Path(__file__).resolve().parents[2]


def _check_table_against_rule(S: int, tab: deps.DepTable, full: bool, rule=producers) -> None:
    n = 3 * S
    assert len(tab.trigger) == len(tab.link) == n and len(tab.needs_off) == len(tab.feeds_off) == n + 1
    for s in range(S):
        for kind in ("F", "I", "W", "B"):
            if full and kind in ("I", "W") or not full and kind == "B":
                if full and kind == "W":
                    assert tab.trigger[class_of(s, "W")] == ABSENT and not tab.needs_of(class_of(s, "W"))
                continue
            q = class_of(s, kind)
            for m in (0, 3):
                want = {done_key(p) for p in rule((s, kind, m), S)}
                got = {(c // 3, KINDS[c % 3], m) for c in tab.needs_of(q)}
                assert got == want, (s, kind, m)
            # the trigger is one of the producers, and implies every other one (an ancestor of it)
            t = tab.trigger[q]
            if not tab.needs_of(q):
                assert t == ROOT
                continue
            assert t in tab.needs_of(q)
            for p in tab.needs_of(q):
                if p != t:
                    assert p in _ancestors(tab, t)
            assert tab.link[q] == (-1 if t // 3 == s else min(s, t // 3))
            assert q in tab.feeds_of(t) and tab.feeds_of(t).count(q) == 1
    for p in range(n):
        feeds = tab.feeds_of(p)
        assert all(tab.trigger[c] == p for c in feeds)
        assert [c for c in feeds if c // 3 == p // 3] == sorted(c for c in feeds if c // 3 == p // 3)
        assert feeds == tuple(sorted(feeds, key=lambda c: (c // 3 != p // 3, c)))  # same stage first
        assert set(tab.users_of(p)) == {q for q in range(n) if p in tab.needs_of(q)}


def _ancestors(tab: deps.DepTable, q: int) -> set[int]:
    out, todo = set(), [q]
    while todo:
        for p in tab.needs_of(todo.pop()):
            if p not in out:
                out.add(p)
                todo.append(p)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_table_agrees_with_producers_on_every_op(seed):
    rng = random.Random(seed)
    for _ in range(20):
        S = rng.randint(1, 40)
        for full in (False, True):
            tab = table(S, full)
            assert tab is table(S, full)  # cached per problem
            assert tab.spec() == (S, tab.trigger, tab.link, tab.feeds_off, tab.feeds, tab.needs_off, tab.needs)
            _check_table_against_rule(S, tab, full)
            N = rng.randint(1, 9)
            for op_id in range(3 * S * N):  # the op-id form (CrossPipe's model, the C code)
                q, m = divmod(op_id, N)
                if tab.trigger[q] == ABSENT:
                    continue
                p = tab.producer_op(op_id, N)
                assert p == (None if tab.trigger[q] < 0 else tab.trigger[q] * N + m)


def test_table_is_placement_independent_and_the_reference_sends_its_messages():
    """The table has no placement: for V and loop placements (several stages per rank) the messages are
    the table's cross-stage edges whose stages sit on different ranks, on the boundary link it names."""
    from titan_ext.plan.placement import boundary_link, stage_to_rank

    for R, V, kind in ((2, 2, "loop"), (3, 2, "v"), (2, 3, "loop"), (4, 2, "v")):
        s2r = stage_to_rank(R, V, kind)
        tab = table(R * V)
        for c, p in enumerate(tab.trigger):
            if p >= 0 and s2r[p // 3] != s2r[c // 3]:
                assert tab.link[c] == min(p // 3, c // 3)
                assert boundary_link(s2r, tab.link[c]) is not None or kind == "loop"


def test_bad_rules_are_refused():
    def cycle(op, S):  # F(s) needs W(s-1), which (through I(s-1) → I(s) → F(s)) needs F(s): a cycle
        s, k, m = op
        if k == "F" and s > 0:
            return ((s - 1, "F", m), (s - 1, "W", m))
        return producers(op, S)

    def two_triggers(op, S):  # W(s) needs I(s) and W(s+1): neither implies the other
        s, k, m = op
        if k == "W" and s < S - 1:
            return ((s, "I", m), (s + 1, "W", m))
        return producers(op, S)

    def far(op, S):  # F(s) needs F(s-2): no link joins them
        s, k, m = op
        return ((s - 2, "F", m),) if k == "F" and s >= 2 else producers(op, S)

    for rule, what in ((cycle, "itself"), (two_triggers, "independent"), (far, "non-adjacent")):
        with pytest.raises(ValueError, match=what):
            table(4, rule=rule)
    assert table(4, rule=producers) == table(4)


# --------------------------------------------------------------------------- another rule, every walker
def independent_backward(op, S):
    """A rule that is not the pipeline's: each stage's backward waits for its own forward only."""
    s, k, m = op
    if k in ("I", "B"):
        return ((s, "F", m),)
    return producers(op, S)


@pytest.fixture
def other_rule(monkeypatch):
    """Every evaluator's table (and the reference's ``producers``) is the independent-backward rule's."""
    from titan_ext.plan.crosspipe import _compiled, greedy, retime

    def other(num_stages, full_backward=False, rule=None):
        return deps.table(num_stages, full_backward, rule or independent_backward)

    for mod in (pm, sim_mod, virt, val_mod, greedy, retime, _compiled):
        monkeypatch.setattr(mod, "table", other)
    monkeypatch.setattr(sim_mod, "producers", independent_backward)
    _compiled._specs.clear()
    _compiled._cache.clear()
    yield other
    _compiled._specs.clear()
    _compiled._cache.clear()


def _profile(rng: random.Random, S: int, N: int) -> PipelineProfile:
    ms = lambda lo, hi: round(rng.uniform(lo, hi), 3)  # noqa: E731
    links = tuple(LinkProfile(ms(0, 9), rng.choice((math.inf, 1e9, 2e8)), rng.choice((0.0, 1e6, 4e6)))
                  for _ in range(S - 1))
    return PipelineProfile(S, N, [ms(0.5, 8) for _ in range(S)], [ms(0.5, 5) for _ in range(S)],
                           [ms(0, 3) for _ in range(S)], links)


@pytest.mark.skipif(pm._GENERATE_C is None, reason="_pipemorph_c not built")
def test_compiled_pipemorph_generator_follows_the_table(other_rule):
    rng = random.Random(5)
    for _ in range(40):
        S = rng.randint(2, 5)
        N = rng.randint(S, 3 * S)
        prof = _profile(rng, S, N)
        x = sorted((rng.randint(1, N) for _ in range(S)), reverse=True)
        full = rng.random() < 0.3
        c_order, c_mk, c_cap = pm._generate(prof, x, [N] * S, full)
        py_order, py_mk, py_cap = pm._generate_py(prof, x, [N] * S, full)
        assert (c_order, c_mk, c_cap) == (py_order, py_mk, py_cap)
        # the reference under the same rule times the order the same
        assert to_ns(simulate(c_order, prof).makespan_ms) == c_mk
        assert pm.replay_makespan_ns(c_order, prof) == c_mk


@pytest.mark.skipif(pm._GENERATE_C is None, reason="_pipemorph_c not built")
def test_the_other_rule_changes_the_plans(monkeypatch):
    """Sanity of the test above: under the standard rule the same profiles give other orders, so a
    compiled generator with the pipeline rule written in would have failed it."""
    rng = random.Random(5)
    changed = 0
    for _ in range(10):
        S = rng.randint(2, 5)
        N = rng.randint(S, 3 * S)
        prof = _profile(rng, S, N)
        x = sorted((rng.randint(1, N) for _ in range(S)), reverse=True)
        std = pm._generate(prof, x, [N] * S, False)
        monkeypatch.setattr(pm, "table", lambda S_, full=False: deps.table(S_, full, independent_backward))
        other = pm._generate(prof, x, [N] * S, False)
        monkeypatch.undo()
        changed += std[:2] != other[:2]
    assert changed >= 8


@pytest.mark.skipif(virt._CORE is None, reason="_pipemorph_c not built")
def test_compiled_virtual_generator_follows_the_table(other_rule):
    from titan_ext.plan.placement import stage_to_rank

    rng = random.Random(11)
    for _ in range(30):
        R, V, kind = rng.choice(((2, 2, "loop"), (2, 2, "v"), (3, 2, "v"), (2, 3, "loop")))
        S = R * V
        N = rng.randint(S, 2 * S)
        prof = _profile(rng, S, N)
        s2r = list(stage_to_rank(R, V, kind))
        x = [rng.randint(1, 2)] * S
        limit = [rng.randint(2, N)] * S
        c_order, c_mk = virt._virtual_loop(prof, s2r, x, limit)
        py_order, py_mk = virt._virtual_loop_py(prof, s2r, x, limit)
        assert (c_order, c_mk) == (py_order, py_mk)
        assert to_ns(simulate(c_order, prof, stage_to_rank=dict(enumerate(s2r))).makespan_ms) == c_mk


@pytest.mark.skipif(val_mod._CORE is None, reason="_pipemorph_c not built")
def test_compiled_checks_follow_the_table():
    """A plan that deadlocks under the pipeline rule (stage 0 runs I(0,0) before F(0,1), stage 1 needs
    F(1,1) before I(1,0)) is valid under the independent-backward rule, and the compiled check says so."""
    C = val_mod._CORE
    plan = {0: [(0, "F", 0), (0, "I", 0), (0, "F", 1), (0, "I", 1), (0, "W", 0), (0, "W", 1)],
            1: [(1, "F", 0), (1, "F", 1), (1, "I", 0), (1, "I", 1), (1, "W", 0), (1, "W", 1)]}
    assert C.check(table(2).spec(), plan, 2, 2, None) is None
    assert C.check(table(2, rule=independent_backward).spec(), plan, 2, 2, None) == [1, 2]  # peaks
    with pytest.raises(ValueError, match="another problem"):
        C.check(table(3).spec(), plan, 2, 2, None)
    rng = random.Random(2)  # and on random plans: the table's readiness, walked in Python
    for _ in range(300):
        S, N = rng.randint(1, 4), rng.randint(1, 4)
        tab = table(S, rule=rng.choice((producers, independent_backward)))
        ops = [(s, k, m) for s in range(S) for k in "FIW" for m in range(N)]
        rng.shuffle(ops)
        plan = {s: [o for o in ops if o[0] == s] for s in range(S)}
        done, pos, progress = set(), {s: 0 for s in range(S)}, True
        while progress:
            progress = False
            for s in range(S):
                while pos[s] < len(plan[s]):
                    st, k, m = plan[s][pos[s]]
                    if any((c // 3, KINDS[c % 3], m) not in done for c in tab.needs_of(class_of(st, k))):
                        break
                    done.add(plan[s][pos[s]])
                    pos[s] += 1
                    progress = True
        assert (C.check(tab.spec(), plan, S, N, None) is not None) == (len(done) == 3 * S * N)


def test_compiled_crosspipe_greedy_and_engine_follow_the_table(other_rule):
    from titan_ext.plan.crosspipe import _compiled, greedy_schedule, placed_from_profile, wave_profile
    from titan_ext.plan.crosspipe.retime import Retimer

    if not _compiled.available():
        pytest.skip("_greedy_c / _search_c not built")
    C = _compiled.engine()
    rng = random.Random(17)
    for _ in range(30):
        S = rng.randint(2, 5)
        prof = _profile(rng, S, rng.randint(S, 3 * S))
        variant = rng.choice(("ud", "wave"))
        if variant == "wave":
            prof = wave_profile(prof)
        problem = placed_from_profile(prof, variant)
        py = greedy_schedule(problem, n_sub=rng.choice((1, 2)))
        model = Retimer(problem)
        ids, mk, _ = _compiled.greedy_ids(problem, n_sub=py.n_sub)
        assert ids == model.ids(py.orders) and mk == py.makespan_ns
        # the re-timing (its edges from the table), the compiled engine and the reference, under the rule
        timed = model.run(ids)
        assert C.run(model.spec(), ids, math.inf) == timed
        ref = simulate(py.orders, prof, stage_to_rank=dict(enumerate(problem.stage_to_rank))).makespan_ms
        assert timed[0] == to_ns(ref)


# --------------------------------------------------------------------------- shipping the headers
def test_every_c_module_includes_the_shared_headers_and_they_ship():
    """_link.h (the one FIFO send) and _deps.h (the table's C reader) are included by the C modules that
    need them, listed as every plan extension's ``depends`` and shipped as package data."""
    plan = ROOT_DIR / "titan_ext" / "plan"
    includes = {c.name: set(re.findall(r'#include "(_\w+\.h)"', c.read_text())) for c in plan.glob("*.c")}
    assert includes["_pipemorph.c"] == {"_deps.h", "_link.h"}
    assert includes["_greedy.c"] == {"_deps.h", "_link.h"}
    assert includes["_search.c"] == {"_link.h"}  # its table is Retimer.spec()'s per-op edges
    link_h = (plan / "_link.h").read_text()  # one unit: one instantiation of the send, int64 ns
    assert re.findall(r"^TITAN_EXT_LINK_SEND\((\w+), ([\w ]+)\)", link_h, re.M) == [("link_send_ns", "long long")]
    for c in plan.glob("*.c"):  # no module sends a message by hand
        assert "start + tx" not in c.read_text() and "s0 += " not in c.read_text()
    setup = (ROOT_DIR / "setup.py").read_text()
    assert 'PLAN_HEADERS = [os.path.join("titan_ext", "plan", h) for h in ("_link.h", "_deps.h")]' in setup
    assert setup.count("depends=PLAN_HEADERS") == 3
    assert '"titan_ext.plan" = ["_link.h", "_deps.h"]' in (ROOT_DIR / "pyproject.toml").read_text()
