"""Every Python binding of titan_ext._delegate_C fits its call sites (defect 1; no GPU needed).

The C++ source is parsed (CUDA-only bindings included), cross-checked against the compiled module's
pybind11 signatures (the CPU build here; the CUDA build under scripts/check_cuda_build.sh, which points
TITAN_EXT_DELEGATE_C at it), and every call site in titan_ext/ is checked against it (tests/_bindings.py).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import subprocess

import pytest

import _bindings as B


def _compiled():
    """The module to cross-check: TITAN_EXT_DELEGATE_C (a built .so) or the in-tree build."""
    import torch  # noqa: F401  (the extension links against libtorch)

    path = os.environ.get("TITAN_EXT_DELEGATE_C")
    if not path:
        from titan_ext.runtime.comm.delegate._ext import load_ext

        return load_ext()
    loader = importlib.machinery.ExtensionFileLoader("titan_ext._delegate_C", path)
    spec = importlib.util.spec_from_file_location("titan_ext._delegate_C", path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def test_source_bindings_match_compiled_module():
    bindings = B.parse_cpp()
    mod = _compiled()
    sigs = B.compiled_signatures(mod)
    with_cuda = bool(mod.cuda_compiled())
    if os.environ.get("TITAN_EXT_EXPECT_CUDA") == "1":
        assert with_cuda, "the module under test was built without CUDA"
    expected = {k for k, b in bindings.items() if with_cuda or not b.cuda}
    assert set(sigs) == expected, f"bound in the module but not parsed, or the reverse: {set(sigs) ^ expected}"
    for key, (params, self_kind) in sigs.items():
        b = bindings[key]
        assert [k for _, k in params] == [k for _, k in b.params], f"{key}: module {params} vs source {b.params}"
        if not all(n.startswith("arg") for n, _ in params):
            assert [n for n, _ in params] == [n for n, _ in b.params], key
        assert self_kind == b.self_kind, key


def test_every_call_site_fits_its_binding():
    bindings = B.parse_cpp()
    calls = B.call_sites(bindings)
    problems, checked, unknown = B.check_calls(bindings, calls)
    assert not problems, "\n".join(problems)
    used = {c.name for c in calls}
    # the scan sees the CUDA data path too (not vacuous): its calls and all their arguments are typed
    assert {"d2h_signal", "h2d_signal", "stream_wait_flag", "cuda_register", "wait", "tensor"} <= used
    cuda_calls = [c for c in calls if bindings[(c.scope, c.name)].cuda]
    assert all(None not in c.args for c in cuda_calls), [c.text for c in cuda_calls if None in c.args]
    assert checked >= 3 * unknown, (checked, unknown)


@pytest.mark.multiprocess
def test_the_check_finds_the_d2h_signal_bug_of_a01ec7e(tmp_path):
    """The binding of a01ec7e (Tensor first, bound as a Region method) is reported at its call site."""
    root = B.ROOT
    try:
        old = subprocess.run(["git", "-C", root, "show", "a01ec7e:cpp_ext/delegate_ext.cpp"], check=True,
                             capture_output=True, text=True).stdout
    except (subprocess.CalledProcessError, FileNotFoundError):
        pytest.skip("git history of a01ec7e not available")
    p = tmp_path / "delegate_ext.cpp"
    p.write_text(old)
    bindings = B.parse_cpp(str(p))
    problems, _, _ = B.check_calls(bindings, B.call_sites(bindings))
    assert any("d2h_signal" in m and "Tensor first" in m for m in problems), problems
    assert any("is Tensor, d2h_signal expects Region" in m for m in problems), problems


def test_checker_catches_arity_keyword_and_type_mistakes():
    bindings = B.parse_cpp()
    calls = [B.Call("x:1", "Region", "wait", [B.INT, B.INT, B.FLOAT, B.INT, B.INT, B.INT], {}, "too many"),
             B.Call("x:2", "Region", "store", [B.INT], {"valu": B.INT}, "bad keyword"),
             B.Call("x:3", "Region", "tensor", [B.TENSOR, B.INT], {}, "tensor as offset"),
             B.Call("x:4", "module", "d2h_signal", [B.TENSOR, B.INT, B.INT, B.INT], {}, "method as function"),
             B.Call("x:5", "Region", "load", [B.INT], {}, "fine")]
    problems, _, _ = B.check_calls(bindings, calls)
    assert [p.split(":")[1] for p in problems] == ["1", "2", "2", "3", "4"], problems
