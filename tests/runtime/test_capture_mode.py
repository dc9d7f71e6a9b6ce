"""Side-thread device calls under thread-local CUDA-graph capture mode.

ProcessGroupNCCL's watchdog takes ``CUDAStreamCaptureModeGuard{cudaStreamCaptureModeThreadLocal}`` before
it queries a work from its side thread; no Python API sets the mode, so the delegate extension binds
``cudaThreadExchangeStreamCaptureMode`` in its CUDA build (cpp_ext/capture_mode.cu, ``capture_mode_exchange``)
and ``device.thread_device()`` enters it through ``device._capture_mode_guard``.  On CPU: the binding is
absent exactly in a CPU build, the guard is a no-op there, and with a stand-in binding it sets the mode and
restores the previous one; with a GPU and a CUDA build the binding itself is exercised.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from types import SimpleNamespace

import pytest
import torch

from titan_ext.runtime.execute import device


def _ext():
    from titan_ext.runtime.comm.delegate._ext import load_ext

    try:
        return load_ext()
    except ImportError as exc:
        pytest.skip(f"titan_ext._delegate_C not built: {exc}")


def test_the_binding_exists_exactly_in_a_cuda_build():
    mod = _ext()
    cuda = bool(mod.cuda_compiled())
    assert hasattr(mod, "capture_mode_exchange") is cuda
    assert hasattr(mod, "CAPTURE_MODE_THREAD_LOCAL") is cuda
    if cuda:
        assert mod.CAPTURE_MODE_THREAD_LOCAL == 1  # cudaStreamCaptureModeThreadLocal (driver_types.h)


def test_without_the_binding_the_guard_is_a_no_op():
    if bool(_ext().cuda_compiled()):
        pytest.skip("a CUDA build: the binding is there")
    guard = device._capture_mode_guard()
    assert isinstance(guard, contextlib.nullcontext)
    with guard:
        pass


def test_the_guard_sets_thread_local_mode_and_restores_the_previous_one(monkeypatch):
    """With a binding (a stand-in here: the CPU build has none), the guard exchanges the calling thread's
    mode for thread-local on entry and puts the previous one back on exit, also when the body raises."""
    modes = threading.local()
    calls = []

    def exchange(mode: int) -> int:
        calls.append(mode)
        previous = getattr(modes, "mode", 0)  # cudaStreamCaptureModeGlobal: every thread's default
        modes.mode = mode
        return previous

    fake = SimpleNamespace(capture_mode_exchange=exchange, CAPTURE_MODE_THREAD_LOCAL=1)
    monkeypatch.setitem(sys.modules, "titan_ext._delegate_C", fake)
    inside = []
    with pytest.raises(ZeroDivisionError):
        with device._capture_mode_guard():
            inside.append(modes.mode)
            1 / 0  # noqa: B018
    assert inside == [1] and calls == [1, 0] and modes.mode == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_a_side_thread_enters_and_leaves_thread_local_mode():
    mod = _ext()
    if not mod.cuda_compiled():
        pytest.skip("a CPU build of the extension")
    torch.cuda.init()
    factory = device.thread_device()  # the training thread's device, with the capture-mode guard
    seen = []

    def side():
        with factory():
            seen.append(mod.capture_mode_exchange(mod.CAPTURE_MODE_THREAD_LOCAL))  # inside: thread-local
        seen.append(mod.capture_mode_exchange(0))  # after: restored to global (0)

    t = threading.Thread(target=side)
    t.start()
    t.join()
    assert seen == [mod.CAPTURE_MODE_THREAD_LOCAL, 0], seen
