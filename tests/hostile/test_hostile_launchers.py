"""The launchers under hostile conditions: scripts/launch.sh (one machine, no SLURM), the S4 relauncher
(``python -m titan_ext.titan.falcon_s4`` / ``titan-ext falcon-s4``), scripts/run_local.sh and
scripts/frozen_rank.py.

* SIGTERM / SIGINT to a launcher end the whole job (its process group) and the launcher exits 143 / 130,
  with a fake job: a stand-in torchrun that starts a "rank", writes both PIDs and sleeps.
* A relaunch only from a plan written by the run that just ended (its TITAN_EXT_LAUNCH_ID), holding only
  what the S4 planner writes; the plan is marked consumed only once it is applied.
* falcon-s4's argument ranges: one line ``error: ...``, exit 2, before anything starts.
* run_local.sh removes nothing outside its output folder; frozen_rank.py writes to a private folder.

Under SLURM launch.sh hands srun the signal (here a stand-in srun); the real srun runs in
tests/titan/test_titan_slurm.py (slow tier).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from titan_ext.runtime.falcon.restart import S4_PLAN_FILE
from titan_ext.titan import falcon_s4 as s4

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "train_configs/debug_cpu.toml"

# the fake job: each call logged (the launch id and the S4 plan it was given); a run that ends leaves the
# plan to leave (if any) and exits with the status in $FAKE_DIR/exit, else it waits on a rank (a sleep)
_FAKE_JOB = """echo "$* | ${TITAN_EXT_LAUNCH_ID:-unset} | ${TITAN_EXT_S4_PLAN:-unset}" >> "$FAKE_DIR/calls"
if [ -f "$FAKE_DIR/exit" ]; then
  n=$(wc -l < "$FAKE_DIR/calls")
  if [ "$n" = 1 ] && [ -f "$FAKE_DIR/plan" ]; then
    sed "s/@LAUNCH_ID@/$TITAN_EXT_LAUNCH_ID/" "$FAKE_DIR/plan" > "$FAKE_DUMP/falcon_s4_plan.json"
  fi
  [ "$n" = 1 ] && exit "$(cat "$FAKE_DIR/exit")"
  exit 0
fi
[ -n "${FAKE_IGNORE_TERM:-}" ] && trap '' TERM INT
( trap - INT; exec sleep 300 ) &  # a rank
echo "$$ $!" > "$FAKE_DIR/pids.tmp" && mv "$FAKE_DIR/pids.tmp" "$FAKE_DIR/pids"
wait
exit 0
"""

# the interpreter launch.sh runs (PYTHON=...): torchrun is the fake job, the version probe answers at
# once, everything else (launch_fit.py, relaunch-spec) is the real interpreter
FAKE_PYTHON = ("#!/bin/bash\nif [ \"$1 $2\" = \"-m torch.distributed.run\" ]; then\n" + _FAKE_JOB + "fi\n"
               "[ \"$1\" = \"-c\" ] && { echo \"torch (fake)\"; exit 0; }\nexec \"$REAL_PYTHON\" \"$@\"\n")

# what launch() runs as torchrun: the same fake job
FAKE_TORCHRUN = "#!/bin/bash\n" + _FAKE_JOB



def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, left where PID 1 does not reap, has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _as_a_shell_starts() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def _fake(tmp_path: Path, text: str, name: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(0o755)
    return path


def _env(tmp_path: Path, **extra: str) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SLURM_", "CONFIG", "MODULE", "DRY_RUN", "TITAN_EXT_", "FALCON_S4"))}
    dump = tmp_path / "dump"
    dump.mkdir(exist_ok=True)
    return {**clean, "FAKE_DIR": str(tmp_path), "FAKE_DUMP": str(dump), "REAL_PYTHON": sys.executable,
            "PYTHONPATH": str(ROOT), **extra}


def _launch_sh(tmp_path: Path, **extra: str) -> subprocess.Popen:
    env = _env(tmp_path, PYTHON=str(_fake(tmp_path, FAKE_PYTHON, "python")), CONFIG_FILE=CONFIG,
               NPROC_PER_NODE="1", LOG_DIR=str(tmp_path / "logs"), **extra)
    return subprocess.Popen(["bash", str(ROOT / "scripts" / "launch.sh"), "--job.dump_folder", str(tmp_path / "dump")],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_as_a_shell_starts)


class _Forked:
    """launch() in a child forked from this process (torch is imported already: no start-up), its torchrun
    the fake job; as much of subprocess.Popen as _stop uses."""

    def __init__(self, tmp_path: Path, grace_s: float, **extra: str):
        fake = _fake(tmp_path, FAKE_TORCHRUN, "torchrun")
        env = _env(tmp_path, **extra)
        self.err_path = tmp_path / "launcher.err"
        self.returncode = None
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns into pytest
            status = 99
            try:
                _as_a_shell_starts()
                fd = os.open(self.err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                sys.stdout = sys.stderr = open(fd, "w", buffering=1, closefd=False)
                os.environ.clear()
                os.environ.update(env)
                s4._torchrun = lambda nproc, port, args: ["bash", str(fake), *args]
                s4.STOP_GRACE_S = grace_s
                status = s4.main(["--nproc-per-node", "2", "--", "--job.dump_folder", str(tmp_path / "dump")])
            finally:
                os._exit(status)

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def communicate(self, timeout: float | None = None):
        deadline = time.monotonic() + (timeout or 1e9)
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("launch()", timeout)
            time.sleep(0.02)
        return "", self.err_path.read_text()

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


def _job_pids(tmp_path: Path, launcher: subprocess.Popen, timeout_s: float = 60.0) -> tuple[int, int]:
    deadline = time.monotonic() + timeout_s
    while not (tmp_path / "pids").exists():
        assert launcher.poll() is None, launcher.communicate()
        assert time.monotonic() < deadline, "the fake job never started"
        time.sleep(0.05)
    leader, rank = map(int, (tmp_path / "pids").read_text().split())
    return leader, rank


def _stop(tmp_path: Path, launcher: subprocess.Popen, signum: int, within_s: float):
    try:
        leader, rank = _job_pids(tmp_path, launcher)
        assert _running(leader) and _running(rank)
        t0 = time.monotonic()
        launcher.send_signal(signum)
        out, err = launcher.communicate(timeout=within_s + 10)
        took = time.monotonic() - t0
        deadline = time.monotonic() + 2
        while (_running(leader) or _running(rank)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return launcher.returncode, err, took, (_running(leader), _running(rank))
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
        if (tmp_path / "pids").exists():
            for pid in map(int, (tmp_path / "pids").read_text().split()):
                if _running(pid):
                    os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------------------------------- signals
@pytest.mark.multiprocess
@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_launch_sh_signal_ends_the_whole_job(signum, status, tmp_path):
    rc, err, took, running = _stop(tmp_path, _launch_sh(tmp_path), signum, within_s=5)
    assert rc == status, err
    assert running == (False, False), "the fake torchrun or its rank outlived the launcher"
    assert f"stopped by {signal.Signals(signum).name}" in err and took < 5


@pytest.mark.multiprocess
def test_launch_sh_kills_a_job_that_ignores_the_signal_after_the_grace(tmp_path):
    rc, err, took, running = _stop(tmp_path, _launch_sh(tmp_path, STOP_GRACE_S="1", FAKE_IGNORE_TERM="1"),
                                   signal.SIGTERM, within_s=5)
    assert rc == 143 and running == (False, False), err
    assert took < 5


@pytest.mark.parametrize("signum, status, ignored", [(signal.SIGTERM, 143, ""), (signal.SIGINT, 130, ""),
                                                     (signal.SIGTERM, 143, "1")])
def test_falcon_s4_signal_ends_the_whole_job(signum, status, ignored, tmp_path):
    """The job gets the signal; one that ignores it is killed after the grace (1 s here)."""
    rc, err, took, running = _stop(tmp_path, _Forked(tmp_path, 1.0, FAKE_IGNORE_TERM=ignored), signum, within_s=5)
    assert rc == status, err
    assert running == (False, False), "the fake torchrun or its rank outlived the launcher"
    name = signal.Signals(signum).name
    assert err.strip().splitlines()[-1] == f"falcon.s4: stopped by {name}; the job's processes have ended"
    assert took < 5


# srun: runs the task (after its options) in a session of its own, as slurmstepd does, and forwards
# SIGTERM to it; records the signals it gets
FAKE_SRUN = """#!/bin/bash
while [ "${1#--}" != "$1" ]; do shift; done
trap 'echo TERM >> "$FAKE_DIR/srun_got"; kill -TERM -- "-$child"' TERM
trap 'echo INT >> "$FAKE_DIR/srun_got"' INT
setsid "$@" &
child=$!
wait "$child"; wait "$child"
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_launch_sh_under_slurm_hands_srun_a_sigterm(signum, status, tmp_path):
    """Under SLURM the script signals srun only (SIGTERM: srun forwards it to every task; one SIGINT
    would only make srun print its tasks' state) and exits as srun's own signal would."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake(bin_dir, FAKE_SRUN, "srun")
    launcher = _launch_sh(tmp_path, SLURM_JOB_ID="4242", SLURM_JOB_NAME="t", PATH=f"{bin_dir}:{os.environ['PATH']}")
    rc, err, took, running = _stop(tmp_path, launcher, signum, within_s=5)
    assert rc == status and running == (False, False), err
    assert (tmp_path / "srun_got").read_text().split() == ["TERM"] and took < 5


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, value", [("NPROC_PER_NODE", "0"), ("NNODES", "x"), ("MASTER_PORT", "70000"),
                                         ("STOP_GRACE_S", "a[$(touch pwned)]")])
def test_launch_sh_refuses_a_bad_number(name, value, tmp_path):
    env = _env(tmp_path, PYTHON=sys.executable, DRY_RUN="print", CONFIG_FILE=CONFIG, **{name: value})
    run = subprocess.run(["bash", str(ROOT / "scripts" / "launch.sh")], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2 and name in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert not (tmp_path / "pwned").exists()


# ------------------------------------------------------------------------------------------- plans
def _plan(**extra) -> dict:
    plan = {"status": "pending", "launch_id": "@LAUNCH_ID@", "step": 4, "excluded": [3], "world_size": 2,
            "num_dp": 1, "num_pp": 2, "hosts": [socket.gethostname()] * 2, "local_devices": [0, 2],
            "device_type": "cpu",
            "overrides": ["--parallelism.data_parallel_replicate_degree", "1", "--training.global_batch_size", "12",
                          "--checkpoint.enable", "--checkpoint.exclude_from_loading", "dataloader",
                          "--titan_ext.emulate_slow_device", "", "--titan_ext.emulate_slow_link", "0-1:40@2"]}
    plan.update(extra)
    return plan


def _job_leaves(tmp_path: Path, plan: dict | None, status: int = 1) -> None:
    (tmp_path / "exit").write_text(str(status))
    if plan is not None:
        (tmp_path / "plan").write_text(json.dumps(plan))


def _plan_file(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "dump" / S4_PLAN_FILE).read_text())


@pytest.mark.multiprocess
def test_launch_sh_relaunches_from_the_plan_of_the_run_that_just_ended(tmp_path):
    _job_leaves(tmp_path, _plan())
    launcher = _launch_sh(tmp_path)
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, out + err
    first, second = (tmp_path / "calls").read_text().splitlines()
    first_id, second_id = first.split(" | ")[1], second.split(" | ")[1]
    assert first_id != second_id and "unset" not in (first_id, second_id)
    assert "--nproc_per_node 2" in second and "--titan_ext.emulate_slow_link 0-1:40@2" in second
    assert _plan_file(tmp_path)["status"] == "consumed" and _plan_file(tmp_path)["launch_id"] == first_id


@pytest.mark.slow  # ~5 s each, the interpreter's start (torch) for relaunch-spec; the refusals themselves:
# test_relaunch_spec_refuses_in_one_line
@pytest.mark.parametrize("plan, says", [
    (_plan(launch_id="local1.1700000000.42.0"), "is not the run's that just ended"),  # an earlier run's
    (_plan(overrides=["--experimental.custom_import", "evil"]), "'--experimental.custom_import' is not one"),
])
def test_launch_sh_refuses_a_plan_not_of_this_run_or_not_the_planners(plan, says, tmp_path):
    _job_leaves(tmp_path, plan)
    launcher = _launch_sh(tmp_path)
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 1, out + err
    assert len((tmp_path / "calls").read_text().splitlines()) == 1  # no relaunch
    refusal = [line for line in err.splitlines() if "falcon_s4_plan.json" in line]
    assert len(refusal) == 1 and says in refusal[0] and "Traceback" not in err, err
    assert _plan_file(tmp_path)["status"] == "pending"  # never applied: not consumed


@pytest.mark.multiprocess
def test_launch_sh_does_not_relaunch_after_another_failure(tmp_path):
    _job_leaves(tmp_path, _plan(), status=3)
    launcher = _launch_sh(tmp_path)
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 3 and len((tmp_path / "calls").read_text().splitlines()) == 1, out + err
    assert _plan_file(tmp_path)["status"] == "pending"


def _launch_in_process(tmp_path: Path, monkeypatch, plan: dict | None, status: int = 1, *argv: str) -> int:
    fake = _fake(tmp_path, FAKE_TORCHRUN, "torchrun")
    _job_leaves(tmp_path, plan, status)
    for key, value in _env(tmp_path).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(s4, "_torchrun", lambda nproc, port, args: ["bash", str(fake), "--nproc", str(nproc), *args])
    return s4.launch(["--nproc-per-node", "4", *argv, "--", "--job.dump_folder", str(tmp_path / "dump")])


def _calls(tmp_path: Path) -> list[str]:
    return (tmp_path / "calls").read_text().splitlines()


@pytest.mark.multiprocess
def test_falcon_s4_relaunches_from_its_plan_and_consumes_it(tmp_path, monkeypatch):
    assert _launch_in_process(tmp_path, monkeypatch, _plan()) == 0
    first, second = _calls(tmp_path)
    assert "--nproc 2" in second and "--parallelism.data_parallel_replicate_degree 1" in second
    assert second.endswith(str(tmp_path / "dump" / S4_PLAN_FILE))
    plan = _plan_file(tmp_path)
    assert plan["status"] == "consumed" and plan["launch_id"] == first.split(" | ")[1]


@pytest.mark.multiprocess
@pytest.mark.parametrize("plan, says", [
    (_plan(launch_id="host.1.2.0"), "is not the run's that just ended"),
    (_plan(overrides=["--experimental.custom_import", "evil"]), "'--experimental.custom_import' is not one"),
    (_plan(overrides=["--training.global_batch_size", "--experimental.custom_import=evil"]), "has the value"),
    (_plan(overrides=["--titan_ext.emulate_slow_device", "--job.config_file=/x.toml"]), "has the value"),
    (_plan(overrides=["--checkpoint.enable", "--checkpoint.enable"]), "appears twice"),
    (_plan(world_size="2; rm -rf /"), "world_size"),
    (_plan(local_devices=[0, -1]), "local_devices"),
])
def test_falcon_s4_refuses_a_plan_not_of_this_run_or_not_the_planners(plan, says, tmp_path, monkeypatch, capsys):
    assert _launch_in_process(tmp_path, monkeypatch, plan) == 1
    assert len(_calls(tmp_path)) == 1  # no relaunch
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"falcon.s4: {tmp_path / 'dump' / S4_PLAN_FILE}: ") and says in line, line
    assert _plan_file(tmp_path)["status"] == "pending"


@pytest.mark.multiprocess
def test_falcon_s4_does_not_relaunch_after_another_failure_nor_a_stale_plan(tmp_path, monkeypatch):
    assert _launch_in_process(tmp_path, monkeypatch, _plan(), 3) == 3  # a crash is no S4 exit
    assert len(_calls(tmp_path)) == 1 and _plan_file(tmp_path)["status"] == "pending"
    # a pending plan an earlier run left: gone before the job starts; its exit 1 is then no S4 exit
    (tmp_path / "calls").unlink()
    (tmp_path / "plan").unlink()
    assert _launch_in_process(tmp_path, monkeypatch, None, 1) == 1
    assert len(_calls(tmp_path)) == 1 and not (tmp_path / "dump" / S4_PLAN_FILE).exists()


@pytest.mark.multiprocess
def test_a_plan_is_consumed_only_once_applied(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(s4.ENV_LAUNCH_ID, "run.0")
    dump = tmp_path / "dump"
    dump.mkdir()
    uneven = _plan(launch_id="run.0", hosts=["n1", "n1", "n2"], local_devices=[0, 1, 0], world_size=3)
    (dump / S4_PLAN_FILE).write_text(json.dumps(uneven))
    with pytest.raises(SystemExit, match="uneven"):  # relaunch-spec cannot apply it
        s4.main(["relaunch-spec", str(dump), "n1", "n2"])
    assert _plan_file(tmp_path)["status"] == "pending"
    even = _plan(launch_id="run.0", hosts=["n1", "n2"], local_devices=[0, 1])
    (dump / S4_PLAN_FILE).write_text(json.dumps(even))
    assert s4.main(["relaunch-spec", str(dump), "n1", "n2"]) == 0
    out = capsys.readouterr().out
    assert "S4_NNODES=2" in out and "S4_DEVICES_1=1" in out
    assert _plan_file(tmp_path)["status"] == "consumed"
    assert s4.main(["relaunch-spec", str(dump), "n1", "n2"]) == 1  # once
    # launch(): a plan relaunch_env cannot apply (a multi-node GPU restart is launch.sh's) stays pending
    monkeypatch.delenv(s4.ENV_LAUNCH_ID)
    multi = _plan(device_type="cuda", hosts=["n1", "n2"])
    with pytest.raises(SystemExit, match="multi-node"):
        _launch_in_process(tmp_path, monkeypatch, multi)
    assert _plan_file(tmp_path)["status"] == "pending"


@pytest.mark.parametrize("slow_device, slow_link", [("3:24@5", "0-1:30@5"), ("1:4", "2-3:x6@2"), ("", ""),
                                                    ("3 : 2.5", "0 - 1 : 100")])
def test_what_the_planner_writes_passes_the_check(slow_device, slow_link, tmp_path):
    """Both plans' overrides (DP shrinks; a spare replaces the device), emulation included, are accepted."""
    from titan_ext.runtime.falcon.restart import (plan_exclusion, plan_replacement, relaunch_overrides,
                                                  remap_emulation, write_s4_plan)

    grid = [[0, 2], [1, 3]]
    for plan in (plan_exclusion([[0, 3], [1, 4], [2, 5]], [4], 7, [2, 2, 2]),
                 plan_replacement(grid, [3], [4, 5], step=12, split=[5, 1])):
        overrides = relaunch_overrides(plan, remap_emulation(plan, slow_device, slow_link), local_batch_size=2)
        write_s4_plan(tmp_path, plan, status="pending", launch_id="run.0", overrides=overrides,
                      hosts=["h"] * len(plan.kept_ranks), local_devices=list(range(len(plan.kept_ranks))),
                      device_type="cpu")
        assert s4.pending_plan(tmp_path, "run.0")["overrides"] == overrides


def test_relaunch_spec_refuses_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(s4.ENV_LAUNCH_ID, "run.1")
    (tmp_path / S4_PLAN_FILE).write_text(json.dumps(_plan(launch_id="run.0")))
    assert s4.main(["relaunch-spec", str(tmp_path), "h"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert str(tmp_path / S4_PLAN_FILE) in line and "'run.0'" in line
    (tmp_path / S4_PLAN_FILE).write_text("{not json")
    assert s4.main(["relaunch-spec", str(tmp_path), "h"]) == 1
    assert "cannot read" in capsys.readouterr().err
    assert s4.main(["relaunch-spec", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: ")


# ------------------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("case", ["max_s4", "nproc", "port", "port_plus_restarts", "dump_file", "dump_under_file",
                                  "no_dump", "log_dir", "log_nowhere", "not_int"])
def test_falcon_s4_bad_argument_is_one_line_exit_2_before_anything_starts(case, tmp_path, monkeypatch, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("the user's file\n")
    dump = ["--job.dump_folder", str(tmp_path / "dump")]
    argv = {"max_s4": ["--nproc-per-node", "4", "--max-s4", "-1", "--", *dump],
            "nproc": ["--nproc-per-node", "0", "--", *dump],
            "port": ["--nproc-per-node", "4", "--master-port", "0", "--", *dump],
            "port_plus_restarts": ["--nproc-per-node", "4", "--master-port", "65535", "--max-s4", "2", "--", *dump],
            "dump_file": ["--nproc-per-node", "4", "--", "--job.dump_folder", str(a_file)],
            "dump_under_file": ["--nproc-per-node", "4", "--", f"--job.dump_folder={a_file}/sub"],
            "no_dump": ["--nproc-per-node", "4", "--", "--training.steps", "3"],
            "log_dir": ["--nproc-per-node", "4", "--log", str(tmp_path), "--", *dump],
            "log_nowhere": ["--nproc-per-node", "4", "--log", str(tmp_path / "no" / "x.log"), "--", *dump],
            "not_int": ["--nproc-per-node", "four", "--", *dump]}[case]
    started = []
    monkeypatch.setattr(s4, "_torchrun", lambda *a: started.append(a) or ["false"])
    with pytest.raises(SystemExit) as stop:
        s4.main(argv, prog="titan-ext falcon-s4")
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: titan-ext falcon-s4: "), line
    assert not started and a_file.read_text() == "the user's file\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


# ------------------------------------------------------------------------------------------- run_local.sh
@pytest.mark.multiprocess
@pytest.mark.parametrize("schedules", ["../precious", "PipeMorph ../precious", "/tmp", "*", "1F1B ..", "PipeMorph\n../precious"])
def test_run_local_refuses_a_schedule_that_is_no_name_before_removing_anything(schedules, tmp_path):
    precious, out = tmp_path / "precious", tmp_path / "out"
    (precious / "keep").mkdir(parents=True)
    (out / "PipeMorph").mkdir(parents=True)
    (out / "PipeMorph" / "train.log").write_text("an earlier run\n")
    env = {**os.environ, "SCHEDULES": schedules, "OUT": str(out)}
    run = subprocess.run(["bash", str(ROOT / "scripts" / "run_local.sh")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "is not a schedule name" in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert "[setup]" not in run.stdout  # refused before anything ran
    assert (precious / "keep").is_dir() and (out / "PipeMorph" / "train.log").exists()


@pytest.mark.multiprocess
def test_run_local_does_not_follow_a_link_out_of_its_folder(tmp_path):
    precious, out = tmp_path / "precious", tmp_path / "out"
    (precious / "keep").mkdir(parents=True)
    out.mkdir()
    (out / "PipeMorph").symlink_to(precious)
    run = subprocess.run(["bash", str(ROOT / "scripts" / "run_local.sh")], cwd=tmp_path,
                         env={**os.environ, "SCHEDULES": "PipeMorph", "OUT": str(out)},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "not removing it" in run.stderr, run.stdout + run.stderr
    assert (precious / "keep").is_dir() and (out / "PipeMorph").is_symlink()


# ------------------------------------------------------------------------------------------- frozen_rank.py
def test_frozen_rank_logs_to_a_private_folder_by_default():
    import importlib.util

    spec = importlib.util.spec_from_file_location("frozen_rank", ROOT / "scripts" / "frozen_rank.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    first, second = module.default_log(), module.default_log()
    try:
        assert first.parent != second.parent and first.name == "run.log"
        assert (first.parent.stat().st_mode & 0o777) == 0o700 and first.parent.stat().st_uid == os.getuid()
    finally:
        first.parent.rmdir()
        second.parent.rmdir()


@pytest.mark.multiprocess
def test_launch_sh_reads_a_long_slurm_node_list_to_its_end(tmp_path):
    """The rendezvous host is the allocation's first node. `scontrol show hostnames … | head -n 1` closed the
    pipe after one line and scontrol's SIGPIPE ended the launch with status 141 and no message (pipefail):
    here a stand-in scontrol lists 14 000 nodes (96 kB, more than a pipe holds), which it cannot write
    before head has exited."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake(bin_dir, "#!/bin/bash\nseq -f 'n%g' 1 14000\n", "scontrol")
    env = _env(tmp_path, PYTHON=sys.executable, DRY_RUN="print", CONFIG_FILE=CONFIG, NNODES="2",
               PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="77", SLURM_JOB_NODELIST="n[1-14000]",
               SLURM_JOB_NUM_NODES="14000", LOG_DIR=str(tmp_path / "logs"))
    run = subprocess.run(["bash", str(ROOT / "scripts" / "launch.sh")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert re.search(r"--rdzv_endpoint[ =]n1:", run.stdout), run.stdout[-2000:]  # n1, not n10 or n14000
