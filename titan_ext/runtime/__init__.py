"""titan_ext.runtime — torch.distributed side: adaptive schedules, profiler, policy, delay injection.

Never imports titan_ext.titan, torchtitan or wandb (layering, docs/ARCHITECTURE.md).
"""

from ._torch_compat import check_torch as _check_torch

_check_torch()  # a clear error naming the missing torch internal, before the imports below fail

from .emulate.delay_injection import (
    DelaySpecError,
    current_injector,
    inject_link_delays,
    install_from_env,
    parse_delay_spec,
    remove_link_delays,
)
from .adaptive import AdaptiveSchedule
from .control.config import AdaptiveConfig, DelegationConfig, PolicySettings  # the schedules' settings
from .control.deploy import plan_hash, warmup_counts_of
from .control.parts import ScheduleSpec
from .control.registry import adaptive_schedule, register_schedule, registered_schedules, schedule_class
from .decide.policy import Decision, Policy, ReplanPolicy
from .schedules.pipemorph import PipeMorph, PipeMorphConfig  # the two registry entries, in registration order
from .schedules.crosspipe import CrossPipe, CrossPipeConfig
from .falcon import FalconConfig, FalconMonitor  # noqa: F401  (docs/falcon.md)


def __getattr__(name: str):
    if name == "DelegatedPipeMorph":  # removed: delegation is every adaptive schedule's
        raise AttributeError("titan_ext.runtime.DelegatedPipeMorph was removed: every adaptive schedule has "
                             "delegation (PipeMorph(stage, n, delegation='auto'|'always'), any registered "
                             "schedule alike); its API is schedule.delegation: .router, .pool, .log, "
                             ".delegating, .set(on), .close()")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


from titan_ext import _flags  # noqa: E402

if not _flags.DEFER_ENV_STRAGGLER:  # titan_ext.train checks it first, installs it later
    try:
        install_from_env()
    except DelaySpecError as _exc:  # e.g. under the stock torchtitan.train: one line from rank 0, exit 2
        import os as _os
        import sys as _sys

        if _os.environ.get("RANK", "0") == "0":
            print(f"titan_ext: configuration error: {_exc}", file=_sys.stderr, flush=True)
        raise SystemExit(2) from None

__all__ = [
    "AdaptiveConfig",
    "AdaptiveSchedule",
    "CrossPipe",
    "CrossPipeConfig",
    "Decision",
    "DelaySpecError",
    "DelegationConfig",
    "PipeMorph",
    "PipeMorphConfig",
    "Policy",
    "PolicySettings",
    "ReplanPolicy",
    "ScheduleSpec",
    "adaptive_schedule",
    "register_schedule",
    "registered_schedules",
    "schedule_class",
    "current_injector",
    "inject_link_delays",
    "install_from_env",
    "parse_delay_spec",
    "plan_hash",
    "remove_link_delays",
    "warmup_counts_of",
]
