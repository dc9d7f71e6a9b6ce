"""An injected straggler is never silent: a WARNING at start and periodically."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from titan_ext.runtime.emulate import delay_injection as di

ROOT = Path(__file__).resolve().parents[2]


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "INJECTED STRAGGLER" in r.getMessage()]


def test_injector_warns_at_install_and_again_after_the_period(caplog):
    caplog.set_level(logging.WARNING, logger=di.__name__)
    injector = di.inject_link_delays("2:30", origin="[titan_ext] inject_delays")
    try:
        first = _warnings(caplog)
        assert len(first) == 1 and "2:30" in first[0]
        assert "[titan_ext] inject_delays" in first[0]
        installed = injector._next_warning - di.WARN_EVERY_S
        injector.maybe_warn(installed + 0.5 * di.WARN_EVERY_S)  # too early: silent
        assert len(_warnings(caplog)) == 1
        injector.maybe_warn(installed + 1.01 * di.WARN_EVERY_S)
        assert len(_warnings(caplog)) == 2
        injector.maybe_warn(installed + 1.5 * di.WARN_EVERY_S)  # the next period restarts there
        assert len(_warnings(caplog)) == 2
    finally:
        injector.remove()


def test_zero_delay_spec_does_not_warn(caplog):
    caplog.set_level(logging.WARNING, logger=di.__name__)
    di.inject_link_delays("1:0").remove()
    assert _warnings(caplog) == []


@pytest.mark.multiprocess
def test_env_straggler_warns_at_import_naming_the_variable():
    """A leftover TITAN_EXT_INJECT_DELAYS installs at `import titan_ext.runtime`: one WARNING line."""
    env = dict(os.environ, TITAN_EXT_INJECT_DELAYS="1:40")
    out = subprocess.run([sys.executable, "-c", "import titan_ext.runtime"], capture_output=True,
                         text=True, cwd=ROOT, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [ln for ln in out.stderr.splitlines() if "INJECTED STRAGGLER" in ln]
    assert len(lines) == 1 and "TITAN_EXT_INJECT_DELAYS" in lines[0] and "1:40" in lines[0], out.stderr
