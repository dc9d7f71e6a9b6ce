"""Device choices of the delegate data plane (DESIGN.md "GPU rules").

The pool makes its device and stream choices through the runtime's device layer
(:mod:`titan_ext.runtime.device`): every CUDA call runs under the layer's ``context()`` (the stage's
device, an explicit index, from any thread — supervisor and arrival-watcher threads start on device 0,
so a bare ``"cuda"`` there would allocate on GPU 0 of every rank), and its copy streams are the layer's
named streams, one per direction.  Capture is refused here: the copy+signal and spin-wait kernels carry
per-message flag values that a replayed CUDA graph would repeat.
"""

from __future__ import annotations

import torch

from titan_ext.runtime.device import CudaDevice, DeviceLayer

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
