"""PP messages between ranks that share one GPU, staged through host memory on gloo.

NCCL refuses two ranks on one device ("Duplicate GPU detected"), and gloo's point-to-point ops read
and write host memory only. The GPU machines this project gets have one GPU, so to run the whole
runtime there — our schedules and torch's own, 2 and 4 ranks, CUDA stages — this module wraps torch's
``schedules._batch_p2p`` (the one function every pipelining schedule sends and receives through, as
link-delay injection does) so that an op on a CUDA tensor travels as a host copy on the same gloo
group and peer: a send copies device → host and gloo-sends the copy; a receive gloo-receives into a
host buffer and its ``wait()`` copies it onto the device tensor, on the current stream, before the
consumer runs.  Host tensors pass through unchanged.  An op whose peer is this rank (torch 2.11's
start-up handshake of ScheduleZBVZeroBubble sends from the V's turn stage to its neighbour on the same
rank, which NCCL allows and gloo refuses: "Pair is not connected") is matched in place
(``_torch_compat.match_self_p2p``).

It is a test and benchmark transport (``scripts/gpu_tier.py``), not a production path: the copies
are blocking (the host waits for the device at each send), which a real job's NCCL groups or the
delegates (``runtime/comm/delegate/``, pinned slots with async copies and signal flags) avoid.  Install it
before link-delay injection, so the injector's stamps travel through it too.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from titan_ext.runtime._torch_compat import is_send, match_self_p2p, p2p_peer

__all__ = ["HostStagedP2P"]


class _StagedSend:
    """A gloo send of a host copy (kept alive until the send completes)."""

    __slots__ = ("work", "host")

    def __init__(self, work: Any, host: torch.Tensor):
        self.work, self.host = work, host

    def wait(self, timeout: Any = None) -> bool:
        return self.work.wait(timeout) if timeout is not None else self.work.wait()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


class _StagedRecv:
    """A gloo receive into a host buffer; ``wait()`` lands it on the device tensor."""

    __slots__ = ("work", "host", "target", "landed")

    def __init__(self, work: Any, host: torch.Tensor, target: torch.Tensor):
        self.work, self.host, self.target, self.landed = work, host, target, False

    def wait(self, timeout: Any = None) -> bool:
        ok = self.work.wait(timeout) if timeout is not None else self.work.wait()
        if not self.landed:
            # torch's receive buffers require grad (a leaf: only an in-place copy without autograd)
            on_device = torch.cuda.device(self.target.device) if self.target.is_cuda else contextlib.nullcontext()
            with on_device, torch.no_grad():
                self.target.copy_(self.host)
            self.landed = True
        return ok

    def __getattr__(self, name: str) -> Any:  # is_completed, get_future, exception ...: the gloo work's
        return getattr(self.work, name)


class HostStagedP2P:
    """Context manager / installer of the host-staged ``_batch_p2p`` (see the module docstring)."""

    def __init__(self, staged: tuple[str, ...] = ("cuda",)) -> None:
        """``staged``: the device types whose tensors are staged (a test stages "cpu" too)."""
        self._orig: Any = None
        self._staged = staged

    def batch_p2p(self, p2p_ops: list, desc: str | None = None) -> list:  # noqa: ARG002 - torch's signature
        done = match_self_p2p(p2p_ops, dist.get_rank())
        works: list = [done.get(i) for i in range(len(p2p_ops))]
        for i, op in enumerate(p2p_ops):
            if i in done:
                continue
            tensor, peer = op.tensor, p2p_peer(op)
            if tensor.device.type not in self._staged:
                works[i] = op.op(tensor, peer, op.group, op.tag)
            elif is_send(op):
                host = tensor.detach().to("cpu", copy=True)
                works[i] = _StagedSend(dist.isend(host, peer, op.group, op.tag), host)
            else:
                host = torch.empty(tensor.shape, dtype=tensor.dtype)
                works[i] = _StagedRecv(dist.irecv(host, peer, op.group, op.tag), host, tensor)
        return works

    def install(self) -> "HostStagedP2P":
        from torch.distributed.pipelining import schedules

        if self._orig is None:
            self._orig = schedules._batch_p2p
            schedules._batch_p2p = self.batch_p2p
        return self

    def remove(self) -> None:
        from torch.distributed.pipelining import schedules

        if self._orig is not None and schedules._batch_p2p == self.batch_p2p:
            schedules._batch_p2p = self._orig
        self._orig = None

    def __enter__(self) -> "HostStagedP2P":
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.remove()
