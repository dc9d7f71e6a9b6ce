"""The ``[titan_ext]`` section of a TorchTitan TOML config.

Enable it with ``[job] custom_config_module = "titan_ext.titan.config"``: TorchTitan's
``ConfigManager`` merges :class:`JobConfig` below into its own ``JobConfig``, so every field of
:class:`TitanExt` can be set in the TOML file (``[titan_ext] replan_interval = 5``) or on the command
line (``--titan_ext.replan_interval 5``).

Every value is checked when the section is constructed (``TitanExt.__post_init__``), i.e. while
TorchTitan parses the config and before any process group exists. A bad value raises
:class:`TitanExtConfigError` (a ``ValueError``) whose message names the key, e.g.
``[titan_ext] delegation = 'sometimes': must be one of 'off', 'auto', 'always'``.

Besides the built-in knobs of :class:`TitanExt` (each names, in its field metadata, the config keyword it
sets: :func:`sets`), every registered adaptive schedule (``titan_ext.runtime.control.registry``) brings the
fields its config class adds to ``AdaptiveConfig`` as knobs of the same name, documented by the
fields' docstrings (:func:`registered_knobs`); ``JobConfig`` -- what ``job.custom_config_module``
hands TorchTitan -- is built from the registry when asked for (:func:`job_config_class`).

This module imports no torch at import time; validating a non-empty ``inject_delays`` /
``inject_trace`` loads the runtime's delay parser (and with it torch), and so does asking for
``JobConfig`` or the registered knobs (the registry is the runtime's).
"""


import ast
import inspect
import math
import textwrap
import threading
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, Literal

from titan_ext.plan.virtual import PLACEMENTS as VIRTUAL_PLACEMENTS

__all__ = ["TitanExt", "JobConfig", "TitanExtConfigError", "validate_titan_ext", "config_delay_schedule",
           "job_config_class", "registered_knobs", "schedule_knobs", "section_class", "sets"]

# The knobs that take one of a fixed set of strings are typed Literal, as TorchTitan types its own: tyro
# then lists the choices in --help and refuses another on the command line. A TOML value (0.2's
# ConfigManager builds the section from the file before tyro runs) is checked by validate_titan_ext,
# which reads the choices from the same type.
Delegation = Literal["off", "auto", "always"]
Backward = Literal["", "auto", "measure", "split", "full"]
Placement = Literal[("",) + VIRTUAL_PLACEMENTS]  # "" = the schedule's own; the planner's placements
DELEGATION_MODES = typing.get_args(Delegation)
PLACEMENTS = typing.get_args(Placement)
MAX_SLOT_MIB = 65536  # one delegate slot: at most 64 GiB of host memory
MAX_PASS_MS = 600_000.0  # an emulated pass of more than 10 minutes is a typo


def sets(keyword: str, convert: Callable[[Any], Any] | None = None) -> dict:
    """A ``[titan_ext]`` knob's field metadata: the adaptive schedules' config keyword it sets
    (``AdaptiveConfig.updated``'s keywords; ``policy_settings.<field>`` for a ``PolicySettings`` field),
    and how its value becomes the keyword's (``None``: leave the schedule's default).  Read by
    ``titan/options.py``; a schedule's own config fields need none (they are knobs of their own name,
    :func:`schedule_knobs`)."""
    return {"sets": keyword, "convert": convert}


def _gib_to_bytes(v: float) -> float | None:
    return float(v * 1024**3) if v > 0 else None


def _mib_to_bytes(v: float) -> int | None:
    return int(round(v * 2**20)) if v > 0 else None


def _positive_or_none(v: int) -> int | None:
    return int(v) if v > 0 else None


def _empty_is_none(v: str) -> str | None:
    return v or None


def _zero_is_none(v: float) -> float | None:
    return float(v) if v > 0 else None


class TitanExtConfigError(ValueError):
    """A ``[titan_ext]`` value is invalid; the message names the key."""


@dataclass
class TitanExt:
    """Knobs of titan_ext's adaptive pipeline schedules (PipeMorph / CrossPipe) and its metrics."""

    memory_budget_gib: float = field(default=0.0, metadata=sets("memory_budget_bytes", _gib_to_bytes))
    """Activation-memory budget per pipeline rank, in GiB (PipeMorph Alg.1's M): with one
    microbatch's activation bytes, measured in the first forward, it fixes how many microbatches
    stage 0 may hold in flight (x_max = M / M^F). 0 = no budget (``max_inflight`` decides)."""

    max_inflight: int = field(default=0, metadata=sets("max_inflight", _positive_or_none))
    """x_max directly: microbatches stage 0 may hold in flight; overrides ``memory_budget_gib``.
    0 = from the budget, or 2S - 1 without one (uniform slackness 2, the ZeroBubble plan)."""

    adaptive: bool = field(default=True, metadata=sets("adaptive"))
    """Re-plan from live profiling (PipeMorph Alg.2) when a link's measured delay breaks the
    deployed plan's tolerance (Eq.1), and shrink again when it recovers. False = keep the initial
    plan (profiling and metrics still run)."""

    slack_floor: int = field(default=2, metadata=sets("slack_floor"))
    """Smallest slackness Δ_i the adaptive planner keeps on every link (PipeMorph Alg.2). >= 1."""

    backward: Backward = field(default="", metadata=sets("backward", _empty_is_none))
    """Backward actions of PipeMorph's plans: "split" (I and W, ZeroBubble-style: W fills bubbles),
    "full" (one full backward B per microbatch, 1F1B-style, with PipeMorph's warm-up counts), "auto"
    (every re-plan plans both and keeps the one the model predicts faster from measured times;
    PipeMorph's default) or "measure" (after each re-plan, run the other variant for a window of
    iterations and keep the one with the lower measured iteration time; ``runtime/decide/backward.py``).
    Empty = the schedule's default (PipeMorph: auto; CrossPipe: split, its only variant)."""

    polish_s: float = field(default=0.0, metadata=sets("polish_s", _zero_is_none))
    """Anytime planning (PipeMorph / CrossPipe): after each plan the planner deploys (the calibrated
    initial plan, every adaptive re-plan), a background thread polishes it with CP-SAT and CrossPipe's
    search within this many seconds; training never waits for it, and a faster validated plan is
    swapped in at a later check once every rank has it (one more plan version). Needs OR-Tools
    (``pip install 'titan-ext[solver]'``; without it: logged once and off). 0 = off."""

    replan_interval: int = field(default=1, metadata=sets("profile_every"))
    """Iterations between two re-planning checks; the ranks exchange their profiles (one small
    all_gather) once per check. >= 1."""

    profile_window: int = field(default=3, metadata=sets("policy_settings.window"))
    """Recent profile exchanges whose medians form the robust estimates (compute times and link
    delays) the policy and the planner use. >= 1."""

    tolerance_margin: float = field(default=0.10, metadata=sets("policy_settings.rel_margin"))
    """Detector threshold, relative: a link counts as slow when its measured delay exceeds the
    deployed plan's Eq.1 tolerance by this fraction (and the planner plans with this headroom).
    In [0, 10]."""

    tolerance_margin_ms: float = field(default=1.0, metadata=sets("policy_settings.abs_margin_ms"))
    """Detector threshold, absolute (ms): also required on top of the tolerance, so that timer
    noise on tiny tolerances does not trigger re-plans. >= 0."""

    recover_patience: int = field(default=3, metadata=sets("policy_settings.recover_patience"))
    """Hysteresis: consecutive checks that must agree that a link recovered before slackness
    shrinks (memory is given back), so jitter does not flap the plan. >= 1."""

    min_dwell: int = field(default=2, metadata=sets("policy_settings.min_dwell"))
    """Hysteresis: iterations a deployed plan runs at least before it may shrink. >= 0."""

    delegation: Delegation = field(default="off", metadata=sets("delegation"))
    """Moving PP sends/receives off the compute critical path onto delegate processes (PipeMorph
    §5): "off", "auto" (direct until a link's estimated delay exceeds
    ``delegation_slow_link_ms``, then delegated from the next iteration boundary on) or "always".
    Every adaptive schedule has it (its transport, ``schedule.delegation``)."""

    delegation_slow_link_ms: float = field(default=5.0, metadata=sets("slow_link_ms", float))
    """Auto delegation's threshold on a link's estimated one-way delay, ms. >= 0."""

    delegation_failover: bool = field(default=False, metadata=sets("failover"))
    """Retry a failed or timed-out direct PP transfer on the delegate path (PipeMorph §5.3)."""

    delegation_slot_mib: float = field(default=0.0, metadata=sets("delegate_slot_bytes", _mib_to_bytes))
    """Size of one delegate slot (the largest PP message it carries), MiB. 0 = derived from the
    stage's messages at the first delegated iteration (the largest inter-stage activation of the
    pipeline, agreed by all ranks). Host memory per delegate lane is about 16 slots of this size.
    In [0, 65536]."""

    inject_delays: str = ""
    """Straggler emulation on the real PP messages (``titan_ext.runtime.inject_link_delays``), static
    spec: comma-separated "link:ms[:bandwidth]" items, e.g. "2:30" (link 2, between stages 2 and 3,
    gets +30 ms one way), "0:10,2:30:100MB/s", "*:5" (every link). Empty = none. Applies to every
    schedule (baselines too). Mutually exclusive with ``inject_trace``."""

    inject_trace: str = ""
    """Straggler emulation from a CSV trace file: header ``time_s,link0,link2,...`` (optionally
    ``link2_bw`` in bytes/s), rows = per-link latency in ms from that time on (seconds since training
    start, shared by all ranks). Empty = none. Mutually exclusive with ``inject_delays``."""

    placement: Placement = ""
    """Where a rank's model chunks sit when it holds several stages (docs/multistage.md):
    "loop" (rank r holds stages r, r+R, ...: torch's Interleaved schedules) or "v" (rank r holds r
    and 2R-1-r: ZBV / DualPipeV). Empty = the schedule's own placement. Validated here; "v" makes
    ``titan_ext.train`` build TorchTitan's V-style split for PipeMorph / CrossPipe (two stages per
    rank), which read the placement from their stages (``titan_ext.runtime.decide.placement``)."""

    link_alpha_beta: str = ""
    """Known α-β of PP links for CrossPipe's link model (CrossPipe §2.2), in the grammar of
    ``inject_delays``: comma-separated "link:latency_ms[:bandwidth]" items, e.g. "2:5:50MB/s"
    (α = 5 ms, 1/β = 50 MB/s on link 2). Links listed here override what is fitted from the timed
    messages (``titan_ext.plan.linkfit``); empty = none. Validated here; the run-time wiring of
    several stages per rank to these links is not built yet."""

    falcon: bool = field(default=True, metadata=sets("falcon"))
    """Falcon fail-slow detection (BOCD change points on the iteration time, per-link profiling,
    ski-rental mitigation planning; Falcon §4–§5) inside PipeMorph / CrossPipe. Its events, root
    cause, chosen strategy and measured effect are logged with the pipeline metrics (``falcon/*``).
    About 50 µs of CPU per iteration. In DP x PP jobs (data_parallel_replicate_degree > 1 with PP)
    the trainer runs it per step instead, with validation and micro-batch redistribution
    (:mod:`titan_ext.titan.falcon_job`; decisions in ``<dump_folder>/falcon.jsonl``)."""

    falcon_apply: bool = True
    """DP x PP jobs (:mod:`titan_ext.titan.falcon_job`): apply Falcon's decisions (PipeMorph
    re-planning, micro-batch redistribution). False = detect, validate and log them only (a
    baseline with the same measurement)."""

    falcon_check_every: int = 4
    """DP x PP jobs (:mod:`titan_ext.titan.falcon_job`): the ranks exchange Falcon's step numbers
    (one MAX reduction by recursive doubling on the gloo control group) every K steps and at the
    last step, each exchange carrying every step since the previous one: the detector still sees
    every step's iteration time, in order, K - 1 steps later at most. 1 = every step. Decisions
    are applied at an exchange; the steps run between the decided one and the exchange are
    recorded but not fed (they describe the configuration the decision changed)."""

    emulate_slow_device: str = ""
    """Fail-slow emulation (Falcon's computation fail-slow): "D:F[@STEP]" = device (initial rank) D
    computes F times slower (F >= 1), from training step STEP on (default 0). Every forward and
    backward of its model part and the GEMM probe is followed by a sleep of (F - 1) x its duration.
    Empty = none; the environment variable TITAN_EXT_SLOW_DEVICE is used when empty. DP x PP jobs
    only (``data_parallel_replicate_degree`` > 1 with PP; :mod:`titan_ext.titan.falcon_job`)."""

    emulate_slow_link: str = ""
    """Fail-slow emulation (communication): "A-B:MS[@STEP]" = the link between devices A and B adds
    MS ms to every message from step STEP on: to the DP gradient all-reduce (2 ring steps) when A
    and B are one stage's replicas, to the PP messages (``inject_delays`` on A and B only) when they
    are neighbours in a pipeline, and to validation messages. Empty = none; the environment
    variable TITAN_EXT_SLOW_LINK is used when empty. DP x PP jobs only, like emulate_slow_device."""

    emulate_link_window_kib: float = 0.0
    """Latency faults (``emulate_slow_link = "A-B:MS"``) through a bounded window of this many KiB
    in flight per link (NCCL: 8 slots of one chunk per channel): a transfer of n bytes pays
    ceil(n / window) x MS — a stage's DP gradient many times, an activation once (PipeMorph §7.3's
    DP-link latency fault, Fig. 19). 0 = unbounded: every message and ring step pays MS once."""

    emulate_link_hol: bool = False
    """The slow link, once it is a PP hop, blocks the way NCCL's does (PipeMorph §3.2 head-of-line
    blocking: the rank that issued a message on it waits until the message arrived before it goes
    on; ``inject_link_delays(hol=True)``). Messages the delegates carry are not held (what delegation
    removes). False: only the message's arrival is late (gloo on a host, the default)."""

    emulate_link_hol_hold: float = 1.0
    """The strength of ``emulate_link_hol``: the issuing rank is held this fraction of each delayed
    message's delay (1 = until it arrived, the maximal stand-in; 0 = not held). The Fig. 19 bench
    sets it from a calibration to PipeMorph Fig. 6's measured 1.9× (``scripts/bench_falcon.py
    --calibrate-hol``)."""

    falcon_spares: str = ""
    """Spare devices S4 may restart a slow device's rank on (Falcon §5.1: "checkpoint-and-restart on
    healthy nodes"), comma-separated device ids no rank uses: on CPU emulated devices (a healthy
    device of its own), on GPUs local CUDA device indices beyond the world. Empty: S4 shrinks DP
    (the slow device's replica leaves)."""

    falcon_devices: str = ""
    """The device each rank runs on, comma-separated by rank (set by an S4 restart onto a spare;
    emulated faults belong to devices). Empty: rank i on device i."""

    falcon_delegation: bool = False
    """After Falcon's S3 moved a slow link onto a PP hop, turn PipeMorph's re-planning on and delegate
    the moved link's PP messages, the pipeline's other links staying direct (PipeMorph §7.3: S3, then
    re-planning with delegation on the moved link). Needs ``delegation = "auto"`` or ``"always"``."""

    emulate_device_pass_ms: float = 0.0
    """Dedicated-device emulation for PP jobs on a shared CPU host (benchmarks): every forward
    of a model part takes this many ms and every backward twice that, on every rank (F times that
    on the ``emulate_slow_device``), the host sleeping out what the real compute left — so ranks
    that share cores run like ranks on devices of their own while the real compute of a pass stays
    below it. 0 = off: passes take their real time. Ignored on CUDA."""

    gantt_every: int = 10
    """On the first logged step of every K steps, log an image of the measured pipeline timeline
    (Gantt) to W&B and write it under ``<dump_folder>/timelines``. 0 = never."""

    metrics_file: str = "pipeline_metrics.jsonl"
    """Per-step pipeline metrics (iteration time, bubble rate, link delays, plan version, ...),
    one JSON object per line, written under ``<dump_folder>`` by the logging rank. Empty = off."""

    trust_checkpoint: bool = False
    """Load TorchTitan checkpoints without titan_ext's check. By default the trainer loads a DCP step
    folder only when its ``titan_ext_manifest.json`` (written by the trainer's saves) lists exactly its
    files with matching sizes and SHA-256, since loading unpickles them
    (:mod:`titan_ext.titan.checkpoint_guard`). True: load any, e.g. one saved by stock TorchTitan."""

    def __post_init__(self) -> None:
        from titan_ext import _flags

        if not _flags.DEFER_SECTION_CHECK:  # titan_ext.train checks it after parsing (one line)
            validate_titan_ext(self)


def config_delay_schedule(spec: str, key: str = "inject_delays"):
    """A config key's delay schedule (None: empty), parsed by the one parser,
    :func:`titan_ext.runtime.emulate.delay_injection.parse_delay_spec` ("2:30", "0:10,2:30:100MB/s", "*:5",
    "trace:PATH"); errors name ``key``.

    Imports torch (through the runtime) only when called with a non-empty spec.
    """
    if not spec.strip():
        return None
    from titan_ext.runtime.emulate.delay_injection import DelaySpecError
    from titan_ext.runtime.emulate.delay_injection import parse_delay_spec as runtime_parse

    try:
        return runtime_parse(spec)
    except DelaySpecError as e:
        raise TitanExtConfigError(f"[titan_ext] {key} = {spec!r}: {e}") from None


def _check(cond: bool, key: str, value, why: str) -> None:
    if not cond:
        raise TitanExtConfigError(f"[titan_ext] {key} = {value!r}: {why}")


def validate_titan_ext(cfg: TitanExt, num_pp_links: int | None = None) -> None:
    """Check every field; with ``num_pp_links`` also check that injected links exist."""
    for f in fields(TitanExt):  # the built-in knobs (a registered schedule's: _validate_schedule_knobs)
        v = getattr(cfg, f.name)
        if typing.get_origin(f.type) is Literal:  # one of a fixed set of strings
            choices = typing.get_args(f.type)
            _check(isinstance(v, str) and v in choices, f.name, v,
                   "must be one of " + ", ".join(repr(c) for c in choices))
            continue
        tname = f.type if isinstance(f.type, str) else f.type.__name__
        want = {"float": (int, float), "int": int, "str": str, "bool": bool}[tname]
        _check(isinstance(v, want) and (tname == "bool" or not isinstance(v, bool)), f.name, v,
               f"must be of type {tname}")
    _check(math.isfinite(cfg.memory_budget_gib) and cfg.memory_budget_gib >= 0, "memory_budget_gib",
           cfg.memory_budget_gib, "must be a finite number >= 0 (0 = no budget)")
    _check(cfg.max_inflight >= 0, "max_inflight", cfg.max_inflight, "must be >= 0 (0 = automatic)")
    _check(cfg.slack_floor >= 1, "slack_floor", cfg.slack_floor, "must be >= 1")
    _check(math.isfinite(cfg.polish_s) and cfg.polish_s >= 0, "polish_s", cfg.polish_s,
           "must be a finite number of seconds >= 0 (0 = off)")
    _check(cfg.replan_interval >= 1, "replan_interval", cfg.replan_interval, "must be >= 1")
    _check(cfg.profile_window >= 1, "profile_window", cfg.profile_window, "must be >= 1")
    _check(math.isfinite(cfg.tolerance_margin) and 0 <= cfg.tolerance_margin <= 10,
           "tolerance_margin", cfg.tolerance_margin, "must be in [0, 10]")
    _check(math.isfinite(cfg.tolerance_margin_ms) and cfg.tolerance_margin_ms >= 0,
           "tolerance_margin_ms", cfg.tolerance_margin_ms, "must be a finite number >= 0")
    _check(cfg.recover_patience >= 1, "recover_patience", cfg.recover_patience, "must be >= 1")
    _check(cfg.min_dwell >= 0, "min_dwell", cfg.min_dwell, "must be >= 0")
    _check(math.isfinite(cfg.delegation_slow_link_ms) and cfg.delegation_slow_link_ms >= 0,
           "delegation_slow_link_ms", cfg.delegation_slow_link_ms, "must be a finite number >= 0")
    _check(math.isfinite(cfg.delegation_slot_mib) and 0 <= cfg.delegation_slot_mib <= MAX_SLOT_MIB,
           "delegation_slot_mib", cfg.delegation_slot_mib, f"must be in [0, {MAX_SLOT_MIB}] (0 = derived)")
    for key in ("emulate_slow_device", "emulate_slow_link"):
        _check_emulation(key, getattr(cfg, key))
    for key in ("falcon_spares", "falcon_devices"):
        text = getattr(cfg, key).strip()
        _check(not text or all(x.strip().isdigit() and x.strip().isascii() for x in text.split(",")), key, text,
               "must be comma-separated device ids (integers >= 0)")
    _check(math.isfinite(cfg.emulate_link_hol_hold) and 0 <= cfg.emulate_link_hol_hold <= 1,
           "emulate_link_hol_hold", cfg.emulate_link_hol_hold, "must be a number in [0, 1]")
    _check(math.isfinite(cfg.emulate_link_window_kib) and cfg.emulate_link_window_kib >= 0,
           "emulate_link_window_kib", cfg.emulate_link_window_kib, "must be a finite number >= 0 (0 = unbounded)")
    _check(math.isfinite(cfg.emulate_device_pass_ms) and 0 <= cfg.emulate_device_pass_ms <= MAX_PASS_MS,
           "emulate_device_pass_ms", cfg.emulate_device_pass_ms,
           f"must be a number in [0, {MAX_PASS_MS:g}] (0 = off)")
    _check(cfg.falcon_check_every >= 1, "falcon_check_every", cfg.falcon_check_every, "must be >= 1 (1 = every step)")
    _check(cfg.gantt_every >= 0, "gantt_every", cfg.gantt_every, "must be >= 0 (0 = never)")
    _check("/" not in cfg.metrics_file and "\\" not in cfg.metrics_file and "\0" not in cfg.metrics_file
           and cfg.metrics_file.strip() not in (".", ".."), "metrics_file",
           cfg.metrics_file, "must be a plain file name (it is written under job.dump_folder)")
    _check(not (cfg.inject_delays.strip() and cfg.inject_trace.strip()), "inject_delays",
           cfg.inject_delays, "set either inject_delays or inject_trace, not both")
    spec = cfg.link_alpha_beta.strip()
    _check(not spec.startswith("trace:") and not spec.endswith(".csv"), "link_alpha_beta",
           cfg.link_alpha_beta, "takes static 'link:latency_ms[:bandwidth]' items, not a trace")
    _check_links(config_delay_schedule(cfg.link_alpha_beta, "link_alpha_beta"), "link_alpha_beta",
                 cfg.link_alpha_beta, num_pp_links)
    key, schedule = None, None
    if cfg.inject_delays.strip():
        key = "inject_delays"
        _check(not cfg.inject_delays.strip().startswith("trace:")
               and not cfg.inject_delays.strip().endswith(".csv"), key, cfg.inject_delays,
               "a trace file goes into inject_trace")
        schedule = config_delay_schedule(cfg.inject_delays, key)
    elif cfg.inject_trace.strip():
        key = "inject_trace"
        from titan_ext.runtime.emulate.delay_injection import DelaySpecError, load_delay_trace

        try:
            schedule = load_delay_trace(cfg.inject_trace)
        except DelaySpecError as e:
            raise TitanExtConfigError(f"[titan_ext] {key} = {cfg.inject_trace!r}: {e}") from None
    if key is not None:
        _check_links(schedule, key, getattr(cfg, key), num_pp_links)


def _check_links(schedule, key: str, value, num_pp_links: int | None) -> None:
    """The links a parsed spec names exist for the pipeline degree (when it is known)."""
    if schedule is not None and num_pp_links is not None:
        link = schedule.max_link()
        _check(link < num_pp_links, key, value,
               f"link {link} does not exist: with {num_pp_links + 1} pipeline stages the links "
               f"are 0..{num_pp_links - 1} (link i joins stages i and i+1)")


def _check_emulation(key: str, spec: str) -> None:
    if not spec.strip():
        return
    from titan_ext.runtime.falcon.emulation import EmulationSpecError, parse_slow_device, parse_slow_link

    parse = parse_slow_device if key == "emulate_slow_device" else parse_slow_link
    try:
        parse(spec)
    except EmulationSpecError as e:
        raise TitanExtConfigError(f"[titan_ext] {key} = {spec!r}: {e}") from None


# ---------------------------------------------------------------------------------------------------
# the registered schedules' own knobs
# ---------------------------------------------------------------------------------------------------
_TOML_TYPES = (bool, int, float, str)


@dataclass(frozen=True)
class ScheduleKnob:
    """A ``[titan_ext]`` knob derived from a registered schedule's config field."""

    name: str
    type: type
    default: Any
    doc: str  # the config field's docstring
    schedules: tuple[str, ...]  # the registered schedules whose config has the field


def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass and its bases (the string right after a field), by field."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                out[node.target.id] = inspect.cleandoc(nxt.value.value)
    return out


def schedule_knobs(config_class: type) -> list[tuple[str, type, Any, str]]:
    """``(name, type, default, docstring)`` of the ``[titan_ext]`` knobs a schedule's config class
    gives: every field it adds to ``AdaptiveConfig`` whose type a TOML value carries (bool, int,
    float, str) and that has a default.  Other added fields (None-able, sequences, objects) stay
    config-only (``config=`` or keywords of the schedule's constructor).  Imports the runtime."""
    from dataclasses import MISSING

    from titan_ext.runtime.control.config import AdaptiveConfig

    common = {f.name for f in fields(AdaptiveConfig)}
    hints = typing.get_type_hints(config_class)
    docs = field_docs(config_class)
    return [(f.name, hints[f.name], f.default, docs.get(f.name, ""))
            for f in fields(config_class)
            if f.init and f.name not in common and hints.get(f.name) in _TOML_TYPES and f.default is not MISSING]


def registered_knobs() -> dict[str, ScheduleKnob]:
    """The knobs of every registered adaptive schedule (``runtime/control/registry.py``), by name.  A knob
    shared by several schedules must have one type and default; none may shadow a built-in knob."""
    from titan_ext.runtime.control.registry import schedule_specs

    builtin = {f.name for f in fields(TitanExt)}
    out: dict[str, ScheduleKnob] = {}
    for spec in schedule_specs():
        for name, typ, default, doc in schedule_knobs(spec.config_class):
            if name in builtin:
                raise ValueError(f"schedule {spec.name!r}: config field {name!r} would shadow the built-in "
                                 f"[titan_ext] knob {name!r}; rename the field")
            prev = out.get(name)
            if prev is not None and (prev.type, prev.default) != (typ, default):
                raise ValueError(f"[titan_ext] {name}: schedules {prev.schedules + (spec.name,)} give it different "
                                 f"types or defaults ({prev.type.__name__} = {prev.default!r}, "
                                 f"{typ.__name__} = {default!r})")
            out[name] = ScheduleKnob(name, typ, default, prev.doc if prev else doc,
                                     (prev.schedules if prev else ()) + (spec.name,))
    return out


def _validate_schedule_knobs(section: Any, knobs: dict[str, ScheduleKnob]) -> None:
    """A schedule knob's value: of the knob's type, and accepted by each owning schedule's config
    (its ``__post_init__``); errors name the key."""
    from titan_ext.runtime.control.registry import schedule_class

    for knob in knobs.values():
        v = getattr(section, knob.name)
        want = (int, float) if knob.type is float else knob.type
        _check(isinstance(v, want) and (knob.type is bool or not isinstance(v, bool)), knob.name, v,
               f"must be of type {knob.type.__name__}")
        for name in knob.schedules:
            try:
                schedule_class(name).spec.config_class(**{knob.name: v})
            except (TypeError, ValueError) as e:
                raise TitanExtConfigError(f"[titan_ext] {knob.name} = {v!r}: {e}") from None


_built: dict[tuple, type] = {}
_build_lock = threading.Lock()


def section_class() -> type:
    """The ``[titan_ext]`` section: :class:`TitanExt` plus the knobs of every registered adaptive
    schedule (:func:`registered_knobs`, each documented by its config field's docstring; TorchTitan's
    ``--help`` shows it).  Rebuilt when a schedule is registered.  Imports the runtime."""
    knobs = registered_knobs()
    key = tuple((k.name, k.type, k.default, k.schedules) for k in knobs.values())
    with _build_lock:
        if key in _built:
            return _built[key]
    if not knobs:
        return TitanExt
    try:  # the help text TorchTitan's CLI (tyro) shows; a plain type without tyro
        import tyro

        def annotate(k: ScheduleKnob) -> Any:
            return typing.Annotated[k.type, tyro.conf.arg(help=k.doc or None)]
    except ImportError:
        def annotate(k: ScheduleKnob) -> Any:
            return k.type

    def __post_init__(self) -> None:
        TitanExt.__post_init__(self)
        _validate_schedule_knobs(self, knobs)

    doc = "\n".join([TitanExt.__doc__ or "", "", "Knobs of the registered schedules' configs:",
                      *(f"  {k.name} ({', '.join(k.schedules)}): {k.doc}" for k in knobs.values())])
    cls = make_dataclass(
        "TitanExt", [(k.name, annotate(k), field(default=k.default, metadata={"schedules": k.schedules, "doc": k.doc}))
                     for k in knobs.values()],
        bases=(TitanExt,), namespace={"__post_init__": __post_init__, "__doc__": doc, "__module__": __name__})
    with _build_lock:
        return _built.setdefault(key, cls)


def job_config_class() -> type:
    """What TorchTitan's ConfigManager merges into its own JobConfig (``job.custom_config_module =
    "titan_ext.titan.config"``, whose ``JobConfig`` this is): a ``titan_ext`` section of
    :func:`section_class`.  A module that registers a schedule of its own and then exports
    ``JobConfig = job_config_class()`` may be the job's ``custom_config_module`` instead."""
    section = section_class()
    with _build_lock:
        key = ("JobConfig", section)
        if key not in _built:
            _built[key] = make_dataclass(
                "JobConfig", [("titan_ext", section, field(default_factory=section))],
                namespace={"__doc__": "Merged by TorchTitan's ConfigManager into its own JobConfig "
                                      "(``job.custom_config_module``).", "__module__": __name__})
        return _built[key]


def __getattr__(name: str) -> Any:
    if name == "JobConfig":  # built from the schedule registry when TorchTitan (or a test) asks for it
        return job_config_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
