"""scripts/bench_optimality.py's memory settings: ``--memory 0`` = no limit for every
generator and the solver, negative values refused, and solver caches keyed per limit so capped and
uncapped optima never mix (the bare keys of the existing caches stay the cap of S)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "docs" / "benchmarks"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_optimality", ROOT / "scripts" / "bench_optimality.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("value", ["-1", "x", "1.5"])
def test_memory_flag_refuses_negative_and_non_integers(value, capsys):
    with pytest.raises(SystemExit) as e:
        _bench().main(["--memory", value])
    assert e.value.code == 2
    assert "argument --memory" in capsys.readouterr().err


def test_memory_limit_and_cache_key():
    b = _bench()
    assert b.memory_limit(0, 4) is None and b.memory_limit(1, 4) == 4 and b.memory_limit(2, 4) == 8
    assert b.cache_key("B1", 1) == "B1"  # the caches written before the key held the limit
    assert b.cache_key("B1", 0) == "B1@uncapped" and b.cache_key("B1", 2) == "B1@memory2"
    cache = {"B1": {"makespan_ms": 480.3, "memory_limit": 4}, "B1@uncapped": {"makespan_ms": 464.9}}
    assert b.cached_entry(cache, "B1", 1, 4)["makespan_ms"] == 480.3
    assert b.cached_entry(cache, "B1", 0, None)["makespan_ms"] == 464.9
    assert b.cached_entry(cache, "B1", 2, 8) is None
    with pytest.raises(ValueError, match="memory_limit"):
        b.cached_entry({"B1": {"makespan_ms": 1.0, "memory_limit": 8}}, "B1", 1, 4)


@pytest.mark.parametrize("capped,uncapped", [("crosspipe_solver_cache", "crosspipe_solver_cache_uncapped"),
                                             ("crosspipe_holdout_cache", "crosspipe_holdout_cache_uncapped")])
def test_uncapped_caches_are_keyed_apart_and_never_above_the_capped_optimum(capped, uncapped):
    if not (BENCH / f"{uncapped}.json").exists():
        pytest.skip("no uncapped solver cache")
    cap = json.loads((BENCH / f"{capped}.json").read_text())
    unc = json.loads((BENCH / f"{uncapped}.json").read_text())
    for key, row in unc.items():
        case, _, tag = key.partition("@")
        assert tag == "uncapped" and case[0] in "ABCD" and case[1:].isdigit()
        assert row["memory_limit"] is None
        assert row["bound_ms"] <= row["makespan_ms"] + 1e-6
        if row["optimal"]:
            assert row["bound_ms"] == pytest.approx(row["makespan_ms"])
        if case in cap:  # lifting the cap can only help
            assert row["makespan_ms"] <= cap[case]["bound_ms"] + 1e-6


def test_uncapped_run_caches_under_its_own_key(tmp_path):
    pytest.importorskip("ortools")
    cache = tmp_path / "cache.json"
    out = tmp_path / "out.json"
    assert _bench().main(["--memory", "0", "--configs", "A", "--seeds", "1", "--repeat", "1", "--time-limit", "20",
                          "--solver-cache", str(cache), "--json", str(out)]) == 0
    entry = json.loads(cache.read_text())
    assert list(entry) == ["A0@uncapped"] and entry["A0@uncapped"]["memory_limit"] is None
    row = json.loads(out.read_text())["cases"][0]
    assert row["memory_limit"] is None and row["solver"]["cache_key"] == "A0@uncapped"
    assert not row["solver"]["cached"]
