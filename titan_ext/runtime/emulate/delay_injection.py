"""Straggler emulation: per-link one-way latency and bandwidth cap on the real PP messages.

Model (DESIGN.md "Timing model", CrossPipe §4.2.3 α-β with link occupancy, PipeMorph §3/§7 injected
delays): the planner's, ``plan.timing.LinkQueues`` (:meth:`~titan_ext.plan.timing.LinkQueues.send_timed`:
each message with the latency and bandwidth the spec gives its link at hand-over).  Link ``i`` joins PP
ranks ``i`` and ``i+1`` (``plan.placement.rank_link``, the planner's rule: the wrap-around pair
``(P-1, 0)`` of looped schedules with P ≥ 3 is no link of the model, so its messages are never delayed —
docs/ARCHITECTURE.md "Decisions recorded here").  A message of ``size`` bytes handed to the transport at
time ``t`` on link ``i`` in one direction starts transmission at ``start = max(t, link_free)``, occupies
the link (that direction) until ``start + size/bandwidth``, and cannot be received before

    ``arrival = start + size / bandwidth + latency``

nor before the message sent before it in that direction (FIFO delivery, when a trace lowers the latency).

Mechanism: *receiver-side arrival*, keeping NCCL's rules and CUDA's.
The injector replaces ``torch.distributed.pipelining.schedules._batch_p2p`` — the single function
through which every torch pipelining schedule (``ScheduleGPipe``, ``Schedule1F1B``,
``_PipelineScheduleRuntime`` subclasses, PipeMorph) issues its PP sends and receives.  Every op is
issued at once, from the calling thread, in the schedule's order and inside the schedule's own batch
(torch's ``batch_isend_irecv`` groups stay whole and carry nothing but the schedule's tensors, so
NCCL's pairing holds).  A send on a link the spec names is *stamped*: its hand-over time is when its
data is ready on the device — an event recorded on the producing stream right after the data was
produced (:meth:`~titan_ext.runtime.execute.device.DeviceLayer.mark_ready`; on CPU the host clock at issue is
the device's), read on the host clock by the device layer's event clock once it completed, by the
injector's stamper thread (never the schedule's thread: no host wait, no blocking copy).  The stamper
books the link model with it and publishes the model's ``arrival`` (wall clock) as host data in the
job's ``torch.distributed`` store under the message's sequence number on its rank pair — no device
tensor, no copy, no data-group traffic.  The receiver's handle (:class:`DelayedRecvWork`) completes
no earlier than ``arrival``.  Its stamp is fetched by a helper thread per sending peer
(:class:`_StampReader`): one blocking ``store.wait`` on a private connection (``store.clone()``: a
TCPStore client serialises its calls, so a blocking wait on the shared one would hold every other store
call of the process), then ``get`` and ``delete_key`` — three store requests per receive, where polling
``check`` from ``wait()`` and from every ``is_completed()`` poll cost the store about a thousand
requests a second per pending receive.  ``wait()`` waits for the fetched stamp, sleeps the host until
then and makes the stream wait on the data (``Work.wait()``); ``is_completed()`` (polled by the device
layer's arrival watcher) only looks at the fetched stamp: no store request, never a read of a device
tensor (a ``.item()`` there would queue behind the compute stream and read arrivals late).  A stamp
that cannot be made (the sender's device clock raised in its stamper thread) is published as an error
and raised by the receiver's ``wait()``; one that never comes is waited for at most the PP timeout
(:func:`titan_ext.runtime.comm.timeouts.current_timeout_s`, else the store's): no receive waits without a
deadline, and the stamper thread survives any error.  The sender is never slept, compute is
never slept: only data arrival is delayed, FIFO per link and direction — unless ``hol=True``: then the
thread that issued a delayed send is held until it arrived (NCCL's head-of-line blocking on a slow link,
PipeMorph §3.2: the launch of the next communication blocks the host while the transmission queue is
full; the simulator's ``hol`` rule, under which a rank cannot start its next action before its sends
arrived).  The delay is the link's, not the transport's: a message the delegates carry
(:meth:`LinkDelayInjector.delegated_due_ns`) is sent by its delegate at its model arrival, and there the
trainer is never held.  Both ends of a named link
must run the same spec (links the spec does not name carry no stamps), and the stamp compares wall
clocks, so across hosts the emulation is as exact as their clock sync.

Install with :func:`inject_link_delays` (Python) or the environment variable
``TITAN_EXT_INJECT_DELAYS`` (read when :mod:`titan_ext.runtime` is imported, and by
:func:`install_from_env`).  Spec grammar::

    spec   := item ("," item)*          e.g.  "2:30"  or  "0:10,2:30:100MB/s"  or  "*:5"
    item   := LINK ":" LATENCY_MS [":" BANDWIDTH]
    LINK   := integer >= 0 | "*"        ("*" = every link)
    BANDWIDTH := number unit, unit in B/s KB/s MB/s GB/s Kbit/s Mbit/s Gbit/s (decimal prefixes)

or a trace file (``trace:PATH`` or a path ending in ``.csv``): CSV with a header ``time_s`` followed by
one column per link (``link2`` or ``2``), values = latency in ms from that time on (piecewise constant,
time measured from installation, or from ``t0`` = a ``time.time()`` epoch passed to
:func:`inject_link_delays` so all ranks share an origin).  Optional columns ``link2_bw`` give a bandwidth
cap in bytes/s (empty or ``inf`` = uncapped).

An installed injector is never silent: it logs a WARNING when installed and again every
:data:`WARN_EVERY_S` seconds while it delays messages (a leftover ``TITAN_EXT_INJECT_DELAYS`` would
otherwise slow a real job unnoticed).
"""

from __future__ import annotations

import csv
import io
import logging
import math
import os
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from titan_ext.args import ArgumentTypeError
from titan_ext.plan.placement import rank_link
from titan_ext.plan.timing import LinkQueues, to_ns

ENV_VAR = "TITAN_EXT_INJECT_DELAYS"
MAX_DELAY_MS = 1e9  # a latency above this (11.6 days) is a typo; larger ones overflowed time.sleep
MIN_BANDWIDTH = 1.0  # bytes/s: below, one message's transfer time is beyond any job
MAX_LINK = 1 << 20  # link ids above are typos (a 5,000-digit integer is refused here, not by int())
MAX_TRACE_BYTES = 16 << 20  # a delay trace larger than this is refused (it is read before the job starts)
WARN_EVERY_S = 60.0  # repeat the "injected straggler active" warning this often while it is used
#: a stamp the sender's stamper could not make is published as this prefix + the error (never a number)
STAMP_ERROR = "error:"
#: how long a receive waits for its stamp when neither a PP timeout nor the store's timeout is known
STAMP_WAIT_DEFAULT_S = 300.0
log = logging.getLogger(__name__)

__all__ = [
    "ENV_VAR",
    "DelaySpecError",
    "LinkDelay",
    "DelaySchedule",
    "LinkDelayInjector",
    "parse_delay_spec",
    "load_delay_trace",
    "inject_link_delays",
    "install_from_env",
    "schedule_from_env",
    "current_injector",
    "remove_link_delays",
]


class DelaySpecError(ValueError):
    """A malformed delay spec or trace file; the message names the offending part."""


class DelaySpecTypeError(DelaySpecError, ArgumentTypeError):
    """A delay spec of the wrong type (not text / a DelaySchedule): a TypeError that callers catching
    :class:`DelaySpecError` (a ValueError) still catch."""


@dataclass(frozen=True)
class LinkDelay:
    """Injected impairment of one PP link (both directions)."""

    latency_ms: float = 0.0
    """One-way latency added to every message, milliseconds."""
    bandwidth_bytes_per_s: float = math.inf
    """Transmission rate cap in bytes/s (``inf`` = uncapped); a message occupies the link size/bw."""

    def transfer_ns(self, nbytes: int) -> int:
        """The link's occupancy by an ``nbytes`` message (size/bandwidth, integer ns as ``LinkQueues``)."""
        bw = self.bandwidth_bytes_per_s
        return 0 if math.isinf(bw) else int(round(1e9 * nbytes / bw))

    @property
    def is_zero(self) -> bool:
        return self.latency_ms == 0.0 and math.isinf(self.bandwidth_bytes_per_s)


_BW_UNITS = {
    "b/s": 1.0, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9,
    "bps": 1.0 / 8, "kbit/s": 1e3 / 8, "mbit/s": 1e6 / 8, "gbit/s": 1e9 / 8,
}
_BW_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z/]+)\s*$")


def _parse_bandwidth(text: str, where: str) -> float:
    m = _BW_RE.match(text)
    if not m or m.group(2).lower() not in _BW_UNITS:
        raise DelaySpecError(
            f"{where}: bandwidth {text!r} is not '<number><unit>' with unit one of "
            f"{sorted(_BW_UNITS)} (e.g. '100MB/s')"
        )
    value = float(m.group(1)) * _BW_UNITS[m.group(2).lower()]
    return _check_bandwidth(value, text, where)


def _check_bandwidth(value: float, text: str, where: str) -> float:
    if not (math.isfinite(value) and value >= MIN_BANDWIDTH):
        raise DelaySpecError(f"{where}: bandwidth {text!r} must be > 0 (a finite number of bytes/s >= {MIN_BANDWIDTH:g})")
    return value


def _parse_nonneg_float(text: str, what: str, where: str, upper: float = MAX_DELAY_MS) -> float:
    from titan_ext.args import parse_float

    try:
        value = parse_float(text.strip().removesuffix("ms"), what)
    except ValueError:
        raise DelaySpecError(f"{where}: {what} {text!r} is not a number (ASCII digits)") from None
    if not math.isfinite(value) or value < 0 or value > upper:
        raise DelaySpecError(f"{where}: {what} {text!r} must be a finite number >= 0 (at most {upper:g})")
    return value


def _link_id(text: str, where: str) -> int:
    """A link id: ASCII digits, at most :data:`MAX_LINK`."""
    digits = text.lstrip("0") or "0"
    if not (text.isascii() and text.isdigit()) or len(digits) > 8 or int(digits) > MAX_LINK:
        raise DelaySpecError(f"{where}: link {text!r} is not '*' or an integer in [0, {MAX_LINK}] (ASCII digits)")
    return int(digits)


@dataclass
class DelaySchedule:
    """Per-link delays, possibly changing over time (a trace).

    ``steps`` is a list of ``(time_s, {link: LinkDelay})`` sorted by time; the delays of the last step
    with ``time_s <= now`` apply; links absent from a step have no delay.  ``wildcard`` (link ``*``)
    applies to every link without an explicit entry.
    """

    steps: list[tuple[float, dict[int, LinkDelay]]] = field(default_factory=lambda: [(0.0, {})])
    wildcard: list[LinkDelay | None] = field(default_factory=lambda: [None])
    source: str = ""

    def at(self, elapsed_s: float, link: int) -> LinkDelay:
        idx = 0
        for i, (t, _) in enumerate(self.steps):
            if t <= elapsed_s:
                idx = i
            else:
                break
        delays = self.steps[idx][1]
        if link in delays:
            return delays[link]
        wild = self.wildcard[idx] if idx < len(self.wildcard) else None
        return wild if wild is not None else LinkDelay()

    def max_link(self) -> int:
        return max((link for _, d in self.steps for link in d), default=-1)

    def is_empty(self) -> bool:
        """No delay on any link at any time."""
        return (all(v.is_zero for _, d in self.steps for v in d.values())
                and all(w is None or w.is_zero for w in self.wildcard))

    def describe(self) -> str:
        return self.source


def parse_delay_spec(spec: str) -> DelaySchedule:
    """Parse a static spec (``"2:30"``, ``"0:10,2:30:1GB/s"``, ``"*:5"``) or ``trace:PATH`` / ``*.csv``.

    An empty spec means no delay.  Raises :class:`DelaySpecError` naming the bad item.
    """
    if not isinstance(spec, str):
        raise DelaySpecTypeError(f"delay spec must be a string, got {type(spec).__name__}")
    text = spec.strip()
    if text.startswith("trace:"):
        return load_delay_trace(text[len("trace:"):])
    if text.endswith(".csv"):
        return load_delay_trace(text)
    delays: dict[int, LinkDelay] = {}
    wildcard: LinkDelay | None = None
    if text == "":
        return DelaySchedule(source="")
    for raw in text.split(","):
        item = raw.strip()
        where = f"delay spec {spec!r}, item {item!r}"
        if not item:
            raise DelaySpecError(f"delay spec {spec!r}: empty item (stray comma?)")
        parts = item.split(":")
        if len(parts) not in (2, 3):
            raise DelaySpecError(f"{where}: expected LINK:LATENCY_MS[:BANDWIDTH]")
        link_txt = parts[0].strip()
        latency = _parse_nonneg_float(parts[1], "latency", where)
        bw = _parse_bandwidth(parts[2], where) if len(parts) == 3 else math.inf
        delay = LinkDelay(latency, bw)
        if link_txt == "*":
            if wildcard is not None:
                raise DelaySpecError(f"{where}: link '*' given twice")
            wildcard = delay
            continue
        link = _link_id(link_txt, where)
        if link in delays:
            raise DelaySpecError(f"{where}: link {link} given twice")
        delays[link] = delay
    return DelaySchedule(steps=[(0.0, delays)], wildcard=[wildcard], source=spec)


_LINK_COL = re.compile(r"^(?:link)?([0-9]+)(_bw)?$")


_TRACES: dict[tuple, DelaySchedule] = {}  # parsed traces by (path, inode, size, mtime): read once per process


def load_delay_trace(path: str) -> DelaySchedule:
    """Load a delay trace CSV (header ``time_s,link0,link2,...`` [+ ``linkN_bw``]); see module doc.

    A regular file of at most :data:`MAX_TRACE_BYTES`; parsed once per process (the config check, the
    job check and the installation share the parsed form while the file is unchanged)."""
    path = path.strip()
    from titan_ext.args import regular_file_stat

    st = regular_file_stat(path, MAX_TRACE_BYTES, f"delay trace {path!r}", "CSV", DelaySpecError)
    key = (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    cached = _TRACES.get(key)
    if cached is None:
        cached = _TRACES[key] = _parse_trace(path)
    return DelaySchedule(steps=list(cached.steps), wildcard=list(cached.wildcard), source=cached.source)


def _parse_trace(path: str) -> DelaySchedule:
    from titan_ext.args import read_input_text

    text = read_input_text(path, MAX_TRACE_BYTES, f"delay trace {path!r}", "CSV", DelaySpecError)
    try:
        rows = [r for r in csv.reader(io.StringIO(text, newline="")) if r and any(c.strip() for c in r)]
    except csv.Error as e:
        raise DelaySpecError(f"delay trace {path!r}: {e}") from None
    if not rows:
        raise DelaySpecError(f"delay trace {path!r}: empty file (needs a header 'time_s,link<i>,...')")
    header = [h.strip() for h in rows[0]]
    if header[0] not in ("time_s", "time"):
        raise DelaySpecError(
            f"delay trace {path!r}: first header column is {header[0]!r}, expected 'time_s'"
        )
    columns: list[tuple[int, bool]] = []
    for h in header[1:]:
        m = _LINK_COL.match(h)
        if not m:
            raise DelaySpecError(
                f"delay trace {path!r}: header column {h!r} is not 'link<i>', '<i>' or 'link<i>_bw'"
            )
        columns.append((_link_id(m.group(1), f"delay trace {path!r}, column {h!r}"), m.group(2) is not None))
    if len(set(columns)) != len(columns):
        raise DelaySpecError(f"delay trace {path!r}: duplicate column in header {header}")
    if not columns:
        raise DelaySpecError(f"delay trace {path!r}: header names no link column")
    steps: list[tuple[float, dict[int, LinkDelay]]] = []
    last_t = -math.inf
    for lineno, row in enumerate(rows[1:], start=2):
        where = f"delay trace {path!r}, line {lineno}"
        if len(row) != len(header):
            raise DelaySpecError(f"{where}: {len(row)} fields, header has {len(header)}")
        t = _parse_nonneg_float(row[0], "time_s", where, upper=1e9)
        if t <= last_t:
            raise DelaySpecError(f"{where}: time_s {t} is not increasing (previous {last_t})")
        last_t = t
        lat: dict[int, float] = {}
        bws: dict[int, float] = {}
        for (link, is_bw), cell in zip(columns, row[1:]):
            cell = cell.strip()
            if is_bw:
                if cell in ("", "inf"):
                    continue
                from titan_ext.args import parse_float

                try:
                    value = parse_float(cell, "bandwidth")
                except ValueError:
                    raise DelaySpecError(f"{where}: bandwidth {cell!r} for link {link} is not a number "
                                         f"(ASCII digits)") from None
                bws[link] = _check_bandwidth(value, cell, f"{where}, link {link}")
            else:
                lat[link] = _parse_nonneg_float(cell, f"latency of link {link}", where) if cell else 0.0
        step = {
            link: LinkDelay(lat.get(link, 0.0), bws.get(link, math.inf))
            for link in set(lat) | set(bws)
        }
        steps.append((t, step))
    if not steps:
        raise DelaySpecError(f"delay trace {path!r}: header only, no rows")
    if steps[0][0] > 0:
        steps.insert(0, (0.0, {}))
    return DelaySchedule(steps=steps, wildcard=[None] * len(steps), source=f"trace:{path}")


class _Stamp:
    """One receive's arrival stamp, fetched by a :class:`_StampReader` thread: ``ready`` is set once
    ``value`` (the sender's model arrival, wall clock) or ``error`` is there."""

    __slots__ = ("key", "value", "error", "ready")

    def __init__(self, key: str):
        self.key, self.value, self.error = key, math.nan, None
        self.ready = threading.Event()


class _StampReader:
    """Fetches the arrival stamps of this process's delayed receives from the store: one daemon thread
    per sending peer (``titan_ext/delay/SRC->DST``), in the pair's issue order — the order in which the
    sender's stamper publishes them.  Per stamp: a blocking ``wait`` (bounded by :func:`_stamp_limit_s`),
    ``get``, ``delete_key`` on the thread's own connection (``store.clone()``), so the wait holds no other
    thread's store call (a TCPStore client serialises its calls) and costs no polling."""

    def __init__(self, store: Any):
        self.store = store
        self._queues: dict[str, queue.SimpleQueue] = {}
        self._lock = threading.Lock()

    def fetch(self, key: str) -> _Stamp:
        stamp = _Stamp(key)
        pair = key.rpartition("/")[0]
        with self._lock:
            q = self._queues.get(pair)
            if q is None:
                q = self._queues[pair] = queue.SimpleQueue()
                threading.Thread(target=self._run, args=(q,), daemon=True,
                                 name=f"titan_ext-delay-stamps-{pair.rpartition('/')[2]}").start()
        q.put(stamp)
        return stamp

    def _run(self, q: queue.SimpleQueue) -> None:
        store = _private_connection(self.store)
        while True:
            stamp = q.get()
            if stamp is None:
                return
            try:
                stamp.value = _take_stamp(store, stamp.key)
            except BaseException as exc:  # noqa: BLE001 - raised by the receive's wait()
                stamp.error = exc
            stamp.ready.set()

    def close(self) -> None:
        """End the threads once the stamps already asked for are fetched."""
        with self._lock:
            for q in self._queues.values():
                q.put(None)
            self._queues.clear()


def _private_connection(store: Any) -> Any:
    """A connection of its own to ``store`` (``Store.clone()``), or ``store`` where it has none."""
    clone = getattr(store, "clone", None)
    try:
        return clone() if clone is not None else store
    except (RuntimeError, NotImplementedError):
        return store


def _stamp_limit_s(store: Any) -> float:
    """How long a receive's stamp is waited for: the PP timeout, else the store's own, else
    :data:`STAMP_WAIT_DEFAULT_S`."""
    from ..comm.timeouts import current_timeout_s

    limit = current_timeout_s()
    if limit is None:
        try:
            limit = store.timeout.total_seconds()
        except (AttributeError, RuntimeError):
            limit = STAMP_WAIT_DEFAULT_S
    return limit


def _take_stamp(store: Any, key: str) -> float:
    """Wait for ``key``, read it and delete it (three store requests); an error stamp or no stamp
    within :func:`_stamp_limit_s` raises, naming the sending rank."""
    sender = key.rpartition("/")[0].rpartition("/")[2].partition("->")[0]
    limit = _stamp_limit_s(store)
    try:
        store.wait([key], timedelta(seconds=limit))
    except RuntimeError as exc:  # DistStoreError: the wait timed out (or the store is gone)
        raise RuntimeError(f"link-delay injection: timed out after {limit:g} s waiting for the arrival stamp "
                           f"{key!r}: rank {sender} never published it ({exc})") from exc
    text = store.get(key).decode()
    store.delete_key(key)
    if text.startswith(STAMP_ERROR):
        raise RuntimeError(f"link-delay injection: rank {sender} could not stamp the message {key!r}: its "
                           f"delay stamper failed: {text[len(STAMP_ERROR):]}")
    return float(text)


class DelayedRecvWork:
    """A receive on a delayed link: complete when its data has landed and the stamped ``arrival``
    (wall clock, published by the sender's stamper in the store under ``key``, fetched by a
    :class:`_StampReader` thread) has passed."""

    def __init__(self, works: list[Any], key: str, store: Any, reader: _StampReader | None = None):
        self.works = works  # the data's (or the batch's one coalesced work)
        self.key, self.store = key, store
        self._stamp = (reader if reader is not None else _StampReader(store)).fetch(key)

    def _read(self, block: bool) -> float | None:
        """The stamp once fetched (``block``: waits for the reader, which always ends: a value, the
        sender's error, or its own timeout); None if not yet fetched and not ``block``."""
        stamp = self._stamp
        if block:
            stamp.ready.wait()
        elif not stamp.ready.is_set():
            return None
        if stamp.error is not None:
            raise stamp.error
        return stamp.value

    def arrival(self) -> float:
        """The sender's model arrival time (waits for the stamp to be fetched)."""
        return self._read(block=True)

    def wait(self, timeout: Any = None) -> bool:  # noqa: ARG002 - Work API compatibility
        delay = self.arrival() - time.time()
        if delay > 0:
            time.sleep(delay)
        for w in self.works:  # NCCL: the stream waits on the data; gloo: the host until it landed
            w.wait()
        return True

    def is_completed(self) -> bool:
        """Truthful and without a host sync or a store request: the data's works report completion and
        the fetched stamp has passed (never a read of a device tensor).  A failed stamp counts as
        completed, as ProcessGroupNCCL's ``isCompleted`` for a work with an exception: ``wait()`` raises it."""
        if not all(w.is_completed() for w in self.works):
            return False
        stamp = self._stamp
        if not stamp.ready.is_set():
            return False
        return stamp.error is not None or time.time() >= stamp.value

    def get_future(self) -> torch.futures.Future:
        """Completes at arrival (a helper thread waits; the future's value is None)."""
        fut: torch.futures.Future = torch.futures.Future()

        def resolve() -> None:
            try:
                self.wait()
                fut.set_result(None)
            except BaseException as exc:  # noqa: BLE001 - handed to the future
                fut.set_exception(exc)

        threading.Thread(target=resolve, name="titan_ext-delayed-recv", daemon=True).start()
        return fut


class _Arrival:
    """A delayed send's model arrival (``time.monotonic()``), set by the stamper thread (or its error)."""

    def __init__(self) -> None:
        self._stamped = threading.Event()
        self.time = math.nan
        self.error: str | None = None

    def set(self, arrival: float) -> None:
        self.time = arrival
        self._stamped.set()

    def fail(self, error: str) -> None:
        self.error = error
        self._stamped.set()

    def wait(self) -> None:
        """Until the message has arrived (raises if its stamp could not be made)."""
        self._stamped.wait()
        if self.error is not None:
            raise RuntimeError(f"link-delay injection: a held send's arrival could not be stamped: {self.error}")
        delay = self.time - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class LinkDelayInjector:
    """Holds back PP sends per link; see the module docstring for the model and mechanism."""

    def __init__(self, schedule: DelaySchedule, t0: float | None = None,
                 origin: str = "inject_link_delays()", hol: bool = False, hol_hold: float = 1.0):
        from titan_ext.args import bool_arg, real_arg

        self.hol = bool_arg(hol, "hol")
        """Head-of-line blocking (PipeMorph §3.2, ``simulate(hol=True)``): the thread that issues a send
        on a delayed link is held until that message has arrived (or :attr:`hol_hold` of the way)."""
        self.hol_hold = real_arg(hol_hold, "hol_hold (the fraction of a send's delay its issuer is held)",
                                 minimum=0, maximum=1)
        """The blocking's strength: the issuer is held until ``ready + hol_hold × (arrival − ready)``
        (1 = until the message arrived, the maximal stand-in; 0 = not held). A phenomenological knob,
        set so that the emulated slowdown matches a measured one (PipeMorph Fig. 6's 1.9×:
        ``scripts/bench_falcon.py --calibrate-hol``)."""

        if not isinstance(schedule, DelaySchedule):
            raise DelaySpecTypeError(f"schedule must be a DelaySchedule (parse_delay_spec), got {type(schedule).__name__}")
        real_arg(t0, "t0 (a time.time() epoch)", minimum=0, optional=True)
        if not isinstance(origin, str):
            raise ArgumentTypeError(f"origin must be text (who asked for the delays), got {origin!r}")
        self.schedule = schedule
        self.origin = origin  # who asked for it, named in the warnings
        # Origin of trace time: a shared wall-clock epoch if given, else installation time.
        now_wall, now_mono = time.time(), time.monotonic()
        self._origin_mono = now_mono - (now_wall - t0) if t0 is not None else now_mono
        self._lock = threading.Lock()
        self._queues = LinkQueues(())  # the link model, channel (link, direction); times in ns
        self.messages_delayed = 0
        self.messages_passed = 0
        self._orig_batch_p2p = None
        self._next_warning = math.inf
        self.store: Any = None
        """Where stamps travel (host data): the job's ``torch.distributed`` store unless set."""
        self._sequence: dict[tuple[int, int], int] = {}  # (src, dst) global ranks -> stamped messages
        self._devices: dict[Any, Any] = {}  # torch.device -> its device layer (the event clock)
        self._stamps: Any = None  # the stamper thread's queue
        self._reader: _StampReader | None = None  # fetches this rank's receives' stamps
        self.stamper_errors: list[BaseException] = []
        """Errors the stamper thread caught (each published to its receiver instead of a stamp)."""

    # -- configuration -------------------------------------------------------------------------
    def update(self, spec: str | DelaySchedule) -> None:
        """Replace the delays from now on (same origin); a spec string is parsed first."""
        if not isinstance(spec, (str, DelaySchedule)):
            raise DelaySpecTypeError(f"spec must be a delay spec (text) or a DelaySchedule, got {type(spec).__name__}")
        sched = parse_delay_spec(spec) if isinstance(spec, str) else spec
        with self._lock:
            self.schedule = sched

    def link_delay(self, link: int, now: float | None = None) -> LinkDelay:
        now = time.monotonic() if now is None else now
        return self.schedule.at(now - self._origin_mono, link)

    def warn(self, now: float | None = None) -> None:
        """Log that an injected straggler is active (and schedule the next reminder)."""
        now = time.monotonic() if now is None else now
        log.warning("titan_ext: INJECTED STRAGGLER active (%s, set by %s): PP messages are delayed "
                    "on purpose, %d so far; remove it for real training", self.schedule.describe(),
                    self.origin, self.messages_delayed)
        self._next_warning = now + WARN_EVERY_S

    def maybe_warn(self, now: float) -> None:
        """The periodic reminder: warn again once :data:`WARN_EVERY_S` has passed."""
        if now >= self._next_warning:
            self.warn(now)

    # -- the model -----------------------------------------------------------------------------
    def arrival_time(self, link: int, direction: int, nbytes: int, now: float) -> float:
        """Earliest receive time (``time.monotonic()`` seconds) of a message handed over at ``now``, booking
        the link: ``plan.timing.LinkQueues.send_timed`` on channel (link, direction), in integer ns, with
        the link's latency and size/bandwidth at ``now``."""
        delay = self.link_delay(link, now)
        arrival_ns = self._queues.send_timed((link, direction), int(round(now * 1e9)),
                                             to_ns(delay.latency_ms), delay.transfer_ns(nbytes))
        return arrival_ns / 1e9

    # -- transport -----------------------------------------------------------------------------
    def stamps_link(self, link: int) -> bool:
        """Whether messages on ``link`` carry an arrival stamp: the spec names it (at any time)."""
        sched = self.schedule
        return any(w is not None for w in sched.wildcard) or any(link in d for _, d in sched.steps)

    def _stamped_link(self, op: Any) -> tuple[int, int] | None:
        """(link, direction) of an op whose link the spec delays; None for any other — a link the spec
        does not name, a send to self (torch < 2.13's start-up handshake between two stages of one
        rank) or between ranks no link of the model joins (the loop wrap-around with P ≥ 3: the
        planner's rule, ``plan.placement.rank_link``)."""
        if op.group_peer == dist.get_rank(op.group):
            return None
        stamped = self._link_and_direction(op)
        return stamped if stamped is not None and self.stamps_link(stamped[0]) else None

    def _link_and_direction(self, op: Any) -> tuple[int, int] | None:
        """(link, direction) of the rank pair of ``op`` (``rank_link``; 0 = towards the higher rank, the
        forward activations' direction), None where no link joins the pair."""
        group_size = dist.get_world_size(op.group)
        me = dist.get_rank(op.group)
        max_link = max(group_size - 2, 0)
        if self.schedule.max_link() > max_link:
            raise DelaySpecError(
                f"delay spec {self.schedule.describe()!r} names link {self.schedule.max_link()} but "
                f"the PP group has {group_size} ranks (links 0..{max_link}: link i joins ranks i and i+1)"
            )
        link = rank_link(me, op.group_peer)
        if link is None:
            return None
        return link, 0 if op.group_peer > me else 1

    def _device(self, device: torch.device) -> Any:
        from ..execute.device import device_layer

        if device not in self._devices:
            self._devices[device] = device_layer(device)
        return self._devices[device]

    def _key(self, src: int, dst: int) -> str:
        """The next stamp's key on the rank pair (src -> dst): both ends count the pair's stamped
        messages in issue order (a pair's p2p ops match in issue order)."""
        k = self._sequence.get((src, dst), 0)
        self._sequence[(src, dst)] = k + 1
        return f"titan_ext/delay/{src}->{dst}/{k}"

    def _stamp_send(self, op: Any, link: int, direction: int, key: str) -> _Arrival | None:
        """Mark the send's data ready on its device (an event on the producing stream, right after
        the producer) and hand it to the stamper thread, which publishes the model arrival (with
        :attr:`hol`, the message's :class:`_Arrival`)."""
        layer = self._device(op.tensor.device)
        token = layer.mark_ready()
        nbytes = op.tensor.numel() * op.tensor.element_size()
        if self._stamps is None:
            self._stamps = queue.SimpleQueue()
            threading.Thread(target=self._stamper, args=(self._stamps,), name="titan_ext-delay-stamper",
                             daemon=True).start()
        arrived = _Arrival() if self.hol else None
        self._stamps.put((layer, token, link, direction, nbytes, key, arrived))
        return arrived

    def _stamper(self, stamps: Any) -> None:
        """Per send, in issue order: wait (this thread only) until its data is ready on the device,
        book the link from that time and publish the arrival (wall clock) in the store.  Never dies of
        an error: it is recorded, logged and published in the stamp's place (:meth:`_stamp_failed`)."""
        while True:
            item = stamps.get()
            if item is None:
                return
            layer, token, link, direction, nbytes, key, arrived = item
            try:
                ready = layer.ready_time(token)  # the device layer's clock (time.perf_counter)
                with self._lock:
                    # the model runs on time.monotonic(): move the device-ready time onto it
                    ready_mono = ready - (_device_now() - time.monotonic())
                    arrival = self.arrival_time(link, direction, nbytes, ready_mono)
                    if arrival > ready_mono:
                        self.messages_delayed += 1
                    else:
                        self.messages_passed += 1
                wall = time.time() + (arrival - time.monotonic())
                self.store.set(key, repr(wall))
            except BaseException as exc:  # noqa: BLE001 - see _stamp_failed
                self._stamp_failed(key, exc, arrived)
                continue
            if arrived is not None:  # held for hol_hold of the message's delay
                arrived.set(ready_mono + self.hol_hold * max(0.0, arrival - ready_mono))

    def _stamp_failed(self, key: str, exc: BaseException, arrived: _Arrival | None) -> None:
        """A send that could not be stamped: record and log the error, publish it under the stamp's key
        (the receiver's ``wait()`` raises it: before, the stamper thread died and receivers waited for
        stamps that never came) and release a held issuer (``hol``)."""
        self.stamper_errors.append(exc)
        what = f"{type(exc).__name__}: {exc}"
        if len(self.stamper_errors) == 1:
            log.error("titan_ext: link-delay injection could not stamp %s (%s); its receiver gets the error",
                      key, what, exc_info=exc)
        try:
            self.store.set(key, STAMP_ERROR + what)
        except Exception:  # noqa: BLE001 - the store is gone: the receiver's own timeout ends its wait
            log.error("titan_ext: link-delay injection could not publish the failure of %s either", key)
        if arrived is not None:
            arrived.fail(what)

    def batch_p2p(self, p2p_ops: list, desc: str | None = None) -> list:
        """Drop-in replacement of torch's ``schedules._batch_p2p`` that applies the link delays:
        the same ops, in the same order and batch; a receive on a named link gets a delayed handle."""
        if not p2p_ops:
            return []
        self.maybe_warn(time.monotonic())
        if self.store is None:
            self.store = dist.distributed_c10d._get_default_store()
        if self._reader is None or self._reader.store is not self.store:
            self._reader = _StampReader(self.store)
        keys: list[str | None] = []
        held: list[_Arrival] = []
        for op in p2p_ops:
            stamped = self._stamped_link(op)
            if stamped is None:
                keys.append(None)
                continue
            link, direction = stamped
            me, peer = dist.get_rank(), dist.get_global_rank(op.group or dist.group.WORLD, op.group_peer)
            recv = _is_recv(op)
            key = self._key(peer, me) if recv else self._key(me, peer)
            if not recv:
                arrived = self._stamp_send(op, link, direction, key)
                if arrived is not None:
                    held.append(arrived)
                key = None
            keys.append(key)
        works = self._orig_batch_p2p(list(p2p_ops), desc)
        per_op = len(works) == len(p2p_ops)  # else one coalesced work for the batch (NCCL)
        out = []
        for i, key in enumerate(keys):
            own = [works[i]] if per_op else list(works)
            out.append(own[0] if key is None else DelayedRecvWork(own, key, self.store, self._reader))
        for arrived in held:  # head-of-line blocking: the issuer waits out its delayed sends
            arrived.wait()
        return out

    def delegated_due_ns(self, op: Any) -> int:
        """A send that another transport carries (the delegates, PipeMorph §5.2): its model arrival
        (``time.monotonic_ns()``, the link booked from now) if its link is delayed, else 0 — the delay
        is the link's, whichever path its messages take.  Never blocks, whatever :attr:`hol` says:
        the delegates are what removes head-of-line blocking.  The link is booked from the host's
        hand-over time: on CUDA the data is ready only after its device-to-host copy, so the delay
        counts from slightly early there (not run on a GPU)."""
        stamped = self._stamped_link(op)
        if stamped is None:
            return 0
        link, direction = stamped
        nbytes = op.tensor.numel() * op.tensor.element_size()
        with self._lock:
            arrival = self.arrival_time(link, direction, nbytes, time.monotonic())
            self.messages_delayed += 1
        return int(arrival * 1e9)

    # -- installation --------------------------------------------------------------------------
    def install(self) -> "LinkDelayInjector":
        from torch.distributed.pipelining import schedules

        global _CURRENT
        if _CURRENT is not None and _CURRENT is not self:
            _CURRENT.remove()
        self._orig_batch_p2p = schedules._batch_p2p
        schedules._batch_p2p = self.batch_p2p
        _CURRENT = self
        if not self.schedule.is_empty():
            self.warn()
        return self

    def remove(self) -> None:
        """Restore torch's ``_batch_p2p``."""
        from torch.distributed.pipelining import schedules

        global _CURRENT
        if self._orig_batch_p2p is not None and schedules._batch_p2p == self.batch_p2p:
            schedules._batch_p2p = self._orig_batch_p2p
        if _CURRENT is self:
            _CURRENT = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def __enter__(self) -> "LinkDelayInjector":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


_CURRENT: LinkDelayInjector | None = None


def _is_recv(op: Any) -> bool:
    return op.op is dist.irecv or getattr(op.op, "__name__", "") == "irecv"


def _device_now() -> float:
    """The device layer's host clock (its event times are on it)."""
    from ..execute import device

    return device.now()


def inject_link_delays(spec: str | DelaySchedule, t0: float | None = None,
                       origin: str = "inject_link_delays()", hol: bool = False,
                       hol_hold: float = 1.0) -> LinkDelayInjector:
    """Install link-delay injection for every torch pipelining schedule in this process.

    ``spec``: see the module docstring (``"2:30"``, ``"0:10,2:30:100MB/s"``, ``"trace:delays.csv"``).
    ``t0``: optional shared ``time.time()`` origin for traces.  Returns the injector (``.update(spec)``
    to change delays, ``.remove()`` or use as a context manager to uninstall).  Call it on every rank.
    ``origin`` names who asked for it in the warnings.  ``hol``: NCCL's head-of-line blocking on the
    direct path (:attr:`LinkDelayInjector.hol`), holding the issuer ``hol_hold`` of each delay
    (:attr:`LinkDelayInjector.hol_hold`).
    """
    if not isinstance(spec, (str, DelaySchedule)):
        raise DelaySpecTypeError(f"spec must be a delay spec (text) or a DelaySchedule, got {type(spec).__name__}")
    sched = parse_delay_spec(spec) if isinstance(spec, str) else spec
    return LinkDelayInjector(sched, t0=t0, origin=origin, hol=hol, hol_hold=hol_hold).install()


def schedule_from_env() -> tuple[DelaySchedule, float | None] | None:
    """``TITAN_EXT_INJECT_DELAYS`` and ``TITAN_EXT_INJECT_DELAYS_T0`` (a ``time.time()`` epoch) parsed,
    installing nothing: (schedule, t0), or None when unset. Raises ``DelaySpecError`` naming the variable."""
    spec = os.environ.get(ENV_VAR, "").strip()
    if not spec:
        return None
    try:
        sched = parse_delay_spec(spec)
    except DelaySpecError as exc:
        raise DelaySpecError(f"{ENV_VAR} = {spec!r}: {exc}") from None
    text = os.environ.get(ENV_VAR + "_T0", "").strip()
    from titan_ext.args import parse_float

    try:
        t0 = parse_float(text, ENV_VAR + "_T0") if text else None
    except ValueError:
        t0 = math.nan
    if t0 is not None and not (math.isfinite(t0) and t0 >= 0):
        raise DelaySpecError(f"{ENV_VAR}_T0 = {text!r}: expected a time.time() epoch in seconds (a number >= 0)")
    return sched, t0


def install_from_env() -> LinkDelayInjector | None:
    """Install from ``TITAN_EXT_INJECT_DELAYS`` if set and non-empty (idempotent); a malformed variable
    raises ``DelaySpecError`` naming it (:func:`schedule_from_env`)."""
    parsed = schedule_from_env()
    if parsed is None:
        return None
    sched, t0 = parsed
    if _CURRENT is not None and _CURRENT.schedule.source == sched.source:
        return _CURRENT
    return LinkDelayInjector(sched, t0=t0, origin=ENV_VAR).install()


def current_injector() -> LinkDelayInjector | None:
    """The installed injector, if any (other transports, e.g. delegates, can call its model)."""
    return _CURRENT


def remove_link_delays() -> None:
    if _CURRENT is not None:
        _CURRENT.remove()
