"""scripts/gpu_tier_multi.py (PipeMorph over real NCCL, one process per GPU) without a GPU: it skips
cleanly with its reason; its one-context-per-GPU check (nvidia-smi's compute apps, the driver's primary
contexts) on sample outputs, a pid with a context on two GPUs failing it; its CPU reference; and its
training loop and read-outs on CPU under the ``nccl_rules`` backend (the part that would otherwise first run on a lent multi-GPU machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import gpu_tier_multi as multi  # noqa: E402

U0 = "6f3a2c1e-0000-4b1d-9a8e-000000000000"
U1 = "6f3a2c1e-1111-4b1d-9a8e-111111111111"


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_without_a_gpu_it_says_why_it_skips_and_exits_0(tmp_path):
    out = tmp_path / "multi.json"
    proc = subprocess.run([sys.executable, "scripts/gpu_tier_multi.py", "--json", str(out)], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": ""},
                          capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["skipped"] is True and doc["failures"] == []
    assert doc["reason"] == "no CUDA GPU (torch.cuda.is_available() is False)"
    assert f"skipped: {doc['reason']}" in proc.stdout


def test_skip_reasons():
    one = multi.skip_reason(True, 1, True)
    assert one.startswith("1 GPU:") and "at least 2" in one and "NCCL refuses two ranks on one device" in one
    assert multi.skip_reason(True, 0, True).startswith("0 GPU:")
    assert "no NCCL" in multi.skip_reason(True, 2, False)
    assert multi.skip_reason(True, 2, True) is None and multi.skip_reason(True, 8, True) is None


# nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader
GOOD = f"""4101, GPU-{U0}, 1530 MiB
4102, GPU-{U1}, 1530 MiB
999, GPU-{U0}, 20000 MiB
"""
# rank 1's side thread never selected its device: a second context, on GPU 0
ON_TWO = f"""4101, GPU-{U0}, 1530 MiB
4102, GPU-{U0}, 512 MiB
4102, GPU-{U1}, 1530 MiB
"""
EXPECTED = {4101: U0, 4102: U1.upper()}  # torch's form (no GPU- prefix), case as given
LABELS = {4101: "rank 0", 4102: "rank 1"}


def test_each_rank_on_exactly_its_own_gpu_passes_whatever_else_runs():
    res = multi.check_contexts(GOOD, EXPECTED, LABELS, none_expected=[4000])
    assert res["ok"] is True and res["problems"] == []
    assert res["contexts"] == {"4101": [U0], "4102": [U1], "4000": []}


def test_a_pid_with_a_context_on_two_gpus_fails():
    res = multi.check_contexts(ON_TWO, EXPECTED, LABELS)
    assert res["ok"] is False
    assert res["problems"] == [f"rank 1 (pid 4102): a context on GPU-{U0} besides its own GPU-{U1}"]
    assert res["contexts"]["4102"] == [U0, U1]


def test_a_rank_missing_from_its_gpu_or_the_launcher_holding_one_fails():
    res = multi.check_contexts(f"4101, GPU-{U0}, 1530 MiB\n4102, GPU-{U0}, 700 MiB\n4000, GPU-{U0}, 300 MiB\n",
                               EXPECTED, LABELS, none_expected=[4000])
    assert res["ok"] is False
    assert res["problems"] == [f"rank 1 (pid 4102): no context on its own GPU-{U1}",
                               f"rank 1 (pid 4102): a context on GPU-{U0} besides its own GPU-{U1}",
                               f"launcher (pid 4000): a context on GPU-{U0}"]


def test_no_rank_listed_is_inconclusive_not_a_pass():
    # a container: nvidia-smi shows the host's pids, or "No running processes found"
    for text in (f"77001, GPU-{U0}, 1530 MiB\n77002, GPU-{U1}, 1530 MiB\n", "No running processes found\n", ""):
        res = multi.check_contexts(text, EXPECTED, LABELS)
        assert res["ok"] is None and "none of the ranks' pids" in res["problems"][0]
    assert multi.parse_compute_apps(f"[N/A], GPU-{U0}, 1 MiB\nWARNING: x\n12, gpu-{U1.upper()}, [N/A]\n") == [(12, U1)]


def test_the_verdict_needs_one_conclusive_check_and_every_conclusive_check_passed():
    smi_ok = multi.check_contexts(GOOD, EXPECTED, LABELS)
    smi_none = multi.check_contexts("", EXPECTED, LABELS)
    smi_bad = multi.check_contexts(ON_TWO, EXPECTED, LABELS)
    drv_ok = multi.driver_check([[0], [1]], [0, 1])
    drv_bad = multi.driver_check([[0], [0, 1]], [0, 1])
    drv_none = multi.driver_check([[0], None], [0, 1])
    assert drv_bad["problems"] == ["rank 1: primary contexts on devices [0, 1], expected only [1]"]
    assert multi.verdict(smi_ok, drv_ok) == {"ok": True, "decided_by": ["nvidia-smi", "cuDevicePrimaryCtxGetState"],
                                             "problems": []}
    v = multi.verdict(smi_none, drv_ok)  # pids not visible (a container): the driver decides
    assert v["ok"] is True and v["decided_by"] == ["cuDevicePrimaryCtxGetState"]
    assert multi.verdict(smi_none, drv_bad)["ok"] is False
    assert multi.verdict(smi_ok, drv_bad)["ok"] is False  # they must agree
    assert multi.verdict(smi_bad, drv_none)["ok"] is False
    assert multi.verdict(None, drv_ok)["ok"] is True  # no nvidia-smi
    v = multi.verdict(smi_none, drv_none)
    assert v["ok"] is False and v["decided_by"] == [] and v["problems"][0].startswith("neither nvidia-smi")


def test_primary_contexts_without_libcuda_is_unknown_not_empty():
    try:
        import ctypes

        ctypes.CDLL("libcuda.so.1")
        pytest.skip("libcuda present: the unknown case needs a machine without a CUDA driver")
    except OSError:
        pass
    assert multi.primary_contexts() is None


def _train_on_cpu(rank, world, args):
    import torch
    import torch.distributed as dist

    control = dist.new_group(backend="gloo")
    out = multi._train(rank, world, torch.device("cpu"), control, args)
    # nobody here has nvidia-smi or libcuda: the check must say it could not tell, not pass
    everyone = [{"rank": r, "pid": 1000 + r, "device": r, "uuid": U0, "primary_contexts": multi.primary_contexts()}
                for r in range(world)]
    out["contexts"] = multi.contexts_now(everyone, os.getpid()) if rank == 0 else None
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_the_training_loop_and_its_readouts_run_on_cpu_and_match_the_cpu_reference():
    from titan_ext.testing import run_ranks

    args = SimpleNamespace(steps=4, warmup=1, microbatches=4, mb_rows=8, dim=32, action_ms=1.0, profile_every=2,
                           pp_timeout_s=120.0)
    # nccl_rules: NCCL's semantics on CPU (on plain gloo every PP wait passes a timeout, a host wait)
    res = run_ranks(_train_on_cpu, 2, args, backend="nccl_rules", timeout_s=220)
    for r in res:
        assert r["params_equal_cpu"], r["params_max_abs_diff"]  # the reference is the pipeline's arithmetic
        assert r["budget_violations"] == []
        assert [s["step"] for s in r["steady_steps"]] == [1, 2, 3]
        assert [s["exchange"] for s in r["steady_steps"]] == [False, True, False]  # profile_every=2
        assert 0.0 <= r["idle_fraction"] < 1.0 and r["action_ms_median"] >= 1.0
        assert r["predicted_activation_bytes"] > 0
    assert len(res[1]["losses"]) == 4 and all(len(step) == 4 for step in res[1]["losses"])
    ctx = res[0]["contexts"]
    if not os.path.exists("/usr/bin/nvidia-smi"):
        assert ctx["ok"] is False and ctx["decided_by"] == [] and ctx["nvidia_smi"] is None
