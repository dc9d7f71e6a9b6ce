"""scripts/bench_runtime.py's DP x PP grid: a grid that cannot be built is refused with exit status 2 and
a one-line reason before any process starts (no rendezvous, no process group)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.multiprocess
@pytest.mark.parametrize("argv, needle", [
    (["--mode", "frontier", "--world", "4", "--dp", "3"], "must divide --world 4"),
    (["--mode", "frontier", "--world", "8", "--dp", "2", "--link", "3"], "the PP group has 4 ranks (links 0..2)"),
    (["--mode", "sleep", "--world", "4", "--dp", "2"], "frontier mode only"),
])
def test_bad_grid_is_refused_before_any_process_group(argv, needle, tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_runtime.py"), *argv,
                          "--json", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "MASTER_PORT": "1"})  # a rendezvous would fail: none is attempted
    assert out.returncode == 2, out.stderr[-2000:]
    assert needle in out.stderr
    assert not (tmp_path / "r.json").exists()
