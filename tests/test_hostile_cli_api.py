"""Issue 39, items 1, 5 and 6 (CLI and Python API): hostile input, kept as a table. Each case asserts the
specific clean outcome -- exit code, one line on stderr naming the argument, no file left behind, the
user's file untouched -- or, for the API, a TypeError/ValueError naming the argument. None repeats
tests/test_cli_robust.py or tests/test_plan_api_errors.py.

Signals (item 1): a few subprocess tests send a real SIGINT/SIGTERM to ``titan-ext plan --schedule
optimal`` while it writes its outputs (after the CP-SAT solve, which used to leave the kernel's SIGINT
action at SIG_DFL: the process died at once, exit -2, leaving its temporary files), and the Python API
must leave the caller's handlers -- and the kernel's action -- as it found them."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from titan_ext.cli import main

ROOT = Path(__file__).resolve().parent.parent
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


def _signal_while_writing(tmp_path: Path, signum: int, schedule: str = "optimal"):
    pytest.importorskip("ortools")
    work = tmp_path / "work"
    work.mkdir()
    (work / "mine.csv").write_text(USERS)
    (work / "t.json").write_text(USERS)
    marker = tmp_path / "inside_writer"
    argv = [*PLAN, *T, "--delay", "1:20", "--schedule", schedule, "--time-limit", "30",
            "--out-csv", "mine.csv", "--trace", "t.json", "--gantt", "g.png"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(marker), *argv], cwd=work, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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


@pytest.mark.parametrize("signum,code,line", [
    (signal.SIGINT, 130, "titan-ext: interrupted (Ctrl-C)"),
    pytest.param(signal.SIGTERM, 143, "titan-ext: terminated (SIGTERM)", marks=pytest.mark.slow),  # same path
])
def test_signal_after_an_optimal_solve_cleans_up_one_line(signum, code, line, tmp_path):
    """Issue 39: Ctrl-C after `--schedule optimal` killed the process (exit -2, no message) and left
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


def test_ctrl_c_during_a_solve_stops_it_and_raises_keyboard_interrupt():
    """A SIGINT inside the native solve stops the search at once (not at its 60 s limit) and reaches Python
    as KeyboardInterrupt after the clean-up: handler and wake-up fd as they were."""
    pytest.importorskip("ortools")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", _SOLVE_CHILD], env=env, capture_output=True, text=True, timeout=120)
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
