"""How the executor talks: the transport of one SEND_*/RECV_* action's point-to-point ops.

"What to compute" (the plan) is kept apart from "how to talk" (the transport), as in torch's
pipelining: the executor hands each lowered SEND_F / SEND_B / RECV_F / RECV_B action's
``dist.P2POp`` list to a :class:`Transport`.  :class:`TorchP2P` is torch's own path; the delegation
data plane (``titan_ext.runtime.comm.delegate.schedule.DelegateTransport``, PipeMorph §5.2) is another, and
works under every planner.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch.distributed as dist
from torch.distributed.pipelining import schedules as _torch_schedules
from torch.distributed.pipelining.schedules import _Action

__all__ = ["TorchP2P", "Transport"]


class Transport(Protocol):
    """``issue(action, ops)`` starts the ops and returns handles with ``wait()``; after a receive's
    ``wait()`` its data is in the ops' tensors.  ``close()`` releases what the transport holds."""

    def issue(self, action: _Action, ops: list[dist.P2POp]) -> list[Any]: ...

    def close(self) -> None: ...


class TorchP2P:
    """torch's ``schedules._batch_p2p`` on the PP data group (looked up at call time, so link-delay
    injection, which wraps it, applies)."""

    def issue(self, action: _Action, ops: list[dist.P2POp]) -> list[Any]:  # noqa: ARG002
        return _torch_schedules._batch_p2p(ops)

    def close(self) -> None:
        pass
