"""CLI and Python API: hostile input, kept as a table. Each case asserts the
specific clean outcome -- exit code, one line on stderr naming the argument, no file left behind, the
user's file untouched -- or, for the API, a TypeError/ValueError naming the argument. None repeats
tests/cli/test_cli_robust.py or tests/plan/test_plan_api_errors.py.

Signals (item 1): a few subprocess tests send a real SIGINT/SIGTERM to ``titan-ext plan --schedule
optimal`` while it writes its outputs (after the CP-SAT solve, which used to leave the kernel's SIGINT
action at SIG_DFL: the process died at once, exit -2, leaving its temporary files), and the Python API
must leave the caller's handlers -- and the kernel's action -- as it found them."""

from __future__ import annotations

import functools
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from titan_ext.cli import main

ROOT = Path(__file__).resolve().parents[2]
PLAN = ["plan", "--stages", "4", "--microbatches", "8"]
T = ["--times", "10,10,10"]
SIM = ["simulate", "--builtin", "1F1B", "--stages", "4", "--microbatches", "8"]
USERS = "the user's own file\n"


def _run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _sig_caught(signum: int) -> bool:
    """Whether the kernel delivers ``signum`` to a handler (not SIG_DFL / SIG_IGN): /proc's SigCgt mask --
    what Python's ``signal.getsignal`` cannot tell after native code changed the action behind it."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    pytest.skip("no /proc/self/status")


# --------------------------------------------------------------------------------------------------------
# signals: subprocess tests (real signals, no timing race: the child says when it is inside the writer)

# the child: `titan-ext` whose Gantt writer writes half a file, says so, and then waits to be signalled
_CHILD = r"""
import os, sys, time
import titan_ext.plan.export as export
marker = sys.argv[1]
def waiting_gantt(timeline, path, title=None):
    with open(path, "w") as f:
        f.write("half a png")
    with open(marker + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(marker + ".tmp", marker)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(99)  # never signalled
export.write_gantt_png = waiting_gantt
from titan_ext.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _as_a_shell_starts() -> None:
    """The child starts with SIGINT/SIGTERM at their defaults and unblocked, as a command run from a shell
    does: a child inherits an ignored or blocked signal from its parent. A pytest started in the
    background of a non-interactive shell (how CI harnesses start it) inherits SIGINT ignored -- no test
    left it so: tests/conftest.py resets it for the session and fails any test that changes it."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def _signal_while_writing(tmp_path: Path, signum: int, schedule: str = "optimal"):
    pytest.importorskip("ortools")
    work = tmp_path / "work"
    work.mkdir()
    (work / "mine.csv").write_text(USERS)
    (work / "t.json").write_text(USERS)
    marker = tmp_path / "inside_writer"
    argv = [*PLAN, *T, "--delay", "1:20", "--schedule", schedule, "--time-limit", "90",  # a busy host: room
            "--out-csv", "mine.csv", "--trace", "t.json", "--gantt", "g.png"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(marker), *argv], cwd=work, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_as_a_shell_starts)
    try:
        deadline = time.monotonic() + 180
        while not marker.exists():
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "the child never reached the writer"
            time.sleep(0.05)
        child.send_signal(signum)
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    return child.returncode, out, err, work


@pytest.mark.multiprocess
@pytest.mark.parametrize("signum,code,line", [
    (signal.SIGINT, 130, "titan-ext: interrupted (Ctrl-C)"),
    pytest.param(signal.SIGTERM, 143, "titan-ext: terminated (SIGTERM)", marks=pytest.mark.slow),  # same path
])
def test_signal_after_an_optimal_solve_cleans_up_one_line(signum, code, line, tmp_path):
    """Ctrl-C after `--schedule optimal` killed the process (exit -2, no message) and left
    `.mine.csv.XXXX.csv`, `.t.json.XXXX.json`, `.g.png.XXXX.png`; SIGTERM left the same files."""
    rc, out, err, work = _signal_while_writing(tmp_path, signum)
    assert rc == code, (rc, err)
    assert err.strip().splitlines()[-1] == line and "Traceback" not in err, err
    assert sorted(p.name for p in work.iterdir()) == ["mine.csv", "t.json"]  # no temporary file, no g.png
    assert (work / "mine.csv").read_text() == USERS and (work / "t.json").read_text() == USERS


_SOLVE_CHILD = r"""
import os, signal, sys, threading, time
from ortools.sat.python import cp_model
from titan_ext.plan.interrupt import solve
m = cp_model.CpModel()  # no optimum within 60 s on one worker
xs = [m.NewIntVar(0, 1000, f"x{i}") for i in range(60)]
for i in range(59):
    m.Add(xs[i] + xs[i + 1] <= 1000 + i)
m.AddAllDifferent(xs)
m.Maximize(sum((i % 7) * x for i, x in enumerate(xs)))
solver = cp_model.CpSolver()
solver.parameters.max_time_in_seconds = 60
solver.parameters.num_workers = 1
threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
t0 = time.monotonic()
try:
    solve(solver, m)
    print("not interrupted")
except KeyboardInterrupt:
    print(f"KeyboardInterrupt {time.monotonic() - t0:.1f}", signal.getsignal(signal.SIGINT) is signal.default_int_handler,
          signal.set_wakeup_fd(-1))
"""


@pytest.mark.multiprocess
def test_ctrl_c_during_a_solve_stops_it_and_raises_keyboard_interrupt():
    """A SIGINT inside the native solve stops the search at once (not at its 60 s limit) and reaches Python
    as KeyboardInterrupt after the clean-up: handler and wake-up fd as they were."""
    pytest.importorskip("ortools")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", _SOLVE_CHILD], env=env, capture_output=True, text=True, timeout=120,
                       preexec_fn=_as_a_shell_starts)
    assert p.returncode == 0, p.stderr
    words = p.stdout.split()
    assert words[0] == "KeyboardInterrupt" and words[2:] == ["True", "-1"], p.stdout
    assert float(words[1]) < 30, p.stdout  # stopped by the signal (unbounded: 60 s)


def test_api_optimal_solve_keeps_the_callers_handlers():
    """The Python API leaves the caller's SIGINT/SIGTERM handlers as it found them: the same objects, and
    the kernel still delivers both to them (CP-SAT used to leave SIGINT at SIG_DFL behind Python's back)."""
    pytest.importorskip("ortools")
    from titan_ext.plan import PipelineProfile
    from titan_ext.plan.schedules import plan_by_name

    def mine(signum, frame):  # pragma: no cover - never called
        pass

    def theirs(signum, frame):  # pragma: no cover - never called
        pass

    old = signal.signal(signal.SIGINT, mine), signal.signal(signal.SIGTERM, theirs)
    try:
        result = plan_by_name(PipelineProfile.uniform(4, 8, 10, 10, 10, delays_ms={1: 20}), "optimal", time_limit_s=10)
        assert result.predicted_makespan_ms > 0
        assert signal.getsignal(signal.SIGINT) is mine and signal.getsignal(signal.SIGTERM) is theirs
        assert _sig_caught(signal.SIGINT) and _sig_caught(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGINT, old[0])
        signal.signal(signal.SIGTERM, old[1])


def test_cli_main_puts_the_callers_handlers_back(tmp_path, capsys, monkeypatch):
    """`main()` called as a function (a script, a test) installs its SIGTERM handler only while it runs."""
    monkeypatch.chdir(tmp_path)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert _run([*PLAN, *T, "--out-csv", "p.csv"], capsys)[0] == 0
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    assert _run([*PLAN, *T, "--out-csv", "p.csv/"], capsys)[0] == 2
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_keyboard_interrupt_inside_the_command_is_one_line_exit_130(tmp_path, capsys, monkeypatch):
    """Ctrl-C anywhere else (here: while planning) is one line, exit 130, never a traceback, no output."""
    import titan_ext.cli as cli

    monkeypatch.chdir(tmp_path)
    Path("mine.csv").write_text(USERS)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "plan_by_name", interrupted)
    try:
        code, out, err = _run([*PLAN, *T, "--out-csv", "mine.csv"], capsys)
    except KeyboardInterrupt:  # (would end the whole pytest session)
        pytest.fail("KeyboardInterrupt escaped main()")
    assert (code, out, err) == (130, "", "titan-ext: interrupted (Ctrl-C)\n")
    assert os.listdir(tmp_path) == ["mine.csv"] and Path("mine.csv").read_text() == USERS


# --------------------------------------------------------------------------------------------------------
# CLI: one line on stderr (naming the argument), exit 2, nothing on stdout, no file written or left behind,
# the user's files untouched. Each case runs in a folder holding: mine.csv (the user's file), prof.json
# (a valid profile), link.csv -> mine.csv, dangling.json -> a missing file, sub/ (a folder), fifo (a FIFO).

PROFILE = '{"num_stages": 4, "num_microbatches": 8, "f_ms": 10, "b_ms": 10, "w_ms": 10}'
BIG_INT = "9" * 5000
_P = ["plan", "--profile", "prof.json"]

# name: (argv, what the one error line must contain); "{}" in argv: text of the profile file "bad.json"
CLI_BAD = {
    # output paths that name a directory (by their text), a symlink, or an input: refused before any work
    "out_csv_trailing_slash": ([*PLAN, *T, "--out-csv", "mine.csv/"], "--out-csv mine.csv/: is a directory path"),
    "out_csv_dot_component": ([*PLAN, *T, "--out-csv", "mine.csv/."], "is a directory path"),
    "trace_dotdot": ([*PLAN, *T, "--trace", "sub/.."], "--trace sub/..: is a directory path"),
    "gantt_trailing_slash": ([*PLAN, *T, "--gantt", "sub/g.png/"], "--gantt sub/g.png/: is a directory path"),
    "trace_empty_path": ([*PLAN, *T, "--trace", ""], "--trace : is a directory path"),
    "trace_existing_folder": ([*PLAN, *T, "--trace", "sub"], "--trace sub: is a directory"),
    "simulate_trace_trailing_slash": ([*SIM, *T, "--trace", "mine.csv/"], "--trace mine.csv/: is a directory path"),
    "out_csv_symlink": ([*PLAN, *T, "--out-csv", "link.csv"], "--out-csv link.csv: is a symbolic link"),
    "trace_dangling_symlink": ([*PLAN, *T, "--trace", "dangling.json"], "--trace dangling.json: is a symbolic link"),
    "simulate_gantt_symlink": ([*SIM, *T, "--gantt", "link.csv"], "unsupported extension"),  # checked first
    "trace_is_the_profile": ([*_P, "--trace", "prof.json"], "the same file as the input --profile prof.json"),
    "trace_is_the_profile_other_spelling": ([*_P, "--trace", "sub/../prof.json"], "the input --profile"),
    "trace_is_the_csv_input": (["simulate", "--csv", "mine.csv", "--stages", "4", "--microbatches", "8", *T,
                                "--trace", "./mine.csv"], "the same file as the input --csv mine.csv"),
    "out_csv_nul": ([*PLAN, *T, "--out-csv", "a\0b.csv"], "NUL"),
    "profile_nul": (["plan", "--profile", "p\0.json"], "--profile"),
    # numbers: ASCII digits only (Python's int()/float() accept these), bounded length
    "stages_arabic_indic": (["plan", "--stages", "٣", "--microbatches", "8", *T], "--stages"),
    "stages_devanagari": (["plan", "--stages", "४", "--microbatches", "8", *T], "ASCII digits"),
    "microbatches_fullwidth": (["plan", "--stages", "4", "--microbatches", "１２", *T], "--microbatches"),
    "times_fullwidth": ([*PLAN, "--times", "10,１0,10"], "--times"),
    "delay_link_arabic": ([*PLAN, *T, "--delay", "٠:5"], "--delay"),
    "delay_value_arabic": ([*PLAN, *T, "--delay", "0:٥"], "--delay"),
    "bandwidth_fullwidth": ([*PLAN, *T, "--bandwidth", "0:１", "--message-mb", "1"], "--bandwidth"),
    "message_mb_arabic": ([*PLAN, *T, "--message-mb", "٣"], "--message-mb"),
    "memory_limit_arabic": ([*PLAN, *T, "--memory-limit", "٣"], "--memory-limit"),
    "time_limit_fullwidth": ([*PLAN, *T, "--time-limit", "５"], "--time-limit"),
    "slack_floor_arabic": ([*PLAN, *T, "--slack-floor", "٢"], "--slack-floor"),
    "stage_memory_limit_fullwidth": ([*PLAN, *T, "--stage-memory-limit", "４"], "--stage-memory-limit"),
    "virtual_stages_fullwidth": ([*PLAN, *T, "--virtual-stages", "２"], "--virtual-stages"),
    "polish_arabic": ([*PLAN, *T, "--schedule", "auto", "--polish", "٢"], "--polish"),
    "microbatches_5000_digits": (["plan", "--stages", "4", "--microbatches", BIG_INT, *T], "--microbatches"),
    "times_5000_digits": ([*PLAN, "--times", f"10,10,{BIG_INT}"], "--times"),
    "stages_hex": (["plan", "--stages", "0x4", "--microbatches", "8", *T], "--stages"),
    "times_trailing_slash": ([*PLAN, "--times", "10,10,10/"], "--times"),
    "times_four_values": ([*PLAN, "--times", "10,10,10,10"], "--times"),
    "delay_three_parts": ([*PLAN, *T, "--delay", "0:5:5"], "--delay"),
    "delay_no_link": ([*PLAN, *T, "--delay", ":5"], "--delay"),
    "delay_missing_link": ([*PLAN, *T, "--delay", "5:1"], "link 5 does not exist"),
    "delay_twice_same_link": ([*PLAN, *T, "--delay", "0:1", "--delay", "0:2"], "--delay given more than once for link 0"),
    # profiles
    "profile_5000_digit_integer": (["plan", "--profile", "bad.json"], "--profile bad.json"),
    "profile_huge_stage_count": (["plan", "--profile", "bad.json"], "beyond the bound"),
    "profile_nan_time": (["plan", "--profile", "bad.json"], "f_ms"),
    "profile_top_level_list": (["plan", "--profile", "bad.json"], "--profile bad.json"),
    "profile_stages_float": (["plan", "--profile", "bad.json"], "num_stages must be an integer"),
    "profile_stages_bool": (["plan", "--profile", "bad.json"], "num_stages must be an integer"),
    "profile_empty_file": (["plan", "--profile", "bad.json"], "not valid JSON"),
    "profile_utf8_bom": (["plan", "--profile", "bad.json"], "not valid JSON"),
    "profile_fifo": (["plan", "--profile", "fifo"], "--profile fifo: not a regular file"),
    "csv_fifo": (["simulate", "--csv", "fifo", "--stages", "4", "--microbatches", "8", *T], "--csv fifo: not a regular file"),
    # combinations that cannot be planned
    "slack_floor_given_above_one_microbatch": (["plan", "--stages", "1", "--microbatches", "1", *T,
                                                "--slack-floor", "2"], "--slack-floor 2: at most the number"),
    "polish_with_optimal": ([*PLAN, *T, "--schedule", "optimal", "--polish", "1"], "--polish"),
    "bandwidth_without_message_size": ([*PLAN, *T, "--bandwidth", "0:1"], "--bandwidth needs --message-mb"),
    "memory_limit_fraction_one_stage": ([*PLAN, *T, "--memory-limit", "1.5"], "--memory-limit 1.5"),
    "placement_without_virtual_stages": ([*PLAN, *T, "--placement", "v"], "--placement needs --virtual-stages"),
    "virtual_stages_with_zb": ([*PLAN, *T, "--virtual-stages", "2", "--schedule", "zb"], "--schedule zb"),
    "simulate_memory_limit_builtin": ([*SIM, *T, "--memory-limit", "2"], "--memory-limit applies to --schedule"),
    "simulate_unknown_builtin": (["simulate", "--builtin", "Nope", "--stages", "4", "--microbatches", "8", *T],
                                 "unknown built-in schedule 'Nope'"),
    "simulate_csv_with_a_send": (["simulate", "--csv", "bad.json", "--stages", "1", "--microbatches", "1", *T],
                                 "not a compute action"),
    "simulate_has_no_out_csv": ([*SIM, *T, "--out-csv", "x.csv"], "unrecognized arguments"),
    "gantt_without_extension": ([*PLAN, *T, "--gantt", "g"], "unsupported extension"),
}

BAD_FILES = {
    "profile_5000_digit_integer": '{"num_stages": %s}' % BIG_INT,
    "profile_huge_stage_count": PROFILE.replace('"num_stages": 4', '"num_stages": ' + "9" * 30),
    "profile_nan_time": PROFILE.replace('"f_ms": 10', '"f_ms": NaN'),
    "profile_top_level_list": "[1, 2, 3]",
    "profile_stages_float": PROFILE.replace('"num_stages": 4', '"num_stages": 4.0'),
    "profile_stages_bool": PROFILE.replace('"num_stages": 4', '"num_stages": true'),
    "profile_empty_file": "",
    "profile_utf8_bom": "\ufeff" + PROFILE,
    "simulate_csv_with_a_send": "0F0,0SEND_F0\n",
}


def _hostile_folder(tmp_path: Path, case: str) -> dict[str, str]:
    (tmp_path / "mine.csv").write_text(USERS)
    (tmp_path / "prof.json").write_text(PROFILE)
    (tmp_path / "link.csv").symlink_to("mine.csv")
    (tmp_path / "dangling.json").symlink_to("missing.json")
    (tmp_path / "sub").mkdir()
    os.mkfifo(tmp_path / "fifo")
    if case in BAD_FILES:
        (tmp_path / "bad.json").write_text(BAD_FILES[case], encoding="utf-8")
    return {p.name: (p.read_text() if p.is_file() and not p.is_symlink() else "") for p in tmp_path.iterdir()
            if p.name != "fifo"}


@pytest.mark.parametrize("case", sorted(CLI_BAD))
def test_cli_hostile_input_is_one_line_exit_2_and_touches_nothing(case, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = _hostile_folder(tmp_path, case)
    argv, needle = CLI_BAD[case]
    code, out, err = _run(argv, capsys)
    assert code == 2 and out == "", (code, out, err)
    assert len(err.strip().splitlines()) == 1 and needle in err and "Traceback" not in err, err
    after = {p.name: (p.read_text() if p.is_file() and not p.is_symlink() else "") for p in tmp_path.iterdir()
             if p.name != "fifo"}
    assert after == before  # no file written, replaced or left behind (no temporary file)
    assert os.listdir(tmp_path / "sub") == [] and os.readlink(tmp_path / "link.csv") == "mine.csv"


# --------------------------------------------------------------------------------------------------------
# CLI: degenerate but valid input works (S = 1 stage, N = 1 microbatch), and outputs keep their promises

@pytest.mark.parametrize("argv, makespan", [
    (["plan", "--stages", "1", "--microbatches", "1", *T], 30.0),  # once blamed a --slack-floor nobody gave
    (["plan", "--stages", "1", "--microbatches", "1", *T, "--schedule", "zb-h1"], 30.0),
    (["plan", "--stages", "1", "--microbatches", "1", *T, "--schedule", "crosspipe-ud"], 30.0),
    (["plan", "--stages", "1", "--microbatches", "5", *T], 150.0),
    (["plan", "--stages", "4", "--microbatches", "1", *T], 90.0),  # 4 F, 4 I along the pipeline, then W on stage 0
    (["simulate", "--builtin", "GPipe", "--stages", "1", "--microbatches", "1", *T], 30.0),
    (["plan", "--stages", "1", "--microbatches", "1", "--times", "10,10,0"], 20.0),
])
def test_cli_degenerate_but_valid_input_plans(argv, makespan, capsys):
    import json

    code, out, err = _run([*argv, "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["makespan_ms"] == makespan


def test_cli_writes_through_a_plain_path_and_leaves_no_temporary(tmp_path, capsys, monkeypatch):
    """The happy path of the same checks: the user's file is replaced (mode kept) only on success, and the
    folder holds exactly the outputs asked for."""
    monkeypatch.chdir(tmp_path)
    Path("mine.csv").write_text(USERS)
    code, out, err = _run(["plan", "--stages", "1", "--microbatches", "1", *T, "--out-csv", "mine.csv",
                           "--trace", "t.json"], capsys)
    assert code == 0, err
    assert Path("mine.csv").read_text() == "0F0,0I0,0W0\n"
    assert sorted(os.listdir(tmp_path)) == ["mine.csv", "t.json"]


# --------------------------------------------------------------------------------------------------------
# Python API (item 5): TypeError for a wrong type (ArgumentTypeError is a TypeError and, for code written
# a ValueError), ValueError for a bad value; the message names the argument.

from titan_ext.plan import (  # noqa: E402
    LinkProfile,
    PipelineProfile,
    absorbs_delay,
    adapted_warmup_counts,
    as_ops,
    generate_order,
    initial_warmup_counts_for,
    link_tolerance_ms,
    plan_crosspipe,
    plan_pipemorph,
    simulate,
    slackness,
    to_torch_plan,
    validate_plan,
    zb_h1_warmup_counts,
    zb_warmup_counts,
)
from titan_ext.plan import placement as pl  # noqa: E402
from titan_ext.args import parse_float, parse_int  # noqa: E402
from titan_ext.plan.builtin import builtin_plan, plan_builtin  # noqa: E402
from titan_ext.plan.export import read_torch_csv, write_chrome_trace, write_gantt_png, write_torch_csv  # noqa: E402
from titan_ext.plan.linkfit import fit_alpha_beta, fit_link  # noqa: E402
from titan_ext.plan.optimal import solve_optimal  # noqa: E402
from titan_ext.plan.schedules import plan_by_name  # noqa: E402
from titan_ext.plan.simulate import replay_makespan_ns  # noqa: E402
from titan_ext.plan.virtual import plan_virtual  # noqa: E402

P = PipelineProfile.uniform(4, 8, 10, 10, 10)
X = [7, 5, 3, 1]  # zb's warm-up counts at S=4, N=8
NAN = math.nan


def _ops():
    return plan_pipemorph(P, candidates=False).ops


def _timeline():
    return simulate(_ops(), P)


# name: (call, TypeError or ValueError, text the message must contain)
API_BAD = {
    # plan/ entry points
    "to_torch_plan_unknown_kind": (lambda: to_torch_plan({0: [(0, "X", 0)]}), ValueError, "plan[0]: (0, 'X', 0)"),
    "to_torch_plan_short_op": (lambda: to_torch_plan({0: [(0, "F")]}), ValueError, "plan[0]: (0, 'F')"),
    "as_ops_text_rank": (lambda: as_ops({"a": [(0, "F", 0)]}), ValueError, "rank 'a'"),
    "as_ops_int_actions": (lambda: as_ops({0: [1, 2]}), ValueError, "plan[0]: 1 is not an action"),
    "slackness_increasing": (lambda: slackness([1, 3, 5, 7]), ValueError, "warmup_counts must be non-increasing"),
    "slackness_zero_count": (lambda: slackness([2, 0]), ValueError, "warmup_counts[1] must be >= 1"),
    "slackness_floats": (lambda: slackness([2.0, 1.0]), TypeError, "warmup_counts[0] must be an integer"),
    "initial_for_none": (lambda: initial_warmup_counts_for(None), TypeError, "profile must be a PipelineProfile"),
    "initial_for_memory_nan": (lambda: initial_warmup_counts_for(P, NAN), ValueError, "memory_limit must be finite"),
    "initial_for_memory_text": (lambda: initial_warmup_counts_for(P, "4"), TypeError, "memory_limit must be a number"),
    "adapted_literal_text": (lambda: adapted_warmup_counts(P, literal="yes"), TypeError, "literal must be True or False"),
    "adapted_memory_zero": (lambda: adapted_warmup_counts(P, memory_limit=0), ValueError, "memory_limit must be >= 1"),
    "absorbs_delay_nan": (lambda: absorbs_delay(P, X, 0, delay_ms=NAN), ValueError, "delay_ms must be finite"),
    "absorbs_delay_negative": (lambda: absorbs_delay(P, X, 0, delay_ms=-1), ValueError, "delay_ms must be >= 0"),
    "absorbs_delay_text": (lambda: absorbs_delay(P, X, 0, delay_ms="5"), TypeError, "delay_ms must be a number"),
    "absorbs_delay_missing_link": (lambda: absorbs_delay(P, X, 3), ValueError, "link 3 does not exist"),
    "tolerance_negative_counts": (lambda: link_tolerance_ms(P, [-7, 5, 3, 1], 0), ValueError, "warmup_counts[0]"),
    "zb_zero_stages": (lambda: zb_warmup_counts(0, 8), ValueError, "num_stages must be >= 1"),
    "zb_zero_microbatches": (lambda: zb_warmup_counts(4, 0), ValueError, "num_microbatches must be >= 1"),
    "zb_h1_float_stages": (lambda: zb_h1_warmup_counts(4.0), TypeError, "num_stages must be an integer"),
    "generate_inflight_text": (lambda: generate_order(P, X, inflight_limit="3"), TypeError, "inflight_limit"),
    "generate_full_backward_text": (lambda: generate_order(P, X, full_backward="no"), TypeError, "full_backward"),
    "pipemorph_memory_nan": (lambda: plan_pipemorph(P, memory_limit=NAN), ValueError, "memory_limit must be finite"),
    "pipemorph_cap_text": (lambda: plan_pipemorph(P, cap_inflight="no"), TypeError, "cap_inflight"),
    "pipemorph_candidates_int": (lambda: plan_pipemorph(P, candidates=0), TypeError, "candidates"),
    "by_name_none": (lambda: plan_by_name(P, None), TypeError, "name must be a schedule name"),
    "by_name_virtual_zero": (lambda: plan_by_name(P, "pipemorph", virtual_stages=0), ValueError, "virtual_stages"),
    "by_name_time_nan": (lambda: plan_by_name(P, "zb", time_limit_s=NAN), ValueError, "time_limit_s must be finite"),
    "by_name_polish_negative": (lambda: plan_by_name(P, "auto", polish_s=-1), ValueError, "polish_s must be > 0"),
    "by_name_stage_times_one_stage": (lambda: plan_by_name(P, "zb", stage_times_ms=((1,) * 4,) * 3), ValueError,
                                      "stage_times_ms applies to virtual_stages >= 2"),
    "by_name_full_backward_text": (lambda: plan_by_name(P, "zb", full_backward="x"), TypeError, "full_backward"),
    "stage_to_rank_text_v": (lambda: pl.stage_to_rank(4, "2"), TypeError, "stages_per_rank must be an integer"),
    "boundary_link_missing": (lambda: pl.boundary_link((0, 1, 2, 3), 9), ValueError, "boundary 9 does not exist"),
    "read_placement_none": (lambda: pl.read_placement(None), TypeError, "s2r must be a sequence"),
    "read_placement_gap": (lambda: pl.read_placement((0, 2)), ValueError, "no stage is on rank 1"),
    "stage_profile_none": (lambda: pl.stage_profile(None, (0, 1)), TypeError, "profile must be a PipelineProfile"),
    "rank_profile_short_map": (lambda: pl.rank_profile(P, (0, 1)), ValueError, "s2r maps 2 stages"),
    "validate_inflight_negative": (lambda: validate_plan(_ops(), 4, 8, inflight_limit=-1), ValueError,
                                   "inflight_limit must be >= 1"),
    "validate_inflight_text": (lambda: validate_plan(_ops(), 4, 8, inflight_limit="3"), TypeError, "inflight_limit"),
    "validate_dry_run_text": (lambda: validate_plan(_ops(), 4, 8, torch_dry_run="x"), TypeError, "torch_dry_run"),
    "replay_none": (lambda: replay_makespan_ns(None, P), TypeError, "order must be a mapping"),
    "replay_bound_text": (lambda: replay_makespan_ns(_ops(), P, bound_ns="x"), TypeError, "bound_ns"),
    "builtin_name_none": (lambda: builtin_plan(None, 4, 8), TypeError, "name must be the name of a built-in"),
    "builtin_zero_ranks": (lambda: builtin_plan("1F1B", 0, 8), ValueError, "num_ranks must be >= 1"),
    "plan_builtin_none": (lambda: plan_builtin("1F1B", None), TypeError, "profile must be a PipelineProfile"),
    "fit_text": (lambda: fit_alpha_beta("ab", "cd", "ef"), TypeError, "send_s must be a sequence of numbers"),
    "fit_bool_sizes": (lambda: fit_alpha_beta([0, 1], [1, 2], [True, 2]), TypeError, "nbytes[0]"),
    "fit_link_none": (lambda: fit_link(None), TypeError, "forward must be (send_s, arrival_s, nbytes)"),
    "virtual_text_v": (lambda: plan_virtual(P, "2"), TypeError, "num_virtual_stages"),
    "write_csv_path_none": (lambda: write_torch_csv(_ops(), None), TypeError, "path must be a path"),
    "write_csv_path_folder_text": (lambda: write_torch_csv(_ops(), "out/"), ValueError, "is a directory path"),
    "trace_none": (lambda: write_chrome_trace(None, "t.json"), TypeError, "timeline must be a Timeline"),
    "trace_path_int": (lambda: write_chrome_trace(_timeline(), 5), TypeError, "path must be a path"),
    "gantt_none": (lambda: write_gantt_png(None, "g.png"), TypeError, "timeline must be a Timeline"),
    "read_csv_none": (lambda: read_torch_csv(None), TypeError, "path must be a path"),
    "crosspipe_budget_negative": (lambda: plan_crosspipe(P, budget=-1), ValueError, "budget must be > 0"),
    "crosspipe_budget_nan": (lambda: plan_crosspipe(P, budget=NAN), ValueError, "budget must be finite"),
    "crosspipe_time_budget_negative": (lambda: plan_crosspipe(P, time_budget_ms=-1), ValueError, "time_budget_ms"),
    "crosspipe_reserve_text": (lambda: plan_crosspipe(P, reserve="zz"), ValueError, "reserve"),
    "crosspipe_portfolio_text": (lambda: plan_crosspipe(P, portfolio="no"), TypeError, "portfolio"),
    "crosspipe_n_sub_zero": (lambda: plan_crosspipe(P, "udsub", n_sub=0), ValueError, "n_sub must be >= 1"),
    "optimal_none": (lambda: solve_optimal(None), TypeError, "profile must be a PipelineProfile"),
    "optimal_time_negative": (lambda: solve_optimal(P, time_limit_s=-1), ValueError, "time_limit_s must be > 0"),
    "optimal_workers_zero": (lambda: solve_optimal(P, workers=0), ValueError, "workers must be >= 1"),
    "with_delays_list": (lambda: P.with_delays([5]), TypeError, "delays_ms must be a mapping"),
    "with_delays_text_link": (lambda: P.with_delays({"0": 5}), ValueError, "delays_ms: link 0"),
    "with_links_none": (lambda: P.with_links(None), TypeError, "links must be a sequence"),
    "from_json_huge_count": (lambda: PipelineProfile.from_json(
        {"num_stages": 10 ** 30, "num_microbatches": 8, "f_ms": 1, "b_ms": 1, "w_ms": 1}), ValueError,
        "num_stages must be <="),
    "link_bool_latency": (lambda: LinkProfile(True), TypeError, "latency_ms must be a number"),
    # the shared reader of numbers from text (CLI, config files, environment variables)
    "parse_int_arabic": (lambda: parse_int("٣", "--stages"), ValueError, "--stages: not a number (ASCII digits only)"),
    "parse_int_fullwidth": (lambda: parse_int("１２", "slack_floor"), ValueError, "slack_floor"),
    "parse_int_float_text": (lambda: parse_int("12.0", "n"), ValueError, "n: not an integer"),
    "parse_int_too_long": (lambda: parse_int(BIG_INT, "count"), ValueError, "at most 64 characters"),
    "parse_int_not_text": (lambda: parse_int(12, "count"), TypeError, "count must be text"),
    "parse_float_fullwidth": (lambda: parse_float("１.5", "delay"), ValueError, "delay: not a number (ASCII"),
    "parse_float_empty": (lambda: parse_float("  ", "delay"), ValueError, "delay: not a number (not empty)"),
}


@pytest.mark.parametrize("case", sorted(API_BAD))
def test_api_hostile_call_names_the_argument(case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    call, kind, needle = API_BAD[case]
    with pytest.raises((TypeError, ValueError)) as exc:
        call()
    assert isinstance(exc.value, kind), repr(exc.value)
    assert needle in str(exc.value), str(exc.value)
    assert os.listdir(tmp_path) == []  # nothing written


def test_parse_numbers_accept_ascii():
    assert parse_int(" 12 ", "n") == 12 and parse_int("-3", "n") == -3
    assert parse_float("1e-3", "x") == 1e-3 and math.isinf(parse_float("1e400", "x"))  # range: the caller's


@pytest.mark.parametrize("S, N", [(1, 1), (1, 5), (4, 1)])
def test_api_degenerate_but_valid_profiles_plan_simulate_validate(S, N):
    """S = 1 stage, N = 1 microbatch: every one-stage-per-rank planner plans, the plan validates, and the
    reference simulator times it (torch's own schedules that need N >= S say so with a ValueError)."""
    from titan_ext.plan.schedules import SCHEDULE_NAMES

    profile = PipelineProfile.uniform(S, N, 10, 10, 10)
    for name in SCHEDULE_NAMES:
        if name == "optimal" and S * N > 1:
            continue  # (the solver's cost; S = N = 1 runs it)
        try:
            result = plan_by_name(profile, name, time_limit_s=10)
        except ImportError:
            continue  # optimal without ortools
        except ValueError as e:
            assert "rejects" in str(e) and name in ("1F1B", "DualPipeV"), (name, e)  # torch: N >= S
            continue
        t = simulate(result.actions, result.profile, stage_to_rank=dict(enumerate(result.stage_to_rank)))
        assert t.makespan_ms == pytest.approx(result.predicted_makespan_ms), name
        if result.stages_per_rank == 1:
            validate_plan(result.ops, S, N)
        assert t.makespan_ms >= N * 30.0 * (1 if S == 1 else 0), name


def test_exporters_are_all_or_nothing_and_follow_symlinks(tmp_path, monkeypatch):
    """A writer that fails midway leaves the user's file and no temporary; through a symlink the file it
    names is replaced and the link kept."""
    import titan_ext.plan.export as export

    mine = tmp_path / "mine.json"
    mine.write_text(USERS)
    link = tmp_path / "link.json"
    link.symlink_to("mine.json")

    def broken_dumps(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C while the text is written

    timeline = _timeline()
    monkeypatch.setattr(export.Path, "write_text", lambda self, text: (self.open("w").write(text[:10]),
                                                                      broken_dumps()))
    with pytest.raises(KeyboardInterrupt):
        write_chrome_trace(timeline, mine)
    assert mine.read_text() == USERS and sorted(os.listdir(tmp_path)) == ["link.json", "mine.json"]
    monkeypatch.undo()
    write_chrome_trace(timeline, link)
    assert link.is_symlink() and os.readlink(link) == "mine.json" and mine.read_text().startswith('{"traceEvents"')
    assert sorted(os.listdir(tmp_path)) == ["link.json", "mine.json"]


# --------------------------------------------------------------------------------------------------------
# runtime constructors: checked before any process group (no torch.distributed init here)

def _runtime_cases():
    import torch
    from torch.distributed.pipelining import PipelineStage

    from titan_ext.runtime import PipeMorph
    from titan_ext.runtime import PipeMorphConfig
    from titan_ext.runtime.control.config import DelegationConfig
    from titan_ext.runtime.schedules.crosspipe import CrossPipeConfig

    stage = PipelineStage.__new__(PipelineStage)  # a stage object; never used past the argument checks
    return {
        "module_as_stage": (lambda: PipeMorph(torch.nn.Linear(2, 2), 4), TypeError, "stages must be a torch PipelineStage"),
        "microbatches_text": (lambda: PipeMorph(stage, "4"), TypeError, "n_microbatches must be an integer"),
        "microbatches_zero": (lambda: PipeMorph(stage, 0), ValueError, "n_microbatches must be >= 1"),
        "loss_fn_text": (lambda: PipeMorph(stage, 4, loss_fn="mse"), TypeError, "loss_fn must be callable"),
        "profile_every_text": (lambda: PipeMorph(stage, 4, profile_every="2"), TypeError, "profile_every"),
        "profile_every_fraction": (lambda: PipeMorph(stage, 4, profile_every=1.5), TypeError, "profile_every"),
        "decision_log_negative": (lambda: PipeMorph(stage, 4, decision_log_size=-1), ValueError, "decision_log_size"),
        "activation_bytes_negative": (lambda: PipeMorph(stage, 4, activation_bytes=-5.0), ValueError,
                                      "activation_bytes must be > 0"),
        "falcon_text": (lambda: PipeMorph(stage, 4, falcon="yes"), TypeError, "falcon must be False, True"),
        "delegate_slots_zero": (lambda: PipeMorph(stage, 4, delegate_slots=0), ValueError, "delegate_slots"),
        "recv_timeout_negative": (lambda: PipeMorph(stage, 4, recv_timeout_s=-1), ValueError, "recv_timeout_s"),
        "slow_link_nan": (lambda: PipeMorph(stage, 4, slow_link_ms=math.nan), ValueError, "slow_link_ms"),
        "timeout_zero": (lambda: PipeMorph(stage, 4, timeout_s=0), ValueError, "timeout_s must be > 0"),
        "lanes_zero": (lambda: DelegationConfig(lanes=0), ValueError, "delegate_lanes must be >= 1"),
        "failover_text": (lambda: DelegationConfig(failover="yes"), TypeError, "failover"),
        "detector_not_callable": (lambda: DelegationConfig(detector=5), TypeError, "detector must be a callable"),
        "adaptive_text": (lambda: PipeMorphConfig(adaptive="no"), TypeError, "adaptive must be True or False"),
        "initial_times_nan": (lambda: PipeMorphConfig(initial_times_ms=(math.nan, 1, 1)), ValueError, "initial_times_ms F"),
        "backward_unknown": (lambda: PipeMorphConfig(backward="half"), ValueError, "backward must be one of"),
        "observers_text": (lambda: PipeMorphConfig(observers="x"), TypeError, "observers must be a tuple"),
        "crosspipe_message_negative": (lambda: CrossPipeConfig(message_bytes=-1), ValueError, "message_bytes"),
        "crosspipe_bandwidth_text": (lambda: CrossPipeConfig(link_bandwidth_bytes_per_s="x"), TypeError,
                                     "link_bandwidth_bytes_per_s"),
    }


RUNTIME_CASES = ["module_as_stage", "microbatches_text", "microbatches_zero", "loss_fn_text", "profile_every_text",
                 "profile_every_fraction", "decision_log_negative", "activation_bytes_negative", "falcon_text",
                 "delegate_slots_zero", "recv_timeout_negative", "slow_link_nan", "timeout_zero", "lanes_zero",
                 "failover_text", "detector_not_callable", "adaptive_text", "initial_times_nan", "backward_unknown",
                 "observers_text", "crosspipe_message_negative", "crosspipe_bandwidth_text"]


@pytest.mark.parametrize("case", RUNTIME_CASES)
def test_runtime_hostile_argument_fails_before_any_process_group(case):
    import torch.distributed as dist

    from titan_ext.runtime.comm import timeouts

    call, kind, needle = _runtime_cases()[case]
    before = timeouts._timeout_s
    with pytest.raises((TypeError, ValueError)) as exc:
        call()
    assert isinstance(exc.value, kind), repr(exc.value)
    assert needle in str(exc.value), str(exc.value)
    assert not dist.is_initialized() and timeouts._timeout_s == before  # no group, no process-wide side effect


# --------------------------------------------------------------------------------------------------------
# Python API, second sweep: Falcon, the delegate data plane, the runtime's policy and
# registry, delay injection and a few plan/ corners. Each call was silently accepted or failed with an
# AttributeError / KeyError / a numpy or comparison error not naming the argument; now TypeError (the
# project's ArgumentTypeError, also a ValueError) or ValueError naming it, raised before any process
# group, thread, shared memory segment or delegate process exists.

@functools.lru_cache(maxsize=None)
def _api_namespace() -> dict:
    """What the expressions of API_BAD_2 name, imported when a case runs (not at collection)."""
    from titan_ext.plan.ir import to_torch_plan as torch_plan
    from titan_ext.plan.warmup import slackness as slack
    from titan_ext.runtime import (
        Decision,
        PipeMorphConfig,
        PolicySettings,
        ReplanPolicy,
        ScheduleSpec,
        inject_link_delays,
        parse_delay_spec,
        register_schedule,
        schedule_class,
    )
    from titan_ext.runtime.control.config import DelegationConfig
    from titan_ext.runtime.schedules.crosspipe import CrossPipeConfig
    from titan_ext.testing.faults import FaultInjector
    from titan_ext.runtime.comm.delegate import (
        Channel,
        DelegatePool,
        P2PRouter,
        delegates_needed,
        our_shm_names,
        pipeline_channels,
    )
    from titan_ext.runtime.comm.delegate.schedule import Delegation, message_slot_bytes
    from titan_ext.runtime.falcon import (
        BOCDConfig,
        FalconConfig,
        FalconDecision,
        FalconMonitor,
        IterationObservation,
        MitigationPlanner,
        SlowIterationDetector,
        StrategyCosts,
        estimate_period,
        iteration_times_from_calls,
        locate_slow_links,
        min_max_microbatch_split,
        plan_topology,
        predicted_iteration_s,
        ring_validation_passes,
        suspicious_groups,
        topology_score,
    )

    def planner(config):  # pragma: no cover - never called
        return None

    def planner2(layout, config):  # pragma: no cover - never called
        return None

    return {**globals(), **locals()}


TE, VE = TypeError, ValueError

# name: (the call, as the expression it is, TypeError or ValueError, text the message must contain)
API_BAD_2 = {
    # FalconConfig: every field (only the three ratios and the refine gain were checked, by comparison)
    "falcon_config_detector_none": ('FalconConfig(detector=None)', TE, "FalconConfig.detector must be a BOCDConfig"),
    "falcon_config_costs_dict": ('FalconConfig(costs={})', TE, "FalconConfig.costs must be a StrategyCosts"),
    "falcon_config_ratio_text": ('FalconConfig(suspicious_ratio="x")', TE, "FalconConfig.suspicious_ratio must be a number"),
    "falcon_config_ratio_inf": ('FalconConfig(slow_link_ratio=math.inf)', VE, "FalconConfig.slow_link_ratio must be finite"),
    "falcon_config_excess_negative": ('FalconConfig(slow_link_min_excess_s=-1)', VE,
                                      "FalconConfig.slow_link_min_excess_s must be >= 0"),
    "falcon_config_window_zero": ('FalconConfig(effect_window=0)', VE, "FalconConfig.effect_window must be >= 1"),
    "falcon_config_window_float": ('FalconConfig(effect_window=2.5)', TE, "FalconConfig.effect_window must be an integer"),
    "falcon_config_wait_none": ('FalconConfig(validation_wait_iters=None)', TE, "FalconConfig.validation_wait_iters"),
    "falcon_config_delegation_text": ('FalconConfig(delegation_available="yes")', TE,
                                      "FalconConfig.delegation_available must be True or False"),
    "falcon_config_microbatches_zero": ('FalconConfig(num_microbatches=0)', VE, "FalconConfig.num_microbatches must be >= 1"),
    "falcon_config_period_threshold": ('FalconConfig(period_threshold=1.5)', VE, "FalconConfig.period_threshold must be <= 1"),
    "falcon_config_period_window_one": ('FalconConfig(period_window=1)', VE, "FalconConfig.period_window must be >= 2"),
    "falcon_config_tracking_text": ('FalconConfig(group_tracking="no")', TE, "FalconConfig.group_tracking must be True or False"),
    "falcon_config_floor_zero": ('FalconConfig(group_floor_s=0)', VE, "FalconConfig.group_floor_s must be > 0"),
    "falcon_config_gain_text": ('FalconConfig(split_refine_gain="x")', TE, "FalconConfig.split_refine_gain must be a number"),
    # FalconMonitor: config, grid, groups, recorder
    "monitor_config_int": ('FalconMonitor(5)', TE, "config must be a FalconConfig"),
    "monitor_config_bocd": ('FalconMonitor(BOCDConfig())', TE, "config must be a FalconConfig, got BOCDConfig"),
    "monitor_config_empty_dict": ('FalconMonitor({})', TE, "config must be a FalconConfig, got dict"),
    "monitor_grid_ragged": ('FalconMonitor(grid=[[0, 1], [2]])', VE, "grid must be a rectangle"),
    "monitor_grid_repeated": ('FalconMonitor(grid=[[0, 1], [1, 2]])', VE, "grid has repeated ranks"),
    "monitor_grid_text": ('FalconMonitor(grid="ab")', TE, "grid must be a sequence of rows"),
    "monitor_grid_floats": ('FalconMonitor(grid=[[0.0, 1.0]])', TE, "grid[0][0] must be an integer"),
    "monitor_grid_empty": ('FalconMonitor(grid=[])', VE, "grid is empty"),
    "monitor_set_grid_none": ('FalconMonitor().set_grid(None)', TE, "grid must be a sequence of rows"),
    "monitor_pp_groups_text": ('FalconMonitor(pp_groups="pp0")', TE, "pp_groups must be a mapping"),
    "monitor_pp_link_negative": ('FalconMonitor(pp_groups={"pp0": -1})', VE, "pp_groups['pp0'] must be >= 0"),
    "monitor_dp_group_int": ('FalconMonitor(dp_groups=[0])', TE, "dp_groups: group names are text"),
    "monitor_group_both_kinds": ('FalconMonitor(pp_groups=["g"], dp_groups=["g"])', VE, "both name ['g']"),
    "monitor_recorder_int": ('FalconMonitor(recorder=5)', TE, "recorder must be a CallRecorder"),
    "monitor_observe_groups_int": ('FalconMonitor().observe(1.0, 5)', TE, "per_group_times must be a mapping"),
    "monitor_observe_text": ('FalconMonitor().observe("x")', TE, "iteration_time_s must be a number"),
    "monitor_validation_pause_negative": ('FalconMonitor().report_validation(pause_s=-1)', VE, "pause_s must be >= 0"),
    "observation_nan": ('IterationObservation(math.nan)', VE, "iteration_time_s must be finite"),
    "observation_negative": ('IterationObservation(-1.0)', VE, "iteration_time_s must be > 0"),
    "observation_group_nan": ('IterationObservation(1.0, {"g": math.nan})', VE, "per_group_times['g'] must be finite"),
    "observation_split_float": ('IterationObservation(1.0, replica_microbatch_s=(1.0,), split=(1.5,))', TE,
                                "split[0] must be an integer"),
    "observation_replica_negative": ('IterationObservation(1.0, replica_microbatch_s=(-1.0,), split=(1,))', VE,
                                     "replica_microbatch_s[0] must be >= 0"),
    "decision_iteration_text": ('FalconDecision("x")', TE, "iteration must be an integer"),
    "decision_metrics_int": ('FalconDecision(0, 5)', TE, "metrics must be a mapping"),
    # the detector and the planner
    "bocd_threshold_above_one": ('BOCDConfig(threshold=1.5)', VE, "BOCDConfig.threshold must be <= 1"),
    "bocd_average_unknown": ('BOCDConfig(average="mode")', VE, "BOCDConfig.average must be one of"),
    "bocd_run_length_one": ('BOCDConfig(expected_run_length=1)', VE, "BOCDConfig.expected_run_length must be > 1"),
    "bocd_outlier_prob_one": ('BOCDConfig(outlier_prob=1)', VE, "BOCDConfig.outlier_prob must be within [0, 1)"),
    "bocd_window_float": ('BOCDConfig(window=2.5)', TE, "BOCDConfig.window must be an integer"),
    "detector_config_none": ('SlowIterationDetector(None)', TE, "config must be a BOCDConfig"),
    "detector_observe_text": ('SlowIterationDetector().observe("1")', TE, "iteration_time_s must be a number"),
    "costs_negative": ('StrategyCosts(ignore=-1)', VE, "StrategyCosts.ignore must be >= 0"),
    "costs_text": ('StrategyCosts(pipemorph_replan="x")', TE, "StrategyCosts.pipemorph_replan must be a number"),
    "costs_of_unknown": ('StrategyCosts().of("nope")', VE, "strategy must be one of"),
    "planner_costs_none": ('MitigationPlanner(None)', TE, "costs must be a StrategyCosts"),
    "planner_start_nan": ('MitigationPlanner().start("compute", math.nan)', VE, "healthy_iteration_s must be finite"),
    "split_total_bool": ('min_max_microbatch_split(True, [1.0])', TE, "total_microbatches must be an integer"),
    "split_time_inf": ('min_max_microbatch_split(8, [1.0, math.inf])', VE, "per_microbatch_s[1] must be finite"),
    "split_min_negative": ('min_max_microbatch_split(8, [1.0, 1.0], min_per_group=-1)', VE, "min_per_group must be >= 0"),
    "predicted_split_length": ('predicted_iteration_s(1.0, [1, 1], [1.0], [1, 1])', VE, "split has 2 entries, expected 1"),
    "predicted_new_split_negative": ('predicted_iteration_s(1.0, [1], [1.0], [-1])', VE, "new_split[0] must be >= 0"),
    "topology_rounds_negative": ('plan_topology([[0, 1]], max_rounds=-1)', VE, "max_rounds must be >= 0"),
    "topology_grid_floats": ('plan_topology([[0.5, 1]])', TE, "grid[0][0] must be an integer"),
    "topology_link_short": ('plan_topology([[0, 1]], slow_links=[(0,)])', VE, "slow_links[0] has 1 entries, expected 2"),
    "score_unknown_straggler": ('topology_score([[0, 1]], stragglers=[5])', VE, "straggler 5 not in the grid"),
    "suspicious_list": ('suspicious_groups([1, 2])', TE, "transfer_times_s must be a mapping"),
    "suspicious_ratio_text": ('suspicious_groups({"a": 1.0}, ratio="x")', TE, "ratio must be a number"),
    "slow_links_int_key": ('locate_slow_links({0: 1.0})', TE, "link_times_s key 0 must be a sequence"),
    "ring_text": ('ring_validation_passes("abc")', TE, "ring must be a sequence of integers"),
    "period_zero": ('iteration_times_from_calls([0, 1, 2], 0)', VE, "period must be >= 1"),
    "period_threshold_nan": ('estimate_period([1, 2] * 4, threshold=math.nan)', VE, "threshold must be finite"),
    # the delegate data plane: checked before the extension loads or a delegate starts
    "delegation_config_none": ('Delegation(None)', TE, "config must be a DelegationConfig"),
    "delegation_config_text": ('Delegation("auto")', TE, "config must be a DelegationConfig"),
    "slot_bytes_float": ('message_slot_bytes(1.5)', TE, "nbytes must be an integer"),
    "channel_loop": ('Channel(0, 0, "F")', VE, "src = dst = 0"),
    "channel_direction": ('Channel(0, 1, "X")', VE, "direction must be one of"),
    "channels_float_ranks": ('pipeline_channels(0, [0.0, 1.0])', TE, "stage_to_rank[0] must be an integer"),
    "channels_foreign_rank": ('pipeline_channels(5, [0, 1])', VE, "rank 5 runs no stage"),
    "delegates_max_float": ('delegates_needed(1, 1, 2.5)', TE, "max_delegates must be an integer"),
    "delegates_rate_negative": ('delegates_needed(-1, 1)', VE, "production_bytes_per_s must be >= 0"),
    "faults_from_negative": ('FaultInjector(from_seq=-1)', VE, "from_seq must be >= 0"),
    "faults_predicate_int": ('FaultInjector(predicate=5)', TE, "predicate must be a callable"),
    "faults_direction": ('FaultInjector(broken={(1, "X"): 0})', VE, "direction must be one of"),
    "router_timeout_negative": ('P2PRouter(0, recv_timeout_s=-1)', VE, "recv_timeout_s must be > 0"),
    "router_rank_text": ('P2PRouter("0")', TE, "rank must be an integer"),
    "router_pool_int": ('P2PRouter(0, pool=5)', TE, "pool must be a DelegatePool"),
    "router_hol_negative": ('P2PRouter(0, hol_delay_ms={1: -5})', VE, "hol_delay_ms[1] must be >= 0"),
    "pool_rank_text": ('DelegatePool("0", [])', TE, "rank must be an integer"),
    "pool_not_an_end": ('DelegatePool(0, [Channel(1, 2, "F")])', VE, "rank 0 is not an end of"),
    "pool_slots_zero": ('DelegatePool(0, [], num_slots=0)', VE, "num_slots must be >= 1"),
    "pool_lanes_kind": ('DelegatePool(0, [], lanes={"X": 1})', VE, "lanes key must be one of"),
    "shm_names_text": ('our_shm_names("x")', TE, "pids must be an iterable of process ids"),
    # runtime: policy, registry, configs, delay injection
    "settings_window_bool": ('PolicySettings(window=True)', TE, "policy window must be an integer"),
    "replan_margin_nan": ('ReplanPolicy(rel_margin=math.nan)', VE, "policy rel_margin must be finite"),
    "replan_window_text": ('ReplanPolicy(window="3")', TE, "policy window must be an integer"),
    "replan_dwell_negative": ('ReplanPolicy(min_dwell=-1)', VE, "policy min_dwell must be >= 0"),
    "decision_action_int": ('Decision(5, "x")', TE, "Decision action must be a non-empty name"),
    "decision_mode_unknown": ('Decision("adapt", "x", mode="sometimes")', VE, "Decision mode must be one of"),
    "schedule_class_none": ('schedule_class(None)', TE, "name must be a schedule name"),
    "register_text": ('register_schedule("x")', TE, "spec must be a ScheduleSpec"),
    "spec_planner_int": ('ScheduleSpec("X", 5, planner2)', TE, "one_stage_planner must be a callable"),
    "spec_empty_name": ('ScheduleSpec("", planner, planner2)', TE, "ScheduleSpec name must be a non-empty"),
    "spec_config_int": ('ScheduleSpec("X", planner, planner2, config_class=int)', TE,
                        "config_class must be an AdaptiveConfig subclass"),
    "spec_backward_text": ('ScheduleSpec("X", planner, planner2, backward_choices="split")', TE,
                           "backward_choices must be a tuple"),
    "inject_int": ('inject_link_delays(5)', TE, "spec must be a delay spec (text) or a DelaySchedule"),
    "inject_t0_nan": ('inject_link_delays("0:1", t0=math.nan)', VE, "t0 (a time.time() epoch) must be finite"),
    "inject_origin_int": ('inject_link_delays("0:1", origin=5)', TE, "origin must be text"),
    "delay_spec_int": ('parse_delay_spec(5)', TE, "delay spec must be a string"),
    "lanes_unknown_kind": ('DelegationConfig(lanes={"X": 1})', VE, "delegate_lanes key (the send kind) must be one of"),
    "slot_bytes_bool": ('DelegationConfig(slot_bytes=True)', TE, "delegate_slot_bytes must be an integer"),
    "faults_int": ('DelegationConfig(faults=5)', TE, "faults must be a FaultInjector"),
    "falcon_object": ('PipeMorphConfig(falcon=object())', TE, "falcon must be False, True or a FalconMonitor"),
    "policy_int": ('PipeMorphConfig(policy=5)', TE, "policy must be a Policy"),
    "planner_text": ('PipeMorphConfig(planner="x")', TE, "planner must be a Planner"),
    "observer_int": ('PipeMorphConfig(observers=(5,))', TE, "observers[0] must be a boundary observer"),
    "bandwidth_empty": ('CrossPipeConfig(link_bandwidth_bytes_per_s=[])', VE, "link_bandwidth_bytes_per_s is empty"),
    # plan/ corners
    "simulate_map_short": ('simulate(_ops(), P, stage_to_rank={0: 0})', VE, "stage_to_rank has no rank for stage(s) [1, 2, 3]"),
    "simulate_map_int": ('simulate(_ops(), P, stage_to_rank=5)', TE, "stage_to_rank must be a mapping"),
    "as_ops_bool_stage": ('as_ops({0: [(True, "F", 0)]})', VE, "its stage must be an integer >= 0"),
    "torch_plan_negative_mb": ('torch_plan({0: [(0, "F", -1)]})', VE, "plan[0]: (0, 'F', -1)"),
    "pipemorph_validate_int": ('plan_pipemorph(P, validate=1)', VE, "validate must be True, False or 'torch'"),
    "slackness_empty": ('slack([])', VE, "warmup_counts is empty"),
    "uniform_delay_negative": ('PipelineProfile.uniform(4, 8, 1, 1, 1, delays_ms={0: -1})', VE,
                               "delays_ms[0] must be >= 0"),
    "with_delays_nan": ('P.with_delays({0: NAN})', VE, "delays_ms[0] is NaN"),
}


@pytest.mark.parametrize("case", sorted(API_BAD_2))
def test_api_hostile_call_names_the_argument_second_sweep(case, monkeypatch):
    import threading

    import torch.distributed as dist

    import titan_ext.runtime.comm.delegate.pool as pool
    from titan_ext.runtime import current_injector
    from titan_ext.runtime.comm.delegate import our_shm_names

    def started(*args, **kwargs):
        raise AssertionError("DelegatePool went past its argument checks (loaded the data plane)")

    monkeypatch.setattr(pool, "load_ext", started)
    expression, kind, needle = API_BAD_2[case]
    namespace = _api_namespace()
    threads, injector = threading.active_count(), current_injector()
    with pytest.raises((TypeError, ValueError)) as exc:
        eval(expression, namespace)
    assert isinstance(exc.value, kind), repr(exc.value)
    assert needle in str(exc.value), str(exc.value)
    # nothing was started: no process group, thread, shared memory segment or delay injector
    assert not dist.is_initialized() and threading.active_count() == threads
    assert our_shm_names([os.getpid()]) == [] and current_injector() is injector


def test_api_degenerate_but_valid_runtime_objects_without_a_process_group():
    """The smallest valid arguments work, and nothing needs a process group: one DP replica of one PP
    stage (grid [[0]]), one micro-batch, one stage's warm-up counts, a delegation that is configured but
    not started, a router without a pool."""
    import torch.distributed as dist

    from titan_ext.plan.warmup import initial_warmup_counts, slackness as slack
    from titan_ext.runtime import Decision, PolicySettings, ReplanPolicy, ScheduleSpec
    from titan_ext.runtime.control.config import DelegationConfig
    from titan_ext.runtime.comm.delegate import P2PRouter, delegates_needed, pipeline_channels
    from titan_ext.testing.faults import FaultInjector
    from titan_ext.runtime.comm.delegate.schedule import Delegation, message_slot_bytes
    from titan_ext.runtime.falcon import (
        BOCDConfig,
        FalconConfig,
        FalconDecision,
        FalconMonitor,
        IterationObservation,
        StrategyCosts,
        acf,
        estimate_period,
        iteration_times_from_calls,
        locate_slow_devices,
        min_max_microbatch_split,
        plan_topology,
        predicted_iteration_s,
        ring_validation_passes,
        suspicious_groups,
        tree_validation_passes,
    )

    # Falcon: 1 x 1 grid, one micro-batch, healthy iterations; defaults and inf costs are valid
    config = FalconConfig(num_microbatches=1, costs=StrategyCosts(checkpoint_restart=math.inf),
                          detector=BOCDConfig(expected_run_length=2), split_refine_gain=None)
    monitor = FalconMonitor(config, grid=[[0]], pp_groups={}, dp_groups=())
    for _ in range(5):
        decision = monitor.observe(IterationObservation(0.1, {"dp_stage0": 0.0}, replica_microbatch_s=(0.1,), split=(1,)))
    assert isinstance(decision, FalconDecision) and decision.iteration == 4 and not decision.validate
    assert monitor.observe(0.1, {"pp_link0": -0.0001}).iteration == 5  # a link delay estimate may read < 0
    assert FalconMonitor().config == FalconConfig() and FalconDecision(-1).iteration == -1
    assert min_max_microbatch_split(1, [0.5]) == [1] and predicted_iteration_s(1.0, [1], [0.5], [0]) == 0.5
    assert plan_topology([[0]]).grid == ((0,),) and ring_validation_passes([0]) == [] == tree_validation_passes([0])
    assert suspicious_groups({}) == [] == locate_slow_devices({0: 1.0})
    assert estimate_period([]) is None and len(acf([1], 0)) == 0 and len(iteration_times_from_calls([0.0], 1)) == 0
    # delegation configured, not started: no pool, no process, no group
    delegation = Delegation(DelegationConfig(mode="always", lanes={"F": 1, "B": 1}, slot_bytes=4096,
                                             faults=FaultInjector(broken={(1, "F"): 0})))
    assert delegation.pool is None and delegation.router is None and not delegation.delegating
    assert P2PRouter(0).pool is None and pipeline_channels(0, [0]) == [] and message_slot_bytes(0) == 4096
    assert delegates_needed(math.nan, 1.0) == 1 and delegates_needed(math.inf, 0.0, max_delegates=1) == 1
    # policy and registry entries
    assert ReplanPolicy(window=1, recover_patience=0, min_dwell=0).window == 1 and PolicySettings(rel_margin=0).rel_margin == 0
    assert Decision("initial", "S = 1", mode="initial", warmup_counts=[1], inflight_limit=[1]).replans is False
    assert ScheduleSpec("Mine", lambda config: None, lambda layout, config: None, backward_choices=("split",)).name == "Mine"
    # plan/: one stage, one micro-batch
    one = PipelineProfile.uniform(1, 1, 10, 10, 10)
    assert slack([1]) == [] and initial_warmup_counts(1, 1) == [1] == zb_warmup_counts(1, 1)
    t = simulate(plan_pipemorph(one).ops, one, stage_to_rank={0: 0})
    assert t.makespan_ms == 30.0 and plan_crosspipe(one).makespan_ms == 30.0
    assert not dist.is_initialized()
