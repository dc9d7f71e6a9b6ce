"""The ``[titan_ext]`` section of a TorchTitan TOML config.

Enable it with ``[job] custom_config_module = "titan_ext.titan.config"``: TorchTitan's
``ConfigManager`` merges :class:`JobConfig` below into its own ``JobConfig``, so every field of
:class:`TitanExt` can be set in the TOML file (``[titan_ext] replan_interval = 5``) or on the command
line (``--titan_ext.replan_interval 5``).

Every value is checked when the section is constructed (``TitanExt.__post_init__``), i.e. while
TorchTitan parses the config and before any process group exists. A bad value raises
:class:`TitanExtConfigError` (a ``ValueError``) whose message names the key, e.g.
``[titan_ext] delegation = 'sometimes': must be one of 'off', 'auto', 'always'``.

This module imports no torch at import time; only validating a non-empty ``inject_delays`` /
``inject_trace`` loads the runtime's delay parser (and with it torch).
"""


import math
import os
from dataclasses import dataclass, field, fields

from titan_ext.plan.virtual import PLACEMENTS as VIRTUAL_PLACEMENTS

__all__ = ["TitanExt", "JobConfig", "TitanExtConfigError", "validate_titan_ext", "config_delay_schedule"]

DELEGATION_MODES = ("off", "auto", "always")
MAX_SLOT_MIB = 65536  # one delegate slot: at most 64 GiB of host memory
PLACEMENTS = ("",) + VIRTUAL_PLACEMENTS  # "" = the schedule's own



class TitanExtConfigError(ValueError):
    """A ``[titan_ext]`` value is invalid; the message names the key."""


@dataclass
class TitanExt:
    """Knobs of titan_ext's adaptive pipeline schedules (PipeMorph / CrossPipe) and its metrics."""

    memory_budget_gib: float = 0.0
    """Activation-memory budget per pipeline rank, in GiB (PipeMorph Alg.1's M): with one
    microbatch's activation bytes, measured in the first forward, it fixes how many microbatches
    stage 0 may hold in flight (x_max = M / M^F). 0 = no budget (``max_inflight`` decides)."""

    max_inflight: int = 0
    """x_max directly: microbatches stage 0 may hold in flight; overrides ``memory_budget_gib``.
    0 = from the budget, or 2S - 1 without one (uniform slackness 2, the ZeroBubble plan)."""

    adaptive: bool = True
    """Re-plan from live profiling (PipeMorph Alg.2) when a link's measured delay breaks the
    deployed plan's tolerance (Eq.1), and shrink again when it recovers. False = keep the initial
    plan (profiling and metrics still run)."""

    slack_floor: int = 2
    """Smallest slackness Δ_i the adaptive planner keeps on every link (PipeMorph Alg.2). >= 1."""

    backward: str = ""
    """Backward actions of PipeMorph's plans: "split" (I and W, ZeroBubble-style: W fills bubbles),
    "full" (one full backward B per microbatch, 1F1B-style, with PipeMorph's warm-up counts) or
    "auto" (after each re-plan, run the other variant for ``profile_window`` iterations and keep the
    one with the lower measured iteration time; PipeMorph's default). Empty = the schedule's default
    (PipeMorph: auto; CrossPipe: split, its only variant)."""

    replan_interval: int = 1
    """Iterations between two re-planning checks; the ranks exchange their profiles (one small
    all_gather) once per check. >= 1."""

    profile_window: int = 3
    """Recent profile exchanges whose medians form the robust estimates (compute times and link
    delays) the policy and the planner use. >= 1."""

    tolerance_margin: float = 0.10
    """Detector threshold, relative: a link counts as slow when its measured delay exceeds the
    deployed plan's Eq.1 tolerance by this fraction (and the planner plans with this headroom).
    In [0, 10]."""

    tolerance_margin_ms: float = 1.0
    """Detector threshold, absolute (ms): also required on top of the tolerance, so that timer
    noise on tiny tolerances does not trigger re-plans. >= 0."""

    recover_patience: int = 3
    """Hysteresis: consecutive checks that must agree that a link recovered before slackness
    shrinks (memory is given back), so jitter does not flap the plan. >= 1."""

    min_dwell: int = 2
    """Hysteresis: iterations a deployed plan runs at least before it may shrink. >= 0."""

    delegation: str = "off"
    """Moving PP sends/receives off the compute critical path onto delegate processes (PipeMorph
    §5): "off", "auto" (direct until a link's estimated delay exceeds
    ``delegation_slow_link_ms``, then delegated from the next iteration boundary on) or "always".
    Uses the runtime's DelegatedPipeMorph."""

    delegation_slow_link_ms: float = 5.0
    """Auto delegation's threshold on a link's estimated one-way delay, ms. >= 0."""

    delegation_failover: bool = False
    """Retry a failed or timed-out direct PP transfer on the delegate path (PipeMorph §5.3)."""

    delegation_slot_mib: float = 0.0
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

    placement: str = ""
    """Where a rank's model chunks sit when it holds several stages (docs/multistage.md):
    "loop" (rank r holds stages r, r+R, ...: torch's Interleaved schedules) or "v" (rank r holds r
    and 2R-1-r: ZBV / DualPipeV). Empty = the schedule's own placement. Validated here; "v" makes
    ``titan_ext.train`` build TorchTitan's V-style split for PipeMorph / CrossPipe (two stages per
    rank), which read the placement from their stages (``titan_ext.runtime.placement``)."""

    link_alpha_beta: str = ""
    """Known α-β of PP links for CrossPipe's link model (CrossPipe §2.2), in the grammar of
    ``inject_delays``: comma-separated "link:latency_ms[:bandwidth]" items, e.g. "2:5:50MB/s"
    (α = 5 ms, 1/β = 50 MB/s on link 2). Links listed here override what is fitted from the timed
    messages (``titan_ext.plan.linkfit``); empty = none. Validated here; the run-time wiring of
    several stages per rank to these links is not built yet."""

    falcon: bool = True
    """Falcon fail-slow detection (BOCD change points on the iteration time, per-link profiling,
    ski-rental mitigation planning; Falcon §4–§5) inside PipeMorph / CrossPipe. Its events, root
    cause, chosen strategy and measured effect are logged with the pipeline metrics (``falcon/*``).
    About 50 µs of CPU per iteration. In DP x PP jobs (data_parallel_replicate_degree > 1 with PP)
    the trainer runs it per step instead, with validation and micro-batch redistribution
    (:mod:`titan_ext.titan.falcon.job`; decisions in ``<dump_folder>/falcon.jsonl``)."""

    falcon_apply: bool = True
    """DP x PP jobs (:mod:`titan_ext.titan.falcon.job`): apply Falcon's decisions (PipeMorph
    re-planning, micro-batch redistribution). False = detect, validate and log them only (a
    baseline with the same measurement)."""

    emulate_slow_device: str = ""
    """Fail-slow emulation (Falcon's computation fail-slow): "D:F[@STEP]" = device (initial rank) D
    computes F times slower (F >= 1), from training step STEP on (default 0). Every forward and
    backward of its model part and the GEMM probe is followed by a sleep of (F - 1) x its duration.
    Empty = none; the environment variable TITAN_EXT_SLOW_DEVICE is used when empty. DP x PP jobs
    only (``data_parallel_replicate_degree`` > 1 with PP; :mod:`titan_ext.titan.falcon.job`)."""

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
    the moved link's pipeline's PP messages (PipeMorph §7.3: S3, then re-planning with delegation on
    the moved link). Needs ``delegation = "auto"`` or ``"always"`` (the delegating schedule)."""

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

    def __post_init__(self) -> None:
        validate_titan_ext(self)


def config_delay_schedule(spec: str, key: str = "inject_delays"):
    """A config key's delay schedule (None: empty), parsed by the one parser,
    :func:`titan_ext.runtime.delay_injection.parse_delay_spec` ("2:30", "0:10,2:30:100MB/s", "*:5",
    "trace:PATH"); errors name ``key``.

    Imports torch (through the runtime) only when called with a non-empty spec.
    """
    if not spec.strip():
        return None
    from titan_ext.runtime.delay_injection import DelaySpecError
    from titan_ext.runtime.delay_injection import parse_delay_spec as runtime_parse

    try:
        return runtime_parse(spec)
    except DelaySpecError as e:
        raise TitanExtConfigError(f"[titan_ext] {key} = {spec!r}: {e}") from None


def _check(cond: bool, key: str, value, why: str) -> None:
    if not cond:
        raise TitanExtConfigError(f"[titan_ext] {key} = {value!r}: {why}")


def validate_titan_ext(cfg: TitanExt, num_pp_links: int | None = None) -> None:
    """Check every field; with ``num_pp_links`` also check that injected links exist."""
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        tname = f.type if isinstance(f.type, str) else f.type.__name__
        want = {"float": (int, float), "int": int, "str": str, "bool": bool}[tname]
        _check(isinstance(v, want) and (tname == "bool" or not isinstance(v, bool)), f.name, v,
               f"must be of type {tname}")
    _check(math.isfinite(cfg.memory_budget_gib) and cfg.memory_budget_gib >= 0, "memory_budget_gib",
           cfg.memory_budget_gib, "must be a finite number >= 0 (0 = no budget)")
    _check(cfg.max_inflight >= 0, "max_inflight", cfg.max_inflight, "must be >= 0 (0 = automatic)")
    _check(cfg.slack_floor >= 1, "slack_floor", cfg.slack_floor, "must be >= 1")
    _check(cfg.backward in ("", "auto", "split", "full"), "backward", cfg.backward,
           "must be one of '', 'auto', 'split', 'full'")
    _check(cfg.replan_interval >= 1, "replan_interval", cfg.replan_interval, "must be >= 1")
    _check(cfg.profile_window >= 1, "profile_window", cfg.profile_window, "must be >= 1")
    _check(math.isfinite(cfg.tolerance_margin) and 0 <= cfg.tolerance_margin <= 10,
           "tolerance_margin", cfg.tolerance_margin, "must be in [0, 10]")
    _check(math.isfinite(cfg.tolerance_margin_ms) and cfg.tolerance_margin_ms >= 0,
           "tolerance_margin_ms", cfg.tolerance_margin_ms, "must be a finite number >= 0")
    _check(cfg.recover_patience >= 1, "recover_patience", cfg.recover_patience, "must be >= 1")
    _check(cfg.min_dwell >= 0, "min_dwell", cfg.min_dwell, "must be >= 0")
    _check(cfg.delegation in DELEGATION_MODES, "delegation", cfg.delegation,
           "must be one of " + ", ".join(repr(m) for m in DELEGATION_MODES))
    _check(math.isfinite(cfg.delegation_slow_link_ms) and cfg.delegation_slow_link_ms >= 0,
           "delegation_slow_link_ms", cfg.delegation_slow_link_ms, "must be a finite number >= 0")
    _check(math.isfinite(cfg.delegation_slot_mib) and 0 <= cfg.delegation_slot_mib <= MAX_SLOT_MIB,
           "delegation_slot_mib", cfg.delegation_slot_mib, f"must be in [0, {MAX_SLOT_MIB}] (0 = derived)")
    for key in ("emulate_slow_device", "emulate_slow_link"):
        _check_emulation(key, getattr(cfg, key))
    for key in ("falcon_spares", "falcon_devices"):
        text = getattr(cfg, key).strip()
        _check(not text or all(x.strip().isdigit() for x in text.split(",")), key, text,
               "must be comma-separated device ids (integers >= 0)")
    _check(math.isfinite(cfg.emulate_link_window_kib) and cfg.emulate_link_window_kib >= 0,
           "emulate_link_window_kib", cfg.emulate_link_window_kib, "must be a finite number >= 0 (0 = unbounded)")
    _check(math.isfinite(cfg.emulate_device_pass_ms) and cfg.emulate_device_pass_ms >= 0,
           "emulate_device_pass_ms", cfg.emulate_device_pass_ms, "must be a finite number >= 0 (0 = off)")
    _check(cfg.gantt_every >= 0, "gantt_every", cfg.gantt_every, "must be >= 0 (0 = never)")
    _check("/" not in cfg.metrics_file and "\\" not in cfg.metrics_file, "metrics_file",
           cfg.metrics_file, "must be a plain file name (it is written under job.dump_folder)")
    _check(not (cfg.inject_delays.strip() and cfg.inject_trace.strip()), "inject_delays",
           cfg.inject_delays, "set either inject_delays or inject_trace, not both")
    _check(cfg.placement in PLACEMENTS, "placement", cfg.placement,
           "must be one of " + ", ".join(repr(p) for p in PLACEMENTS))
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
        _check(os.path.isfile(cfg.inject_trace), key, cfg.inject_trace, "no such file")
        schedule = config_delay_schedule("trace:" + cfg.inject_trace, key)
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


@dataclass
class JobConfig:
    """Merged by TorchTitan's ConfigManager into its own JobConfig (``job.custom_config_module``)."""

    titan_ext: TitanExt = field(default_factory=TitanExt)
