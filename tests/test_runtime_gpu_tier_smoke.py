"""scripts/gpu_tier.py (the GPU tier's runtime step) run on the CPU: every code path of the script but the
CUDA memory statistics and events, so a lent GPU's few minutes are not spent finding a script error.
Under torch 2.11 (the GPU image's torch, ``scripts/ci_versions.sh torch-2.11``) ZBV's start-up handshake
sends between the two stages of one rank, through the link-delay injector."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(240)
def test_the_gpu_tier_script_runs_on_cpu_and_reports_each_cell(tmp_path):
    out = tmp_path / "gpu_tier.json"
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_tier.py", "--device", "cpu", "--worlds", "2", "--schedules", "ZBV,PipeMorph",
         "--steps", "3", "--warmup", "1", "--microbatches", "4", "--dim", "64", "--json", str(out)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["failures"] == []
    cells = {(c["schedule"], c["delay_ms"]): c for c in doc["cells"]}
    assert set(cells) == {("ZBV", 0.0), ("ZBV", 60.0), ("PipeMorph", 0.0), ("PipeMorph", 60.0)}
    for c in cells.values():
        assert "error" not in c, c
        assert c["losses_equal_cpu"] and c["params_equal_cpu"], c
        assert c["params_moved"] and c["params_equal_torch_1f1b"], c
        assert c["host_syncs_per_step_max_per_rank"] == [0, 0]
    for delay in (0.0, 60.0):
        pm = cells[("PipeMorph", delay)]
        # the planner's prediction: peak in-flight activations of the deployed plan x measured bytes (> 0)
        assert all(b is not None and b > 0 for b in pm["predicted_activation_bytes_per_rank"])
        assert pm["booked_forward_ms"] > 0
    # +60 ms on the one link of two ranks: every schedule is slower with it than without
    assert cells[("ZBV", 60.0)]["median_ms"] > cells[("ZBV", 0.0)]["median_ms"]
