"""Build of titan_ext's compiled parts: the C++/CUDA data plane (cpp_ext/ -> titan_ext._delegate_C)
and the CrossPipe planner's search engine (titan_ext/plan/_search.c -> titan_ext.plan._search_c; plain
C and the CPython API, built with or without torch; the planner falls back to pure Python without it).

Everything else lives in pyproject.toml. Install with `pip install --no-build-isolation .` (scripts/setup.sh
uses `-e`) so the extension compiles against the torch already in the environment; an isolated build env
has no torch, and the build then stops with one line saying so (TITAN_EXT_NO_DELEGATE_C=1 installs without
the extension on purpose). CPU sources always; the CUDA sources when nvcc and a CUDA torch are both present
(TITAN_EXT_NO_CUDA=1: CPU only), for the architectures in TORCH_CUDA_ARCH_LIST (default 8.0;9.0;10.0+PTX).
"""
import os
import shutil
import sys

from setuptools import Extension, setup

# the plan/ C modules' shared headers: _link.h (the one FIFO link send) and _deps.h (the dependency table
# of plan/deps.py as the C code reads it); a change to either rebuilds every module (depends), and
# pyproject.toml's package-data ships them (sdist, wheel)
PLAN_HEADERS = [os.path.join("titan_ext", "plan", h) for h in ("_link.h", "_deps.h")]
# plan search engine: no torch, no numpy (titan_ext.plan stays importable without them)
search_ext = Extension("titan_ext.plan._search_c", [os.path.join("titan_ext", "plan", "_search.c")],
                       depends=PLAN_HEADERS, extra_compile_args=["-O2"], libraries=["m"])
# plan greedy generator (crosspipe.greedy_schedule compiled): same constraints as search_ext
greedy_ext = Extension("titan_ext.plan._greedy_c", [os.path.join("titan_ext", "plan", "_greedy.c")],
                       depends=PLAN_HEADERS, extra_compile_args=["-O2"], libraries=["m"])
# plan PipeMorph generator and plan checks (pipemorph._generate_py, validate's checks 1-3 compiled): same
# constraints as search_ext
generate_ext = Extension("titan_ext.plan._pipemorph_c", [os.path.join("titan_ext", "plan", "_pipemorph.c")],
                         depends=PLAN_HEADERS, extra_compile_args=["-O2"])
ext_modules, cmdclass = [search_ext, greedy_ext, generate_ext], {}
# the C++/CUDA data plane (titan_ext._delegate_C): the CPU source always, the CUDA sources when nvcc and a
# CUDA torch are present, and the headers they include from cpp_ext/ (a change to one rebuilds: depends);
# MANIFEST.in ships all of them in the sdist, whichever the machine that makes it builds
DELEGATE_CPU_SOURCES = [os.path.join("cpp_ext", "delegate_ext.cpp")]
DELEGATE_CUDA_SOURCES = [os.path.join("cpp_ext", f) for f in ("delegate_cuda.cu", "capture_mode.cu")]
DELEGATE_HEADERS = [os.path.join("cpp_ext", h) for h in ("delegate_cuda.h", "capture_mode.h")]


def _cuda_home() -> str | None:
    """CUDA_HOME / CUDA_PATH if set, else the toolkit of the nvcc on PATH, else /usr/local/cuda: the
    first that holds a toolkit (bin/nvcc and include/cuda_runtime_api.h; an nvcc on PATH may be a
    wrapper script outside its toolkit)."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    nvcc = shutil.which("nvcc")
    candidates = [os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))] if nvcc else []
    for home in candidates + ["/usr/local/cuda"]:
        if os.path.exists(os.path.join(home, "bin", "nvcc")) and \
                os.path.exists(os.path.join(home, "include", "cuda_runtime_api.h")):
            return home
    return None


# C++ standard of the extension: torch >= 2.14's headers need C++20, and torch 2.13's own
# cpp_extension builds with C++20 too (its default flag), so one standard for every supported torch.
CXX_STD = "-std=c++20"


#: the GPU architectures built when TORCH_CUDA_ARCH_LIST is not set: A100 (8.0), H100/H200 (9.0), B200 (10.0),
#: and PTX for 10.0 so that a newer GPU JIT-compiles the kernels instead of failing to load them
DEFAULT_CUDA_ARCH_LIST = "8.0;9.0;10.0+PTX"

#: set to 1 to install without the compiled data plane on purpose (delegation must then stay "off")
SKIP_ENV = "TITAN_EXT_NO_DELEGATE_C"

# torch.utils.cpp_extension reads CUDA_HOME at import, and without TORCH_CUDA_ARCH_LIST it asks the
# visible GPUs for their architectures (a crash on a build machine with nvcc and no GPU): set both first.
# A TORCH_CUDA_ARCH_LIST from the environment is honoured as it is.
if _cuda_home() and os.environ.get("TITAN_EXT_NO_CUDA") != "1":
    os.environ.setdefault("CUDA_HOME", _cuda_home())
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCH_LIST)
try:
    import torch
    from torch.utils import cpp_extension
except ImportError:
    torch = None
    if os.environ.get(SKIP_ENV) != "1":
        # pip's default isolated build env has no torch: fail with what to do, never skip silently
        sys.exit("titan_ext: torch is not importable at build time, so titan_ext._delegate_C cannot be built: "
                 "install into an environment that has torch with `pip install --no-build-isolation .` "
                 f"(or set {SKIP_ENV}=1 to install without it; delegation must then stay \"off\")")
    print(f"[titan_ext] {SKIP_ENV}=1 and no torch at build time: titan_ext._delegate_C not built")

if torch is not None:
    here = os.path.dirname(os.path.abspath(__file__))
    nvcc = shutil.which("nvcc") or (
        os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc") if cpp_extension.CUDA_HOME else None)
    with_cuda = bool(torch.version.cuda) and nvcc is not None and os.path.exists(nvcc) \
        and os.environ.get("TITAN_EXT_NO_CUDA") != "1"
    sources = list(DELEGATE_CPU_SOURCES)
    std = CXX_STD
    kwargs = dict(include_dirs=[os.path.join(here, "cpp_ext")], depends=DELEGATE_HEADERS, libraries=["rt"],
                  extra_compile_args={"cxx": ["-O3", std]})
    if with_cuda:
        sources += DELEGATE_CUDA_SOURCES
        kwargs["define_macros"] = [("WITH_CUDA", None)]
        kwargs["extra_compile_args"]["nvcc"] = ["-O3", std]
        ext = cpp_extension.CUDAExtension("titan_ext._delegate_C", sources, **kwargs)
    else:
        kwargs["extra_compile_args"] = kwargs["extra_compile_args"]["cxx"]
        ext = cpp_extension.CppExtension("titan_ext._delegate_C", sources, **kwargs)
    arch = f", TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST')}" if with_cuda else ""
    print(f"[titan_ext] building titan_ext._delegate_C ({'CPU+CUDA' if with_cuda else 'CPU only'}, {std}{arch})")
    ext_modules = [search_ext, greedy_ext, generate_ext, ext]
    cmdclass = {"build_ext": cpp_extension.BuildExtension}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
