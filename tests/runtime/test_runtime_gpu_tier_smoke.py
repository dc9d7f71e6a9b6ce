"""scripts/gpu_tier.py (the GPU tier's runtime step) run on the CPU: every code path of the script but the
CUDA calls themselves (events are host stamps, the spin a sleep, the staging copies plain copies), so a
lent GPU's few minutes are not spent finding a script error.  The staged transport (its sender and
lander threads, NCCL's semantics for the device layer), the per-step host-sync accounting, the idle
fraction and the plan read-out all run here.  Under torch 2.11 (the GPU image's torch,
``scripts/ci_versions.sh torch-2.11``) ZBV's start-up handshake sends between the two stages of one
rank, through the staged transport and the link-delay injector.

On 2026-11-28 the PipeMorph, CrossPipe and delegated-PipeMorph cells failed on an H100 in the script's
own plan read-out ("too many values to unpack"), which then ran on CUDA only: the read-out now runs on
every device and this test runs all three cells, each required to report the plan's prediction."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run_tier(tmp_path, schedules: str) -> dict:
    out = tmp_path / "gpu_tier.json"
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_tier.py", "--device", "cpu", "--worlds", "2", "--schedules", schedules,
         "--steps", "4", "--warmup", "1", "--microbatches", "4", "--dim", "64", "--json", str(out)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["failures"] == []
    assert doc["transport"]["pp_backend"] == "gloo" and "NCCL refuses two ranks" in doc["transport"]["why"]
    return doc


def _common(c: dict) -> None:
    assert "error" not in c, c
    assert c["losses_equal_cpu"] and c["params_equal_cpu"], c
    assert c["params_moved"] and c["params_equal_torch_1f1b"], c
    assert c["host_syncs_per_step_max_per_rank"] == [0, 0]
    steps = c["steady_steps_per_rank"]
    assert [[s["step"] for s in r] for r in steps] == [[1, 2, 3], [1, 2, 3]]  # counted per steady step
    for r in range(2):
        assert 0.0 <= c["idle_fraction_per_rank"][r] < 1.0
        assert c["action_ms_median_per_rank"][r] >= 1.0  # --action-ms on CPU: 1 ms sleeps
        assert c["arrival_waits_per_rank"][r] is not None  # the staged transport carried the messages


@pytest.mark.slow  # 50 s on a loaded host; its parts run in the default tier (tests/runtime/test_runtime_gpu_tier_units.py)
@pytest.mark.soak
@pytest.mark.timeout(600)
def test_the_gpu_tier_script_runs_on_cpu_and_reports_each_cell(tmp_path):
    doc = _run_tier(tmp_path, "ZBV,PipeMorph")
    cells = {(c["schedule"], c["delay_ms"]): c for c in doc["cells"]}
    assert set(cells) == {("ZBV", 0.0), ("ZBV", 60.0), ("PipeMorph", 0.0), ("PipeMorph", 60.0)}
    for c in cells.values():
        _common(c)
    for delay in (0.0, 60.0):
        pm = cells[("PipeMorph", delay)]
        # the planner's prediction: peak in-flight activations of the deployed plan x measured bytes (> 0)
        assert all(b is not None and b > 0 for b in pm["predicted_activation_bytes_per_rank"])
        assert pm["booked_forward_ms"] > 0
        # profile_every=2: steps 1 and 3 have no exchange, where the budget is 0
        assert [s["exchange"] for s in pm["steady_steps_per_rank"][0]] == [False, True, False]
        assert pm["steps_without_exchange"] == 2
    # +60 ms on the one link of two ranks: every schedule is slower with it than without
    assert cells[("ZBV", 60.0)]["step_ms"] > cells[("ZBV", 0.0)]["step_ms"]


@pytest.mark.slow  # the read-out that failed there is pinned in the default tier by test_runtime_gpu_tier_units.py
@pytest.mark.timeout(600)
def test_the_cells_that_failed_on_the_h100_run_to_the_end_on_cpu(tmp_path):
    doc = _run_tier(tmp_path, "CrossPipe,PipeMorph-delegated")
    cells = {(c["schedule"], c["delay_ms"]): c for c in doc["cells"]}
    assert set(cells) == {("CrossPipe", 0.0), ("CrossPipe", 60.0), ("PipeMorph-delegated", 0.0)}
    for c in cells.values():
        _common(c)
        # the read-out that raised on the H100: the deployed plan's peak in-flight activations x bytes
        assert all(b is not None and b > 0 for b in c["predicted_activation_bytes_per_rank"]), c
        assert c["plan_version"] >= 1 and c["booked_forward_ms"] > 0
