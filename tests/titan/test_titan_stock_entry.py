"""TorchTitan's own entry point (``python -m torchtitan.train``, 0.2: ``--job.config_file X.toml`` with
``custom_import``/``custom_config_module``; 0.3: ``--module titan_ext.titan --config ...``) with a bad
``[titan_ext]`` value, a non-ASCII digit or a bad schedule name: titan_ext's checks run at ``import
titan_ext``, which TorchTitan's import of our config module causes before its parser runs, and end with
one line from rank 0 and exit 2 on every rank -- not tyro's boxed message, not a traceback
(titan_ext/titan/entry.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from _titan_version import IS_TT03

pytest.importorskip("torchtitan")

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "train_configs" / "debug_cpu.toml"
BASE = (["--module", "titan_ext.titan", "--config", "pipemorph_debugmodel"] if IS_TT03
        else ["--job.config_file", str(CONFIG)])

# option -> what the one line says
BAD = {
    "negative_delay": (["--titan_ext.inject_delays", "2:-5"], "[titan_ext] inject_delays = '2:-5'"),
    "arabic_indic_digit": (["--titan_ext.replan_interval", "٣"], "write numbers with ASCII digits"),
    "fullwidth_digits": (["--training.steps", "１２"], "write numbers with ASCII digits"),
    "bad_schedule": (["--parallelism.pipeline_parallel_schedule", "NoSuch"],
                     "pipeline_parallel_schedule = 'NoSuch'"),
    # Literal knobs (titan/config.py): tyro refuses a value outside their choices on the command line
    "bad_backward": (["--titan_ext.backward", "fast"], "invalid choice 'fast' for argument '--titan"),
    "bad_delegation": (["--titan_ext.delegation", "sometimes"], "invalid choice 'sometimes' for argument '--titan"),
    "unknown_knob": (["--titan_ext.nosuch", "3"], "Unrecognized options"),
    "not_an_int": (["--titan_ext.replan_interval", "abc"], "replan"),
    "slack_floor_too_big": (["--titan_ext.slack_floor", "100"], "slack_floor = 100"),
}


@pytest.fixture
def stock(monkeypatch):
    """This process as TorchTitan's own entry point, its check not yet run, on rank ``RANK`` of 4."""
    from titan_ext.titan import entry

    monkeypatch.setattr(entry, "stock_entry_point", lambda: True)
    monkeypatch.setattr(entry, "_stock_checked", False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.chdir(ROOT)
    for var in ("TITAN_EXT_INJECT_DELAYS", "TITAN_EXT_SLOW_DEVICE", "TITAN_EXT_SLOW_LINK"):
        monkeypatch.delenv(var, raising=False)
    return entry


def _stock_parse(args: list[str], monkeypatch):
    """What TorchTitan's main does first: its ConfigManager's parse of the command line, during which its
    import of our config module imports ``titan_ext`` (the hook: its ``__init__`` calls
    ``check_stock_entry``; re-run here by reloading the package, imported long ago in this process)."""
    import importlib

    from torchtitan.config import ConfigManager

    import titan_ext

    monkeypatch.setattr(sys, "argv", ["train.py", *args])
    importlib.reload(titan_ext)
    return ConfigManager().parse_args(args)


@pytest.mark.parametrize("case, rank", [(case, "0") for case in sorted(BAD)]
                         + [(case, "2") for case in ("negative_delay", "arabic_indic_digit", "unknown_knob")])
def test_bad_value_under_the_stock_entry_is_one_line_and_exit_2(case, rank, stock, monkeypatch, capsys):
    args, needle = BAD[case]
    monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as exc:
        _stock_parse([*BASE, *args], monkeypatch)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    if rank == "0":
        assert len(lines) == 1 and lines[0].startswith("titan_ext: configuration error: "), err
        assert needle in lines[0], lines[0]
    else:
        assert lines == [], err
    assert "Traceback" not in out + err and "╭" not in out + err


def test_a_valid_job_passes_the_stock_check(stock, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    cfg = _stock_parse([*BASE, "--training.steps", "3"], monkeypatch)
    assert cfg.training.steps == 3
    assert "titan_ext:" not in capsys.readouterr().err


def test_outside_the_stock_entry_a_library_caller_gets_exceptions(capsys):
    """``ConfigManager().parse_args`` called by a program of its own (here: pytest) is not TorchTitan's
    entry point: nothing of ours exits, the parser behaves as before (tyro's own error)."""
    from torchtitan.config import ConfigManager

    from titan_ext.titan import entry

    assert not entry.stock_entry_point()
    with pytest.raises((ValueError, SystemExit)):
        ConfigManager().parse_args([*BASE, "--titan_ext.inject_delays", "2:-5"])
    assert "titan_ext: configuration error" not in capsys.readouterr().err


def test_stock_entry_point_is_recognised_by_module_or_file(monkeypatch):
    import types

    from titan_ext.titan import entry

    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name="torchtitan.train")
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert entry.stock_entry_point()
    main.__spec__ = types.SimpleNamespace(name="titan_ext.train")
    assert not entry.stock_entry_point()
    main.__spec__ = None
    main.__file__ = "/site-packages/torchtitan/train.py"
    assert entry.stock_entry_point()
    main.__file__ = "/somewhere/train.py"
    assert not entry.stock_entry_point()


@pytest.mark.slow  # a fresh process importing torch and TorchTitan (~10 s)
def test_torchtitan_train_itself_prints_one_line_and_exits_2():
    """The real thing: ``python -m torchtitan.train`` in a fresh process (as torchrun starts each rank),
    a negative injected delay: one line of ours, exit 2, no traceback, no box."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), WORLD_SIZE="4", RANK="0")
    env.pop("TITAN_EXT_INJECT_DELAYS", None)
    p = subprocess.run([sys.executable, "-m", "torchtitan.train", *BASE, "--titan_ext.inject_delays", "2:-5"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-3000:]
    ours = [line for line in p.stderr.splitlines() if not line.startswith("[titan]")]
    assert ours == ["titan_ext: configuration error: [titan_ext] inject_delays = '2:-5': delay spec '2:-5', "
                    "item '2:-5': latency '-5' must be a finite number >= 0 (at most 1e+09)"], p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "╭" not in p.stderr
