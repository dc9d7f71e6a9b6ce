"""Falcon (fail-slow detection, localisation and multi-level mitigation) for titan_ext.

Process-group-free algorithms: :mod:`.bocd`, :mod:`.period`, :mod:`.localize`, :mod:`.mitigation`,
:mod:`.monitor` (its input and output: :mod:`.decision`). torch.distributed parts: :mod:`.hooks`, :mod:`.validation`, :mod:`.redistribute`,
:mod:`.restart`, :mod:`.topology` (S3 in memory), :mod:`.device_clock` (control groups, device
timing) (imported on demand). A DP × PP job's parts that need no TorchTitan: :mod:`.measure` (the step's
observation, validation), :mod:`.apply` (a decision → the job's changes), :mod:`.files` (imported on
demand). The one Falcon package: what hooks into TorchTitan's trainer, config or checkpointer is
``titan_ext/titan/falcon_*.py``. See docs/falcon.md.
"""

from .bocd import BOCDConfig, ChangePoint, OnlineBOCD, SlowIterationDetector
from .localize import (
    locate_slow_devices,
    locate_slow_links,
    ring_validation_passes,
    suspicious_groups,
    tree_validation_passes,
)
from .mitigation import (
    MitigationPlanner,
    StrategyCosts,
    TopologyPlan,
    min_max_microbatch_split,
    predicted_iteration_s,
    plan_topology,
    strategies_for,
    topology_score,
)
from .decision import FalconDecision, IterationObservation
from .monitor import FalconConfig, FalconMonitor
from .period import acf, estimate_period, iteration_times_from_calls

__all__ = [
    "BOCDConfig", "ChangePoint", "OnlineBOCD", "SlowIterationDetector",
    "acf", "estimate_period", "iteration_times_from_calls",
    "suspicious_groups", "ring_validation_passes", "tree_validation_passes", "locate_slow_links", "locate_slow_devices",
    "MitigationPlanner", "StrategyCosts", "strategies_for", "min_max_microbatch_split", "predicted_iteration_s",
    "TopologyPlan", "plan_topology", "topology_score", "FalconConfig", "FalconMonitor",
    "FalconDecision", "IterationObservation",
]
