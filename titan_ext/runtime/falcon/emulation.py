"""Fail-slow emulation on physical devices: a slow device and a slow link.

Falcon's two fail-slow kinds (computation and communication, §3.2 and §3.3) are emulated per *device*, not per
mesh position, so that a topology change (S3) moves the mesh around a fault that stays where it is:

* ``slow_device = "D:F"``: device D computes F× slower. Every compute region handed to
  :meth:`FailSlowEmulation.stretch` (a model part's forward, its backward, the GEMM probe) is followed
  by a sleep of ``(F - 1) ×`` its measured duration on that device.
* ``pass_s`` > 0 (dedicated devices on a shared host): a model part's forward takes ``pass_s`` and its
  backward ``2 × pass_s`` on every device (× F on the slow one): the host sleeps out what the real
  compute left. Ranks that share cores then run like ranks on devices of their own, as long as the
  real compute of a region stays below its emulated time.
* ``slow_link = "A-B:MS"``: the link between devices A and B adds MS milliseconds to every message.
  PP messages get it from :func:`titan_ext.runtime.inject_link_delays` installed on A and B only;
  a collective over a group holding both pays ``steps × MS`` (:meth:`collective_delay_s`; a two-rank
  ring all-reduce is a reduce-scatter and an all-gather step); validation P2P messages pay it per
  message (:meth:`send_delay_s`).
* ``window_bytes`` (latency faults, PipeMorph §7.3's Fig. 19): a transport keeps a bounded window
  of bytes in flight per link (NCCL: ``NCCL_STEPS`` = 8 slots of one chunk per channel), so over a
  link with MS of added latency a transfer of ``n`` bytes takes ``ceil(n / window)`` round trips
  and pays ``ceil(n / window) × MS`` — a large gradient's ring step many times, a small activation
  once. Unbounded (the default): every message and ring step pays MS once.
* ``slow_link = "A-B:xF"``: the link between A and B is F× slower (a bandwidth fault, as Falcon §7.1
  injects communication fail-slows by bandwidth contention: every transfer over it takes F× its healthy
  time). A collective over it pays ``(F - 1) ×`` its healthy time (the job measures it at start:
  ``base_s`` of :meth:`collective_delay_s`); a message of ``n``
  bytes pays ``(F - 1) × n / B``, B the link's healthy bandwidth (:attr:`link_bytes_per_s`, measured
  by the job) — on a PP hop as a bandwidth cap of ``B / (F - 1)`` in the delay injector. So a slow DP
  link that S3 turns into a PP hop costs what the (small) activations need, as in the paper.

``device_of[mesh_rank]`` maps the job's ranks to devices (identity unless a restart plan permuted
the mesh). The specs come from ``[titan_ext] emulate_slow_device`` / ``emulate_slow_link`` or the
environment (``TITAN_EXT_SLOW_DEVICE`` / ``TITAN_EXT_SLOW_LINK``), like ``inject_delays``; both may
carry ``@STEP`` (from that training step on, e.g. ``"3:3@10"``).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["EmulationSpecError", "SlowDevice", "SlowLink", "FailSlowEmulation", "parse_slow_device",
           "parse_slow_link"]

# ASCII digits only ([0-9], never \d: Python's \d and int() also take '٣' or '１２')
_NUM = r"([0-9]{1,9}(?:\.[0-9]{0,9})?|\.[0-9]{1,9})"
_DEVICE = re.compile(r"^\s*([0-9]{1,7})\s*:\s*" + _NUM + r"\s*(?:@\s*([0-9]{1,9}))?\s*$", re.ASCII)
_LINK = re.compile(r"^\s*([0-9]{1,7})\s*-\s*([0-9]{1,7})\s*:\s*(x\s*)?" + _NUM + r"\s*(?:@\s*([0-9]{1,9}))?\s*$",
                   re.ASCII)
MAX_FACTOR = 1000.0  # a device or link F times slower: beyond this it is a typo (a pass would take hours)
MAX_LINK_MS = 600_000.0  # +MS per message: at most 10 minutes (beyond any job's timeout)


class EmulationSpecError(ValueError):
    """A malformed emulation spec."""


@dataclass(frozen=True)
class SlowDevice:
    device: int
    factor: float
    from_step: int = 0


@dataclass(frozen=True)
class SlowLink:
    devices: frozenset
    delay_ms: float
    from_step: int = 0
    factor: float = 1.0
    """Transfer-time factor (``"A-B:xF"``); 1 for a latency fault (``"A-B:MS"``)."""


def parse_slow_device(spec: str) -> SlowDevice | None:
    """``"D:F[@STEP]"`` (device D is F ≥ 1 times slower from STEP on); "" = none."""
    if not spec.strip():
        return None
    m = _DEVICE.match(spec)
    if not m or not 1.0 <= float(m.group(2)) <= MAX_FACTOR:
        raise EmulationSpecError(f"expected DEVICE:FACTOR[@STEP] in ASCII digits with 1 <= FACTOR <= "
                                 f"{MAX_FACTOR:g}, e.g. '3:3'")
    return SlowDevice(int(m.group(1)), float(m.group(2)), int(m.group(3) or 0))


def parse_slow_link(spec: str) -> SlowLink | None:
    """``"A-B:MS[@STEP]"`` (+MS per message between devices A != B from STEP on) or ``"A-B:xF[@STEP]"``
    (the link is F ≥ 1 times slower); "" = none."""
    if not spec.strip():
        return None
    m = _LINK.match(spec)
    if (not m or int(m.group(1)) == int(m.group(2))
            or (m.group(3) and not 1.0 <= float(m.group(4)) <= MAX_FACTOR)
            or (not m.group(3) and float(m.group(4)) > MAX_LINK_MS)):
        raise EmulationSpecError(f"expected A-B:MS[@STEP] or A-B:xFACTOR[@STEP] in ASCII digits with devices "
                                 f"A != B, MS <= {MAX_LINK_MS:g} and 1 <= FACTOR <= {MAX_FACTOR:g}, e.g. "
                                 f"'0-1:40' or '0-1:x6@5'")
    devices, value, step = frozenset((int(m.group(1)), int(m.group(2)))), float(m.group(4)), int(m.group(5) or 0)
    if m.group(3):
        return SlowLink(devices, 0.0, step, factor=value)
    return SlowLink(devices, value, step)


class FailSlowEmulation:
    """The emulated faults as seen from one mesh rank (see the module docstring)."""

    def __init__(self, rank: int, device_of: Sequence[int], slow_device: SlowDevice | None = None,
                 slow_link: SlowLink | None = None, pass_s: float = 0.0, window_bytes: float = math.inf):
        if not (pass_s >= 0 and pass_s < float("inf")):
            raise EmulationSpecError(f"pass_s must be a finite number >= 0, got {pass_s!r}")
        if not window_bytes > 0:
            raise EmulationSpecError(f"window_bytes must be > 0, got {window_bytes!r}")
        self.window_bytes = float(window_bytes)
        self.rank, self.device_of, self.pass_s = rank, [int(d) for d in device_of], float(pass_s)
        self.slow_device, self.slow_link = slow_device, slow_link
        for d in ([slow_device.device] if slow_device else []) + sorted(slow_link.devices if slow_link else []):
            if d not in self.device_of:
                raise EmulationSpecError(f"device {d} does not exist (devices {sorted(self.device_of)})")
        self.step = 0
        self.link_bytes_per_s = float("inf")
        """Healthy bandwidth of a link (the job measures its DP all-reduce); for ``xF`` links."""

    @property
    def device(self) -> int:
        return self.device_of[self.rank]

    def compute_factor(self) -> float:
        sd = self.slow_device
        return sd.factor if sd and sd.device == self.device and self.step >= sd.from_step else 1.0

    def _on_slow_link(self, rank_a: int, rank_b: int) -> bool:
        sl = self.slow_link
        return (sl is not None and self.step >= sl.from_step
                and {self.device_of[rank_a], self.device_of[rank_b]} == sl.devices)

    def link_ms(self, rank_a: int, rank_b: int) -> float:
        """Emulated extra latency (ms) of one message between mesh ranks a and b (now)."""
        return self.slow_link.delay_ms if self._on_slow_link(rank_a, rank_b) else 0.0

    def link_factor(self, rank_a: int, rank_b: int) -> float:
        """Emulated transfer-time factor of the link between mesh ranks a and b (now; 1 = healthy)."""
        return self.slow_link.factor if self._on_slow_link(rank_a, rank_b) else 1.0

    def stretch(self, t0: float, passes: float | None = None) -> None:
        """End of a compute region that began at ``t0`` (perf_counter): sleep (F - 1) × its length;
        with ``pass_s`` > 0 and a model region of ``passes`` forward-pass times (forward 1,
        backward 2), sleep until ``passes × pass_s × F`` since ``t0`` (dedicated devices)."""
        f = self.compute_factor()
        if self.pass_s > 0 and passes is not None:
            time.sleep(max(0.0, passes * self.pass_s * f - (time.perf_counter() - t0)))
        elif f > 1.0:
            time.sleep((f - 1.0) * (time.perf_counter() - t0))

    def round_trips(self, nbytes: float) -> int:
        """Round trips a transfer of ``nbytes`` takes through the window (≥ 1)."""
        return max(1, math.ceil(nbytes / self.window_bytes)) if math.isfinite(self.window_bytes) else 1

    def send_delay_s(self, src: int, dst: int, nbytes: int = 0) -> float:
        """Extra time of one message of ``nbytes`` from mesh rank src to dst."""
        return (self.round_trips(nbytes) * self.link_ms(src, dst) / 1e3
                + (self.link_factor(src, dst) - 1.0) * nbytes / self.link_bytes_per_s)

    def collective_delay_s(self, ranks: Sequence[int], steps: int, base_s: float = 0.0,
                           step_bytes: float = 0.0) -> float:
        """Extra time of a ring collective of ``steps`` message steps over ``ranks`` (ring order)
        whose healthy time is ``base_s`` and whose every step moves ``step_bytes`` over a link."""
        ring = list(ranks)
        pairs = [(a, b) for a, b in zip(ring, ring[1:] + ring[:1]) if a != b]
        worst_ms = max((self.link_ms(a, b) for a, b in pairs), default=0.0)
        worst_factor = max((self.link_factor(a, b) for a, b in pairs), default=1.0)
        return steps * self.round_trips(step_bytes) * worst_ms / 1e3 + (worst_factor - 1.0) * base_s

    def pp_link_spec(self, pp_ranks: Sequence[int]) -> str:
        """``inject_delays`` spec for this rank's pipeline (stage order ``pp_ranks``): the slow link
        if it is a PP hop of this pipeline and this rank is one of its ends, else ""."""
        if self.rank not in pp_ranks:
            return ""
        items = []
        for i, (a, b) in enumerate(zip(pp_ranks, pp_ranks[1:])):
            ms, factor = self.link_ms(a, b), self.link_factor(a, b)
            if self.rank not in (a, b) or (ms <= 0 and factor <= 1.0):
                continue
            cap = self.link_bytes_per_s / (factor - 1.0) if factor > 1.0 else float("inf")
            items.append(f"{i}:{ms:g}" + (f":{cap:.6g}B/s" if cap < float("inf") else ""))
        return ",".join(items)
