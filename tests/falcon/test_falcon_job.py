"""Falcon in a TorchTitan DP 2 x PP 2 job on CPU: emulation, S2's exactness, end to end.

The end-to-end runs (torchrun, 4 ranks on loopback under the nccl_rules test backend unless
``$TITAN_EXT_TEST_BACKEND`` names gloo, TorchTitan's llama3 debug model) are module
fixtures shared by several tests: a 40-step healthy run, and a run where device 3 (stage 1 of DP
replica 1) becomes 24x slower in its forward and backward-input passes at step 10, once with Falcon applying its decisions and once only
detecting and logging them (same seed and data).
"""

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from _titan_version import falcon_job as _torchrun
from _titan_version import falcon_log as _falcon_log

from titan_ext.runtime.falcon.emulation import (
    EmulationSpecError,
    FailSlowEmulation,
    parse_slow_device,
    parse_slow_link,
)
from titan_ext.testing import run_ranks

SLOW_FROM = 10
SLOW_FACTOR = 24
"""The debug model's stage compute is ~1 ms a micro-batch: at 24x the slow replica adds ~1 s a step,
>= 3x the step-time noise of a loaded 2-core host (at 8x one run in three saw no onset)."""
STEPS = 28


# --------------------------------------------------------------------------- emulation (no processes)


def test_emulation_specs_and_what_each_rank_pays():
    assert parse_slow_device("3:2.5@7") == parse_slow_device(" 3 : 2.5 @ 7 ")
    assert parse_slow_device("") is None and parse_slow_link(" ") is None
    for bad in ("3", "3:0.5", "x:2"):
        with pytest.raises(EmulationSpecError):
            parse_slow_device(bad)
    for bad in ("0-0:40", "0:40", "0-1"):
        with pytest.raises(EmulationSpecError):
            parse_slow_link(bad)
    link = parse_slow_link("0-1:40@5")
    # mesh rank r runs device device_of[r]; after a permutation the fault stays with the devices
    e = FailSlowEmulation(0, [0, 2, 1, 3], slow_link=link)
    e.step = 4
    assert e.link_ms(0, 2) == 0.0  # not active before step 5
    e.step = 5
    assert e.link_ms(0, 2) == e.link_ms(2, 0) == 40.0 and e.link_ms(0, 1) == 0.0
    assert e.collective_delay_s([0, 2], steps=2) == pytest.approx(0.080)
    assert e.collective_delay_s([1, 3], steps=2) == 0.0
    # ranks 0 and 2 (devices 0, 1) are neighbours in pipeline [0, 2]: link 0 of that pipeline
    assert e.pp_link_spec([0, 2]) == "0:40" and e.pp_link_spec([1, 3]) == ""
    with pytest.raises(EmulationSpecError):
        FailSlowEmulation(0, range(4), slow_device=parse_slow_device("7:2"))


def test_emulation_is_checked_before_any_process_group(monkeypatch):
    from types import SimpleNamespace

    from titan_ext.titan.falcon_emulate import check_emulation

    section = SimpleNamespace(emulate_slow_device="3:2", emulate_slow_link="")
    check_emulation(section, pp=2, dp_replicate=2, dp_shard=1, world_size=4)
    with pytest.raises(ValueError, match="DP x PP jobs only"):
        check_emulation(section, pp=4, dp_replicate=1, dp_shard=1, world_size=4)
    with pytest.raises(ValueError, match="device 3 does not exist"):
        check_emulation(section, pp=2, dp_replicate=2, dp_shard=1, world_size=2)
    monkeypatch.setenv("TITAN_EXT_SLOW_LINK", "1-1:40")  # the environment is checked too
    with pytest.raises(ValueError, match="emulate_slow_link = '1-1:40'"):
        check_emulation(SimpleNamespace(emulate_slow_device="", emulate_slow_link=""), 2, 2, 1, 4)


def test_slow_device_stretches_compute_by_its_factor():
    from titan_ext.titan.falcon_emulate import install_compute_stretch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256))
    x = torch.randn(64, 256, requires_grad=True)
    emulation = FailSlowEmulation(0, [0], slow_device=parse_slow_device("0:3"))
    regions: list[float] = []
    original = emulation.stretch

    def record(t0, passes=None):
        import time

        t1 = time.perf_counter()
        original(t0, passes)
        regions.append((t1 - t0, time.perf_counter() - t0))

    emulation.stretch = record
    install_compute_stretch(model, emulation)
    model(x).sum().backward()
    assert len(regions) == 2  # the forward and the backward of the part
    for busy, total in regions:  # each region ends after (3 - 1) x its own length of sleep
        assert total >= 3 * busy * 0.99


@pytest.mark.parametrize("slow", [False, True])
def test_dedicated_device_emulation_pads_each_pass_to_its_device_time(slow):
    """``emulate_device_pass_ms``: a forward takes P, a backward 2P (the slow device 3x that),
    whatever the host's real compute of the pass was (here far below P)."""
    import time

    from titan_ext.titan.falcon_emulate import install_compute_stretch

    pass_s = 0.05
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
    x = torch.randn(4, 16, requires_grad=True)
    emulation = FailSlowEmulation(0, [0], slow_device=parse_slow_device("0:3") if slow else None, pass_s=pass_s)
    regions: list[tuple[float, float]] = []  # (the pass's device time, its measured length)
    original = emulation.stretch

    def record(t0, passes=None):
        t1 = time.perf_counter()
        original(t0, passes)
        regions.append((passes * pass_s * (3 if slow else 1), time.perf_counter() - t0, t1 - t0))

    emulation.stretch = record
    install_compute_stretch(model, emulation)
    model(x).sum().backward()
    assert [round(r[0] / pass_s) for r in regions] == ([3, 6] if slow else [1, 2])  # forward, backward
    for device_s, total, busy in regions:
        assert busy < device_s and device_s <= total < device_s + busy + 0.1
    with pytest.raises(EmulationSpecError):
        FailSlowEmulation(0, [0], pass_s=-1.0)


# --------------------------------------------------------------------------- S2 exactness (gloo, float64)


def _model():
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 1)).double()


def _chunks_of_replica(dp: int, k: int):
    """Replica dp's data loader: k chunks of (input_dict, labels), 3 samples each, float64."""
    g = torch.Generator().manual_seed(500 + dp)
    return [({"input": torch.randn(3, 6, generator=g, dtype=torch.float64)},
             torch.randn(3, 1, generator=g, dtype=torch.float64)) for _ in range(k)]


def _step_gradients(chunks, group) -> list[torch.Tensor]:
    from titan_ext.runtime.falcon.redistribute import weighted_all_reduce_gradients

    model = _model()
    for inputs, labels in chunks:  # TorchTitan: token-sum losses, one backward per chunk
        torch.nn.functional.mse_loss(model(inputs["input"]), labels, reduction="sum").backward()
    weighted_all_reduce_gradients(model.parameters(), 1.0, group)  # DPSync.sync
    return [p.grad.clone() for p in model.parameters()]


def _s2_worker(rank, world, outdir):
    from titan_ext.runtime.falcon.redistribute import redistribute_chunks

    mine = _chunks_of_replica(rank, 3)
    out = {"even": _step_gradients(mine, None)}
    for split in ([4, 2], [1, 5]):
        chunks = redistribute_chunks(mine, split, rank)
        out[str(split)] = _step_gradients(chunks, None)
        out[f"n{split}"] = len(chunks)
    torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))


@pytest.mark.multiprocess
def test_s2_redistribution_keeps_the_global_gradient_float64(tmp_path):
    run_ranks(_s2_worker, 2, str(tmp_path), backend="gloo")
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    # independent reference: one process, the whole global batch (both loaders' chunks), float64
    model = _model()
    for dp in range(2):
        for inputs, labels in _chunks_of_replica(dp, 3):
            torch.nn.functional.mse_loss(model(inputs["input"]), labels, reduction="sum").backward()
    ref = [p.grad for p in model.parameters()]
    for r, out in enumerate(res):
        assert out["n[4, 2]"] == [4, 2][r] and out["n[1, 5]"] == [1, 5][r]
        for key in ("even", "[4, 2]", "[1, 5]"):
            for got, want in zip(out[key], ref):
                torch.testing.assert_close(got, want, rtol=1e-9, atol=0)


# --------------------------------------------------------------------------- end to end (torchrun)


def _events(dump: Path) -> list[dict]:
    path = dump / "falcon_events.jsonl"
    if not path.exists():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _losses(dump: Path) -> list[float]:
    with open(dump / "pipeline_metrics.jsonl") as f:
        return [json.loads(line)["loss"] for line in f if line.strip()]


@pytest.fixture(scope="module")
def slow_device_runs(tmp_path_factory):
    """The job with device 3 slow from SLOW_FROM and Falcon applying, and its reference: the same job
    with neither the fault nor any mitigation applied (the emulated fault only delays, so the
    reference computes what an unmitigated faulty run computes, in a third of its time)."""
    runs = {}
    for name, args in (("falcon", ["--titan_ext.emulate_slow_device", f"3:{SLOW_FACTOR}@{SLOW_FROM}",
                                   "--titan_ext.falcon_apply"]),
                       ("off", ["--titan_ext.no-falcon_apply"])):
        dump = tmp_path_factory.mktemp(f"slow_device_{name}")
        _torchrun(dump, STEPS, args)
        runs[name] = dump
    return runs


@pytest.mark.slow
@pytest.mark.soak  # CI runs it in the TorchTitan 0.3 tier (scripts/ci_versions.sh)
def test_slow_device_detected_localised_and_s2_applied(slow_device_runs):
    rows = _falcon_log(slow_device_runs["falcon"])
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    onsets = [r for r in rows if r.get("falcon/event") == "onset"]
    assert onsets, "no onset detected"
    onset = onsets[0]
    # the first onset is the injected one, a few steps after it began (never before: the
    # emulation starts at SLOW_FROM) and it was localised to device 3 by the GEMM probe
    assert SLOW_FROM <= onset["step"] <= SLOW_FROM + 10, onset
    assert onset["falcon/slow_devices"].split(",")[0] == "3", onset
    assert onset["falcon/root_cause"] == "compute"
    applied = [r for r in rows if "microbatch_redistribution" in r.get("falcon/apply", "")]
    assert applied, "S2 was not applied"
    split = json.loads(applied[0]["falcon/plan/microbatch_split"])
    assert sum(split) == 6 and split[0] > split[1]  # replica 1 holds the slow device: fewer chunks
    # each plan in force from the next step on, until the next one (S2's closed loop may re-plan)
    plans = {r["step"]: json.loads(r["falcon/plan/microbatch_split"]) for r in applied}
    in_force = split
    for r in [r for r in rows if r["step"] > applied[0]["step"]]:
        assert json.loads(r["falcon/split"]) == plans.get(r["step"], in_force), (r["step"], plans)
        in_force = plans.get(r["step"], in_force)
    # S3 / S4 may be *decided* later (Alg. 1 on measured costs); an applied S3 (in memory) carries
    # its measured cost, S4 is not applied in this job
    for e in _events(slow_device_runs["falcon"]):
        if e.get("strategy") == "S3" and e.get("applied"):
            assert e["measured_cost_s"] > 0
        assert not (e.get("strategy") == "S4" and e.get("applied"))
    # every decision is a falcon_events.jsonl row: S2 applied at that step, with measured costs
    events = _events(slow_device_runs["falcon"])
    s2 = [e for e in events if e["kind"] == "decision" and e["strategy"] == "S2"]
    assert [e["observed_step"] for e in s2] == [r["step"] for r in applied] and s2[0]["applied"]
    assert all(0 <= e["iteration"] - e["observed_step"] < 4 for e in s2)  # applied at the next check
    assert s2[0]["suspected"]["root_cause"] == "compute" and 3 in s2[0]["suspected"]["slow_devices"]
    assert 0 < s2[0]["estimated_cost_s"] < 60 and s2[0]["measured_cost_s"] is not None


@pytest.mark.slow
def test_s2_on_dedicated_devices_matches_the_closed_form(tmp_path):
    """Dedicated-device emulation (``emulate_device_pass_ms``: forward P = 30 ms, backward 2P): a
    chunk is a 1F1B pass of 2 micro-batches over 2 stages, 3τ with τ = 3P a stage's forward +
    backward; device 3 at 4x from step 5 makes replica 1's chunk τ + 4τ + 4τ = 9τ. With F the step
    outside the chunks (from the healthy steps, F = healthy − 9τ) the fault takes F + 27τ, and S2
    must choose the split a brute force over the 6 chunks gives ([5, 1]: max(5 · 3τ, 9τ) = 15τ)
    and then take F + 15τ: 1.6x healthy, where no split reaches the 1.25x that the shared cores
    sometimes show (docs/falcon.md "Dedicated devices"). Medians of the job's own steps, within 15 %."""
    tau, total = 3 * 0.030, 6
    _torchrun(tmp_path, 20, ["--titan_ext.emulate_slow_device", "3:4@5", "--titan_ext.emulate_device_pass_ms", "30"])
    rows = {r["step"]: r for r in _falcon_log(tmp_path)}
    s2 = [(e["iteration"], e["observed_step"]) for e in _events(tmp_path)
          if e["kind"] == "decision" and e["strategy"] == "S2" and e["applied"]]
    assert s2, ("S2 was not applied", [(e["kind"], e.get("suspected"), e.get("strategy"), e.get("applied"))
                                       for e in _events(tmp_path)])
    chunk = [3 * tau, 9 * tau]
    best = min(([m, total - m] for m in range(1, total)), key=lambda sp: max(m * c for m, c in zip(sp, chunk)))
    # the plan is in the row of the step that decided it; it was applied at the check s2[0][0]
    assert json.loads(rows[s2[0][1]]["falcon/plan/microbatch_split"]) == best == [5, 1]
    s2 = [applied for applied, _ in s2]

    def median(steps):
        return float(np.median([rows[k]["falcon/iteration_time_s"] for k in steps]))

    healthy = median(range(2, 5))
    fixed = healthy - 9 * tau
    assert fixed >= 0, healthy
    assert median(range(5, s2[0] + 1)) == pytest.approx(fixed + 27 * tau, rel=0.15)
    assert median(range(s2[0] + 2, 21)) == pytest.approx(fixed + 15 * tau, rel=0.15)


@pytest.mark.slow
@pytest.mark.soak  # CI runs it in the TorchTitan 0.3 tier (scripts/ci_versions.sh)
def test_s2_run_trains_like_the_unmitigated_run(slow_device_runs):
    # same seed, data and global batch; S2 only changes which replica computes which chunk
    # (float32 sums in another order: equal within float tolerance, not bit for bit)
    with_s2, without = _losses(slow_device_runs["falcon"]), _losses(slow_device_runs["off"])
    assert len(with_s2) == len(without) == STEPS
    for a, b in zip(with_s2, without):
        assert a == pytest.approx(b, rel=2e-3), (with_s2, without)
    assert with_s2[-1] < 0.7 * with_s2[0]


@pytest.mark.slow  # a 4-rank TorchTitan job (about 30 s)
@pytest.mark.soak  # CI's healthy Falcon job under nccl_rules: tests/falcon/test_falcon_s3.py's reference run (32 steps)
def test_short_dp2_pp2_job_runs_under_the_test_backend_and_learns(tmp_path):
    """The default tier's DP 2 x PP 2 job: 6 steps under nccl_rules (NCCL's rules on the PP
    and DP groups: a host tensor on them, a reordered or split batch, an op from a second thread
    raises), Falcon on: every step is profiled, nothing is mitigated, the loss falls (the replicas'
    gradients are summed and the stages' data arrive in order).  24-45 s on a loaded 2-core host."""
    _torchrun(tmp_path, 6, [])
    rows = _falcon_log(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(r["falcon/split"] == "[3, 3]" and not r.get("falcon/apply") for r in rows)
    losses = _losses(tmp_path)
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    # measured: 0.49x on TorchTitan 0.2.2's debug config, 0.81x on 0.3's (another model size and lr)
    assert losses[-1] < 0.9 * losses[0], losses


@pytest.fixture(scope="module")
def healthy_run(tmp_path_factory):
    dump = tmp_path_factory.mktemp("healthy")
    _torchrun(dump, 40, [])
    return dump


@pytest.mark.slow
@pytest.mark.soak  # 70 s; CI's DP 2 x PP 2 job without a fault: tests/falcon/test_falcon_s3.py's reference run
def test_healthy_40_step_run_takes_no_mitigation(healthy_run):
    """Zero mitigations *applied*. The shared host itself may slow every rank
    for a few steps (seen: steps 26-31 of a run at 2-4 s against ~0.5 s, +236 %); Falcon then
    rightly detects an event and decides, but nothing of the job changes: no S2 split, no S3 grid,
    no S4, and a PipeMorph re-plan on a schedule that already re-plans is no application."""
    rows = _falcon_log(healthy_run)
    assert [r["step"] for r in rows] == list(range(1, 41))
    applied = {e["name"] for e in _events(healthy_run) if e["kind"] == "decision" and e["applied"]}
    assert applied <= {"ignore"}, applied  # S1 "ignore" is doing nothing
    assert all(r["falcon/split"] == "[3, 3]" and r["falcon/grid"] == "[[0, 2], [1, 3]]" for r in rows)
    losses = _losses(healthy_run)
    assert losses[-1] < 0.5 * losses[0]


# --------------------------------------------------------------------------- falcon_events.jsonl rows


def test_event_rows_record_each_decision_its_costs_and_outcome():
    from types import SimpleNamespace

    from titan_ext.runtime.falcon import StrategyCosts
    from titan_ext.titan.falcon_events import event_rows

    monitor = SimpleNamespace(root_cause="dp_link", slow_devices=[], slow_links=[(0, 1)],
                              suspicious=["dp_stage0"],
                              config=SimpleNamespace(costs=StrategyCosts(topology_adjustment=2.5)))
    decision = {"falcon/event": "onset", "falcon/change_point_iteration": 5, "falcon/iteration_time_s": 0.4,
                "falcon/root_cause": "dp_link", "falcon/apply": "ignore,topology_adjustment",
                "falcon/impact_s": 2.6, "falcon/effect/ignore": 0.0,
                "falcon/effect/ignore/before_s": 0.4, "falcon/effect/ignore/after_s": 0.4}
    costs = monitor.config.costs
    rows = event_rows(7, decision, monitor, costs, {"ignore": 0.0, "topology_adjustment": 0.01}, True)
    assert [r["kind"] for r in rows] == ["event", "localised", "decision", "decision", "outcome"]
    s1, s3 = rows[2], rows[3]
    assert (s1["strategy"], s1["applied"]) == ("S1", True)
    # S3 applied in memory: its measured cost is the application's, next to the estimate it replaced
    assert (s3["strategy"], s3["applied"], s3["measured_cost_s"]) == ("S3", True, 0.01)
    assert s3["estimated_cost_s"] == 2.5 and s3["suspected"]["slow_links"] == [[0, 1]]
    # decided but not applied (e.g. a plan that keeps the grid): no measured cost
    s3_kept = event_rows(7, decision, monitor, costs, {"ignore": 0.0}, True)[3]
    assert (s3_kept["applied"], s3_kept["measured_cost_s"]) == (False, None)
    assert rows[4]["iteration_time_after_s"] == 0.4
    # with falcon_apply off nothing is applied
    assert not any(r.get("applied") for r in event_rows(7, decision, monitor, costs, {}, False))


def test_validation_is_narrowed_to_the_suspicious_groups_rings():
    from titan_ext.runtime.falcon.measure import rings_to_validate

    grid = [[0, 2], [1, 3]]  # TorchTitan's DP 2 x PP 2: pipelines {0,2}, {1,3}; DP columns {0,1}, {2,3}
    assert rings_to_validate(grid, ["dp_stage1"]) == [[2, 3]]
    assert rings_to_validate(grid, ["pp1_link0", "dp_stage0", "pp1_link0"]) == [[1, 3], [0, 1]]
    # nothing flagged by profiling: every pipeline and DP column
    assert rings_to_validate(grid, []) == [[0, 2], [1, 3], [0, 1], [2, 3]]
