"""PP messages between ranks that share one GPU, staged through host memory on gloo.

NCCL refuses two ranks on one device ("Duplicate GPU detected"), and gloo's point-to-point ops read
and write host memory only. The GPU machines this project gets have one GPU, so to run the whole
runtime there — our schedules and torch's own, 2 and 4 ranks, CUDA stages — this module wraps torch's
``schedules._batch_p2p`` (the one function every pipelining schedule sends and receives through, as
link-delay injection does) so that an op on a CUDA tensor travels as a host copy on the same gloo
group and peer: a send copies device → host and gloo-sends the copy; a receive gloo-receives into a
host buffer and its ``wait()`` copies it onto the device tensor, on the current stream, before the
consumer runs.  Host tensors pass through unchanged.

It is a test and benchmark transport (``scripts/gpu_tier.py``), not a production path: the copies
are blocking (the host waits for the device at each send), which a real job's NCCL groups or the
delegates (``runtime/delegate/``, pinned slots with async copies and signal flags) avoid.  Install it
before link-delay injection, so the injector's stamps travel through it too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["HostStagedP2P"]


def _is_send(op: Any) -> bool:
    return getattr(op.op, "__name__", "") == "isend"


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
            with torch.cuda.device(self.target.device):
                self.target.copy_(self.host)
            self.landed = True
        return ok

    def __getattr__(self, name: str) -> Any:  # is_completed, get_future, exception ...: the gloo work's
        return getattr(self.work, name)


class HostStagedP2P:
    """Context manager / installer of the host-staged ``_batch_p2p`` (see the module docstring)."""

    def __init__(self) -> None:
        self._orig: Any = None

    def batch_p2p(self, p2p_ops: list, desc: str | None = None) -> list:  # noqa: ARG002 - torch's signature
        works = []
        for op in p2p_ops:
            tensor = op.tensor
            if tensor.device.type != "cuda":
                works.append(op.op(tensor, op.peer, op.group, op.tag))
            elif _is_send(op):
                host = tensor.detach().to("cpu")
                works.append(_StagedSend(dist.isend(host, op.peer, op.group, op.tag), host))
            else:
                host = torch.empty(tensor.shape, dtype=tensor.dtype)
                works.append(_StagedRecv(dist.irecv(host, op.peer, op.group, op.tag), host, tensor))
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
