"""The command line's habits: --version, ``python -m titan_ext``, --json writes only JSON to stdout,
the training tools as subcommands with --help."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from titan_ext import cli

ROOT = Path(__file__).resolve().parents[2]


def _module(*argv):
    return subprocess.run([sys.executable, "-m", "titan_ext", *argv], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


@pytest.mark.multiprocess
def test_version_and_module_help_exit_0():
    version = _module("--version")
    assert version.returncode == 0 and version.stdout.startswith("titan-ext "), version
    helped = _module("--help")
    assert helped.returncode == 0, helped.stderr
    for name in ("plan", "simulate", "compare", "summary", "wandb-offline", "falcon-s4"):
        assert name in helped.stdout


@pytest.mark.multiprocess
def test_plan_json_stdout_parses_whole():
    run = _module("plan", "--stages", "4", "--microbatches", "8", "--times", "10,10,10", "--json")
    assert run.returncode == 0, run.stderr
    document = json.loads(run.stdout)  # the whole of stdout, not its last line
    assert document["makespan_ms"] > 0 and document["schedule"] == "pipemorph"
    assert "makespan" in run.stderr  # the human report is still there, on stderr


@pytest.mark.parametrize("argv", [
    ["simulate", "--builtin", "1F1B", "--stages", "4", "--microbatches", "8", "--times", "10,10,10", "--json"],
    ["compare", "--stages", "4", "--microbatches", "8", "--times", "10,10,10", "--json"],
])
def test_every_json_command_writes_only_json(argv, capsys):
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    json.loads(out)
    assert err.strip()


@pytest.mark.parametrize("tool", ["summary", "wandb-offline", "falcon-s4"])
def test_tools_are_subcommands_with_help(tool, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main([tool, "--help"])
    assert stop.value.code == 0
    assert f"titan-ext {tool}" in capsys.readouterr().out


def test_summary_json_alone_on_stdout(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "schedule": "PipeMorph", "loss": 2.0 - s / 10, "iteration_ms": 100.0 + s,
             "bubble_rate": 0.2, "plan_version": 1, "train_step_ms": 120.0} for s in range(1, 7)]
    (run / "pipeline_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli.main(["summary", str(run), "--skip", "1", "--json"]) == 0
    out, err = capsys.readouterr()
    (summary,) = json.loads(out)
    assert summary["steps"] == 6 and "PipeMorph" in err


def test_wandb_offline_without_runs_says_so(tmp_path, capsys):
    assert cli.main(["wandb-offline", str(tmp_path)]) == 1
    assert "no W&B offline run" in capsys.readouterr().err
