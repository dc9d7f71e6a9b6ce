"""Installing into an existing environment: the build without torch stops with one line, the default
CUDA architectures, and a job that asks for delegation without the compiled data plane stops with one line."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_NO_TORCH = "import sys; sys.modules['torch'] = None; sys.argv = ['setup.py', '--name']; exec(open('setup.py').read())"


@pytest.mark.multiprocess
def test_build_without_torch_fails_with_one_line():
    run = subprocess.run([sys.executable, "-c", _NO_TORCH], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "TITAN_EXT_NO_CUDA": "1"})
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "--no-build-isolation" in lines[0] and "torch" in lines[0], run.stderr


@pytest.mark.multiprocess
def test_build_without_torch_on_purpose():
    run = subprocess.run([sys.executable, "-c", _NO_TORCH], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "TITAN_EXT_NO_CUDA": "1", "TITAN_EXT_NO_DELEGATE_C": "1"})
    assert run.returncode == 0, run.stderr
    assert "titan_ext._delegate_C not built" in run.stdout


def test_default_cuda_architectures():
    text = (ROOT / "setup.py").read_text()
    assert 'DEFAULT_CUDA_ARCH_LIST = "8.0;9.0;10.0+PTX"' in text
    assert 'os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCH_LIST)' in text  # the env's wins


def test_license_and_its_field():
    import tomllib

    assert "BSD 3-Clause" in (ROOT / "LICENSE").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # the table form: setuptools < 77 (what a cluster's or the GPU image's environment may have) refuses
    # the SPDX string form at build time
    assert project["license"] == {"text": "BSD-3-Clause"}


@pytest.fixture
def without_delegate_c(monkeypatch):
    import importlib

    from titan_ext.runtime.comm.delegate import _ext

    real = importlib.import_module

    def import_module(name, *args, **kwargs):
        if name == "titan_ext._delegate_C":
            raise ImportError("No module named 'titan_ext._delegate_C'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(_ext, "_mod", None)
    monkeypatch.setattr(importlib, "import_module", import_module)


def test_delegation_without_the_extension_stops_with_one_line(without_delegate_c):
    pytest.importorskip("torchtitan")
    from titan_ext.titan import registry
    from titan_ext.titan.config import JobConfig, TitanExt

    with registry.active_job_config(JobConfig(titan_ext=TitanExt(delegation="auto"))):
        with pytest.raises(SystemExit) as stop:
            registry.get_schedule_class("PipeMorph")
    message = str(stop.value.code)
    assert "\n" not in message and "titan_ext._delegate_C" in message and "--no-build-isolation" in message
    with registry.active_job_config(JobConfig(titan_ext=TitanExt())):
        registry.get_schedule_class("PipeMorph")  # delegation off: no extension needed
