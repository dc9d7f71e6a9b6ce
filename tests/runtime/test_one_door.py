"""One door (Deliver item 5): every call that touches a device, or a communicator's completion,
from the host lives in the device layer, the transports or the test backends.

On a GPU the host must run ahead of the device: a call that reads a device tensor, waits for an event or
a stream, or copies between host and device without ``non_blocking=True`` drains the device's queue
(``host_syncs.py`` lists what CUDA and NCCL block on), and any CUDA call from a thread that never selected
its device opens a context on GPU 0.  Such calls are reviewable only if they sit in a few known places:
:data:`DOOR` names them, each with why it is a door.  Anywhere else in ``titan_ext`` a call of that kind
needs an entry in the one :data:`ALLOWLIST` — ``(module path, function qualname, call) -> reason`` — that
says why it is harmless there (e.g. it reads a host tensor of the gloo control plane).

What the walk finds (every module of the package, its syntax tree, ``import torch as t`` / ``from torch
import cuda`` aliases followed):

* a method call named ``.synchronize( .query( .is_completed( .elapsed_time( .item( .tolist( .cpu(
  .numpy(`` (by name: a ``threading.Event`` has none of them);
* a blocking copy: ``.copy_(`` / ``.cuda(`` without ``non_blocking=True``; ``.to(`` without it whose target
  may be a device (anything but a dtype: ``.to("cpu")``, ``.to(device)``; a host tensor's ``.to(cuda)``
  from pageable memory waits too); ``torch.tensor / as_tensor / asarray(..., device=X)`` with X not the
  literal ``"cpu"``;
* any use of ``torch.cuda`` (an attribute, a call, the module passed as a value).

Not found, by design (the walk has no types): ``float(t)`` / ``int(t)`` / ``bool(t)`` of a device tensor,
and ``Work.wait()`` (a stream wait on NCCL; ``wait(timeout)`` blocks the host, but ``wait`` is every
``threading`` object's name too).  The run-time counters (``testing/host_syncs.py``, the simulated device
that runs behind the host) count those.

A failure lists every offending ``file:line call`` and every allowlist entry that no longer matches
anything (a stale entry would hide the next call of that kind in the same function).
"""

from __future__ import annotations

import ast
import functools
import gc
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "titan_ext"

#: where host-side device calls belong: a module path, or a folder ending in "/" (everything under it)
DOOR: dict[str, str] = {
    "titan_ext/runtime/execute/device.py": "the device layer: devices, streams, events, timing, receive completion",
    "titan_ext/runtime/comm/transport.py": "the PP transport (torch's _batch_p2p): issues and completes P2P works",
    # the delegate data plane (PipeMorph §5.2): moves message bytes between device, pinned rings and
    # delegate processes, and owns its works' completion; schedule.py (the delegation policy and its
    # boundary observer) and __init__.py (re-exports) are not part of it
    "titan_ext/runtime/comm/delegate/_device.py": "delegate data plane: its device and stream choices",
    "titan_ext/runtime/comm/delegate/_ext.py": "delegate data plane: loads its compiled CUDA/C++ kernels",
    "titan_ext/runtime/comm/delegate/lanes.py": "delegate data plane: rings registered with the device",
    "titan_ext/runtime/comm/delegate/link.py": "delegate data plane: direct-path helpers of a link",
    "titan_ext/runtime/comm/delegate/pool.py": "delegate data plane: the training process's side",
    "titan_ext/runtime/comm/delegate/recovery.py": "delegate data plane: the direct-path fallback's works",
    "titan_ext/runtime/comm/delegate/recvpath.py": "delegate data plane: ring slots onto the device",
    "titan_ext/runtime/comm/delegate/ring.py": "delegate data plane: pinned shared-memory slots",
    "titan_ext/runtime/comm/delegate/sendpath.py": "delegate data plane: device tensors into ring slots",
    "titan_ext/runtime/comm/delegate/transport.py": "delegate data plane: the router's works",
    "titan_ext/runtime/comm/delegate/worker.py": "delegate data plane: the delegate process (gloo on host memory)",
    "titan_ext/testing/": "the test backends, simulated devices, host-sync accounting and the shared-GPU "
                          "transport (test and benchmark paths: their blocking copies are their design)",
}

_HOST_CONTROL = ("a host tensor: made by torch.tensor/torch.zeros/torch.full without a device and "
                 "exchanged on the gloo control group, never a device tensor")

#: (module path, function qualname, call) -> why this call is allowed outside the door
ALLOWLIST: dict[tuple[str, str, str], str] = {
    # ---- runtime/ (outside the door)
    ("titan_ext/runtime/_torch_compat.py", "match_self_p2p", ".copy_"):
        "a P2P op a rank sends to itself (torch < 2.13's start-up handshake): the receive buffer and the "
        "clone of the matched send are both this rank's stage tensors on its one device, so copy_ is a "
        "device-to-device copy enqueued on the current stream (a memcpy on CPU), never a host wait",
    ("titan_ext/runtime/comm/control_plane.py", "ControlPlane._send", ".copy_"):
        "host to host: all_gather refuses a device vector, and out[me] is torch.empty_like of it",
    ("titan_ext/runtime/comm/control_plane.py", "ControlPlane.gather_ints", ".item"):
        "reads all_gather's outputs: host tensors (torch.empty_like of a torch.tensor made without a "
        "device) received on the gloo control group, never a device tensor",
    ("titan_ext/runtime/comm/control_plane.py", "ControlPlane.any", ".item"):
        "reads the vote: " + _HOST_CONTROL,
    ("titan_ext/runtime/comm/peers.py", "Peers.merge", ".tolist"):
        "reads the peers' MAX all-reduce of spans and hashes: " + _HOST_CONTROL,
    ("titan_ext/runtime/measure/profiler.py", "decode_profiles", ".tolist"):
        "reads the control plane's all_gather of encode_profile's vectors: " + _HOST_CONTROL,
    ("titan_ext/runtime/measure/profiler.py", "estimate_clock_offsets", ".tolist"):
        "reads the NTP ping-pong buffer (torch.zeros on the host) received on the control group, once at "
        "the first iteration: " + _HOST_CONTROL,
    ("titan_ext/runtime/measure/profiler.py", "estimate_clock_offsets", ".item"):
        "reads the same host buffer as the .tolist above (the server's offset and RTT), once per job",
    ("titan_ext/runtime/emulate/delay_injection.py", "DelayedRecvWork.is_completed", ".is_completed"):
        "a Work wrapper's is_completed forwarding to the receive works it wraps (and a store read): no "
        "device call of its own; the thread and device it runs on are its caller's (the device layer's "
        "ArrivalWatcher, under the stage's device context; the PP watch, under the registering thread's)",
    ("titan_ext/runtime/comm/timeouts.py", "_TimedWork.done", ".is_completed"):
        "the PP watch's non-blocking completion poll of a waited work (to name a silent peer before NCCL's "
        "watchdog fires): on NCCL a cudaEventQuery, made by the titan_ext-pp-watch thread inside the "
        "registering thread's device context (_done enters device.thread_device(), captured in _watch; it "
        "also sets the thread-local capture mode), as ProcessGroupNCCL's watchdog takes a device guard",
    # ---- runtime/falcon/ (Falcon §4.3 measurements)
    ("titan_ext/runtime/falcon/decision.py", "_listed", ".tolist"):
        "argument normalisation of a user's IterationObservation (replica_microbatch_s, split): a numpy "
        "array (host memory) becomes a list; titan_ext's own FalconJob passes tuples of Python floats, so "
        "only a user who hands in a device tensor reads it here, on their own call",
    ("titan_ext/runtime/falcon/localize.py", "_ranks_arg", ".tolist"):
        "argument normalisation of a numpy array of ranks (isinstance np.ndarray: host memory)",
    ("titan_ext/runtime/falcon/mitigation.py", "_listed", ".tolist"):
        "argument normalisation of a numpy array (isinstance np.ndarray: host memory)",
    ("titan_ext/runtime/falcon/redistribute.py", "_all_gather_stacked", ".cpu"):
        "S2's data-loader chunks: TorchTitan's loader yields host tensors (train_step moves the batch to "
        "the device afterwards), so .cpu() returns them as they are; the gather runs on a gloo control group",
    ("titan_ext/runtime/falcon/redistribute.py", "weighted_all_reduce_gradients", ".copy_"):
        "device to device: a bucket's flat buffer is torch.cat of the gradients themselves (on their "
        "device), all-reduced, then copied back into each gradient on the current stream, no host wait",
    ("titan_ext/runtime/falcon/device_clock.py", "to_device", ".to"):
        "every caller (redistribute.py, topology.py) passes a tensor already on the stage's device, so the "
        "tensor is returned as is; the .to is reached only by a tensor elsewhere, which no caller makes",
    # ---- Falcon's DP x PP job (titan/falcon_*.py, runtime/falcon/measure.py)
    ("titan_ext/titan/falcon_costs.py", "_time_state_load", ".copy_"):
        "device to device: the state-load probe copies the stage's own tensors into empty_like buffers on "
        "the same device (the copy being timed), once at start-up",
    ("titan_ext/titan/falcon_dp.py", "DPSync._per_stage", ".tolist"):
        "reads torch.full(...) made on the host and all-reduced on the gloo control group: " + _HOST_CONTROL,
    ("titan_ext/runtime/falcon/measure.py", "ObservationExchange._complete", ".tolist"):
        "reads the step exchange's vector (torch.full on the host, all-reduced on the gloo control group): "
        "a host tensor, never a device tensor",
    ("titan_ext/titan/falcon_s4.py", "_restart_estimate_s", ".to"):
        "S4's restart-cost estimate, once per job at start-up (FalconJob.__init__ -> estimate_s4_cost): the "
        "first PROBE_BYTES of a parameter larger than the probe, copied to the host to write a probe "
        "checkpoint (torch.save/load timed afterwards); a blocking device-to-host copy off the steady step",
    ("titan_ext/titan/falcon_s4.py", "_restart_estimate_s", ".cpu"):
        "as _restart_estimate_s's .to: whole parameters up to PROBE_BYTES copied to the host for the "
        "probe checkpoint, once per job at start-up, never in a step",
}

_METHODS = frozenset({"synchronize", "query", "is_completed", "elapsed_time", "item", "tolist", "cpu", "numpy"})
_COPIES = frozenset({"copy_", "cuda"})  # blocking unless non_blocking=True
_FACTORIES = frozenset({"torch.tensor", "torch.as_tensor", "torch.asarray"})
#: a module without a match has no call the walk could find (a cheap filter before parsing): every kind
#: needs a method name after a dot, the word cuda (an alias is imported under it) or a factory's name
_MAYBE = re.compile(r"\.\s*(synchronize|query|is_completed|elapsed_time|item|tolist|cpu|numpy|copy_|cuda|to)\s*\("
                    r"|\bcuda\b|\b(tensor|as_tensor|asarray)\b")
#: torch's dtype names (``torch.<name>``), spelled out: importing torch would cost the walk seconds
_DTYPES = frozenset("""float float16 half bfloat16 float32 float64 double complex64 complex128 cfloat cdouble
    uint8 uint16 uint32 uint64 int8 int16 short int32 int int64 long bool float8_e4m3fn float8_e5m2""".split())


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name → torch dotted name, from every import of the module (any scope)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch" or a.name.startswith("torch."):
                    if a.asname:
                        names[a.asname] = a.name
                    else:
                        names["torch"] = "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and (node.module == "torch" or node.module.startswith("torch.")):
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _non_blocking(call: ast.Call, positional: int) -> bool:
    """``non_blocking=True`` (keyword, or the literal True at ``positional``)."""
    for kw in call.keywords:
        if kw.arg == "non_blocking":
            return isinstance(kw.value, ast.Constant) and kw.value.value is True
    return len(call.args) > positional and isinstance(call.args[positional], ast.Constant) \
        and call.args[positional].value is True


def _is_dtype(node: ast.AST, resolve) -> bool:
    name = resolve(node)
    if name is None:
        return False
    last = name.rsplit(".", 1)[-1]
    if name.startswith("torch.") and name.count(".") == 1:
        return last in _DTYPES
    return "dtype" in last.lower()


def _host_literal(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value == "cpu"


class _Finder(ast.NodeVisitor):
    def __init__(self, path: str, tree: ast.AST):
        self.path, self.aliases = path, _aliases(tree)
        self.scope: list[str] = []
        self.hits: list[tuple[str, str, str, int]] = []  # (path, qualname, call, line)

    def resolve(self, node: ast.AST) -> str | None:
        name = _dotted(node)
        if name is None:
            return None
        head, _, rest = name.partition(".")
        if head in self.aliases:
            return self.aliases[head] + ("." + rest if rest else "")
        return name

    def hit(self, node: ast.AST, call: str) -> None:
        self.hits.append((self.path, ".".join(self.scope) or "<module>", call, node.lineno))

    def _scoped(self, node) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def _cuda(self, node: ast.AST) -> bool:
        """``torch.cuda`` or one of its attributes (the outermost such chain is reported, once)."""
        name = self.resolve(node)
        if name is None or not (name == "torch.cuda" or name.startswith("torch.cuda.")):
            return False
        self.hit(node, ".".join(name.split(".")[:3]))
        return True

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if not self._cuda(node):
            self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        self._cuda(node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        name = self.resolve(f)
        if isinstance(f, ast.Attribute) and not (name or "").startswith("torch.cuda"):
            if f.attr in _METHODS:
                self.hit(node, "." + f.attr)
            elif f.attr in _COPIES and not _non_blocking(node, 1 if f.attr == "copy_" else 0):
                self.hit(node, "." + f.attr)
            elif f.attr == "to" and not _non_blocking(node, 1):
                targets = [a for a in node.args] + [k.value for k in node.keywords if k.arg == "device"]
                if any(not _is_dtype(t, self.resolve) for t in targets):
                    self.hit(node, ".to")
        if name in _FACTORIES:
            device = next((k.value for k in node.keywords if k.arg == "device"), None)
            if device is not None and not _host_literal(device):
                self.hit(node, f"{name}(device=)")
        self.generic_visit(node)


def find_calls(source: str, path: str) -> list[tuple[str, str, str, int]]:
    """Every host-side device call of one module's source: (path, qualname, call, line)."""
    tree = ast.parse(source, path)
    finder = _Finder(path, tree)
    finder.visit(tree)
    return finder.hits


def in_door(path: str) -> bool:
    return any(path == d or (d.endswith("/") and path.startswith(d)) for d in DOOR)


@functools.lru_cache(maxsize=1)
def _package_calls() -> tuple[tuple[str, str, str, int], ...]:
    """The walk of the whole package (about 1.5 MB of source), once per session.  The garbage collector
    is paused meanwhile: with torch loaded (conftest imports it) every collection the parser's millions
    of allocations trigger scans torch's heap too -- 4.5 s instead of 1.5 s on a busy 2-core host.  Only
    the modules :data:`_MAYBE` matches are parsed (a third of the package's source)."""
    hits = []
    paused = gc.isenabled()
    gc.disable()
    try:
        for p in sorted(PACKAGE.rglob("*.py")):
            source = p.read_text()
            if "__pycache__" not in p.parts and _MAYBE.search(source):
                hits += find_calls(source, p.relative_to(ROOT).as_posix())
    finally:
        if paused:
            gc.enable()
    return tuple(hits)


def test_every_host_device_call_goes_through_the_door_or_says_why_not():
    calls = _package_calls()
    outside = [h for h in calls if not in_door(h[0])]
    offending = [f"{path}:{line} {call} (in {qual})" for path, qual, call, line in outside
                 if (path, qual, call) not in ALLOWLIST]
    assert not offending, (
        "host-side device calls outside the device layer (titan_ext/runtime/execute/device.py), the transports and "
        "testing/ -- move each into the device layer, or add (module, qualname, call) -> reason to "
        "tests/runtime/test_one_door.py's ALLOWLIST:\n  " + "\n  ".join(offending))


def test_every_allowlist_entry_still_matches_a_call_and_gives_a_reason():
    found = {(path, qual, call) for path, qual, call, _ in _package_calls()}
    stale = [f"{k}" for k in ALLOWLIST if k not in found]
    in_the_door = [f"{k}" for k in ALLOWLIST if in_door(k[0])]
    thin = [f"{k}: {r!r}" for k, r in ALLOWLIST.items() if len(r) < 60 or "pending" in r.lower()]
    assert not stale, "allowlist entries that match no call any more (remove them):\n  " + "\n  ".join(stale)
    assert not in_the_door, "allowlist entries for modules of the door (not needed):\n  " + "\n  ".join(in_the_door)
    assert not thin, "allowlist entries without a real reason:\n  " + "\n  ".join(thin)


def test_the_door_names_existing_modules():
    missing = [d for d in DOOR if not (ROOT / d).exists()]
    assert not missing, f"DOOR names paths that do not exist: {missing}"


_SAMPLE = '''
import torch
import torch as th
from torch import cuda as tc
from torch.cuda import synchronize as sync

x = torch.cuda.is_available()

def reads(t, dev, ev, work, buf):
    t.item(); t.tolist(); t.cpu(); t.numpy()
    ev.synchronize(); ev.query(); ev.elapsed_time(ev); work.is_completed()
    buf.copy_(t)
    buf.copy_(t, non_blocking=True)
    buf.copy_(t, True)
    t.to("cpu")
    t.to(dev)
    t.to(device=dev, dtype=torch.float32)
    t.to(dev, non_blocking=True)
    t.to(torch.float32)
    t.to(t.dtype)
    t.to(dtype=torch.bfloat16)
    t.cuda()
    t.cuda(non_blocking=True)
    torch.tensor([1.0], device=dev)
    torch.tensor([1.0], device="cpu")
    torch.tensor([1.0])
    th.cuda.synchronize()
    tc.current_stream(dev).wait_stream(tc.Stream())
    sync()
    items = {}.items()
    threading_event.wait(1.0)

class C:
    def m(self):
        def inner(s):
            return s.stream.query()
        return torch.cuda
'''


def test_the_walk_finds_each_kind_of_call_and_skips_the_harmless_ones():
    """The finder itself: a module with every kind of call, and the forms that are not host syncs."""
    got = sorted((qual, call, line) for _, qual, call, line in find_calls(_SAMPLE, "sample.py"))
    want = sorted([
        ("<module>", "torch.cuda.is_available", 7),
        ("reads", ".item", 10), ("reads", ".tolist", 10), ("reads", ".cpu", 10), ("reads", ".numpy", 10),
        ("reads", ".synchronize", 11), ("reads", ".query", 11), ("reads", ".elapsed_time", 11),
        ("reads", ".is_completed", 11),
        ("reads", ".copy_", 12),
        ("reads", ".to", 15), ("reads", ".to", 16), ("reads", ".to", 17),
        ("reads", ".cuda", 22),
        ("reads", "torch.tensor(device=)", 24),
        ("reads", "torch.cuda.synchronize", 27),
        ("reads", "torch.cuda.current_stream", 28), ("reads", "torch.cuda.Stream", 28),
        ("reads", "torch.cuda.synchronize", 29),
        ("C.m.inner", ".query", 36),
        ("C.m", "torch.cuda", 37),
    ])
    assert got == want, f"missing: {sorted(set(want) - set(got))}; unexpected: {sorted(set(got) - set(want))}"


def test_the_control_plane_refuses_a_device_vector_instead_of_copying_it_to_the_host():
    """The control plane's all_gather took any vector and ``.cpu()``'d it: a device vector would have been
    a blocking device-to-host copy on the caller's thread, outside the door.  It now refuses one (a
    ``meta`` tensor stands for a device tensor on a CPU-only host) and passes host vectors as before."""
    import pytest
    import torch

    from titan_ext.runtime.comm.control_plane import ControlPlane

    plane = ControlPlane(None)  # no process group: the local plane
    with pytest.raises(ValueError, match="host tensors"):
        plane.all_gather(torch.zeros(3, device="meta"))
    assert [t.tolist() for t in plane.all_gather(torch.ones(2))] == [[1.0, 1.0]]
