"""CLI: `titan-ext plan|simulate --schedule crosspipe-ud|crosspipe-udsub|crosspipe-wave|optimal`."""

from __future__ import annotations

import json

import pytest

from titan_ext.cli import main
from titan_ext.plan import LinkProfile, PipelineProfile, simulate
from titan_ext.plan.crosspipe import plan_crosspipe, wave_profile

ARGS = ["--stages", "4", "--microbatches", "8", "--times", "10,10,10", "--delay", "1:20", "--json"]


def _last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["crosspipe-ud", "crosspipe-udsub", "crosspipe-wave"])
def test_plan_prints_the_simulated_makespan_of_the_plan(name, capsys):
    assert main(["plan", "--schedule", name, "--memory-limit", "4", *ARGS]) == 0
    out = _last_json(capsys)
    prof = PipelineProfile(4, 8, 10.0, 10.0, 10.0, (LinkProfile(), LinkProfile(latency_ms=20.0), LinkProfile()))
    variant = name.split("-")[1]
    sim_prof = wave_profile(prof) if variant == "wave" else prof
    plan = plan_crosspipe(sim_prof, variant, memory_limit=8 if variant == "wave" else 4)
    assert out["makespan_ms"] == pytest.approx(simulate(plan.actions, sim_prof).makespan_ms)
    assert out["schedule"] == name and "plan_ms" in out


def test_optimal_and_simulate(capsys):
    pytest.importorskip("ortools")
    assert main(["plan", "--schedule", "optimal", "--memory-limit", "4", "--time-limit", "20", *ARGS]) == 0
    opt = _last_json(capsys)
    assert opt["proven_optimal"] and opt["makespan_ms"] == pytest.approx(opt["bound_ms"])
    assert main(["simulate", "--schedule", "crosspipe-ud", "--memory-limit", "4", *ARGS]) == 0
    ud = _last_json(capsys)
    assert opt["makespan_ms"] <= ud["makespan_ms"] + 1e-6


def test_bad_arguments_exit_2(capsys):
    assert main(["plan", "--schedule", "crosspipe-wave", "--memory-limit", "0", *ARGS]) == 2
    assert main(["simulate", "--schedule", "crosspipe-loop", *ARGS]) == 2
    assert main(["plan", "--schedule", "optimal", "--time-limit", "-1", *ARGS]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("error:") for line in err)
