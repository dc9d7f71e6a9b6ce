"""S4 onto spare devices (Falcon §5.1 S4: "checkpoint-and-restart on healthy nodes"):
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

ROOT = Path(__file__).resolve().parents[2]
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

    from titan_ext.runtime.falcon.apply import JobView, plan_changes

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


# --------------------------------------------------------------------------- end to end (torchrun)
CONFIG = "train_configs/debug_cpu_dp2_pp2.toml"


@pytest.mark.slow
@pytest.mark.soak  # 150 s; CI's S4 run is tests/falcon/test_falcon_s4.py's (the same restart, shrinking DP)
def test_s4_onto_a_spare_keeps_dp_and_resumes_bit_equal_to_a_job_loading_the_checkpoint(tmp_path):
    """The launcher on the DP 2 × PP 2 job of tests/falcon/test_falcon_s4.py (dedicated-device emulation,
    device 3 24× slower from step 5) with one spare device (4): S4 restarts rank 3 on device 4 with
    DP 2 kept; the restarted steps run at the healthy speed, and its losses equal bit for bit those
    of a DP 2 × PP 2 job on the same devices that loads the same checkpoint."""
    import shutil
    import subprocess
    import sys

    from _falcon_s4_job import _COMMON, PASS_MS, SLOW_FACTOR, SLOW_FROM, STEPS, _env, _rows
    from titan_ext.testing import free_port as _free_port
    from titan_ext.runtime.falcon.restart import S4_PLAN_FILE

    dump = tmp_path / "s4"
    cmd = [sys.executable, "-m", "titan_ext.titan.falcon_s4", "--nproc-per-node", "4",
           "--master-port", str(_free_port()), "--log", str(dump / "train.log"), "--",
           "--job.config_file", CONFIG, "--job.dump_folder", str(dump), "--training.steps", str(STEPS),
           *_COMMON, "--titan_ext.emulate_slow_device", f"3:{SLOW_FACTOR}@{SLOW_FROM}",
           "--titan_ext.emulate_device_pass_ms", str(PASS_MS), "--titan_ext.falcon_spares", "4",
           "--checkpoint.enable", "--checkpoint.interval", "100000"]
    dump.mkdir()
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), timeout=900)
    assert p.returncode == 0, (dump / "train.log").read_text()[-4000:]
    events = _rows(dump / "falcon_events.jsonl")
    s4 = [e for e in events if e["kind"] == "decision" and e["strategy"] == "S4" and e["applied"]]
    assert len(s4) == 1, events
    step = s4[0]["iteration"]
    plan = json.loads((dump / S4_PLAN_FILE).read_text())
    assert plan["mode"] == "replace" and plan["devices"] == [0, 1, 2, 4] and plan["status"] == "consumed"
    assert plan["num_dp"] == 2 and plan["kept_ranks"] == [0, 1, 2, 3] and plan["chunks_per_replica"] == 3
    restart = [e for e in events if e["kind"] == "restart"]
    assert len(restart) == 1 and restart[0]["measured_cost_s"] > restart[0]["save_s"] > 0  # S4's cost measured
    times = {r["step"]: r["falcon/iteration_time_s"] for r in _rows(dump / "falcon.jsonl")}
    assert sorted(times) == list(range(1, STEPS + 1))
    healthy = sorted(times[k] for k in range(2, SLOW_FROM))
    after = sorted(times[k] for k in times if k > step + 1)
    # on the spare every device is healthy again: the steps are back near the healthy ones (the
    # shrink's DP 1 world runs ~2x them: one replica takes all 6 chunks)
    median_after = after[len(after) // 2]
    assert median_after < 0.5 * s4[0]["iteration_time_before_s"], (times, step)  # the fault is gone
    assert median_after < 2.0 * healthy[len(healthy) // 2], (times, step)  # and DP 2 again (DP 1: ~2x)
    losses = {r["step"]: r["loss"] for r in _rows(dump / "pipeline_metrics.jsonl")}

    ref = tmp_path / "ref"
    shutil.copytree(dump / "checkpoint" / f"step-{step}", ref / "checkpoint" / f"step-{step}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
           "-m", "titan_ext.train", "--job.config_file", CONFIG, "--job.dump_folder", str(ref),
           "--training.steps", str(STEPS), *_COMMON, "--titan_ext.emulate_device_pass_ms", str(PASS_MS),
           "--titan_ext.falcon_devices", "0,1,2,4", "--titan_ext.no-falcon_apply",
           "--checkpoint.enable", "--checkpoint.interval", "100000", "--checkpoint.load_step", str(step),
           "--checkpoint.exclude_from_loading", "dataloader"]
    with open(ref / "train.log", "w") as f:
        p = subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=f, stderr=subprocess.STDOUT, timeout=600)
    assert p.returncode == 0, (ref / "train.log").read_text()[-4000:]
    ref_losses = {r["step"]: r["loss"] for r in _rows(ref / "pipeline_metrics.jsonl")}
    assert sorted(ref_losses) == list(range(step + 1, STEPS + 1))
    assert [losses[s] for s in ref_losses] == [ref_losses[s] for s in ref_losses]  # bit for bit
