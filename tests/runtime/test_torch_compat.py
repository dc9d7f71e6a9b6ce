"""The torch pin (pyproject) and the runtime's fail-fast check of the torch internals it uses."""

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def _requirement(name: str) -> Requirement:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(r for r in map(Requirement, deps) if r.name == name)


def test_installed_torch_is_in_the_pinned_range_and_has_every_internal():
    import torch

    from titan_ext.runtime._torch_compat import TESTED, missing_internals

    assert str(_requirement("torch").specifier) == str(Requirement(f"torch{TESTED}").specifier)
    assert _requirement("torch").specifier.contains(torch.__version__.split("+")[0])
    assert missing_internals() == []


@pytest.mark.multiprocess
def test_missing_internal_is_named_at_import_of_the_runtime():
    """A torch without one private internal: importing the runtime names it (fresh process)."""
    code = ("import torch.distributed.pipelining.schedules as s\n"
            "del s._add_send_recv\n"
            "del s._PipelineScheduleRuntime._prepare_schedule_with_comms\n"
            "import titan_ext.runtime\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: titan_ext.runtime needs torch>=2.11,<2.16"), last
    assert "torch.distributed.pipelining.schedules._add_send_recv" in last
    assert "_PipelineScheduleRuntime._prepare_schedule_with_comms" in last


def test_version_gate_requires_the_wait_internals_from_torch_2_15_on():
    from titan_ext.runtime._torch_compat import WAIT_ACTIONS_SINCE, has_wait_actions, required_internals

    def names(version):
        return {f"{m}.{n}" for m, ns in required_internals(version).items() for n in ns}

    waits = "torch.distributed.pipelining.schedules._add_wait_send"
    assert WAIT_ACTIONS_SINCE == (2, 15)
    assert waits not in names((2, 13)) and waits not in names((2, 14))
    assert waits in names((2, 15)) and waits in names((2, 16))
    assert names((2, 13)) == names((2, 14)) < names((2, 15))
    assert [has_wait_actions(v) for v in [(2, 13), (2, 14), (2, 15)]] == [False, False, True]


def test_gate_matches_the_installed_torch():
    """The gate (by version) agrees with what this torch really has (by looking)."""
    from torch.distributed.pipelining import schedules

    from titan_ext.runtime._torch_compat import has_wait_actions

    assert has_wait_actions() == hasattr(schedules._ComputationType, "WAIT_REDUCE_GRAD")
    assert has_wait_actions() == hasattr(schedules, "_add_wait_send")


def test_a_2_15_without_its_wait_passes_is_named(monkeypatch):
    """torch reporting 2.15 but lacking its wait passes: the runtime's import check names them."""
    import pytest
    import torch
    import torch.distributed.pipelining.schedules as schedules

    from titan_ext.runtime._torch_compat import check_torch

    monkeypatch.setattr(torch, "__version__", "2.15.0")
    for name in ("_add_wait_send", "_add_wait_send_budget", "_validate_send_waits"):
        monkeypatch.delattr(schedules, name, raising=False)
    with pytest.raises(ImportError) as exc:
        check_torch()
    msg = str(exc.value)
    assert msg.startswith("titan_ext.runtime needs torch>=2.11,<2.16 (tested); torch 2.15.0 lacks"), msg
    assert "torch.distributed.pipelining.schedules._add_wait_send," in msg and "_validate_send_waits" in msg
    assert "_add_send_recv" not in msg  # what it has is not named


def test_triton_is_declared_where_torchtitan_imports_it():
    req = _requirement("triton")
    assert req.marker is not None and req.marker.evaluate({"sys_platform": "linux"})
    assert not req.marker.evaluate({"sys_platform": "darwin"})


def test_each_torch_form_of_initialize_stages_and_compute_loss_gets_what_it_takes():
    """torch 2.11's ``_initialize_stages(args, kwargs)`` once failed with a TypeError at the first step on
    a GPU machine; 2.12 adds ``target``, 2.13 ``loss_kwargs`` (stored here as the three signatures)."""
    from titan_ext.runtime._torch_compat import initialize_stages, with_loss_kwargs

    calls = []

    class V211:
        def _initialize_stages(self, args, kwargs):
            calls.append(("2.11", args, kwargs))

        def _compute_loss(self, output, target):
            return ("2.11", output, target)

    class V212(V211):
        def _initialize_stages(self, args, kwargs, target=None):
            calls.append(("2.12", args, kwargs, target))

    class V213(V212):
        def _initialize_stages(self, args, kwargs, target=None, loss_kwargs=None):
            calls.append(("2.13", args, kwargs, target, loss_kwargs))

        def _compute_loss(self, output, target, loss_kwargs=None):
            return ("2.13", output, target, loss_kwargs)

    for cls in (V211, V212, V213):
        initialize_stages(cls(), "a", "k", "t", None)
    initialize_stages(V213(), "a", "k", "t", {"w": 1})
    assert calls == [("2.11", "a", "k"), ("2.12", "a", "k", "t"), ("2.13", "a", "k", "t", None),
                     ("2.13", "a", "k", "t", {"w": 1})]
    assert with_loss_kwargs(V211()._compute_loss, "o", "t") == ("2.11", "o", "t")
    assert with_loss_kwargs(V213()._compute_loss, "o", "t", loss_kwargs={"w": 1}) == ("2.13", "o", "t", {"w": 1})
    with pytest.raises(TypeError, match="loss_kwargs needs torch >= 2.13"):
        with_loss_kwargs(V212()._compute_loss, "o", "t", loss_kwargs={"w": 1})
    with pytest.raises(TypeError, match="loss_kwargs needs torch >= 2.13"):
        initialize_stages(V212(), "a", "k", "t", {"w": 1})


