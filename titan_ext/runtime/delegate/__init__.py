"""Delegate data plane (PipeMorph §5): host-staged P2P through delegate processes.

* :mod:`.ring` — pinned shared-memory slot rings and their flags (compiled part in cpp_ext/).
* :mod:`.pool` — delegate processes per communication kind and the training side's send/recv.
* :mod:`.recovery` — a killed delegate: exact fallback to the direct path, respawn, return.
* :mod:`.transport` — direct / delegate / failover transports with one ``isend``/``irecv`` API,
  and the delegation mode (off / auto / always).
* :mod:`.schedule` — delegation as a transport choice of the adaptive schedules (PipeMorph, CrossPipe).

User documentation: docs/delegate.md.
"""

from .pool import Channel, DelegateError, DelegatePool, delegates_needed, pipeline_channels, store_address
from .ring import our_shm_names, sweep_stale_segments
from .transport import FaultInjector, P2PRouter

__all__ = [
    "Channel",
    "DelegateError",
    "DelegatePool",
    "FaultInjector",
    "P2PRouter",
    "delegates_needed",
    "our_shm_names",
    "pipeline_channels",
    "store_address",
    "sweep_stale_segments",
]
