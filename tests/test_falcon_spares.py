"""S4 onto spare devices (issue 35 item 1; Falcon §5.1 S4: "checkpoint-and-restart on healthy nodes"):
the slow device's rank restarts on a spare, the grid and DP stay. Fast tests: the plan, the relaunch
overrides parsed by TorchTitan's ConfigManager, the emulation of the restarted job, the job's choice
between the spare path and the shrink. (No end-to-end restart test yet: see docs/falcon.md.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from titan_ext.runtime.falcon import FalconConfig, FalconDecision, FalconMonitor
from titan_ext.runtime.falcon.emulation import FailSlowEmulation, parse_slow_device
from titan_ext.runtime.falcon.restart import (
    ReplacePlan,
    ShrinkPlan,
    plan_replacement,
    relaunch_overrides,
    remap_emulation,
)

ROOT = Path(__file__).resolve().parent.parent
TITAN_GRID = [[0, 2], [1, 3]]  # TorchTitan's DP 2 x PP 2 (pp outermost)


def test_replacement_keeps_the_grid_and_moves_the_slow_rank_onto_the_spare():
    plan = plan_replacement(TITAN_GRID, [3], [4, 5], step=12, split=[5, 1])
    assert isinstance(plan, ReplacePlan) and plan.num_dp == 2 and plan.kept_replicas == [0, 1]
    assert plan.kept_ranks == [0, 1, 2, 3]  # new rank i plays old rank i: the same roles
    assert plan.devices == [0, 1, 2, 4] and plan.replaced == {3: 4} and plan.spares_left == [5]
    assert plan.chunks_per_replica == 3  # the global batch evenly again (TorchTitan's split)
    # after an S3 (grid [[0, 1], [2, 3]]): new rank i plays the rank of the same (stage, replica)
    plan = plan_replacement([[0, 1], [2, 3]], [1], [4], step=3, split=[3, 3])
    assert plan.kept_ranks == [0, 2, 1, 3] and plan.devices == [0, 2, 4, 3]
    # a job already restarted once (rank 3 on device 4): device ids, not ranks, are replaced
    plan = plan_replacement(TITAN_GRID, [3], [3, 5], step=20, split=[3, 3], device_of=[0, 1, 2, 4])
    assert plan.devices == [0, 1, 2, 3] and plan.replaced == {4: 3}  # device 3 free again: a spare
    with pytest.raises(ValueError, match="spare"):
        plan_replacement(TITAN_GRID, [1, 3], [4], step=1, split=[3, 3])
    with pytest.raises(ValueError, match="spare"):
        plan_replacement(TITAN_GRID, [3], [2], step=1, split=[3, 3])  # device 2 is in use
    with pytest.raises(ValueError, match="evenly"):
        plan_replacement(TITAN_GRID, [3], [4], step=1, split=[4, 1])


def test_replacement_overrides_parse_and_the_fault_stays_with_its_device():
    from torchtitan.config import ConfigManager

    plan = plan_replacement(TITAN_GRID, [3], [4], step=12, split=[5, 1])
    emulation = remap_emulation(plan, "3:24@5", "0-1:30@5")
    assert emulation == {"emulate_slow_device": "", "emulate_slow_link": "0-1:30@5",
                         "falcon_devices": "0,1,2,4", "falcon_spares": ""}
    args = ["--job.config_file", str(ROOT / "train_configs/debug_cpu_dp2_pp2.toml"),
            "--titan_ext.emulate_slow_device", "3:24@5", "--training.local_batch_size", "2",
            "--training.global_batch_size", "-1", *relaunch_overrides(plan, emulation, local_batch_size=2)]
    cfg = ConfigManager().parse_args(args)
    assert cfg.parallelism.data_parallel_replicate_degree == 2  # DP kept
    assert cfg.training.global_batch_size == 12 and cfg.checkpoint.enable
    assert cfg.titan_ext.emulate_slow_device == "" and cfg.titan_ext.falcon_devices == "0,1,2,4"
    # the restarted job's rank 3 runs on device 4: healthy; the link fault 0-1 is still there
    devices = [int(d) for d in cfg.titan_ext.falcon_devices.split(",")]
    em3 = FailSlowEmulation(3, devices, slow_device=parse_slow_device(cfg.titan_ext.emulate_slow_device))
    assert em3.device == 4 and em3.compute_factor() == 1.0
    # before the restart the same rank ran on device 3, 24x slow
    em = FailSlowEmulation(3, range(4), slow_device=parse_slow_device("3:24@5"))
    em.step = 6
    assert em.compute_factor() == 24.0


def test_job_takes_the_spare_path_when_it_has_spares_and_shrinks_otherwise():
    """plan_changes' S4: with ``falcon_spares`` a ReplacePlan, predicted to run at the healthy step
    (it pays while the step is slower); without, today's shrink gated on its own prediction."""
    import numpy as np

    from titan_ext.titan.falcon.apply import JobView, plan_changes

    mon = FalconMonitor(FalconConfig(num_microbatches=6), grid=TITAN_GRID)
    rng = np.random.default_rng(0)
    for i in range(40):  # healthy 1.0 s, then device 3 makes the step 2.3 s
        out = mon.observe((1.0 if i < 20 else 2.3) * (1 + 0.01 * rng.standard_normal()))
        if out.validate:
            mon.report_validation(gemm_times_s={0: 1.0, 1: 1.0, 2: 1.0, 3: 4.0})
    assert mon.slow_devices == [3] and mon.detector.slow
    decision = FalconDecision(40, {"falcon/apply": "checkpoint_restart"})
    view = JobView(step=40, split=(3, 3), even_split=(3, 3), grid=((0, 2), (1, 3)), replanning_on=True,
                   checkpoint_enabled=True, spares=(4,))
    spare = plan_changes(decision, view, mon)
    assert isinstance(spare.s4_plan, ReplacePlan) and spare.s4_plan.devices == [0, 1, 2, 4]
    assert spare.metrics["falcon/predicted_s/checkpoint_restart"] == pytest.approx(1.0, rel=0.05)
    shrink = plan_changes(decision, JobView(**{**view.__dict__, "spares": ()}), mon)
    assert type(shrink.s4_plan) is ShrinkPlan and shrink.s4_plan.kept_replicas == [0]
    # more devices to replace than spares: the shrink
    mon.report_validation(gemm_times_s={0: 1.0, 1: 4.0, 2: 1.0, 3: 4.0})
    both = plan_changes(decision, view, mon)
    assert type(both.s4_plan) is not ReplacePlan
