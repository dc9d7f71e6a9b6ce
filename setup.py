"""Build of titan_ext's compiled parts: the C++/CUDA data plane (cpp_ext/ -> titan_ext._delegate_C)
and the CrossPipe planner's search engine (titan_ext/plan/_search.c -> titan_ext.plan._search_c; plain
C and the CPython API, built with or without torch; the planner falls back to pure Python without it).

Everything else lives in pyproject.toml. Installed by scripts/setup.sh with
`pip install --no-build-isolation -e .` so the extension compiles against the torch already in the
environment (an isolated build env would pull a multi-GB CUDA torch). CPU sources always; the CUDA
sources only when nvcc and a CUDA torch are both present.
"""
import os
import shutil

from setuptools import Extension, setup

# plan search engine: no torch, no numpy (titan_ext.plan stays importable without them)
search_ext = Extension("titan_ext.plan._search_c", [os.path.join("titan_ext", "plan", "_search.c")],
                       extra_compile_args=["-O2"], libraries=["m"])
# plan greedy generator (crosspipe.greedy_schedule compiled): same constraints as search_ext
greedy_ext = Extension("titan_ext.plan._greedy_c", [os.path.join("titan_ext", "plan", "_greedy.c")],
                       extra_compile_args=["-O2"], libraries=["m"])
# plan PipeMorph generator and plan checks (pipemorph._generate_py, validate's checks 1-3 compiled): same
# constraints as search_ext
generate_ext = Extension("titan_ext.plan._pipemorph_c", [os.path.join("titan_ext", "plan", "_pipemorph.c")],
                         extra_compile_args=["-O2"])
ext_modules, cmdclass = [search_ext, greedy_ext, generate_ext], {}
try:
    import torch
    from torch.utils import cpp_extension
except ImportError:  # an isolated build env without torch: the pure-Python parts still install
    torch = None
    print("[titan_ext] torch not importable at build time: titan_ext._delegate_C NOT built "
          "(install with scripts/setup.sh, which uses --no-build-isolation)")

if torch is not None:
    here = os.path.dirname(os.path.abspath(__file__))
    src = os.path.join("cpp_ext")
    nvcc = shutil.which("nvcc") or (
        os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc") if cpp_extension.CUDA_HOME else None)
    with_cuda = bool(torch.version.cuda) and nvcc is not None and os.path.exists(nvcc) \
        and os.environ.get("TITAN_EXT_NO_CUDA") != "1"
    sources = [os.path.join(src, "delegate_ext.cpp")]
    kwargs = dict(include_dirs=[os.path.join(here, src)], libraries=["rt"],
                  extra_compile_args={"cxx": ["-O3", "-std=c++17"]})
    if with_cuda:
        sources.append(os.path.join(src, "delegate_cuda.cu"))
        kwargs["define_macros"] = [("WITH_CUDA", None)]
        kwargs["extra_compile_args"]["nvcc"] = ["-O3"]
        ext = cpp_extension.CUDAExtension("titan_ext._delegate_C", sources, **kwargs)
    else:
        kwargs["extra_compile_args"] = kwargs["extra_compile_args"]["cxx"]
        ext = cpp_extension.CppExtension("titan_ext._delegate_C", sources, **kwargs)
    print(f"[titan_ext] building titan_ext._delegate_C ({'CPU+CUDA' if with_cuda else 'CPU only'})")
    ext_modules = [search_ext, greedy_ext, generate_ext, ext]
    cmdclass = {"build_ext": cpp_extension.BuildExtension}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
