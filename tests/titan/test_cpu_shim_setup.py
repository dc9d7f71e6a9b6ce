"""TorchTitan's CPU shim runs the set-up hooks its environment names (``TITAN_EXT_CPU_SETUP``) before
TorchTitan builds its groups; the tests' hook (``testing/cpu_setup.py``) is named by the tests'
launcher, never by the shim."""

from __future__ import annotations

import sys
import types

import pytest

from titan_ext.testing import cpu_setup
from titan_ext.titan import cpu_shim


@pytest.fixture
def hook_module(monkeypatch):
    calls: list[str] = []
    mod = types.ModuleType("titan_ext_test_hook")
    mod.setup = lambda: calls.append("setup")
    mod.other = lambda: calls.append("other")
    mod.value = 3
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return mod.__name__, calls


def test_the_shim_calls_every_named_hook_in_order(hook_module):
    name, calls = hook_module
    done = cpu_shim.run_setup_hooks({cpu_shim.SETUP_ENV: f"{name}:other, {name}"})
    assert calls == ["other", "setup"] and done == [f"{name}:other", name]
    assert cpu_shim.run_setup_hooks({}) == [] and calls == ["other", "setup"]


def test_a_hook_that_is_missing_or_not_callable_fails_naming_it(hook_module):
    name, _ = hook_module
    with pytest.raises(RuntimeError, match=f"{cpu_shim.SETUP_ENV}: '{name}:value' is not a callable"):
        cpu_shim.run_setup_hooks({cpu_shim.SETUP_ENV: f"{name}:value"})
    with pytest.raises(RuntimeError, match="no_such_module_here"):
        cpu_shim.run_setup_hooks({cpu_shim.SETUP_ENV: "no_such_module_here:setup"})


def test_the_tests_launcher_names_the_tests_hook_once():
    assert cpu_setup.SETUP_ENV == cpu_shim.SETUP_ENV
    env = cpu_setup.job_env({"A": "1", cpu_shim.SETUP_ENV: "other:hook"})
    assert env[cpu_shim.SETUP_ENV] == f"other:hook,{cpu_setup.SETUP}" and env["A"] == "1"
    assert cpu_setup.job_env(env) == env
    module, _, function = cpu_setup.SETUP.partition(":")
    assert getattr(sys.modules[module], function) is cpu_setup.setup
