"""a bad TOML file or environment variable is one line from rank 0 (the other
ranks exit quietly with the same code), exit 2, no traceback and nothing announced first; and a frozen
rank ends a 4-rank job within comm.train_timeout_seconds + 30 s with a message naming it (slow tier)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _titan_version import TITAN_EXT_TRAIN, tt02_only

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "train_configs" / "debug_cpu.toml"

# name: (TOML text or None for "no such file", env, the one line must contain)
BAD = {
    "missing_file": (None, {}, "No such file or directory"),
    "syntax_error": ("[job\nx = 1\n", {}, "titan_ext: malformed TOML: "),
    "duplicate_key": ('[job]\ndump_folder = "a"\ndump_folder = "b"\n', {}, "Cannot overwrite a value"),
    "not_utf8": (b"\xff\xfe[job]\n", {}, "not UTF-8 text"),
    "env_delays_garbage": ("", {"TITAN_EXT_INJECT_DELAYS": "garbage"}, "TITAN_EXT_INJECT_DELAYS = 'garbage'"),
    "env_delays_link_beyond": ("", {"TITAN_EXT_INJECT_DELAYS": "9:30"}, "link 9 does not exist"),
    "env_t0_not_a_number": ("", {"TITAN_EXT_INJECT_DELAYS": "1:30", "TITAN_EXT_INJECT_DELAYS_T0": "abc"},
                            "TITAN_EXT_INJECT_DELAYS_T0 = 'abc'"),
    "env_t0_infinite": ("", {"TITAN_EXT_INJECT_DELAYS": "1:30", "TITAN_EXT_INJECT_DELAYS_T0": "inf"},
                        "TITAN_EXT_INJECT_DELAYS_T0"),
}


def _config(tmp_path: Path, text) -> Path:
    path = tmp_path / "c.toml"
    if text is None:
        return tmp_path / "missing.toml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    elif text.startswith("[job\n") or text.startswith("[job]"):
        path.write_text(text)
    else:
        path.write_text(CONFIG.read_text() + "\n" + text)
    return path


@tt02_only(TITAN_EXT_TRAIN)
@pytest.mark.parametrize("rank", ["0", "2"])
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_file_or_env_is_one_line_from_rank_0_exit_2(case, rank, tmp_path, capsys, monkeypatch):
    import torchtitan.train

    from titan_ext import train

    text, env, needle = BAD[case]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(torchtitan.train, "main", lambda *a: pytest.fail("reached TorchTitan's main"))
    with pytest.raises(SystemExit) as exc:
        train.main(["--job.config_file", str(_config(tmp_path, text))])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    if rank == "0":
        assert len(lines) == 1 and lines[0].startswith("titan_ext: ") and needle in lines[0], err
    else:
        assert lines == [], err  # the other ranks exit quietly with the same code
    assert "Traceback" not in out + err


@tt02_only(TITAN_EXT_TRAIN)
@pytest.mark.slow  # a fresh trainer process (torch + TorchTitan imports)
def test_env_straggler_is_checked_before_it_is_announced(tmp_path):
    """`TITAN_EXT_INJECT_DELAYS=9:30` announced an active straggler (installed at `import
    titan_ext.runtime`) before refusing; the trainer now checks it first (a fresh process, as torchrun's)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), TITAN_EXT_INJECT_DELAYS="9:30", WORLD_SIZE="4", RANK="0")
    p = subprocess.run([sys.executable, "-m", "titan_ext.train", "--job.config_file", str(CONFIG)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "INJECTED STRAGGLER" not in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1] == ("titan_ext: configuration error: TITAN_EXT_INJECT_DELAYS = '9:30': "
                                                 "link 9 does not exist with 4 pipeline stages (links 0..2)")


@tt02_only(TITAN_EXT_TRAIN + " (scripts/frozen_rank.py runs train_configs/debug_cpu.toml)")
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("schedule, backend", [
    ("PipeMorph", "nccl_rules"),
    # the other three pairs: 60-90 s each, the soak tier's (gloo's PP timeout in CI: the stopped rank
    # under delegation, tests/hostile/test_hostile_faults.py)
    pytest.param("1F1B", "gloo", marks=pytest.mark.soak), pytest.param("PipeMorph", "gloo", marks=pytest.mark.soak),
    pytest.param("1F1B", "nccl_rules", marks=pytest.mark.soak)])
def test_frozen_rank_ends_the_job_within_timeout_plus_30s_naming_it(schedule, backend, tmp_path):
    """SIGSTOP rank 2 at step 5 of train_configs/debug_cpu.toml (4 ranks, torchrun): the job ends within
    comm.train_timeout_seconds + 30 s and the log names rank 2 (before the fix: 333 s, 'Timed out
    waiting 300000ms for recv', for ours and for torch's 1F1B alike).  Under nccl_rules no PP wait has a
    timeout: the PP group's timeout (NCCL's watchdog) ends the job, after the watch named and fenced rank 2."""
    timeout_s = 30
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "frozen_rank.py"), "--rank", "2", "--step", "5",
                        "--timeout", str(timeout_s), "--schedule", schedule, "--log", str(tmp_path / "run.log"),
                        "--backend", backend],
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                       timeout=850)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["froze"] and res["exit_code"] != 0, res
    assert res["ended_after_s"] <= timeout_s + 30, res
    assert res["names_rank"] and "rank 2 stopped answering" in res["message"], res


@pytest.mark.multiprocess
@pytest.mark.parametrize("rank, lines", [("0", 1), ("2", 0)])
def test_a_malformed_env_straggler_at_import_is_one_line_and_exit_2(rank, lines):
    """Under the stock torchtitan.train (custom_import imports titan_ext.runtime): a malformed
    TITAN_EXT_INJECT_DELAYS ends the process with one line from rank 0 and exit 2, no traceback."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), TITAN_EXT_INJECT_DELAYS="garbage", RANK=rank)
    p = subprocess.run([sys.executable, "-c", "import titan_ext.runtime"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == lines and all(e.startswith("titan_ext: configuration error: TITAN_EXT_INJECT_DELAYS") for e in err)


def test_the_train_timeout_follows_the_first_step_under_any_trainer(monkeypatch):
    """The switch from comm.init_timeout_seconds to comm.train_timeout_seconds rides on the schedule built
    by our wrapped builder, so the stock torchtitan.train gets it too (it used to be TitanExtTrainer's)."""
    from types import SimpleNamespace

    from titan_ext.runtime.comm import timeouts
    from titan_ext.titan import registry

    seen = []

    class Schedule:
        def step(self, *args, **kwargs):
            seen.append(timeouts._timeout_s)
            return "out"

    monkeypatch.setattr(timeouts, "_timeout_s", 100.0)
    sched = Schedule()
    registry._train_timeout_after_first_step(sched, SimpleNamespace(comm=SimpleNamespace(train_timeout_seconds=30)))
    assert sched.step() == "out" and timeouts._timeout_s == 30
    assert sched.step() == "out" and seen == [100.0, 30]
