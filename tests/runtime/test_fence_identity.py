"""The fence kills a stopped peer only when it is a rank of this job (``timeouts._same_job``): the pid
published in the unauthenticated store is never trusted alone — a sibling (same parent: torchrun's agent,
a test's spawner) or a process with this job's run id and rendezvous address in its environment."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from titan_ext.runtime.comm import timeouts

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.mark.multiprocess
def test_a_sibling_rank_is_of_this_job_and_an_unrelated_process_is_not():
    """A parent spawns a peer and a judge; the judge asks about the peer (its sibling) and about the
    parent's own parent (not a sibling, no job keys)."""
    parent = f"""
import json, os, subprocess, sys, time
peer = subprocess.Popen({SLEEP!r})
time.sleep(0.2)
judge = subprocess.run([sys.executable, "-c",
    "import json, os, sys; from titan_ext.runtime.comm import timeouts; "
    "print(json.dumps([timeouts._same_job(int(a), environ={{}}) for a in sys.argv[1:]]))",
    str(peer.pid), str(os.getppid())], capture_output=True, text=True, check=True)
peer.kill()
print(judge.stdout.strip())
"""
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True, False]


@pytest.mark.multiprocess
def test_the_job_keys_identify_a_rank_that_is_no_sibling():
    env = {"TORCHELASTIC_RUN_ID": "job-7", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}
    other = subprocess.Popen(SLEEP, env=env)
    try:
        time.sleep(0.2)
        assert timeouts._same_job(other.pid, environ=env)
        assert not timeouts._same_job(other.pid, environ=env | {"MASTER_PORT": "29512"})  # another job
        assert not timeouts._same_job(other.pid, environ={})  # nothing to compare: never trusted
    finally:
        other.kill()
        other.wait()


@pytest.mark.multiprocess
def test_a_pid_that_does_not_exist_is_not_of_this_job():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert not timeouts._same_job(gone.pid, environ={"MASTER_PORT": "1"})
