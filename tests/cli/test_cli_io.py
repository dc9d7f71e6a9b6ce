"""The CLI's cross-cutting behaviour: defaults in --help, per-stage --times, --profile fields,
write errors (one line, exit 2, no partial output) and a closed pipe (no traceback)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from titan_ext.cli import main
from titan_ext.plan import PipelineProfile, plan_pipemorph, simulate

ROOT = Path(__file__).resolve().parents[2]
BASE = ["plan", "--stages", "4", "--microbatches", "12"]


def _run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "number of microbatches) (default: 2)" in out and "(default: pipemorph)" in out
    assert "(default: None)" not in out  # options without a default say nothing


def test_per_stage_times_match_the_library(capsys):
    code, out, err = _run([*BASE, "--times", "10,10,10/12,12,12/10,10,10/14,14,14", "--json"], capsys)
    assert code == 0
    profile = PipelineProfile(4, 12, (10, 12, 10, 14), (10, 12, 10, 14), (10, 12, 10, 14))
    expected = simulate(plan_pipemorph(profile).actions, profile).makespan_ms
    assert f"makespan    {expected:.3f} ms" in err  # with --json the report goes to stderr
    assert json.loads(out)["makespan_ms"] == expected
    code, out, err = _run([*BASE, "--times", "10,10,10/12,12,12"], capsys)
    assert code == 2 and out == "" and "2 F,B,W triples for 4 stages" in err


@pytest.mark.parametrize("times", ["10,10", "10,x,10", "10,10,1e400", "10,-1,10"])
def test_bad_times_one_line(times, capsys):
    code, out, err = _run([*BASE, "--times", times], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1


def test_profile_unknown_field_rejected_and_documented_example_works(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"num_stages": 4, "num_microbatches": 12, "f_ms": 10, "b_ms": 10, "w_ms": 10, "fms": 3}')
    code, out, err = _run(["plan", "--profile", str(bad)], capsys)
    assert code == 2 and out == "" and "unknown field(s) fms" in err
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    example = help_text[help_text.index("Example: ") + 9:help_text.index(". Optional")]
    good = tmp_path / "good.json"
    good.write_text(example)
    code, out, err = _run(["plan", "--profile", str(good)], capsys)
    assert code == 0, err
    assert out.startswith("makespan")


@pytest.mark.parametrize("flag,target", [
    ("--out-csv", "missing/dir/plan.csv"),   # missing directory
    ("--out-csv", "."),                      # a directory
    ("--trace", "/dev/full"),                # disk full
    ("--gantt", "plan.bmp"),                 # unsupported extension
])
def test_write_error_is_one_line_exit_2(flag, target, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = _run([*BASE, "--times", "10,10,10", flag, target], capsys)
    assert code == 2 and out == "", out
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"error: {flag} "), err


def test_failed_write_leaves_no_partial_output(tmp_path, capsys):
    csv = tmp_path / "plan.csv"
    code, out, err = _run([*BASE, "--times", "10,10,10", "--out-csv", str(csv),
                           "--gantt", str(tmp_path / "missing" / "plan.png")], capsys)
    assert code == 2 and out == "" and "--gantt" in err
    assert not csv.exists()  # written first, removed when the Gantt failed


@pytest.mark.multiprocess
def test_closed_pipe_is_quiet(tmp_path):
    """`titan-ext ... | true`: the reader is gone before the JSON is written: exit 0, no traceback (with
    --json the human report goes to stderr)."""
    cmd = (f"{sys.executable} -m titan_ext.cli plan --stages 8 --microbatches 64 --times 10,10,10 "
           f"--json 2>err.txt | true; echo ${{PIPESTATUS[0]}}; cat err.txt")
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, cwd=tmp_path,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "0" and "Traceback" not in out.stdout and "error" not in out.stdout, out.stdout


def test_compare_side_by_side_matches_closed_forms(capsys):
    """S=4, N=12, F=B=W=10 ms, no delay: PipeMorph = ZB of PipeMorph Fig.4 (390 ms); torch's GPipe
    and 1F1B (full backward B = I+W = 20 ms) = (N + S - 1)·(F + B) = 450 ms."""
    import json

    code, out, err = _run(["compare", "--stages", "4", "--microbatches", "12", "--times", "10,10,10",
                           "--json"], capsys)
    assert code == 0, err
    rows = {r["schedule"]: r for r in json.loads(out)["schedules"]}  # stdout is the JSON document
    assert rows["PipeMorph"]["makespan_ms"] == 390.0
    assert rows["torch GPipe"]["makespan_ms"] == 450.0 and rows["torch 1F1B"]["makespan_ms"] == 450.0
    assert rows["torch GPipe"]["peak_inflight"] == 12 and rows["torch 1F1B"]["peak_inflight"] == 4
    assert {"CrossPipe (udsub)", "CrossPipe (wave)", "torch ZBVZeroBubble", "torch DualPipeV"} <= set(rows)
    assert "PipeMorph" in err.splitlines()[1] and "vs best torch" in err.splitlines()[0]


_BAD_CLI = {
    # name: (argv, the one error line must contain)
    "negative_message_mb": ([*BASE, "--times", "10,10,10", "--message-mb", "-1"], "--message-mb"),
    "nan_message_mb": ([*BASE, "--times", "10,10,10", "--message-mb", "nan"], "--message-mb"),
    "times_overflow": ([*BASE, "--times", "1e308,1e308,1e308"], "--times"),
    "delay_overflow": ([*BASE, "--times", "10,10,10", "--delay", "1:1e308"], "--delay"),
    "stages_beyond_bound": (["plan", "--stages", str(10**12), "--microbatches", "12", "--times", "10,10,10"],
                            "--stages: expected an integer in [1, 65536]"),
    "duplicate_delay": ([*BASE, "--times", "10,10,10", "--delay", "1:10", "--delay", "1:20"],
                        "--delay given more than once for link 1"),
    "fractional_slack_floor": ([*BASE, "--times", "10,10,10", "--slack-floor", "1.5"], "--slack-floor"),
    "fractional_memory_limit": ([*BASE, "--times", "10,10,10", "--memory-limit", "7.5"], "--memory-limit"),
    "memory_limit_with_builtin": (["simulate", "--builtin", "1F1B", "--stages", "4", "--microbatches", "12",
                                   "--times", "10,10,10", "--memory-limit", "3"], "--memory-limit"),
}


@pytest.mark.parametrize("case", sorted(_BAD_CLI))
def test_bad_input_one_line_exit_2_no_output(case, capsys):
    argv, needle = _BAD_CLI[case]
    code, out, err = _run(argv, capsys)
    assert code == 2 and out == "", out
    assert len(err.strip().splitlines()) == 1 and needle in err, err


@pytest.mark.parametrize("body,needle", [
    ('{"num_stages": "4", "num_microbatches": 12, "f_ms": 10, "b_ms": 10, "w_ms": 10}', "num_stages"),
    ('{"num_stages": 4, "num_microbatches": 12, "f_ms": 10, "b_ms": 10}', "missing field(s) w_ms"),
    ('{"num_stages": 4, "num_microbatches": 12, "f_ms": 10, "b_ms": 10, "w_ms": [1, 2]}', "w_ms"),
    ('{"num_stages": 4, "num_microbatches": 12, "f_ms": 10, "b_ms": 10, "w_ms": 10, '
     '"links": [{"latency": 3}]}', "latency"),
])
def test_profile_missing_or_mistyped_field_named(body, needle, tmp_path, capsys):
    path = tmp_path / "p.json"
    path.write_text(body)
    code, out, err = _run(["plan", "--profile", str(path)], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and needle in err, err
