"""Delegate data plane (PipeMorph §5): host-staged P2P through delegate processes.

* :mod:`.ring` — pinned shared-memory slot rings and their flags (compiled part in cpp_ext/).
* :mod:`.pool` — ``DelegatePool``: one training rank's delegates and its send/recv API, composed of
  :mod:`.lanes` (delegate processes and their rings), :mod:`.sendpath` (into the rings),
  :mod:`.recvpath` (receive matching by sequence number) and :mod:`.recovery` (lane health; a killed or
  frozen delegate: exact fallback to the direct path, respawn, return); :mod:`.link` is their shared
  vocabulary (no part imports another part's module but lanes/link).
* :mod:`.transport` — direct / delegate / failover transports with one ``isend``/``irecv`` API,
  and the delegation mode (off / auto / always).
* :mod:`.schedule` — delegation as a transport choice of the adaptive schedules (PipeMorph, CrossPipe),
  and the step-level failover of an NCCL PP group (``StepFailover``: the failure agreed at the end of the
  step, every link moved to the delegates, the step re-run from its start).

User documentation: docs/delegate.md.
"""

from .pool import Channel, DelegateError, DelegatePool, delegates_needed, pipeline_channels, store_address
from .ring import our_shm_names, sweep_stale_segments
from .transport import Faults, P2PRouter

__all__ = [
    "Channel",
    "DelegateError",
    "DelegatePool",
    "Faults",
    "P2PRouter",
    "delegates_needed",
    "our_shm_names",
    "pipeline_channels",
    "store_address",
    "sweep_stale_segments",
]
