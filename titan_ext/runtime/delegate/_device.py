"""Device choices of the delegate data plane (DESIGN.md "GPU rules"; issue 20 defect 7 and "Also").

A local helper until the runtime's device layer exists: every CUDA call of the pool names the stage's
device (an explicit index, resolved once on the constructing thread), from any thread — supervisor
and arrival-watcher threads start on device 0, so a bare ``"cuda"`` there would allocate on GPU 0 of
every rank; and the copy+signal / spin-wait kernels refuse CUDA graph capture.
"""

from __future__ import annotations

import contextlib

import torch


def resolve_device(device) -> torch.device | None:
    """The CUDA device with an explicit index (None for a CPU stage).  ``cuda`` without an index is
    the constructing thread's current device."""
    if device is None:
        return None
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


def on_device(dev: torch.device | None):
    """``torch.cuda.device(dev)`` for a CUDA device, a no-op otherwise (use around every CUDA call)."""
    return torch.cuda.device(dev) if dev is not None else contextlib.nullcontext()


def refuse_capture(what: str) -> None:
    """The delegate kernels bake a flag token and a spin-wait target into each launch; a captured CUDA
    graph would replay stale ones and spin forever — so capture is refused, not recorded."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{what}: the delegate data plane cannot run under CUDA graph capture (its "
                           f"copy+signal and spin-wait kernels carry per-message flag values); run the "
                           f"pipeline's P2P outside the captured region or use direct P2P")
