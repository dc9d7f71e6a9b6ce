"""Falcon S4 applied: checkpoint with TorchTitan's checkpointer, exclude the slow
device, relaunch on the remaining ranks, resume with the batch re-split for the smaller world.

Fast tests: the plan (against a brute-force reading of TorchTitan's mesh), the relaunch overrides
(parsed by TorchTitan's own ConfigManager), the launcher's environment. The end-to-end test (slow
tier) runs the launcher on a DP 2 × PP 2 job whose device 3 turns slow, and checks the restarted
job's losses against a reference that loads the same checkpoint on the same DP 1 × PP 2 world.
"""

import dataclasses
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from titan_ext.runtime.falcon.restart import (
    S4_PLAN_FILE,
    devices_to_exclude,
    plan_exclusion,
    relaunch_overrides,
    remap_emulation,
)
from titan_ext.testing import free_port, torchrun
from titan_ext.titan.falcon_s4 import consume_plan, relaunch_env

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "train_configs/debug_cpu_dp2_pp2.toml"


def _titan_grid(num_dp: int, num_pp: int) -> list[list[int]]:
    """TorchTitan's (pp, dp_replicate) mesh: global rank = pp * num_dp + dp."""
    return [[s * num_dp + d for s in range(num_pp)] for d in range(num_dp)]


@pytest.mark.parametrize("num_dp,num_pp", [(2, 2), (3, 2), (4, 3)])
def test_plan_keeps_every_replica_without_an_excluded_device_brute_force(num_dp, num_pp):
    grid = _titan_grid(num_dp, num_pp)
    world = range(num_dp * num_pp)
    for k in (1, 2):
        for excluded in itertools.combinations(world, k):
            replicas_hit = {r % num_dp for r in excluded}
            kept = [d for d in range(num_dp) if d not in replicas_hit]
            total = num_dp * 6  # 6 chunks a replica; re-split evenly over the kept ones
            if not kept:
                with pytest.raises(ValueError, match="leaves no DP replica"):
                    plan_exclusion(grid, excluded, 9, [6] * num_dp)
                continue
            if total % len(kept):
                with pytest.raises(ValueError, match="does not split evenly"):
                    plan_exclusion(grid, excluded, 9, [6] * num_dp)
                continue
            plan = plan_exclusion(grid, excluded, 9, [6] * num_dp)
            assert plan.kept_replicas == kept and plan.num_dp == len(kept)
            assert plan.chunks_per_replica * len(kept) == total  # the global batch is unchanged
            # new world in TorchTitan's order: new rank s * K + i runs stage s of kept replica i
            for new, old in enumerate(plan.kept_ranks):
                assert old % num_dp == kept[new % len(kept)] and old // num_dp == new // len(kept)
            assert not set(plan.kept_ranks) & set(excluded)


def test_plan_rejects_bad_input():
    grid = _titan_grid(2, 2)
    with pytest.raises(ValueError, match="not in the grid"):
        plan_exclusion(grid, [7], 3, [3, 3])
    with pytest.raises(ValueError, match="at least one device"):
        plan_exclusion(grid, [], 3, [3, 3])
    assert devices_to_exclude([3, 1], [(0, 2)]) == [1, 3]  # devices when validation found some
    assert devices_to_exclude([], [(2, 0)]) == [2]  # else one end of each slow link


def test_emulation_follows_the_devices_into_the_smaller_world():
    plan = plan_exclusion(_titan_grid(3, 2), [4], 7, [2, 2, 2])  # replica 1 (ranks 1, 4) dropped
    assert plan.kept_ranks == [0, 2, 3, 5]
    got = remap_emulation(plan, "3:4@5", "2-5:40@1")
    assert got == {"emulate_slow_device": "2:4@5", "emulate_slow_link": "1-3:40@1"}
    # the excluded device's fault leaves with it
    assert remap_emulation(plan, "4:4", "1-3:40")["emulate_slow_device"] == ""
    assert remap_emulation(plan, "4:4", "1-3:40")["emulate_slow_link"] == ""


def test_relaunch_overrides_parse_with_torchtitans_config_manager():
    from torchtitan.config import ConfigManager

    plan = plan_exclusion(_titan_grid(2, 2), [3], 12, [5, 1])
    args = ["--job.config_file", str(ROOT / CONFIG), "--titan_ext.emulate_slow_device", "3:4@5",
            "--training.local_batch_size", "2", "--training.global_batch_size", "-1",
            *relaunch_overrides(plan, remap_emulation(plan, "3:4@5", ""), local_batch_size=2)]
    cfg = ConfigManager().parse_args(args)
    assert cfg.parallelism.data_parallel_replicate_degree == 1
    assert cfg.training.global_batch_size == 12  # 6 chunks of 2, even where the job left it to DP
    assert cfg.checkpoint.enable and cfg.checkpoint.exclude_from_loading == ["dataloader"]
    assert cfg.titan_ext.emulate_slow_device == "" and cfg.titan_ext.emulate_slow_link == ""
    # TorchTitan's own split of the global batch in the new world is the plan's
    per_replica = cfg.training.global_batch_size // (cfg.training.local_batch_size * plan.num_dp)
    assert per_replica == plan.chunks_per_replica == 6


def test_launcher_environment_and_one_restart_per_plan(tmp_path):
    plan = {"device_type": "cuda", "hosts": ["h"] * 4, "local_devices": [0, 2, 4, 6]}
    env = relaunch_env(plan, {"CUDA_VISIBLE_DEVICES": "7,6,5,4,3,2,1,0", "TITAN_EXT_SLOW_DEVICE": "3:4"})
    assert env["CUDA_VISIBLE_DEVICES"] == "7,5,3,1" and "TITAN_EXT_SLOW_DEVICE" not in env
    assert "CUDA_VISIBLE_DEVICES" not in relaunch_env({"device_type": "cpu"}, {})
    (tmp_path / S4_PLAN_FILE).write_text(json.dumps({"status": "pending", "step": 4}))
    assert consume_plan(tmp_path)["step"] == 4
    assert consume_plan(tmp_path) is None  # consumed: a later failure is not an S4


# --------------------------------------------------------------------------- end to end (torchrun)
from _falcon_s4_job import _COMMON, PASS_MS, SLOW_FACTOR, SLOW_FROM, STEPS, _env, _rows  # noqa: E402


@pytest.fixture(scope="module")
def s4_run(tmp_path_factory):
    dump = tmp_path_factory.mktemp("s4")
    cmd = [sys.executable, "-m", "titan_ext.titan.falcon_s4", "--nproc-per-node", "4",
           "--master-port", str(free_port()), "--log", str(dump / "train.log"), "--",
           "--job.config_file", CONFIG, "--job.dump_folder", str(dump), "--training.steps", str(STEPS),
           *_COMMON, "--titan_ext.emulate_slow_device", f"3:{SLOW_FACTOR}@{SLOW_FROM}",
           "--titan_ext.emulate_device_pass_ms", str(PASS_MS), "--checkpoint.enable", "--checkpoint.interval", "100000"]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), timeout=900)
    assert p.returncode == 0, (dump / "train.log").read_text()[-4000:]
    return dump


@pytest.mark.slow
def test_s4_restarts_without_the_slow_device_and_resumes_from_its_checkpoint(s4_run, tmp_path):
    events = _rows(s4_run / "falcon_events.jsonl")
    s4 = [e for e in events if e["kind"] == "decision" and e["strategy"] == "S4"]
    assert len(s4) == 1 and s4[0]["applied"], events
    step = s4[0]["iteration"]
    s2 = [i for i, e in enumerate(events) if e["kind"] == "decision" and e["strategy"] == "S2"]
    # the ladder: S2 applied first (in an earlier step, or the same one when the impact that
    # accumulated until localisation already exceeds both costs)
    assert s2 and events[s2[0]]["applied"] and s2[0] < events.index(s4[0])
    # ski rental: S4 was applied when the accumulated impact reached its (measured) cost
    assert s4[0]["impact_s"] >= s4[0]["estimated_cost_s"] > 1.0
    plan = json.loads((s4_run / S4_PLAN_FILE).read_text())
    assert plan["excluded"] == [3] and plan["kept_ranks"] == [0, 2] and plan["status"] == "consumed"
    assert plan["num_dp"] == 1 and plan["chunks_per_replica"] == 6  # 2 x 3 chunks, one replica
    restart = [e for e in events if e["kind"] == "restart"]
    assert len(restart) == 1 and restart[0]["iteration"] == step + 1
    assert restart[0]["measured_cost_s"] > restart[0]["save_s"] > 0
    assert json.loads((s4_run / "falcon_costs.json").read_text())["checkpoint_restart"] == \
        restart[0]["measured_cost_s"]
    times = {r["step"]: r["falcon/iteration_time_s"] for r in _rows(s4_run / "falcon.jsonl")}
    assert sorted(times) == list(range(1, STEPS + 1))  # the restarted job logs its steps too
    after = sorted(times[k] for k in times if k > step + 1)
    # the 24x device is gone: the smaller world's steps are far below the slow ones (~0.9 s against
    # ~2.3 s; the fault left with the device)
    assert after[len(after) // 2] < 0.5 * s4[0]["iteration_time_before_s"], (times, step)
    losses = {r["step"]: r["loss"] for r in _rows(s4_run / "pipeline_metrics.jsonl")}
    assert sorted(losses) == list(range(1, STEPS + 1))  # every step once: step+1.. after the restart

    # reference: the same checkpoint, loaded by a plain DP 1 x PP 2 job (no Falcon decisions)
    ref = tmp_path / "ref"
    shutil.copytree(s4_run / "checkpoint" / f"step-{step}", ref / "checkpoint" / f"step-{step}")
    p = torchrun(2, ["-m", "titan_ext.train", "--job.config_file", CONFIG, "--job.dump_folder", str(ref),
                     "--training.steps", str(STEPS), *_COMMON, "--parallelism.data_parallel_replicate_degree", "1",
                     "--checkpoint.enable", "--checkpoint.interval", "100000", "--checkpoint.load_step", str(step),
                     "--checkpoint.exclude_from_loading", "dataloader"],
                 log=ref / "train.log", cwd=ROOT, env=_env(), timeout=600)
    assert p.returncode == 0, (ref / "train.log").read_text()[-4000:]
    ref_losses = {r["step"]: r["loss"] for r in _rows(ref / "pipeline_metrics.jsonl")}
    assert sorted(ref_losses) == list(range(step + 1, STEPS + 1))
    assert [losses[s] for s in ref_losses] == [ref_losses[s] for s in ref_losses]  # bit for bit
    # and they continue the trained model: far below the first steps' loss of a fresh model
    assert ref_losses[step + 1] < 0.8 * losses[1]


def test_multi_node_relaunch_spec_keeps_the_nodes_with_kept_devices():
    from titan_ext.titan.falcon_s4 import relaunch_spec

    plan = {"hosts": ["n1.c", "n1.c", "n2.c", "n2.c"], "local_devices": [0, 2, 1, 3], "overrides": []}
    spec = relaunch_spec(plan, ["n1", "n2", "n3"])  # SLURM's short names; n3's devices all excluded
    assert (spec["nnodes"], spec["nproc_per_node"], spec["exclude"]) == (2, 2, ["n3"])
    assert spec["devices"] == {"n1": [0, 2], "n2": [1, 3]}
    with pytest.raises(SystemExit, match="uneven"):  # torchrun starts as many ranks on every node
        relaunch_spec({**plan, "hosts": ["n1", "n1", "n1", "n2"]}, ["n1", "n2"])


@pytest.mark.multiprocess
def test_launch_sh_relaunches_on_the_kept_devices_after_an_s4_exit(tmp_path):
    """scripts/launch.sh outside SLURM with a stand-in torchrun (PYTHON=fake): the first run leaves a
    pending S4 plan and fails, the relaunch gets the plan's world, overrides, devices and no
    emulation from the environment, and a success ends the loop."""
    dump, calls = tmp_path / "dump", tmp_path / "calls"
    dump.mkdir()
    plan = {"status": "pending", "launch_id": "LAUNCH_ID", "hosts": [socket.gethostname()] * 2, "local_devices": [0, 2],
            "device_type": "cuda", "overrides": ["--parallelism.data_parallel_replicate_degree", "1",
                                                 "--titan_ext.emulate_slow_device", ""]}
    fake = tmp_path / "py"
    fake.write_text(f"""#!/bin/bash
if [[ " $* " == *" torch.distributed.run "* ]]; then
  echo "$# $* | ${{CUDA_VISIBLE_DEVICES:-unset}} ${{TITAN_EXT_S4_PLAN:-unset}} ${{TITAN_EXT_SLOW_DEVICE:-unset}}" >> {calls}
  if [ ! -f {tmp_path}/once ]; then touch {tmp_path}/once; echo '{json.dumps(plan)}' | sed "s/LAUNCH_ID/$TITAN_EXT_LAUNCH_ID/" > {dump}/{S4_PLAN_FILE}; exit 1; fi
  exit 0
fi
exec {sys.executable} "$@"
""")
    fake.chmod(0o755)
    env = dict(os.environ, PYTHON=str(fake), NPROC_PER_NODE="4", LOG_DIR=str(tmp_path / "logs"),
               TITAN_EXT_SLOW_DEVICE="3:4", CONFIG_FILE=CONFIG)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    p = subprocess.run(["bash", "scripts/launch.sh", "--job.dump_folder", str(dump)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    first, second = calls.read_text().splitlines()
    assert "--nproc_per_node 4" in first and first.endswith("| unset unset 3:4")
    assert "--nproc_per_node 2" in second and "--parallelism.data_parallel_replicate_degree 1" in second
    assert second.endswith(f"| 0,2 {dump / S4_PLAN_FILE} unset")
    # the emptied emulation key is one (empty) argument: its count is the first run's + 4
    assert int(second.split()[0]) == int(first.split()[0]) + 4
    assert json.loads((dump / S4_PLAN_FILE).read_text())["status"] == "consumed"


# --------------------------------------------------------------------------- S4 only where it pays


def _chunk_s(stage_factor: float) -> float:
    """One chunk (2 micro-batches through 2 stages, forward 30 ms / backward 60 ms a stage, stage 1
    ``stage_factor`` x slower) on devices of their own: the plan simulator's 1F1B makespan."""
    from titan_ext.plan.builtin import plan_builtin
    from titan_ext.plan.profile import PipelineProfile

    f, b = (30.0, 30.0 * stage_factor), (60.0, 60.0 * stage_factor)
    return plan_builtin("1F1B", PipelineProfile(2, 2, f, b, (0.0, 0.0))).predicted_makespan_ms / 1e3


@pytest.mark.parametrize("same_step", [False, True])
@pytest.mark.parametrize("factor, pays", [(4.0, False), (24.0, True)])
def test_s4_is_applied_only_where_the_restart_is_predicted_to_pay(factor, pays, same_step):
    """DP 2 x PP 2, 6 chunks, device 3 (replica 1's stage 1) ``factor`` x slow, 0.12 s of every
    step outside the replicas' compute. The true step times come from the simulated chunk times:
    with S2's [5, 1] 0.12 + max(5 c, c_slow); after S4 (replica 0 takes all 6 chunks) 0.12 + 6 c.
    S4 pays for the 24x device and not for the 4x one; the gate predicts S4's step from the
    monitor's measurements and decides the same — measured with [5, 1] in force, or at [3, 3]
    when S2 and S4 are decided in the same step (S4 is then weighed against S2's prediction)."""
    from titan_ext.runtime.falcon import FalconConfig, FalconDecision, FalconMonitor, IterationObservation
    from titan_ext.runtime.falcon.apply import JobView, plan_changes

    c, c_slow, fixed = _chunk_s(1.0), _chunk_s(factor), 0.12
    with_s2, after = fixed + max(5 * c, c_slow), fixed + 6 * c
    assert (after < with_s2) == pays
    measured_at = [3, 3] if same_step else [5, 1]
    mon = FalconMonitor(FalconConfig(num_microbatches=6), grid=[[0, 2], [1, 3]])
    mon.report_validation(gemm_times_s={0: 1.0, 1: 1.0, 2: 1.0, 3: factor})  # validation names device 3
    assert mon.slow_devices == [3]
    # S4 alone with S2's [5, 1] in force, or S2's [5, 1] and S4 decided in the same step at [3, 3]
    decision = FalconDecision(20, {"falcon/apply": "microbatch_redistribution,checkpoint_restart",
                                   "falcon/plan/microbatch_split": "[5, 1]"} if same_step
                              else {"falcon/apply": "checkpoint_restart"})
    view = JobView(step=20, split=tuple(measured_at), even_split=(3, 3), grid=((0, 2), (1, 3)),
                   replanning_on=True, checkpoint_enabled=True)
    first = plan_changes(decision, view, mon)
    assert first.s4_plan is not None and "falcon/predicted_s/checkpoint_restart" not in first.metrics  # nothing
    # measured yet: Alg. 1's decision stands
    for _ in range(6):
        mon.observe(IterationObservation(fixed + max(m * t for m, t in zip(measured_at, [c, c_slow])),
                                         replica_microbatch_s=(c, c_slow), split=measured_at))
    changes = plan_changes(decision, view, mon)
    assert ("checkpoint_restart" in changes.applied) == (changes.s4_plan is not None) == pays
    assert changes.metrics["falcon/predicted_s/checkpoint_restart"] == pytest.approx(after, rel=1e-9)
    assert changes.split == ((5, 1) if same_step else None)
    if pays:
        assert changes.s4_plan.kept_replicas == [0] and changes.s4_plan.chunks_per_replica == 6
    off = plan_changes(decision, dataclasses.replace(view, checkpoint_enabled=False), mon)
    assert off.s4_plan is None and any("checkpointer" in line for _, line in off.notes)


def _s4_resume_rank(rank: int, world: int, dump: str) -> tuple:
    from types import SimpleNamespace

    from titan_ext.titan.falcon_s4 import OUTCOME_STEPS, S4Resume

    # the job's last step is the 5th after the restart: its times are reduced at the check cadence (the
    # default falcon_check_every, 4) and at that last step
    trainer = SimpleNamespace(job_config=SimpleNamespace(job=SimpleNamespace(dump_folder=dump),
                                                         training=SimpleNamespace(steps=13 + OUTCOME_STEPS - 1)))
    resume = S4Resume.from_env(trainer, check_every=4)
    assert (resume.every, resume.last_step) == (4, 13 + OUTCOME_STEPS - 1)
    resume.before_step(13)
    for step in range(13, 13 + OUTCOME_STEPS):
        resume.after_step(step, 0.1 * (rank + 1))
    return resume.measured_s, resume.times


@pytest.mark.multiprocess
def test_s4_resume_reduces_its_host_times_on_a_control_group_not_the_data_group(tmp_path):
    """The restarted job's S4 cost and step times are host tensors: on a GPU job the default group is
    NCCL, which takes device tensors only. Under the NCCL-rules backend (every group but the gloo
    control groups is a data group that refuses host-made tensors) the restarted job records its
    cost and outcome, the slowest rank's times."""
    import time as _time

    from titan_ext.testing import run_ranks
    from titan_ext.titan.falcon_s4 import ENV_S4_PLAN

    plan = {"status": "consumed", "step": 12, "begin_time": _time.time() - 3.0, "excluded": [3],
            "world_size": 2, "num_dp": 1, "chunks_per_replica": 6, "estimated_cost_s": 20.0,
            "save_s": 1.0, "iteration_time_before_s": 2.0}
    (tmp_path / S4_PLAN_FILE).write_text(json.dumps(plan))
    results = run_ranks(_s4_resume_rank, 2, str(tmp_path), backend="nccl_rules",
                        env={ENV_S4_PLAN: str(tmp_path / S4_PLAN_FILE)}, timeout_s=120)
    (cost0, times0), (cost1, times1) = results
    assert cost0 == cost1 and cost0 >= 3.0
    assert times0 == times1 == [pytest.approx(0.2)] * 5  # MAX over the ranks
    rows = [json.loads(line) for line in (tmp_path / "falcon_events.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["restart", "outcome"]


# --------------------------------------------------------------------------- S4 onto spare nodes (SLURM)


def test_node_replacement_keeps_the_grid_and_moves_the_slow_node_whole():
    """Falcon §5.1's S4 with the launcher's spare node: DP 2 x PP 2 on two nodes of two ranks, device 3
    slow; its node (ranks 2, 3) restarts on the spare node, whose devices get new ids (4, 5)."""
    from titan_ext.runtime.falcon.restart import NodeReplacePlan, ReplacePlan, plan_node_replacement

    grid = _titan_grid(2, 2)  # [[0, 2], [1, 3]]
    plan = plan_node_replacement(grid, [3], spare_nodes=1, ranks_per_node=2, step=30, split=[5, 1])
    assert isinstance(plan, NodeReplacePlan) and isinstance(plan, ReplacePlan)
    assert plan.num_dp == 2 and plan.kept_ranks == [0, 1, 2, 3] and plan.chunks_per_replica == 3
    assert plan.excluded_nodes == [1] and plan.devices == [0, 1, 4, 5] and plan.replaced == {2: 4, 3: 5}
    # the emulated slow device leaves with its node; a fault between the kept devices stays
    emulation = remap_emulation(plan, "3:12@20", "0-1:x26@8")
    assert emulation["emulate_slow_device"] == "" and emulation["emulate_slow_link"] == "0-1:x26@8"
    assert emulation["falcon_devices"] == "0,1,4,5"
    # after an S3 (grid [[0, 1], [2, 3]]): new rank i plays the rank of the same (stage, replica)
    plan = plan_node_replacement([[0, 1], [2, 3]], [3], 1, 2, step=30, split=[5, 1])
    assert plan.kept_ranks == [0, 2, 1, 3] and plan.devices == [0, 4, 1, 5]
    # two slow devices on two nodes need two spare nodes; a job restarted once numbers on from its ids
    with pytest.raises(ValueError, match="spare node"):
        plan_node_replacement(grid, [0, 3], 1, 2, step=1, split=[3, 3])
    plan = plan_node_replacement(grid, [0, 3], 2, 2, step=1, split=[3, 3], device_of=[0, 1, 4, 5])
    assert plan.devices == [6, 7, 8, 9] and plan.excluded_nodes == [0, 1]
    with pytest.raises(ValueError, match="whole nodes"):
        plan_node_replacement(grid, [3], 1, 3, step=1, split=[3, 3])


def test_s4_restarts_on_a_spare_whenever_there_is_one_and_shrinks_only_without_saying_why():
    """plan_checkpoint_restart's order: spare devices, else the launcher's spare nodes, else the shrink,
    whose reason names both missing paths."""
    from titan_ext.runtime.falcon.restart import (NodeReplacePlan, ReplacePlan, S4Unavailable, ShrinkPlan,
                                                  plan_checkpoint_restart, spare_nodes_from_env)

    grid = _titan_grid(2, 2)
    args = (True, [3], [], grid, 30, [5, 1])
    assert type(plan_checkpoint_restart(*args, spares=(4,), spare_nodes=(1, 2))) is ReplacePlan
    assert type(plan_checkpoint_restart(*args, spare_nodes=(1, 2))) is NodeReplacePlan
    shrink = plan_checkpoint_restart(*args, spare_nodes=(0, 2))
    assert type(shrink) is ShrinkPlan and shrink.num_dp == 1
    assert "falcon_spares is empty" in shrink.shrink_reason and "TITAN_EXT_SPARE_NODES" in shrink.shrink_reason
    # too few spares of either kind: the shrink, with each path's reason
    grid3 = _titan_grid(3, 2)  # [[0, 3], [1, 4], [2, 5]]; nodes of 2 ranks: {0, 1}, {2, 3}, {4, 5}
    shrink = plan_checkpoint_restart(True, [0, 4], [], grid3, 30, [2, 2, 2], spares=(6,), spare_nodes=(1, 2))
    assert type(shrink) is ShrinkPlan and shrink.kept_replicas == [2]
    assert "1 spare(s)" in shrink.shrink_reason and "1 spare node(s)" in shrink.shrink_reason
    with pytest.raises(S4Unavailable, match="no spare path: .*falcon_spares is empty"):  # no replica is left
        plan_checkpoint_restart(True, [0, 3], [], grid, 30, [3, 3], spare_nodes=(0, 2))
    # the launcher's environment (scripts/launch.sh exports the count, torchrun LOCAL_WORLD_SIZE)
    assert spare_nodes_from_env({"TITAN_EXT_SPARE_NODES": "1", "LOCAL_WORLD_SIZE": "4"}) == (1, 4)
    assert spare_nodes_from_env({"TITAN_EXT_SPARE_NODES": "x"}) == (0, None)


def test_node_replacement_relaunch_spec_excludes_the_slow_node_and_keeps_the_node_count():
    from titan_ext.titan.falcon_s4 import relaunch_spec

    plan = {"mode": "replace_nodes", "hosts": ["n1.c", "n1.c", "n2.c", "n2.c"], "local_devices": [0, 1, 0, 1],
            "excluded_hosts": ["n2.c"], "overrides": ["--parallelism.data_parallel_replicate_degree", "2"]}
    spec = relaunch_spec(plan, ["n1", "n2", "n3"])
    assert (spec["nnodes"], spec["nproc_per_node"], spec["exclude"]) == (2, 2, ["n2"])
    assert spec["devices"] == {"n1": [0, 1], "n3": [0, 1]} and spec["spare_nodes"] == 0
    with pytest.raises(SystemExit, match="2 node"):  # no spare node left in the allocation
        relaunch_spec(plan, ["n1", "n2"])
    with pytest.raises(SystemExit, match="spare nodes is scripts/launch.sh"):  # not the one-node launcher
        relaunch_env(plan, {})


@pytest.mark.multiprocess
def test_launch_sh_under_slurm_restarts_on_the_spare_node_with_the_same_node_count(tmp_path):
    """scripts/launch.sh under SLURM (stand-ins for scontrol and srun): an allocation of 3 nodes for a
    job of NNODES=2 exports TITAN_EXT_SPARE_NODES=1; after an S4 exit whose plan replaces node n1, the
    relaunch is srun --nodes=2 --exclude=n1 with the plan's overrides (the rendezvous on a node it
    keeps), and the restarted job sees no spare node left."""
    dump, calls, bin_dir = tmp_path / "dump", tmp_path / "calls", tmp_path / "bin"
    dump.mkdir()
    bin_dir.mkdir()
    plan = {"status": "pending", "launch_id": "LAUNCH_ID", "mode": "replace_nodes", "world_size": 4,
            "hosts": ["n1", "n1", "n2", "n2"], "local_devices": [0, 1, 0, 1], "excluded_hosts": ["n1"],
            "device_type": "cpu", "overrides": ["--parallelism.data_parallel_replicate_degree", "2",
                                                "--titan_ext.falcon_devices", "0,1,4,5"]}
    (bin_dir / "scontrol").write_text("#!/bin/bash\nprintf 'n1\\nn2\\nn3\\n'\n")
    (bin_dir / "srun").write_text(f"""#!/bin/bash
line="$*"; echo "${{line//$'\\n'/ }} | ${{TITAN_EXT_SPARE_NODES:-unset}} ${{TITAN_EXT_S4_PLAN:-unset}}" >> {calls}
if [ ! -f {tmp_path}/once ]; then touch {tmp_path}/once
  echo '{json.dumps(plan)}' | sed "s/LAUNCH_ID/$TITAN_EXT_LAUNCH_ID/" > {dump}/{S4_PLAN_FILE}; exit 1; fi
exit 0
""")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON=sys.executable, NNODES="2",
               NPROC_PER_NODE="2", LOG_DIR=str(tmp_path / "logs"), CONFIG_FILE=CONFIG, SLURM_JOB_ID="77",
               SLURM_JOB_NODELIST="n[1-3]", SLURM_JOB_NUM_NODES="3")
    env.pop("TITAN_EXT_SPARE_NODES", None)
    p = subprocess.run(["bash", "scripts/launch.sh", "--job.dump_folder", str(dump)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    first, second = calls.read_text().splitlines()
    assert first.startswith("--nodes=2 --ntasks-per-node=1") and first.endswith("| 1 unset")
    assert "--rdzv_endpoint n1:29500" in first
    assert second.startswith("--nodes=2 --exclude=n1 --ntasks-per-node=1")
    assert "--rdzv_endpoint n2:29500" in second  # the rendezvous moves off the excluded head node
    assert "--nproc_per_node 2" in second and "--titan_ext.falcon_devices 0,1,4,5" in second
    assert second.endswith(f"| 0 {dump / S4_PLAN_FILE}")
    assert "excluded nodes: n1" in p.stdout
