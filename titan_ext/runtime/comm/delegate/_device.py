"""Device choices of the delegate data plane (DESIGN.md "GPU rules").

The pool makes its device and stream choices through the runtime's device layer
(:mod:`titan_ext.runtime.execute.device`): every CUDA call runs under the layer's ``context()`` (the stage's
device, an explicit index, from any thread — supervisor and arrival-watcher threads start on device 0,
so a bare ``"cuda"`` there would allocate on GPU 0 of every rank), and its copy streams are the layer's
named streams, one per direction.  Capture is refused here: the copy+signal and spin-wait kernels carry
per-message flag values that a replayed CUDA graph would repeat.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from ...execute.device import CudaDevice, DeviceLayer, thread_device

D2H_STREAM, H2D_STREAM = "delegate-d2h", "delegate-h2d"


def layer_for(device) -> DeviceLayer | None:
    """The CUDA device layer the pool uses (None for a CPU stage).  ``device``: a device layer (the
    executor's), a device, or None; ``cuda`` without an index is the constructing thread's device."""
    if isinstance(device, DeviceLayer):
        return device if device.device.type == "cuda" else None
    if device is None or torch.device(device).type != "cuda":
        return None
    dev = torch.device(device)
    return CudaDevice(dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device()))


def refuse_capture(what: str) -> None:
    """The delegate kernels bake a flag token and a spin-wait target into each launch; a captured CUDA
    graph would replay stale ones and spin forever — so capture is refused, not recorded."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{what}: the delegate data plane cannot run under CUDA graph capture (its "
                           f"copy+signal and spin-wait kernels carry per-message flag values); run the "
                           f"pipeline's P2P outside the captured region or use direct P2P")


def side_context(layer: DeviceLayer | None) -> Callable[[], Any]:
    """A context factory for the pool's side threads (arrival watchers, the supervisor, the send and
    receive pumps), **captured on the calling thread** — the training thread, which builds the pool:
    the training thread's device as :func:`titan_ext.runtime.execute.device.thread_device` gives it (its device
    guard and thread-local capture mode, as ProcessGroupNCCL's watchdog takes before each query), then
    the stage's device layer's context (an explicit device index).  A thread that never selected its
    device runs CUDA calls on device 0 and opens a context there."""
    owner = thread_device()
    stage = layer.context if layer is not None else contextlib.nullcontext

    @contextlib.contextmanager
    def context() -> Any:
        with owner(), stage():
            yield

    return context


#: the stream wait of a simulated device that runs behind the host: a CPU test's device simulation
#: registers it while installed (:func:`register_stream_wait`); the runtime names no test module
_STREAM_WAIT: list[Callable[[Callable[[], bool], str], None]] = []


def register_stream_wait(wait: Callable[[Callable[[], bool], str], None] | None) -> None:
    """Install (None: remove) ``wait(landed, name)``: enqueue on the calling thread's current stream a
    wait until ``landed()``.  The lagging device of the tests (``testing/lagdevice.py``) registers its
    own while installed, so a delegate receive's consumer wait stalls that device's stream as
    ``cudaStreamWaitEvent`` stalls a GPU's."""
    _STREAM_WAIT[:] = [] if wait is None else [wait]


def stream_wait() -> Callable[[Callable[[], bool], str], None] | None:
    """The registered stream wait (:func:`register_stream_wait`), else None: the host is the device."""
    return _STREAM_WAIT[0] if _STREAM_WAIT else None
