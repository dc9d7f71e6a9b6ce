"""The package as it ships: an sdist holds every file the C/C++ builds read (setup.py's own lists and the
headers they include; MANIFEST.in), the extensions compile from the unpacked sdist, the version is written
once (titan_ext.__version__, read by setuptools without importing anything), and the optional
dependencies are extras."""

import json
import os
import re
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# setup.py run as pip runs it, without torch (TITAN_EXT_NO_DELEGATE_C=1: the plan modules only)
_NO_TORCH = "import sys; sys.modules['torch'] = None; sys.argv = ['setup.py', *sys.argv[1:]]; exec(open('setup.py').read())"
_ENV_NO_TORCH = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "TITAN_EXT_NO_DELEGATE_C": "1",
                 "TITAN_EXT_NO_CUDA": "1"}
# the files setup.py names for its builds: every extension's sources and depends, and the data plane's
# CUDA sources and headers, which it builds only where nvcc and a CUDA torch are
_SETUP_FILES = """
import json, runpy, setuptools, sys
setuptools.setup = lambda **kwargs: None
sys.modules['torch'] = None
g = runpy.run_path('setup.py', run_name='__main__')
files = [f for ext in g['ext_modules'] for f in [*ext.sources, *ext.depends]]
files += g['DELEGATE_CPU_SOURCES'] + g['DELEGATE_CUDA_SOURCES'] + g['DELEGATE_HEADERS']
print(json.dumps(sorted(set(files))))
"""
_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def _run(args: list[str], cwd: Path, env: dict | None = None, timeout: int = 300) -> str:
    p = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def setup_files() -> list[str]:
    """setup.py's file lists (relative paths), read by running it with ``setup()`` a no-op."""
    out = _run([sys.executable, "-c", _SETUP_FILES], ROOT, env=_ENV_NO_TORCH)
    return json.loads(out.strip().splitlines()[-1])


def with_includes(files: list[str]) -> set[str]:
    """``files`` and every local header they include (``#include "..."``, next to the includer), transitively."""
    todo, seen = list(files), set()
    while todo:
        rel = todo.pop()
        if rel in seen:
            continue
        seen.add(rel)
        for name in _INCLUDE.findall((ROOT / rel).read_text()):
            header = os.path.normpath(os.path.join(os.path.dirname(rel), name))
            assert (ROOT / header).is_file(), f"{rel} includes {name!r}, which is not at {header}"
            todo.append(header)
    return seen


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> tuple[set[str], Path]:
    """An sdist made from this checkout (its egg-info kept out of the checkout), unpacked: the files it
    holds (paths inside its top folder) and that folder."""
    out = tmp_path_factory.mktemp("sdist")
    _run([sys.executable, "-c", _NO_TORCH, "-q", "egg_info", "--egg-base", str(out), "sdist", "--dist-dir", str(out)],
         ROOT, env=_ENV_NO_TORCH)
    (archive,) = out.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        names = {m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile() and "/" in m.name}
        tar.extractall(out / "unpacked", filter="data")
    (top,) = (out / "unpacked").iterdir()
    return names, top


@pytest.mark.multiprocess
def test_setup_lists_every_header_its_sources_include():
    """A header a source includes is one of setup.py's ``depends`` (an edit rebuilds) or its lists, so
    the lists are what the builds read."""
    listed = setup_files()
    assert {"cpp_ext/delegate_ext.cpp", "cpp_ext/delegate_cuda.cu", "titan_ext/plan/_search.c"} <= set(listed)
    assert with_includes(listed) == set(listed)


@pytest.mark.multiprocess
def test_sdist_holds_every_file_the_extension_builds_read(sdist):
    names, _ = sdist
    needed = with_includes(setup_files())
    assert not needed - names, f"missing from the sdist (MANIFEST.in): {sorted(needed - names)}"
    assert {"setup.py", "pyproject.toml", "MANIFEST.in", "LICENSE", "README.md"} <= names
    assert not [n for n in names if n.endswith((".so", ".o"))]  # no build output of this checkout


@pytest.mark.multiprocess
def test_version_is_written_once(sdist):
    import titan_ext

    assert "version" not in PROJECT and "version" in PROJECT["dynamic"]
    dynamic = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["dynamic"]
    assert dynamic["version"] == {"attr": "titan_ext.__version__"}
    assign = re.compile(r"""^\s*(__version__|version)\s*=\s*["']""", re.M)
    sources = [ROOT / "pyproject.toml", ROOT / "setup.py", *(ROOT / "titan_ext").rglob("*.py")]
    written = [str(p.relative_to(ROOT)) for p in sources for _ in assign.finditer(p.read_text())]
    assert written == ["titan_ext/__init__.py"], written
    assert not (ROOT / "setup.cfg").exists()
    names, top = sdist
    assert f"Version: {titan_ext.__version__}\n" in (top / "PKG-INFO").read_text()


def test_optional_dependencies_are_extras():
    deps = {Requirement(r).name for r in PROJECT["dependencies"]}
    assert not deps & {"wandb", "matplotlib", "ortools"}
    extras = {name: [Requirement(r) for r in reqs] for name, reqs in PROJECT["optional-dependencies"].items()}
    assert [r.name for r in extras["wandb"]] == ["wandb"] and [r.name for r in extras["plot"]] == ["matplotlib"]
    (everything,) = extras["all"]
    assert everything.name == PROJECT["name"] and everything.extras == {"solver", "wandb", "plot"}
    assert '".[test,all]"' in (ROOT / "scripts" / "setup.sh").read_text()  # the tests' environment has them


def test_triton_range_admits_what_the_installed_torch_pins():
    """Our triton range holds the version the installed torch's wheel asks for (its CUDA wheels pin one:
    2.11 ==3.6.0, 2.14 ~=3.8.0, 2.15 ~=3.9.0; a CPU wheel asks for none)."""
    import importlib.metadata as md

    ours = next(Requirement(r) for r in PROJECT["dependencies"] if Requirement(r).name == "triton")
    pins = [s for r in map(Requirement, md.requires("torch") or []) if r.name == "triton" for s in r.specifier]
    for spec in pins:
        assert ours.specifier.contains(spec.version), (str(ours), str(spec))
    if not pins:
        try:
            assert ours.specifier.contains(md.version("triton"))
        except md.PackageNotFoundError:
            pytest.skip("neither torch's metadata nor this environment names a triton")


@pytest.mark.multiprocess
def test_plan_modules_build_from_the_sdist(sdist):
    """The planner's three C modules compile from the unpacked sdist alone and import from it (about 5 s;
    the C++ data plane, over a minute: the test below)."""
    _, top = sdist
    _run([sys.executable, "-c", _NO_TORCH, "-q", "build_ext", "--inplace"], top, env=_ENV_NO_TORCH)
    mods = ["titan_ext.plan._search_c", "titan_ext.plan._greedy_c", "titan_ext.plan._pipemorph_c"]
    code = f"import importlib; print([importlib.import_module(m).__file__ for m in {mods}])"
    files = _run([sys.executable, "-c", code], top, env=_ENV_NO_TORCH)
    assert files.count(str(top)) == 3, files


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.soak  # about 100 s on 2 cores (torch's headers); the sdist's contents are checked above
def test_every_extension_builds_from_the_sdist(sdist):
    """All four extensions, titan_ext._delegate_C against the installed torch (CPU), compile from the
    unpacked sdist and import from it."""
    pytest.importorskip("torch")
    _, top = sdist
    env = {**os.environ, "TITAN_EXT_NO_CUDA": "1"}
    env.pop("TITAN_EXT_NO_DELEGATE_C", None)
    _run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], top, env=env, timeout=900)
    mods = ["titan_ext._delegate_C", "titan_ext.plan._search_c", "titan_ext.plan._greedy_c",
            "titan_ext.plan._pipemorph_c"]
    code = f"import importlib, torch; print([importlib.import_module(m).__file__ for m in {mods}])"
    assert _run([sys.executable, "-c", code], top, env=env).count(str(top)) == 4
