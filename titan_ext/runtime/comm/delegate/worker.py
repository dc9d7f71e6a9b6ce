"""A delegate process: moves one lane's messages between its shared-memory ring and Gloo.

Started by :class:`~titan_ext.runtime.comm.delegate.pool.DelegatePool` as
``python -m titan_ext.runtime.comm.delegate.worker ...`` with the ring's file descriptor inherited.
A *send* delegate (Gloo rank 0 of its lane) waits for READY slots in ring order and sends each
message's header and payload straight from the slot (zero-copy); a *recv* delegate (Gloo rank 1)
eagerly receives into FREE slots in ring order, marks them READY and then acknowledges the message's
sequence number back over the same pair (tag 2).  A thread of the send delegate receives those
acknowledgements and publishes the last one in its ring (``CTRL_ACKED``): the training process keeps
each message it handed over until then, so a lane that dies can be replayed exactly on the direct path
(docs/delegate.md, "Killed delegate").  The acknowledgement receive is always posted, so either end
of a lane notices at once when the other end's connection closes.

The delegate dies with its training process (PR_SET_PDEATHSIG=SIGKILL, plus a parent-pid check), and
on any failure writes the error text into the ring's control block and exits non-zero.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta


def _parse(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--slots", type=int, required=True)
    p.add_argument("--slot-bytes", type=int, required=True)
    p.add_argument("--role", choices=("send", "recv"), required=True)
    p.add_argument("--store-host", required=True)
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--gpu-flags", action="store_true", help="slot flags are also written by the GPU (poll)")
    return p.parse_args(argv)


ACK_TAG = 2


def main(argv=None) -> int:
    args = _parse(argv)
    from ._ext import load_ext

    ext = load_ext()
    ext.set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != args.parent:  # the parent died before prctl took effect
        return 4
    # SIGTERM keeps its default action: a Python handler would not run while Gloo blocks in C++.

    import torch
    import torch.distributed as dist

    from . import ring as R

    lane = R.SlotRing.attach(args.fd, args.slots, args.slot_bytes)
    os.close(args.fd)
    region = lane.region
    threading.Thread(target=_heartbeat, args=(region,), daemon=True, name="titan_ext-delegate-heartbeat").start()
    try:
        store = dist.TCPStore(args.store_host, args.store_port, is_master=False,
                              timeout=timedelta(seconds=args.timeout_s))
        prefixed = dist.PrefixStore(args.prefix, store)
        rank = 0 if args.role == "send" else 1
        # An idle lane may wait for its next message indefinitely: no Gloo timeout on the data path.
        # A dead peer shows up at once as a closed connection; the training side owns the timeouts.
        pg = dist.ProcessGroupGloo(prefixed, rank, 2, timedelta(days=7))
        region.store(R.CTRL_DELEGATE_STATE, 1)
        sleep_us = 50 if args.gpu_flags else 2000
        if args.role == "send":
            threading.Thread(target=_ack_loop, args=(lane, pg, args.prefix), daemon=True,
                             name="titan_ext-delegate-acks").start()
            _send_loop(lane, pg, args.parent, sleep_us)
        else:
            _recv_loop(lane, pg, args.parent, sleep_us)
        region.store(R.CTRL_DELEGATE_STATE, 2)
        return 0
    except BaseException as exc:  # noqa: BLE001 - reported through the ring, then exit non-zero
        lane.set_error(f"{args.role} delegate (pid {os.getpid()}, lane {args.prefix}) failed: "
                       f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}")
        return 3


def _heartbeat(region) -> None:
    """Tick CTRL_HEARTBEAT every HEARTBEAT_S: the trainer's supervisor treats a delegate whose ticks
    stop (SIGSTOP, a hang that holds the interpreter) like a dead one (recovery.py)."""
    from . import ring as R

    while True:
        region.add64(R.CTRL_HEARTBEAT, 1)
        time.sleep(R.HEARTBEAT_S)


def _ack_loop(lane, pg, prefix) -> None:
    """Send delegate: publish the peer's acknowledgements in the ring; a closed connection (the peer
    delegate died) fails this delegate at once, even while it has nothing to send."""
    import torch

    from . import ring as R

    buf = torch.empty(1, dtype=torch.int64)
    try:
        while True:
            pg.recv([buf], 1, ACK_TAG).wait()
            lane.region.store64(R.CTRL_ACKED, int(buf[0]))
    except BaseException as exc:  # noqa: BLE001 - reported through the ring
        if lane.region.load(R.CTRL_STOP):
            os._exit(0)
        lane.set_error(f"send delegate (pid {os.getpid()}, lane {prefix}) lost its peer: {type(exc).__name__}: {exc}")
        os._exit(3)


def _alive(parent: int) -> bool:
    return os.getppid() == parent


def _send_loop(lane, pg, parent, sleep_us) -> None:
    from . import ring as R

    r = lane.region
    i = 0
    while True:
        while True:  # wait for the next slot in ring order
            rc = lane.wait_state(i, R.READY, 0.5, R.CTRL_STOP, sleep_us)
            if rc == 0:
                break
            if rc == 2 and lane.state(i) != R.READY:
                return  # stop requested and nothing left to send
            if not _alive(parent):
                return
        lane.set_state(i, R.BUSY, wake=False)
        seq, nbytes, _, _ = lane.read_header(i)
        wait_ns = lane.due_ns(i) - time.monotonic_ns()
        if wait_ns > 0:  # an injected delay of this link (ring.H_DUE_NS): a one-way latency, pipelined
            time.sleep(wait_ns / 1e9)
        t0 = time.perf_counter_ns()
        pg.send([lane.header_bytes[i]], 1, 0).wait()
        if nbytes:
            pg.send([lane.payload(i, nbytes)], 1, 1).wait()
        r.add64(R.CTRL_BUSY_NS, time.perf_counter_ns() - t0)
        r.add64(R.CTRL_BYTES, nbytes)
        r.add64(R.CTRL_MESSAGES, 1)
        lane.set_state(i, R.FREE)
        i = (i + 1) % lane.num_slots


def _recv_loop(lane, pg, parent, sleep_us) -> None:
    from . import ring as R

    import torch

    r = lane.region
    ack = torch.empty(1, dtype=torch.int64)
    i = 0
    while True:
        while True:
            rc = lane.wait_state(i, R.FREE, 0.5, R.CTRL_STOP, sleep_us)
            if rc == 0:
                break
            if rc == 2 or not _alive(parent):
                return
        lane.set_state(i, R.WRITING, wake=False)
        pg.recv([lane.header_bytes[i]], 0, 0).wait()
        t1 = time.perf_counter_ns()  # idle time waiting for the peer is not throughput
        nbytes = int(lane.headers[i][R.H_NBYTES])
        if nbytes > lane.slot_bytes:
            raise RuntimeError(f"incoming message of {nbytes} bytes exceeds slot size {lane.slot_bytes}")
        if nbytes:
            pg.recv([lane.payload(i, nbytes)], 0, 1).wait()
        r.add64(R.CTRL_BUSY_NS, time.perf_counter_ns() - t1)
        r.add64(R.CTRL_BYTES, nbytes)
        r.add64(R.CTRL_MESSAGES, 1)
        ack[0] = int(lane.headers[i][R.H_SEQ])
        lane.set_state(i, R.READY)
        pg.send([ack], 0, ACK_TAG).wait()  # after READY: whatever is acknowledged is in the ring
        i = (i + 1) % lane.num_slots


if __name__ == "__main__":
    sys.stdout.flush()
    os._exit(main())  # no interpreter teardown under the acknowledgement thread's pending receive
