"""The torch pin (pyproject) and the runtime's fail-fast check of the torch internals it uses."""

import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent


def _requirement(name: str) -> Requirement:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(r for r in map(Requirement, deps) if r.name == name)


def test_installed_torch_is_in_the_pinned_range_and_has_every_internal():
    import torch

    from titan_ext.runtime._torch_compat import TESTED, missing_internals

    assert str(_requirement("torch").specifier) == str(Requirement(f"torch{TESTED}").specifier)
    assert _requirement("torch").specifier.contains(torch.__version__.split("+")[0])
    assert missing_internals() == []


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
    assert last.startswith("ImportError: titan_ext.runtime needs torch>=2.13,<2.14"), last
    assert "torch.distributed.pipelining.schedules._add_send_recv" in last
    assert "_PipelineScheduleRuntime._prepare_schedule_with_comms" in last


def test_triton_is_declared_where_torchtitan_imports_it():
    req = _requirement("triton")
    assert req.marker is not None and req.marker.evaluate({"sys_platform": "linux"})
    assert not req.marker.evaluate({"sys_platform": "darwin"})
