"""Settings of the adaptive schedules, in TorchTitan's config style: typed fields with defaults and
docstrings, checked in ``__post_init__`` (a bad value fails at construction with one clear line).

:class:`AdaptiveConfig` holds the settings every adaptive schedule shares; each schedule's config class
(``PipeMorphConfig``, ``CrossPipeConfig``: beside their entries) adds its own.
``PipeMorph(stage, n_microbatches, loss_fn=..., config=PipeMorphConfig(...))`` is the documented way to
configure a schedule; the keywords of earlier releases (``PipeMorph(stage, n, adaptive=False,
delegation="auto", ...)``) still work: :meth:`AdaptiveConfig.updated` maps them onto the config, the one
place that knows the old names (``delegate_lanes`` → ``delegation.lanes`` ...).

The settings are plain values; the parts they configure (policy, planner, observers, transport) are
built by :mod:`titan_ext.runtime.control.parts` (one-stage vs multi-stage chosen once) and
:mod:`titan_ext.runtime.control.extensions` (Falcon, delegation), never inside the schedule's coordinator.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from titan_ext.args import ArgumentTypeError, bool_arg, choice_arg, int_arg, real_arg
from titan_ext.plan.deps import KINDS
from ..decide.policy import PolicySettings, ReplanPolicy

__all__ = ["AdaptiveConfig", "DelegationConfig", "PolicySettings", "resolve_config"]


@dataclass(frozen=True)
class DelegationConfig:
    """The delegate data plane (PipeMorph §5.2; ``runtime/comm/delegate/``), a transport choice."""

    mode: str = "off"
    """``"off"`` (direct P2P), ``"always"`` (every SEND/RECV through the delegates) or ``"auto"``
    (switch on when a link's delay exceeds ``slow_link_ms``, or when ``detector`` says so)."""
    failover: bool = False
    """Retry a failed direct P2P op on the delegates (gloo only)."""
    slow_link_ms: float = 5.0
    """``auto``: the per-link delay estimate above which a link counts as slow."""
    detector: Callable[[dict], bool] | None = None
    """``auto``: a custom slow-link detector on the boundary metrics."""
    lanes: int | dict = 1
    """Delegate processes per send kind (or a dict per kind)."""
    slots: int = 16
    """Ring slots per delegate channel."""
    slot_bytes: int | None = None
    """Slot size; None: derived from the stage's messages at the first delegated op."""
    recv_timeout_s: float = 30.0
    """A delegated receive gives up after this long."""
    timeout_s: float = 300.0
    """Delegate process links end after this long without progress."""
    faults: Any = None
    """Primary-path faults (tests): an object with ``fails(op, peer, direction, seq) -> bool``
    (``comm.delegate.transport.Faults``)."""

    def __post_init__(self) -> None:
        """Every field checked (TypeError/ValueError naming it, under its keyword name of earlier
        releases where it has one: ``delegate_slots`` ...)."""
        if isinstance(self.mode, (list, dict, set)) or self.mode not in ("off", "auto", "always"):
            raise ValueError(f"delegation must be one of ('off', 'auto', 'always'), got {self.mode!r}")
        bool_arg(self.failover, "failover")
        real_arg(self.slow_link_ms, "slow_link_ms", minimum=0)
        if self.detector is not None and not callable(self.detector):
            raise ArgumentTypeError(f"detector must be a callable (boundary metrics → bool) or None, got {self.detector!r}")
        if isinstance(self.lanes, dict):
            for kind, n in self.lanes.items():
                choice_arg(kind, "delegate_lanes key (the send kind)", ("F", "B"))
                int_arg(n, f"delegate_lanes[{kind!r}]", 1)
        else:
            int_arg(self.lanes, "delegate_lanes", 1)
        int_arg(self.slots, "delegate_slots", 1)
        real_arg(self.recv_timeout_s, "recv_timeout_s", positive=True)
        real_arg(self.timeout_s, "delegate_timeout_s", positive=True)
        int_arg(self.slot_bytes, "delegate_slot_bytes", 1, optional=True)  # None: derived from the messages
        if self.faults is not None and not callable(getattr(self.faults, "fails", None)):
            raise ArgumentTypeError(f"faults must be a FaultInjector (with fails(op, peer, direction, seq)) or None, "
                                    f"got {self.faults!r}")

    @property
    def enabled(self) -> bool:
        return self.mode != "off" or self.failover


#: keywords of earlier releases that name a field of ``AdaptiveConfig.delegation``
_DELEGATION_KEYWORDS = {"delegation": "mode", "failover": "failover", "slow_link_ms": "slow_link_ms",
                        "detector": "detector", "delegate_lanes": "lanes", "delegate_slots": "slots",
                        "delegate_slot_bytes": "slot_bytes", "recv_timeout_s": "recv_timeout_s",
                        "delegate_timeout_s": "timeout_s", "faults": "faults"}


@dataclass(frozen=True)
class AdaptiveConfig:
    """Settings of every adaptive schedule (PipeMorph §4 planning, §6 runtime).  Every field is also a
    constructor keyword of each schedule (delegation's under their former names)."""

    # -- memory (PipeMorph §4.2 Alg.1 M, x_max; runtime/execute/memory.py) --
    memory_budget_bytes: float | None = None
    """Per-stage budget for activations (Alg.1's M); with ``activation_bytes`` (M^F, measured in the
    first forward when not given) it fixes x_max = ⌊M / M^F⌋ and caps adaptive plans.  Without it, on GPU
    the cap comes from free device memory."""
    max_inflight: int | None = None
    """x_max directly (activations stage 0 may hold); overrides the budget for Alg.1."""
    activation_bytes: float | None = None
    """M^F, bytes one microbatch's forward saves (None: measured)."""
    adaptive_memory_limit: int | None = None
    """A further cap on warm-up forwards of adaptive plans (lifted while delegating, §5.2)."""
    # -- adaptation (§6) --
    adaptive: bool = True
    """Re-plan from live profiling (False: keep the initial plan; profiling still runs)."""
    profile_every: int = 1
    """Exchange profiles / check the policy every k iterations."""
    profile_every_max: int = 4
    """While nothing changes the period doubles up to this (adaptive k); Falcon keeps it at k."""
    slack_floor: int = 2
    """Alg.2's minimum slackness."""
    initial_times_ms: tuple[float, float, float] = (1.0, 1.0, 1.0)
    """(F, I, W) assumed before the first measurement."""
    backward: str = "auto"
    """``"split"``, ``"full"``, ``"auto"`` (the initial plan measures both, every re-plan keeps the variant
    the model predicts faster) or ``"measure"`` (probe the other variant's iteration time; ``backward.py``)."""
    backward_margin: float = 0.02
    """``auto``: relative margin the other variant's plan must be predicted faster by than the running one;
    a measured probe (``measure``, or ``auto``'s where a plan is not realised): the margin split's median
    span must win by (on a tie full)."""
    polish_s: float | None = None
    """Anytime planning: after a planner-made plan is deployed (the calibrated initial plan, each adaptive
    re-plan) a background thread polishes it with CP-SAT and CrossPipe's search within this many seconds
    (``titan_ext.plan.polish.polish_plan``; needs OR-Tools, else skipped once); the training thread never
    waits for it and a faster, validated plan is deployed at a later check (one more plan version).  None: off."""
    decision_log_size: int = 10_000
    """Entries kept in ``decision_log`` and ``metrics_history``."""
    timeout_s: float | None = None
    """PP message waits and control-plane collectives end after this many seconds (process-wide,
    ``timeouts.py``); None: the job's or the process groups' own."""
    peers: Any = "auto"
    """The other PP groups every plan is agreed with (``runtime/comm/peers.py``): their profiles are merged
    at every check, so all PP groups of a job deploy the same plans at the same iterations (what FSDP's,
    TP's and the DP reduction's pairing of the peers' work needs).  ``"auto"``: the ranks at this rank's
    PP position in every other PP group, when the PP group is a dimension of a row-major device mesh over
    the world (``init_device_mesh``, TorchTitan's); every rank of the world then builds the schedule.
    ``"off"``: this PP group decides alone.  A sequence of global ranks (this one included): those.  Peers
    must run the same number of steps (TorchTitan's trainer-replicated DP jobs agree within a replica:
    ``titan/options.replica_peers``)."""
    # -- parts (None: the schedule's registry entry builds them, runtime/control/parts.py) --
    policy_settings: PolicySettings = field(default_factory=PolicySettings)
    """Thresholds the layout's default policy is built from (and that cadence/chooser/head-room read)."""
    policy: Any = None
    """A ready :class:`~titan_ext.runtime.decide.policy.Policy` (None: built from ``policy_settings``)."""
    planner: Any = None
    """A ready :class:`~titan_ext.runtime.decide.planning.Planner` (None: the registry entry's)."""
    falcon: Any = False
    """False, True (a default ``FalconMonitor``) or a ``FalconMonitor``: a boundary observer (Falcon §4–5)."""
    observers: tuple = ()
    """Further boundary observers (``attach(context)``, ``observe(boundary) -> dict``)."""
    delegation: DelegationConfig = field(default_factory=DelegationConfig)
    """The transport: direct torch P2P or the delegate data plane."""

    def __post_init__(self) -> None:
        """Every field checked at construction: TypeError (a wrong type; also a ValueError)
        or ValueError naming the field -- before any process group exists."""
        int_arg(self.profile_every, "profile_every", 1)
        int_arg(self.profile_every_max, "profile_every_max", 1)
        int_arg(self.max_inflight, "max_inflight", 1, optional=True)
        real_arg(self.memory_budget_bytes, "memory_budget_bytes", positive=True, optional=True)
        real_arg(self.activation_bytes, "activation_bytes", positive=True, optional=True)
        int_arg(self.adaptive_memory_limit, "adaptive_memory_limit", 1, optional=True)
        bool_arg(self.adaptive, "adaptive")
        int_arg(self.slack_floor, "slack_floor", 1)
        choice_arg(self.backward, "backward", ("split", "full", "auto", "measure"))
        real_arg(self.backward_margin, "backward_margin", minimum=0)
        if not self.backward_margin < 1:
            raise ValueError(f"backward_margin must be within [0, 1), got {self.backward_margin}")
        real_arg(self.polish_s, "polish_s", positive=True, optional=True)
        int_arg(self.decision_log_size, "decision_log_size", 1)
        if self.timeout_s is not None:
            real_arg(self.timeout_s, "timeout_s", positive=True, maximum=1e7)
        if not (self.peers in ("auto", "off") or (isinstance(self.peers, (tuple, list)) and all(
                isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in self.peers))):
            raise ArgumentTypeError(f"peers must be 'auto', 'off' or a sequence of global ranks, got {self.peers!r}")
        if not (self.falcon is None or isinstance(self.falcon, bool) or callable(getattr(self.falcon, "observe", None))):
            raise ArgumentTypeError(f"falcon must be False, True or a FalconMonitor, got {self.falcon!r}")
        if isinstance(self.observers, (str, bytes)) or not isinstance(self.observers, (tuple, list)):
            raise ArgumentTypeError(f"observers must be a tuple of boundary observers, got {type(self.observers).__name__}")
        for i, o in enumerate(self.observers):
            if not (callable(getattr(o, "attach", None)) and callable(getattr(o, "observe", None))
                    and hasattr(o, "every_iteration")):
                raise ArgumentTypeError(f"observers[{i}] must be a boundary observer (attach(context), "
                                        f"observe(boundary), every_iteration), got {o!r}")
        if self.policy is not None and not callable(getattr(self.policy, "decide", None)):
            raise ArgumentTypeError(f"policy must be a Policy (with decide(...)) or None, got {self.policy!r}")
        if self.planner is not None and not callable(getattr(self.planner, "plan", None)):
            raise ArgumentTypeError(f"planner must be a Planner (with plan(profile, decision, context)) or None, "
                                    f"got {self.planner!r}")
        if not isinstance(self.policy_settings, PolicySettings):
            raise TypeError(f"policy_settings must be a PolicySettings, got {type(self.policy_settings).__name__}")
        if not isinstance(self.delegation, DelegationConfig):
            raise TypeError(f"delegation must be a DelegationConfig (or the keyword delegation='off'|'auto'|"
                            f"'always'), got {self.delegation!r}")
        times = self.initial_times_ms
        if isinstance(times, (str, bytes)) or not isinstance(times, (tuple, list)) or len(times) != 3:
            raise ValueError(f"initial_times_ms must be (F, I, W), got {times!r}")
        for name, t in zip(KINDS, times):
            real_arg(t, f"initial_times_ms {name}", positive=name != "W", minimum=0)

    def updated(self, owner: str = "PipeMorph", **keywords: Any) -> "AdaptiveConfig":
        """A copy with ``keywords`` applied: the config's own fields, and the delegation keywords of
        earlier releases (``delegation="auto"``, ``delegate_lanes=2`` …).  A plain ``ReplanPolicy``
        passed as ``policy=`` (how ``[titan_ext]`` settings once arrived) is read as its thresholds, so
        the layout's own policy is built from them (several stages per rank: ``VirtualReplanPolicy``)."""
        own = {f.name for f in dataclasses.fields(self)} - {"delegation"}
        unknown = sorted(set(keywords) - own - set(_DELEGATION_KEYWORDS))
        if unknown:
            raise TypeError(f"{owner}: unknown option(s) {unknown}; known: {sorted(own | set(_DELEGATION_KEYWORDS))}")
        direct = {k: v for k, v in keywords.items() if k in own}
        settings = _settings_of(direct.get("policy"))
        if settings is not None:
            direct["policy"], direct["policy_settings"] = None, settings
        deleg = {_DELEGATION_KEYWORDS[k]: v for k, v in keywords.items() if k in _DELEGATION_KEYWORDS}
        if deleg:
            direct["delegation"] = dataclasses.replace(self.delegation, **deleg)
        return dataclasses.replace(self, **direct) if direct else self


def _settings_of(policy: Any) -> PolicySettings | None:
    """The thresholds of a plain ``ReplanPolicy`` (exactly that class: a subclass or any other object
    is a policy of its own, used as given), else None."""
    if type(policy) is not ReplanPolicy:
        return None
    return PolicySettings(**{f.name: getattr(policy, f.name) for f in dataclasses.fields(ReplanPolicy) if f.init})


def resolve_config(owner: str, config: AdaptiveConfig | None, config_class: type[AdaptiveConfig],
                   options: dict[str, Any]) -> AdaptiveConfig:
    """A schedule's config: ``config`` (an instance of its entry's ``config_class``; None: the defaults)
    with the constructor's keywords applied (:meth:`AdaptiveConfig.updated`)."""
    if config is not None and not isinstance(config, config_class):
        raise TypeError(f"{owner} takes config={config_class.__name__}(...), got {type(config).__name__}")
    return (config or config_class()).updated(owner, **options)
