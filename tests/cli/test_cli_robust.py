"""Probes kept as tests: bad or extreme command-line input is refused in one line with exit 2
(no traceback, nothing on stdout), outputs never touch a file the user already had, and work is
bounded by --time-limit (compare skips what does not fit its budget)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from titan_ext import cli
from titan_ext.cli import main

ROOT = Path(__file__).resolve().parents[2]
PLAN = ["plan", "--stages", "4", "--microbatches", "12"]
T = ["--times", "10,10,10"]
SIM = ["simulate", "--builtin", "1F1B", "--stages", "4", "--microbatches", "12"]
CMP = ["compare", "--stages", "4", "--microbatches", "12"]


def _run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


PROFILES = {
    "binary": b"\xae\x00\xff" * 10,
    "nested": b"[" * 100000 + b"]" * 100000,
    "too_big": b" " * (cli.MAX_PROFILE_BYTES + 1) + b"{}",
    "infinite_delay": b'{"num_stages": 4, "num_microbatches": 12, "f_ms": 10, "b_ms": 10, "w_ms": 10, '
                      b'"links": [{"latency_ms": 1e400}, {}, {}]}',
    "huge_budget_ratio": b'{"num_stages": 4, "num_microbatches": 12, "f_ms": 10, "b_ms": 10, "w_ms": 10, '
                         b'"activation_bytes": 1e-300, "memory_budget_bytes": 1e300}',
    "few_links": b'{"num_stages": 4, "num_microbatches": 12, "f_ms": 10, "b_ms": 10, "w_ms": 10, '
                 b'"links": [{"latency_ms": 1}]}',
    "times_as_text": b'{"num_stages": 4, "num_microbatches": 12, "f_ms": "10", "b_ms": 10, "w_ms": 10}',
    "links_not_a_list": b'{"num_stages": 4, "num_microbatches": 12, "f_ms": 10, "b_ms": 10, "w_ms": 10, '
                        b'"links": 5}',
    "zero_f": b'{"num_stages": 4, "num_microbatches": 12, "f_ms": 0, "b_ms": 10, "w_ms": 10}',
}

# name: (argv, what the one error line must contain); "{p}" is the profile of the same name
BAD = {
    # non-finite, zero, tiny and absurd numbers
    "bandwidth_overflow": ([*PLAN, *T, "--bandwidth", "0:1e-300", "--message-mb", "1e9"], "message_bytes / bandwidth"),
    "bandwidth_overflow_simulate": ([*SIM, *T, "--bandwidth", "0:1e-300", "--message-mb", "1e9"], "bandwidth"),
    "bandwidth_overflow_compare": ([*CMP, *T, "--bandwidth", "0:1e-300", "--message-mb", "1e9"], "bandwidth"),
    "bandwidth_zero": ([*PLAN, *T, "--bandwidth", "0:0", "--message-mb", "1"], "bandwidth must be > 0"),
    "bandwidth_nan": ([*PLAN, *T, "--bandwidth", "0:nan", "--message-mb", "1"], "--bandwidth"),
    "subnanosecond_times_compare": ([*CMP, "--times", "1e-300,1e-300,0"], "at least 1e-06 ms"),
    "zero_times": ([*PLAN, "--times", "0,0,0"], "f_ms[0] must be > 0"),
    "nan_times": ([*PLAN, "--times", "nan,1,1"], "--times"),
    "inf_delay": ([*PLAN, *T, "--delay", "0:inf"], "--delay"),
    "negative_link": ([*PLAN, *T, "--delay", "-1:5"], "--delay"),
    "zero_stages": (["plan", "--stages", "0", "--microbatches", "12", *T], "--stages"),
    "float_stages": (["plan", "--stages", "4.0", "--microbatches", "12", *T], "--stages"),
    "huge_microbatches": (["plan", "--stages", "4", "--microbatches", "1e9", *T], "--microbatches"),
    "ops_beyond_bound": (["plan", "--stages", "64", "--microbatches", "2048", *T], "beyond the bound of 65536"),
    "virtual_ops_beyond_bound": (["plan", "--stages", "2", "--microbatches", "2000", *T, "--virtual-stages", "1000"],
                                 "beyond the bound of 65536"),
    "slack_floor_absurd": ([*PLAN, *T, "--slack-floor", "1000000000"], "--slack-floor"),
    "slack_floor_beyond_microbatches": ([*PLAN, *T, "--slack-floor", "13"], "at most the number of microbatches"),
    "slack_floor_zero": ([*PLAN, *T, "--slack-floor", "0"], "--slack-floor"),
    "memory_limit_zero": ([*PLAN, *T, "--memory-limit", "0"], "--memory-limit"),
    "time_limit_zero": ([*PLAN, *T, "--time-limit", "0"], "--time-limit"),
    "time_limit_nan": ([*PLAN, *T, "--time-limit", "nan"], "--time-limit"),
    "time_limit_absurd": ([*CMP, *T, "--time-limit", "1e12"], "--time-limit"),
    "message_mb_inf": ([*PLAN, *T, "--message-mb", "inf"], "--message-mb"),
    "placement_v_needs_two": ([*PLAN, *T, "--virtual-stages", "3", "--placement", "v"], "--placement v holds 2"),
    "virtual_stages_one": ([*PLAN, *T, "--virtual-stages", "1"], "--virtual-stages"),
    # repeated options: the last one would win silently
    "repeated_stages": ([*PLAN, *T, "--stages", "5"], "--stages: given more than once"),
    "repeated_times": ([*PLAN, *T, "--times", "1,1,1"], "--times: given more than once"),
    "repeated_schedule": ([*PLAN, *T, "--schedule", "zb", "--schedule", "zb-h1"], "--schedule: given more than once"),
    "repeated_out_csv": ([*PLAN, *T, "--out-csv", "a.csv", "--out-csv", "b.csv"], "--out-csv: given more than once"),
    "repeated_flag": ([*SIM, *T, "--hol", "--hol"], "--hol: given more than once"),
    "repeated_time_limit": ([*CMP, *T, "--time-limit", "5", "--time-limit", "6"], "given more than once"),
    "abbreviated_option": ([*PLAN, *T, "--stage", "5"], "unrecognized arguments"),
    # profiles: text with a size limit, every field checked
    "profile_device": ([*PLAN, "--profile", "/dev/zero"], "not a regular file"),
    "profile_directory": ([*PLAN, "--profile", "."], "not a regular file"),
    "profile_missing": ([*PLAN, "--profile", "missing.json"], "No such file"),
    **{f"profile_{name}": ([*PLAN[:1], "--profile", "{p}"] + (["--delay", "2:5"] if name == "few_links" else []),
                           needle) for name, needle in [
        ("binary", "not UTF-8 text"), ("nested", "not valid JSON"), ("too_big", "larger than"),
        ("infinite_delay", "latency_ms must be"), ("few_links", "1 entries for 4 stages"),
        ("times_as_text", "f_ms"), ("links_not_a_list", "links"), ("zero_f", "f_ms[0] must be > 0")]},
    "csv_device": (["simulate", "--csv", "/dev/zero", "--stages", "4", "--microbatches", "12", *T],
                   "--csv /dev/zero: not a regular file"),
    "csv_directory": (["simulate", "--csv", ".", "--stages", "4", "--microbatches", "12", *T], "not a regular file"),
    # output paths, checked before any work
    "same_output_twice": ([*PLAN, *T, "--out-csv", "x.csv", "--trace", "./x.csv"], "the same file as --out-csv"),
    "output_is_device": ([*PLAN, *T, "--trace", "/dev/null"], "not a regular file"),
    "output_is_directory": ([*PLAN, *T, "--out-csv", "."], "is a directory"),
    "output_in_proc": ([*PLAN, *T, "--out-csv", "/proc/version"], "--out-csv /proc/version"),
    "output_missing_dir": ([*PLAN, *T, "--trace", "missing_dir/t.json"], "no such directory"),
    "gantt_extension": ([*PLAN, *T, "--gantt", "g.bmp"], "unsupported extension"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_exit_2(case, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv, needle = BAD[case]
    if "{p}" in argv:
        name = case.removeprefix("profile_")
        (tmp_path / f"{name}.json").write_bytes(PROFILES[name])
        argv = [a.replace("{p}", f"{name}.json") for a in argv]
    code, out, err = _run(argv, capsys)
    assert code == 2 and out == "", (out, err)
    assert len(err.strip().splitlines()) == 1 and needle in err, err
    profile = {f"{case.removeprefix('profile_')}.json"} if "{p}" in BAD[case][0] else set()
    assert set(os.listdir(tmp_path)) == profile  # nothing written


def test_huge_budget_ratio_plans_like_an_unlimited_budget(tmp_path, capsys):
    """A budget/activation ratio of 1e600 is no overflow: it holds every microbatch (the cap is N)."""
    path = tmp_path / "p.json"
    path.write_bytes(PROFILES["huge_budget_ratio"])
    code, out, err = _run(["plan", "--profile", str(path)], capsys)
    assert code == 0, err
    code2, out2, _ = _run([*PLAN, *T], capsys)
    assert out.splitlines()[0] == out2.splitlines()[0]  # the same makespan as without a budget


def test_failed_write_keeps_the_users_files(tmp_path, capsys, monkeypatch):
    """`--out-csv pre.csv --trace missing_dir/t.json` deleted the user's pre.csv."""
    pre = tmp_path / "pre.csv"
    pre.write_text("the user's file\n")
    code, out, err = _run([*PLAN, *T, "--out-csv", str(pre), "--trace", str(tmp_path / "missing_dir" / "t.json")],
                          capsys)
    assert code == 2 and pre.read_text() == "the user's file\n"
    # a failure while writing (the disk is full for the trace): the csv is not replaced either
    code, out, err = _run([*PLAN, *T, "--out-csv", str(pre), "--gantt", str(tmp_path / "g.png")], capsys)
    assert code == 0 and pre.read_text().startswith("0F0")  # replaced on success
    pre.write_text("the user's file\n")
    real = cli._temporary
    calls = []

    def full_disk_for_the_second(path):
        calls.append(path)
        if len(calls) == 4:  # check_outputs probes 2 paths, then the writer stages the csv, then the gantt
            raise OSError(28, "No space left on device")
        return real(path)

    monkeypatch.setattr(cli, "_temporary", full_disk_for_the_second)
    code, out, err = _run([*PLAN, *T, "--out-csv", str(pre), "--gantt", str(tmp_path / "g2.png")], capsys)
    assert code == 2 and "No space left" in err, err
    assert pre.read_text() == "the user's file\n" and not (tmp_path / "g2.png").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.png", "pre.csv"]  # no temporary file left


def test_outputs_keep_the_mode_of_the_file_they_replace(tmp_path, capsys):
    pre = tmp_path / "pre.csv"
    pre.write_text("x")
    pre.chmod(0o640)
    assert _run([*PLAN, *T, "--out-csv", str(pre)], capsys)[0] == 0
    assert (pre.stat().st_mode & 0o777) == 0o640


@pytest.mark.multiprocess
def test_full_stdout_is_one_line_exit_2():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "titan_ext.cli", *PLAN, *T], stdout=full, stderr=subprocess.PIPE,
                           text=True, env=env, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    # (a busy machine may add the progress line before it)
    assert p.stderr.strip().splitlines()[-1] == "error: cannot write the output: No space left on device"


# CrossPipe's wave planner at 16 x 256 costs ~19 s of CPU (torch's DualPipeV ~10 s); at 32 x 512 several times that:
# beyond the limits below, so the bound is what ends them.
BIG = ["--stages", "32", "--microbatches", "512", "--times", "10,10,10"]


def test_time_limit_holds_end_to_end_with_a_progress_line(capsys, monkeypatch):
    from titan_ext.plan.ir import torch_schedules
    from titan_ext.plan.schedules import plan_by_name  # noqa: F401  (imported ahead, as above)

    torch_schedules()  # imported first: the alarm waits for an import to end (a busy machine's torch
    monkeypatch.setattr(cli, "PROGRESS_AFTER_S", 0.3)  # import could outlast the whole limit)
    cpu0 = time.process_time()
    code, out, err = _run(["plan", *BIG, "--schedule", "crosspipe-wave", "--time-limit", "1"], capsys)
    cpu = time.process_time() - cpu0
    assert code == 2 and out == "", out
    lines = err.strip().splitlines()
    assert lines[0].startswith("titan-ext: plan still running; it stops at --time-limit 1 s"), err
    assert lines[-1] == ("error: plan: not finished within --time-limit 1 s (raise it, or plan fewer stages or "
                         "microbatches)") and len(lines) == 2
    # CPU time, not wall time (a busy machine stretches the wall clock): the alarm comes at 2.05 s of wall
    # time, so at most that much CPU; unbounded, this plan costs > 19 s of CPU (its cost at 16 x 256)
    assert cpu < 10, cpu


def test_compare_skips_what_does_not_fit_its_budget_and_says_so(capsys):
    import json

    from titan_ext.plan.ir import torch_schedules

    torch_schedules()  # (imports are not part of the budget's question)
    cpu0 = time.process_time()
    code, out, err = _run(["compare", *BIG, "--time-limit", "8", "--json"], capsys)
    cpu = time.process_time() - cpu0
    assert code == 0, err
    rows = {r["schedule"]: r for r in json.loads(out.strip().splitlines()[-1])["schedules"]}
    assert len(rows) >= 9 and all("makespan_ms" in r or "error" in r for r in rows.values()), rows
    skipped = {name for name, r in rows.items() if r.get("error", "").startswith("skipped: ")}
    assert {"CrossPipe (wave)", "torch DualPipeV"} <= skipped, rows  # ~50 s and ~25 s alone
    assert all("budget" in rows[name]["error"] for name in skipped)
    # CPU time (robust to a busy machine): 8 s of budget plus short overruns; unbounded, wave and DualPipeV alone
    # cost > 30 s of CPU at 16 x 256
    assert cpu < 20, cpu
