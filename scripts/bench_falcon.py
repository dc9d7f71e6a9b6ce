#!/usr/bin/env python
"""Falcon benchmark: detection latency (iterations after onset) and per-iteration detector cost.

Usage:
    .venv/bin/python scripts/bench_falcon.py [--per-category 100] [--seed0 50000] [--json out.json]
    .venv/bin/python scripts/bench_falcon.py --end-to-end [--steps 24] [--slow-from 6] [--json out.json]
    .venv/bin/python scripts/bench_falcon.py --end-to-end --s4 [--steps 80] [--device-factor 4] [--json out.json]
    .venv/bin/python scripts/bench_falcon.py --end-to-end --group-tracking 6 [--steps 30] [--json out.json]
    .venv/bin/python scripts/bench_falcon.py --compound [--steps 85] [--device-factor 12] --json PATH.json  (+ PATH.png)
    .venv/bin/python scripts/bench_falcon.py --calibrate-hol [--steps 12 --slow-from 6] [--json PATH]
    .venv/bin/python scripts/bench_falcon.py --fig19 [--fault-ms 10,20,30] [--repeat 3] [--steps 16] [--json PATH]

Prints a markdown table and a JSON document (also written to --json). Everything runs on CPU in one
process; the hook-overhead part creates a 1-rank gloo group on loopback.

``--end-to-end``: TorchTitan's llama3 debug model as DP 2 x PP 2 (train_configs/debug_cpu_dp2_pp2.toml,
4 gloo ranks under torchrun) in five scenarios (``--scenarios`` picks some) -- healthy, slow device
(device 3 at 4x), slow DP link (link 0-1, stage 0's DP group, ``--link-factor`` times slower: its
all-reduce +5x at 6), slow PP link (+40 ms between ranks 0 and 2, pipeline 0), and slow device 1 +
slow DP link 0-1 (S2, then S3) from step ``--slow-from`` on -- each without and with Falcon
(``falcon_apply`` false / true: both detect, validate and log; only the second applies), run back
to back per scenario. Iteration time = median of the slowest rank's step time over the steps after
the last applied mitigation (the same steps in both runs); time to mitigation = wall time from the
fault's first step to the end of the step that applied the first strategy other than "ignore"
(applied: from ``falcon_events.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from titan_ext.runtime.falcon import FalconMonitor, SlowIterationDetector  # noqa: E402
from titan_ext.testing.falcon_traces import CATEGORIES, make_traces  # noqa: E402


def _pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def bench_detection(per_category: int, seed0: int) -> dict:
    traces = make_traces(per_category, seed0=seed0)
    per_cat: dict[str, dict] = {c: {"n": 0, "correct": 0, "false_positive": 0, "latency": [],
                                    "latency_full": []} for c in CATEGORIES}
    step_us: list[float] = []
    step_cpu_us: list[float] = []
    iter_s: list[float] = []
    for tr in traces:
        det = SlowIterationDetector()
        for x in tr.times_s:
            c0 = time.thread_time_ns()
            t0 = time.perf_counter()
            det.observe(float(x))
            step_us.append((time.perf_counter() - t0) * 1e6)
            step_cpu_us.append((time.thread_time_ns() - c0) * 1e-3)
        iter_s.extend(tr.times_s.tolist())
        onsets = [c for c in det.change_points if c.kind == "onset"]
        st = per_cat[tr.category]
        st["n"] += 1
        if not tr.failslow:
            st["correct"] += not onsets
            st["false_positive"] += bool(onsets)
            continue
        if onsets and onsets[0].detected_at >= tr.onset and \
                tr.onset - 2 <= onsets[0].index <= tr.full_effect + 2 and \
                onsets[0].detected_at <= tr.full_effect + 10:
            ok = True
            if tr.relief is not None:
                rel = [c for c in det.change_points if c.kind == "relief"]
                ok = bool(rel) and tr.relief - 2 <= rel[0].index <= tr.relief + 2
            st["correct"] += ok
            st["latency"].append(onsets[0].detected_at - tr.onset)
            st["latency_full"].append(onsets[0].detected_at - tr.full_effect)
    out = {"traces": len(traces), "seed0": seed0, "per_category": {}}
    total_correct = 0
    for c, st in per_cat.items():
        total_correct += st["correct"]
        out["per_category"][c] = {
            "n": st["n"],
            "accuracy": st["correct"] / st["n"],
            "false_positives": st["false_positive"],
            "latency_iters_mean": float(np.mean(st["latency"])) if st["latency"] else None,
            "latency_iters_p50": _pct(st["latency"], 50) if st["latency"] else None,
            "latency_iters_p95": _pct(st["latency"], 95) if st["latency"] else None,
            "latency_iters_max": int(max(st["latency"])) if st["latency"] else None,
            "latency_after_full_effect_max": int(max(st["latency_full"])) if st["latency_full"] else None,
        }
    out["accuracy"] = total_correct / len(traces)
    out["detector_step_us"] = {"mean": float(np.mean(step_us)), "p50": _pct(step_us, 50),
                               "p99": _pct(step_us, 99), "cpu_mean": float(np.mean(step_cpu_us))}
    out["mean_iteration_s_in_traces"] = float(np.mean(iter_s))
    return out


def bench_latency_vs_step(seeds: int = 50) -> list[dict]:
    """Latency of a clean step of a given size (2 % jitter), onset at iteration 100."""
    rows = []
    for factor in (1.15, 1.2, 1.5, 2.0, 3.0):
        lat, missed = [], 0
        for s in range(seeds):
            rng = np.random.default_rng(90_000 + s)
            x = 1.0 + 0.02 * rng.standard_normal(200)
            x[100:] *= factor
            det = SlowIterationDetector()
            for v in x:
                det.observe(float(v))
            on = [c for c in det.change_points if c.kind == "onset"]
            if on and on[0].detected_at >= 100:
                lat.append(on[0].detected_at - 100)
            else:
                missed += 1
        rows.append({"factor": factor, "seeds": seeds, "missed": missed,
                     "latency_mean": float(np.mean(lat)) if lat else None,
                     "latency_max": int(max(lat)) if lat else None})
    return rows


def bench_monitor_cost(iterations: int = 3000, group_tracking: bool = True) -> dict:
    """Full FalconMonitor.observe() cost (detector, 4 groups' tracking, planner bookkeeping) on a
    trace with a step."""
    from titan_ext.runtime.falcon import FalconConfig

    rng = np.random.default_rng(7)
    x = 1.0 + 0.02 * rng.standard_normal(iterations)
    x[iterations // 2 :] *= 1.8
    mon = FalconMonitor(FalconConfig(group_tracking=group_tracking), grid=[[0, 1], [2, 3]])
    groups = {"pp0": 1.0, "pp1": 1.0, "dp0": 1.0, "dp1": 1.0}
    cost, cpu = [], []
    for v in x:
        c0 = time.thread_time_ns()
        t0 = time.perf_counter()
        out = mon.observe(float(v), groups)
        if out.get("falcon/validate"):
            mon.report_validation(gemm_times_s={0: 1.0, 1: 1.0, 2: 1.0, 3: 1.8})
        cost.append((time.perf_counter() - t0) * 1e6)
        cpu.append((time.thread_time_ns() - c0) * 1e-3)
    return {"iterations": iterations, "mean_us": float(np.mean(cost)), "p50_us": _pct(cost, 50),
            "p99_us": _pct(cost, 99), "cpu_mean_us": float(np.mean(cpu))}


def bench_hook_overhead(calls: int = 2000) -> dict:
    """Extra time per torch.distributed call due to the CallRecorder (1-rank gloo, 4 KiB all_reduce)."""
    import torch
    import torch.distributed as dist

    from titan_ext.runtime.falcon.hooks import CallRecorder
    from titan_ext.testing import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    t = torch.zeros(1024)

    def run():
        best = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                dist.all_reduce(t)
            best.append((time.perf_counter() - t0) / calls * 1e6)
        return min(best)

    run()
    plain = run()
    with CallRecorder():
        hooked = run()
    dist.destroy_process_group()
    return {"calls": calls, "plain_us_per_call": plain, "hooked_us_per_call": hooked,
            "overhead_us_per_call": hooked - plain}


E2E_SCENARIOS = {
    "healthy": [],
    "slow device (3 at {f}x)": ["--titan_ext.emulate_slow_device", "3:{f}@{k}"],
    "slow DP link (0-1 at {l}x)": ["--titan_ext.emulate_slow_link", "0-1:x{l}@{k}"],
    "slow PP link (0-2 +40 ms)": ["--titan_ext.emulate_slow_link", "0-2:40@{k}"],
    "slow device 1 at {f}x, then its DP link 0-1 at {l}x from {k2}": [
        "--titan_ext.emulate_slow_device", "1:{f}@{k}", "--titan_ext.emulate_slow_link", "0-1:x{l}@{k2}"],
}
"""``{l}x``: the link's transfers take l times their healthy time (``A-B:xF``): its DP all-reduce
+(l - 1)x. The last scenario is a reversed compound case (the reverse of Falcon §7.3's sequence, Fig. 17:
there slow communication → S3, then a slow GPU, then S4; here a slow device, then its DP link, no S4): the slow
device makes the root cause ``compute`` and S2 re-balances the replicas; from step ``k2`` the
device's DP link is slow too, S2 is not enough, the further slowdown is localised anew and S3
follows (the plan puts link 0-1 on a PP hop)."""


SEQ_LEN = 32
"""Tokens per sample of the end-to-end jobs (``--seq-len``): the share of the step that is stage
compute grows with it (docs/falcon.md "Not done")."""
DEVICE_PASS_MS = 0.0
"""``--device-pass-ms``: the jobs' ``emulate_device_pass_ms`` (dedicated-device emulation: every
forward takes this many ms, every backward twice that, the slow device F times that; 0 = the
model's real compute on the shared cores)."""


def _mode_args() -> list[str]:
    """The compute mode's job arguments (every end-to-end job of one invocation runs in one mode)."""
    return ["--training.seq_len", str(SEQ_LEN), "--titan_ext.emulate_device_pass_ms", f"{DEVICE_PASS_MS:g}"]


def _mode() -> str:
    return (f"emulated dedicated devices, forward {DEVICE_PASS_MS:g} ms / backward {2 * DEVICE_PASS_MS:g} ms "
            f"a pass (seq_len {SEQ_LEN})" if DEVICE_PASS_MS > 0 else
            f"real model compute on the shared cores (seq_len {SEQ_LEN})")


def _e2e_run(dump: str, steps: int, args: list[str], nproc: int = 4,
             config: str = "train_configs/debug_cpu_dp2_pp2.toml", batch: tuple[int, int] = (2, 12)) -> list[dict]:
    import shutil

    from titan_ext.testing import torchrun

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", PYTHONWARNINGS="ignore")
    job = ["-m", "titan_ext.train", "--job.config_file", config, "--job.dump_folder", dump,
           "--training.steps", str(steps), "--training.local_batch_size", str(batch[0]),
           "--training.global_batch_size", str(batch[1]), *_mode_args(), *args]
    shutil.rmtree(dump, ignore_errors=True)  # the job appends to its falcon*.jsonl: start empty
    os.makedirs(dump)
    torchrun(nproc, job, log=os.path.join(dump, "train.log"), cwd=root, env=env, local_ranks_filter=0, check=True)
    with open(os.path.join(dump, "falcon.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _e2e_events(dump: str) -> list[dict]:
    path = os.path.join(dump, "falcon_events.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def bench_end_to_end(steps: int, slow_from: int, workdir: str, only: str = "",
                     device_factor: float = 4.0, link_factor: float = 6.0, second_from: int = 0) -> list[dict]:
    rows = []
    fmt = {"f": f"{device_factor:g}", "l": f"{link_factor:g}", "k": slow_from, "k2": second_from or slow_from + 8}
    chosen = {n.format(**fmt): a for n, a in E2E_SCENARIOS.items()
              if not only or any(w.strip() and w.strip() in n.format(**fmt) for w in only.split(","))}
    for name, extra in chosen.items():
        extra = [a.format(**fmt) for a in extra]
        dumps = {falcon: os.path.join(workdir, f"{len(rows)}_{falcon}") for falcon in ("false", "true")}
        logs = {falcon: _e2e_run(dumps[falcon], steps, extra + [flag])
                for falcon, flag in (("false", "--titan_ext.no-falcon_apply"),
                                     ("true", "--titan_ext.falcon_apply"))}
        rows.append(_scenario_row(name, logs, _e2e_events(dumps["true"]), slow_from))
    return rows


LADDER = ("S2", "S3", "S4")
"""Falcon's mitigation levels (§5.1). "Afterwards" is measured after the last of them applied:
PipeMorph's re-plan only changes the schedule and follows any later noise event on a PP hop."""


def _scenario_row(name: str, logs: dict, events: list[dict], slow_from: int) -> dict:
    """One table row from a scenario's two runs (``logs["false"]``: detect only, ``logs["true"]``:
    applying) and the applying run's events. Iteration time = median of the slowest rank's step over
    the steps after the last applied ladder strategy (+1, the step it took effect), the same steps in
    both runs."""
    on = logs["true"]
    applied = [e for e in events if e["kind"] == "decision" and e["applied"] and e["name"] != "ignore"]
    ladder = [e["iteration"] for e in applied if e["strategy"] in LADDER]
    first = min((e["iteration"] for e in applied), default=None)
    window = [r["step"] for r in on if r["step"] > (max(ladder) if ladder else slow_from) + 1]

    def median_iter(log, steps):
        return float(np.median([r["falcon/iteration_time_s"] for r in log if r["step"] in steps]))

    s3 = next((e for e in applied if e["strategy"] == "S3"), {})
    return {
        "scenario": name,
        "iteration_s_without": median_iter(logs["false"], window),
        "iteration_s_with": median_iter(on, window),
        "decisions": [f"{r['step']}:{r['falcon/apply']}" for r in on if r.get("falcon/apply")],
        "root_cause": next((r["falcon/root_cause"] for r in on if "falcon/root_cause" in r), ""),
        "onset_step": next((r["step"] for r in on if r.get("falcon/event") == "onset"), None),
        "onset_located_by": next((e["located_by"] for e in events if e.get("event") == "onset"), None),
        "time_to_mitigation_s": (sum(r["falcon/iteration_time_s"] for r in on
                                     if slow_from <= r["step"] <= first) if first else None),
        "steps_measured": window,
        "applied": [f"{e['iteration']}:{e['strategy']}" for e in applied],
        "mitigations_applied": len(applied),
        "s3_step": s3.get("iteration"),
        "s3_measured_cost_s": s3.get("measured_cost_s"),
        "s3_estimated_cost_s": s3.get("estimated_cost_s"),
        "grid_after": on[-1].get("falcon/grid") if on else None,
    }


FIG19_ARMS = {
    "healthy": ["--titan_ext.no-adaptive", "--titan_ext.no-falcon_apply"],
    "baseline": ["--titan_ext.no-adaptive", "--titan_ext.no-falcon_apply", "FAULT"],
    "s3": ["--titan_ext.no-adaptive", "--titan_ext.falcon_apply", "FAULT"],
    "s3_pipemorph": ["--titan_ext.no-adaptive", "--titan_ext.falcon_apply", "--titan_ext.falcon_delegation",
                     "--titan_ext.delegation", "auto", "--titan_ext.delegation_slow_link_ms", "1e6", "FAULT"],
}
"""PipeMorph §7.3 / Fig. 19's arms: the fixed schedule (PipeMorph's initial plan, re-planning off)
healthy and with the DP-link fault and no mitigation; Falcon's S3 with the schedule frozen; S3, then
PipeMorph's re-planning with delegation on the moved link (``falcon_delegation``; the delegating
schedule's own "auto" switch is held off — ``delegation_slow_link_ms`` 1e6 — so that Falcon decides:
at 5 ms a loaded host's noise switched a pipeline to its delegates at step 2, whose start took 44 s)."""

FIG19_PAPER = {"baseline_over_healthy": 8.04, "s3_speedup_over_baseline": 3.6,
               "s3_over_baseline": 1 / 3.6, "s3_pipemorph_speedup_over_s3": 1.96}
"""PipeMorph §7.3 (NSDI'26 Fig. 19 = Adaptra Fig. 18), as the paper gives them: the fixed ZB plan
8.04× slower under the DP-link fault, Falcon's S3 a 3.6× improvement (0.28× the faulty time),
PipeMorph's re-planning + CPU delegation a further 1.96× over it."""

HOL_TARGET = 1350 / 710
"""PipeMorph §3.2 / Fig. 6: a 30 ms delay between PP stages 0 and 1 of a ZB (1 TP, 1 DP, 4 PP) job on
NCCL, head-of-line blocking included, takes the iteration from 710 ms to 1350 ms — 1.9×."""

HOL_CALIBRATION = "docs/benchmarks/fig19_hol_calibration.json"
"""Where ``--calibrate-hol`` writes its pick and the Fig. 19 runs read their ``emulate_link_hol_hold``."""

FIG19_LINK = "0-1"
"""The faulty link: stage 0's DP link (ranks 0 and 1 are stage 0 of pipelines {0,2,4,6} and {1,3,5,7})."""

HOL_CALIBRATION_LINK = "0-2"
"""The calibration's faulty link: stages 0 and 1 of pipeline {0, 2, 4, 6} (Fig. 6's place)."""


def _load() -> list[float]:
    """The host's 1/5/15-minute load averages (recorded next to every run: the host is shared)."""
    return [round(x, 2) for x in os.getloadavg()]


def _step_series(log: list[dict]) -> dict[int, float]:
    """step -> the slowest rank's step time (ms) of one job."""
    return {int(r["step"]): 1e3 * float(r["falcon/iteration_time_s"]) for r in log}


def hol_ratio(series_ms: dict[int, float], fault_from: int, skip: int = 2) -> dict:
    """One calibration job's slowdown: the median step from ``fault_from + 1`` on over the median of
    steps ``skip`` .. ``fault_from - 1`` (the same job healthy: start-up steps skipped; the fault's
    first step, when it is installed, left out)."""
    before = [v for s, v in series_ms.items() if skip <= s < fault_from]
    after = [v for s, v in series_ms.items() if s > fault_from]
    if not before or not after:
        raise ValueError(f"hol_ratio: no steps before ({before}) or after ({after}) the fault at {fault_from}")
    healthy, faulty = float(np.median(before)), float(np.median(after))
    return {"healthy_ms": healthy, "faulty_ms": faulty, "ratio": faulty / healthy,
            "healthy_steps": len(before), "faulty_steps": len(after)}


def pick_hold(points: list[tuple[float, float]], target: float = HOL_TARGET) -> dict:
    """The head-of-line hold fraction whose slowdown is ``target``, from measured (hold, ratio) points.

    The ratio is taken as non-decreasing in the hold (more blocking cannot speed a step up): the
    measured ratios are made so by a running maximum over the sorted holds (noise on a shared host),
    then the hold is interpolated linearly between the two points around the target. Below the
    lowest point's ratio: the lowest hold; above the highest: the highest hold, ``saturated`` (the
    emulation cannot reach the target there). Returns ``{"hold", "predicted_ratio", "saturated",
    "bracket"}``."""
    if not points:
        raise ValueError("pick_hold: no measured points")
    pts = sorted((float(h), float(r)) for h, r in points)
    if any(not 0 <= h <= 1 or not r > 0 or not np.isfinite(r) for h, r in pts):
        raise ValueError(f"pick_hold: holds must be in [0, 1] and ratios > 0, got {points}")
    env, top = [], -np.inf
    for h, r in pts:
        top = max(top, r)
        env.append((h, top))
    if target <= env[0][1]:
        return {"hold": env[0][0], "predicted_ratio": env[0][1], "saturated": False, "bracket": [env[0], env[0]]}
    if target >= env[-1][1]:
        return {"hold": env[-1][0], "predicted_ratio": env[-1][1], "saturated": target > env[-1][1],
                "bracket": [env[-1], env[-1]]}
    for (h0, r0), (h1, r1) in zip(env, env[1:]):
        if r0 <= target <= r1 and r1 > r0:
            hold = h0 + (h1 - h0) * (target - r0) / (r1 - r0)
            return {"hold": hold, "predicted_ratio": target, "saturated": False, "bracket": [(h0, r0), (h1, r1)]}
    raise AssertionError("unreachable: the envelope brackets the target")


def _fig19_job(dump: str, steps: int, args: list[str], microbatches: int) -> list[dict]:
    return _e2e_run(dump, steps, args, nproc=8, config="train_configs/debug_cpu_dp2_pp4.toml",
                    batch=(microbatches, 4 * microbatches))


def calibrate_hol(steps: int, fault_from: int, fault_ms: float, window_kib: float, workdir: str,
                  microbatches: int = 16, target: float = HOL_TARGET, max_jobs: int = 3) -> dict:
    """Calibrate ``emulate_link_hol_hold`` to PipeMorph Fig. 6 (§3.2): ``fault_ms`` between stages 0
    and 1 of pipeline {0, 2, 4, 6} (:data:`HOL_CALIBRATION_LINK`) from step ``fault_from`` in the Fig. 19
    job with its fixed ZB plan (re-planning off, Falcon not applying), head-of-line blocking on; each
    job's slowdown is its own faulty steps over its own healthy steps (:func:`hol_ratio`). Measured at
    hold 1 (the maximal stand-in) first — if that stays below ``target`` the emulation saturates and
    1 is kept — then at 0 and at the interpolated hold (:func:`pick_hold`), at most ``max_jobs`` jobs."""
    fault = ["--titan_ext.emulate_slow_link", f"{HOL_CALIBRATION_LINK}:{fault_ms:g}@{fault_from}",
             "--titan_ext.emulate_link_window_kib", f"{window_kib:g}", "--titan_ext.emulate_link_hol"]
    runs: list[dict] = []

    def measure(hold: float) -> float:
        dump = os.path.join(workdir, f"hold_{hold:.3f}")
        load0, t0 = _load(), time.time()
        log = _fig19_job(dump, steps, FIG19_ARMS["healthy"] + fault +
                         ["--titan_ext.emulate_link_hol_hold", f"{hold:.4f}"], microbatches)
        series = _step_series(log)
        res = hol_ratio(series, fault_from)
        runs.append({"hold": hold, **res, "series_ms": {str(k): round(v, 1) for k, v in sorted(series.items())},
                     "load_before": load0, "load_after": _load(), "wall_s": round(time.time() - t0, 1)})
        print(f"calibration: hold {hold:.3f} -> {res['ratio']:.3f}x ({res['healthy_ms']:.0f} -> "
              f"{res['faulty_ms']:.0f} ms)", flush=True)
        return res["ratio"]

    measure(1.0)
    if runs[-1]["ratio"] > target and max_jobs > 1:
        measure(0.0)
        guess = pick_hold([(r["hold"], r["ratio"]) for r in runs], target)
        if not guess["saturated"] and 0.0 < guess["hold"] < 1.0 and max_jobs > 2:
            measure(round(guess["hold"], 3))
    pick = pick_hold([(r["hold"], r["ratio"]) for r in runs], target)
    return {"target_ratio": target, "target_source": "PipeMorph §3.2 / Fig. 6: 710 ms -> 1350 ms (1.9x), "
            "30 ms between PP stages 0 and 1, ZB, 1 TP / 1 DP / 4 PP on NCCL",
            "hold": pick["hold"], "predicted_ratio": pick["predicted_ratio"], "saturated": pick["saturated"],
            "measured": [{k: r[k] for k in ("hold", "ratio", "healthy_ms", "faulty_ms")} for r in runs],
            "runs": runs, "fault": f"{HOL_CALIBRATION_LINK}:{fault_ms:g}@{fault_from}", "window_kib": window_kib,
            "steps": steps, "microbatches": microbatches, "compute": _mode(),
            "machine": f"{platform.machine()} {os.cpu_count()} cores",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def calibrated_hold(path: str = HOL_CALIBRATION) -> float:
    """The calibrated ``emulate_link_hol_hold`` (``--calibrate-hol``'s JSON), 1.0 without one."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    full = path if os.path.isabs(path) else os.path.join(root, path)
    if not os.path.exists(full):
        return 1.0
    with open(full) as f:
        return float(json.load(f)["hold"])


def bench_fig19(steps: int, fault_from: int, fault_ms: float, window_kib: float, workdir: str,
                microbatches: int = 16, hol: bool = True, hol_hold: float = 1.0) -> dict:
    """PipeMorph §7.3 (Fig. 19: 1 TP / 2 DP / 4 PP, a 10/20/30 ms latency fault on a DP link; the fixed
    ZB schedule 8.04x slower, Falcon's S3 a 3.6x improvement over it (0.28x its time), PipeMorph's
    re-planning + delegation a further 1.96x) as a
    DP 2 x PP 4 CPU job (train_configs/debug_cpu_dp2_pp4.toml, 8 gloo ranks, dedicated-device
    emulation so that 8 ranks on 2 cores run like 8 devices): ``fault_ms`` on DP link 0-1 (stage 0's
    DP group) from step ``fault_from``, its gradient through a ``window_kib`` window
    (``emulate_link_window_kib``), four arms with the same seed and steps (:data:`FIG19_ARMS`).
    Times: the median of the slowest rank's step over the steps from 4 after the later S3 on.
    ``hol`` (the default): once S3 made the link a PP hop, it blocks the direct path as NCCL's does
    (``emulate_link_hol``, PipeMorph §3.2: the paper's GPUs ran NCCL), holding the issuer ``hol_hold``
    of each delay (``emulate_link_hol_hold``, calibrated by :func:`calibrate_hol`); False: gloo's
    behaviour, where only the message's arrival is late. Every arm's per-step times and the host's load
    before and after it are in the result."""
    fault = ["--titan_ext.emulate_slow_link", f"{FIG19_LINK}:{fault_ms:g}@{fault_from}",
             "--titan_ext.emulate_link_window_kib", f"{window_kib:g}",
             *(["--titan_ext.emulate_link_hol", "--titan_ext.emulate_link_hol_hold", f"{hol_hold:.4f}"] if hol
               else ["--titan_ext.no-emulate_link_hol"])]
    logs, events, load, wall = {}, {}, {}, {}
    for arm, extra in FIG19_ARMS.items():
        dump = os.path.join(workdir, arm)
        args = [a for x in extra for a in (fault if x == "FAULT" else [x])]
        load0, t0 = _load(), time.time()
        logs[arm] = _fig19_job(dump, steps, args, microbatches)
        load[arm], wall[arm] = [load0, _load()], round(time.time() - t0, 1)
        events[arm] = _e2e_events(dump)
    s3_steps = {arm: next((e["iteration"] for e in events[arm] if e["kind"] == "decision" and e["applied"]
                           and e["strategy"] == "S3"), None) for arm in ("s3", "s3_pipemorph")}
    known = [s for s in s3_steps.values() if s is not None]
    first = (max(known) if known else fault_from) + 4
    window = [r["step"] for r in logs["baseline"] if r["step"] >= first]

    def median_ms(arm):
        xs = [r["falcon/iteration_time_s"] for r in logs[arm] if r["step"] in window]
        return 1e3 * float(np.median(xs)) if xs else float("nan")

    delegated = sorted({tuple(link) for r in logs["s3_pipemorph"] if "falcon/delegated_links" in r
                        for link in json.loads(r["falcon/delegated_links"])})
    out = {"healthy_ms": median_ms("healthy"), "baseline_ms": median_ms("baseline"), "s3_ms": median_ms("s3"),
           "s3_pipemorph_ms": median_ms("s3_pipemorph"), "steps": window,
           "s3_step": s3_steps["s3_pipemorph"] if s3_steps["s3_pipemorph"] is not None else s3_steps["s3"],
           "s3_steps": s3_steps, "delegated_links": [list(x) for x in delegated],
           "fault": f"{FIG19_LINK}:{fault_ms:g}@{fault_from}", "fault_ms": fault_ms, "window_kib": window_kib,
           "compute": _mode(), "hol": hol, "hol_hold": hol_hold if hol else None,
           "pp_link": (f"NCCL head-of-line blocking on the direct path (emulate_link_hol, hold {hol_hold:g})"
                       if hol else "arrival delayed only (gloo)"),
           "machine": f"{platform.machine()} {os.cpu_count()} cores",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load": load, "wall_s": wall,
           "per_step_ms": {arm: {str(k): round(v, 1) for k, v in sorted(_step_series(logs[arm]).items())}
                           for arm in FIG19_ARMS},
           "decisions": {arm: [f"{e['iteration']}:{e['strategy']}{'' if e['applied'] else ' (not applied)'}"
                               for e in events[arm] if e["kind"] == "decision" and e["strategy"] != "S1"]
                         for arm in FIG19_ARMS}}
    out["ratios"] = fig19_ratios(out)
    out["pre_fault_ms"] = pre_fault_ms(out["per_step_ms"], fault_from)
    return out


def pre_fault_ms(per_step_ms: dict, fault_from: int, skip: int = 2) -> dict:
    """Every arm's median step before the fault (steps ``skip`` .. ``fault_from - 1``: all four arms
    run the same healthy job there), and their max / min: the invocation's arm-to-arm noise, against
    which its ratios are read."""
    med = {arm: float(np.median([v for s, v in steps.items() if skip <= int(s) < fault_from]))
           for arm, steps in per_step_ms.items()}
    return {"median": med, "max_over_min": max(med.values()) / min(med.values())}


def fig19_ratios(run: dict) -> dict:
    """One invocation's ratios (each arm's median over the same steps)."""
    return {"baseline_over_healthy": run["baseline_ms"] / run["healthy_ms"],
            "s3_over_healthy": run["s3_ms"] / run["healthy_ms"],
            "s3_pipemorph_over_healthy": run["s3_pipemorph_ms"] / run["healthy_ms"],
            "s3_over_baseline": run["s3_ms"] / run["baseline_ms"],
            "s3_speedup_over_baseline": run["baseline_ms"] / run["s3_ms"],
            "s3_over_s3_pipemorph": run["s3_ms"] / run["s3_pipemorph_ms"],
            "s3_pipemorph_over_s3": run["s3_pipemorph_ms"] / run["s3_ms"]}


def fig19_valid(run: dict) -> bool:
    """An invocation measures Fig. 19 only where S3 was applied in both arms that apply it (on a host
    whose load swings, a job slow from its first step shows no onset: its "s3" arm is then a second
    unmitigated baseline)."""
    return all(run["s3_steps"].get(arm) is not None for arm in ("s3", "s3_pipemorph"))


def summarize_fig19(runs: list[dict]) -> dict:
    """Per fault size: the median, min and max over the valid invocations (:func:`fig19_valid`) of
    every ratio and arm time; ``excluded``: the invocations left out, with their reason."""
    out: dict = {}
    for ms in sorted({r["fault_ms"] for r in runs}):
        every = [r for r in runs if r["fault_ms"] == ms]
        mine = [r for r in every if fig19_valid(r)]
        row: dict = {"invocations": len(mine),
                     "excluded": [{"invocation": r.get("invocation"), "s3_steps": r["s3_steps"],
                                   "reason": "S3 not applied in an arm that applies it"}
                                  for r in every if not fig19_valid(r)]}
        if mine:
            keys = ["healthy_ms", "baseline_ms", "s3_ms", "s3_pipemorph_ms"]
            row.update({k: _spread([r[k] for r in mine]) for k in keys})
            row["ratios"] = {k: _spread([r["ratios"][k] for r in mine]) for k in mine[0]["ratios"]}
        out[f"{ms:g}"] = row
    return out


def _spread(xs: list[float]) -> dict:
    return {"median": float(np.median(xs)), "min": float(min(xs)), "max": float(max(xs)),
            "values": [round(float(x), 4) for x in xs]}


def bench_fig19_repeated(fault_ms: list[float], repeat: int, steps: int, fault_from: int, window_kib: float,
                         workdir: str, microbatches: int = 16, hol: bool = True, hol_hold: float = 1.0,
                         partial: str | None = None) -> dict:
    """:func:`bench_fig19` ``repeat`` times at each fault size (invocation r runs every size in turn,
    so a busy stretch of the host falls on all sizes), each invocation with its own healthy arm;
    ``partial``: a path the result so far is rewritten to after every invocation."""
    runs = []
    res: dict = {}
    for r in range(repeat):
        for ms in fault_ms:  # a size may be listed more than once (an explicit order of invocations)
            n = sum(1 for x in runs if x["fault_ms"] == ms)
            run = bench_fig19(steps, fault_from, ms, window_kib, os.path.join(workdir, f"{ms:g}ms_{n}"),
                              microbatches, hol=hol, hol_hold=hol_hold)
            run["invocation"] = n
            runs.append(run)
            print(f"fig19 invocation {r} {ms:g} ms: " + ", ".join(f"{k} {run[k]:.0f}" for k in
                  ("healthy_ms", "baseline_ms", "s3_ms", "s3_pipemorph_ms")), flush=True)
            res = {"paper": FIG19_PAPER, "summary": summarize_fig19(runs), "runs": runs,
                   "hol": hol, "hol_hold": hol_hold if hol else None, "steps": steps, "fault_from": fault_from,
                   "window_kib": window_kib, "microbatches": microbatches, "repeat": repeat}
            if partial:
                with open(partial, "w") as f:
                    json.dump(res, f, indent=2)
    return res


def print_fig19(res: dict) -> None:
    """The summary table: per fault size the median [min–max] over invocations, beside the paper."""
    p = res["paper"]
    print("| fault | n | healthy ms | baseline / healthy | S3 / baseline (speed-up) | S3+PipeMorph / S3 "
          "(further speed-up) |")
    print("|---|---|---|---|---|---|")
    for ms, row in res["summary"].items():
        if not row["invocations"]:
            print(f"| {ms} ms | 0 ({len(row['excluded'])} excluded) | | | | |")
            continue
        q = row["ratios"]

        def f(d, fmt="{:.2f}"):
            return f"{fmt.format(d['median'])} [{fmt.format(d['min'])}–{fmt.format(d['max'])}]"
        print(f"| {ms} ms | {row['invocations']} | {f(row['healthy_ms'], '{:.0f}')} | "
              f"{f(q['baseline_over_healthy'])} | {f(q['s3_over_baseline'])} ({f(q['s3_speedup_over_baseline'])}) | "
              f"{f(q['s3_pipemorph_over_s3'])} ({f(q['s3_over_s3_pipemorph'])}) |")
    print(f"| paper | | | {p['baseline_over_healthy']} | {p['s3_over_baseline']:.2f} ({p['s3_speedup_over_baseline']}) "
          f"| {1 / p['s3_pipemorph_speedup_over_s3']:.2f} ({p['s3_pipemorph_speedup_over_s3']}) |")


def _rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def bench_s4_slow_device(steps: int, slow_from: int, factor: float, workdir: str) -> dict:
    """The slow-device S2 -> S4 scenario: device 3 ``factor``x slower from ``slow_from``; Falcon applies
    S2 and, when the accumulated impact reaches S4's measured cost, S4 (titan/falcon_s4.py: TorchTitan
    checkpoint, relaunch without replica 1 through the S4 launcher). Ratios within this one run: the
    iteration time after S2 / after S4 over the healthy steps before the fault (2 .. slow_from-1).
    Then a reference DP 1 x PP 2 job loads the same checkpoint: its losses must equal the restarted
    job's (same world, same data, fixed pipeline plan)."""
    import shutil
    import subprocess

    from titan_ext.testing import free_port, torchrun

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", PYTHONWARNINGS="ignore")
    for var in ("TITAN_EXT_SLOW_DEVICE", "TITAN_EXT_SLOW_LINK", "TITAN_EXT_S4_PLAN"):
        env.pop(var, None)
    dump, ref = os.path.join(workdir, "s4_slow_device"), os.path.join(workdir, "s4_reference")
    shutil.rmtree(dump, ignore_errors=True)
    shutil.rmtree(ref, ignore_errors=True)
    os.makedirs(dump)
    common = ["--job.config_file", "train_configs/debug_cpu_dp2_pp2.toml", "--training.steps", str(steps),
              "--training.local_batch_size", "2", "--training.global_batch_size", "12",
              *_mode_args(), "--titan_ext.no-adaptive", "--checkpoint.enable",
              "--checkpoint.interval", "100000"]
    subprocess.run([sys.executable, "-m", "titan_ext.titan.falcon_s4", "--nproc-per-node", "4",
                    "--master-port", str(free_port()), "--log", os.path.join(dump, "train.log"), "--",
                    *common, "--job.dump_folder", dump,
                    "--titan_ext.emulate_slow_device", f"3:{factor:g}@{slow_from}"],
                   cwd=root, env=env, check=True)
    falcon = _rows(os.path.join(dump, "falcon.jsonl"))
    events = _rows(os.path.join(dump, "falcon_events.jsonl"))
    metrics = {r["step"]: r for r in _rows(os.path.join(dump, "pipeline_metrics.jsonl"))}
    step_s = {r["step"]: r["falcon/iteration_time_s"] for r in falcon}  # before and after S4
    applied: dict = {}
    for e in events:  # the first application of each strategy
        if e["kind"] == "decision" and e["applied"]:
            applied.setdefault(e["strategy"], e["iteration"])
    restart = next((e for e in events if e["kind"] == "restart"), None)
    s4_step = applied.get("S4")
    healthy = float(np.median([step_s[k] for k in range(2, slow_from) if k in step_s]))
    out = {"scenario": f"slow device (3 at {factor:g}x from step {slow_from}), S2 then S4",
           "steps": steps, "healthy_s": healthy, "applied": applied, "restart": restart,
           "s4_decisions": [{k: e[k] for k in ("iteration", "applied", "iteration_time_before_s",
                                                "iteration_time_predicted_s", "impact_s", "estimated_cost_s")}
                            for e in events if e["kind"] == "decision" and e["strategy"] == "S4"]}
    if "S2" in applied:
        after_s2 = [step_s[k] for k in step_s if applied["S2"] + 1 < k and (s4_step is None or k <= s4_step)]
        out["after_s2_s"] = float(np.median(after_s2)) if after_s2 else None
        out["after_s2_over_healthy"] = out["after_s2_s"] / healthy if after_s2 else None
        out["after_s2_steps"] = len(after_s2)
    if restart is not None:
        # the restarted DP 1 x PP 2 job: the slowest rank's step time (falcon.s4.S4Resume's rows)
        after = [step_s[k] for k in step_s if k > restart["iteration"] + 1]
        out["after_s4_s"] = float(np.median(after)) if after else None
        out["after_s4_over_healthy"] = out["after_s4_s"] / healthy if after else None
        shutil.copytree(os.path.join(dump, "checkpoint", f"step-{s4_step}"),
                        os.path.join(ref, "checkpoint", f"step-{s4_step}"))
        torchrun(2, ["-m", "titan_ext.train", *common, "--job.dump_folder", ref,
                     "--parallelism.data_parallel_replicate_degree", "1", "--checkpoint.load_step", str(s4_step),
                     "--checkpoint.exclude_from_loading", "dataloader"],
                 log=os.path.join(ref, "train.log"), cwd=root, env=env, check=True)
        ref_loss = {r["step"]: r["loss"] for r in _rows(os.path.join(ref, "pipeline_metrics.jsonl"))}
        out["resumed_steps"] = sorted(ref_loss)
        out["losses_identical"] = all(metrics[k]["loss"] == v for k, v in ref_loss.items())
    return out


COMPOUND_SPARE = 4
"""The compound run's spare device (``falcon_spares``): a healthy emulated device no rank uses."""
COMPOUND_DEFAULTS = {"steps": 85, "link_from": 8, "device_from": 28, "link_factor": 26.0, "device_factor": 12.0,
                     "device_pass_ms": 40.0}
"""``--compound``'s settings unless given: the DP link's all-reduce 26x (about +0.8 s a step, Fig. 17's
1.7x slower), device 3 12x from step 28 (after S3's event ended), dedicated-device emulation of 40 ms a
forward (so that the 2 loaded cores' real compute stays below the emulated passes), 85 steps (S4, by
the ski rental, at about step 70 on the loaded host)."""


def bench_compound(steps: int, link_from: int, device_from: int, link_factor: float, device_factor: float,
                   workdir: str, pass_ms: float = 15.0, spare: int = COMPOUND_SPARE) -> dict:
    """Falcon §7.3's compound sequence (Fig. 17) in the TorchTitan DP 2 x PP 2 job, in the paper's order:
    healthy; from ``link_from`` the DP link 0-1 ``link_factor`` x slower (its all-reduce, ``A-B:xF``) ->
    Falcon localises it (``dp_link``) and applies S3 (the link onto a PP hop); from ``device_from`` device 3
    ``device_factor`` x slower (the link still slow) -> re-localised (``compute``), S2; when the accumulated
    impact reaches S4's cost, S4 onto the spare device ``spare`` (``falcon_spares``: Falcon §5.1's
    "restarts training on healthy nodes" -- the same grid and DP, the slow rank's device excluded). One
    job under the S4 launcher (``python -m titan_ext.titan.falcon_s4``), dedicated-device emulation
    (``pass_ms`` a forward, twice that a backward: the four ranks run like devices of their own on the
    shared cores). The slow device's emulation belongs to device 3, which no rank uses after S4: on the
    spare the job runs at the healthy speed again, the link 0-1 (now a PP hop) still slow.
    Iteration time: the slowest rank's step (``falcon.jsonl``); ``healthy_ms``: the median of steps
    2 .. link_from - 1; ``after_s4_ms``: the median of the restarted job's steps after its first."""
    import shutil
    import subprocess

    from titan_ext.testing import free_port

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", PYTHONWARNINGS="ignore")
    for var in ("TITAN_EXT_SLOW_DEVICE", "TITAN_EXT_SLOW_LINK", "TITAN_EXT_S4_PLAN", "TITAN_EXT_INJECT_DELAYS"):
        env.pop(var, None)
    dump = os.path.join(workdir, "compound")
    shutil.rmtree(dump, ignore_errors=True)
    os.makedirs(dump)
    link = f"0-1:x{link_factor:g}@{link_from}"
    device = f"3:{device_factor:g}@{device_from}"
    job = ["--job.config_file", "train_configs/debug_cpu_dp2_pp2.toml", "--job.dump_folder", dump,
           "--training.steps", str(steps), "--training.local_batch_size", "2", "--training.global_batch_size", "12",
           "--training.seq_len", str(SEQ_LEN), "--titan_ext.emulate_device_pass_ms", f"{pass_ms:g}",
           "--titan_ext.no-adaptive", "--titan_ext.falcon_apply", "--checkpoint.enable",
           "--checkpoint.interval", "100000", "--titan_ext.falcon_spares", str(spare),
           "--titan_ext.emulate_slow_link", link, "--titan_ext.emulate_slow_device", device]
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "titan_ext.titan.falcon_s4", "--nproc-per-node", "4",
                    "--master-port", str(free_port()), "--log", os.path.join(dump, "train.log"), "--", *job],
                   cwd=root, env=env, check=True)
    wall = time.time() - t0
    return compound_result(_rows(os.path.join(dump, "falcon.jsonl")), _rows(os.path.join(dump, "falcon_events.jsonl")),
                           link_from, device_from, extra={
                               "faults": {"slow_dp_link": link, "slow_device": device},
                               "spares": [spare], "pass_ms": pass_ms, "steps": steps, "wall_s": wall,
                               "command_args": job})


def compound_result(falcon: list[dict], events: list[dict], link_from: int, device_from: int,
                    extra: dict | None = None) -> dict:
    """The compound run's JSON from its ``falcon.jsonl`` rows (per-step iteration times, the restarted
    job's included) and ``falcon_events.jsonl`` rows: every decision, the applied mitigations in order,
    the medians of each phase (healthy: steps 2 .. link_from - 1; after S3: from the step after S3 to the
    device fault; after S2: from the step after S2 to S4; after S4: the restarted job's steps after its
    first) and the checks of Falcon §7.3's order (S3 < S2 < S4, S4 onto the spare with DP kept)."""
    step_s: dict[int, float] = {}
    for r in falcon:  # one row a step (a step the restart repeats: the later row)
        step_s[int(r["step"])] = float(r["falcon/iteration_time_s"])
    decisions = [{**{k: e.get(k) for k in ("iteration", "strategy", "name", "applied", "impact_s",
                                           "estimated_cost_s", "measured_cost_s", "iteration_time_before_s",
                                           "iteration_time_predicted_s") if k in e},
                  "root_cause": (e.get("suspected") or {}).get("root_cause"),
                  "component": (e.get("suspected") or {}).get("component")}
                 for e in events if e.get("kind") == "decision"]
    mitigations = [{"step": int(e["iteration"]), "strategy": e["strategy"]} for e in events
                   if e.get("kind") == "decision" and e.get("applied") and e.get("strategy") in LADDER]
    first = {}
    for m in mitigations:
        first.setdefault(m["strategy"], m["step"])
    restart = next((e for e in events if e.get("kind") == "restart"), None)
    localised = [{"iteration": e["iteration"], **{k: (e.get("suspected") or {}).get(k) for k in
                                                  ("root_cause", "component", "slow_devices", "slow_links")}}
                 for e in events if e.get("kind") == "localised"]

    def med(lo: int, hi: float) -> float | None:
        xs = [v for k, v in step_s.items() if lo <= k <= hi]
        return 1e3 * float(np.median(xs)) if xs else None

    healthy = med(2, link_from - 1)
    s3, s2, s4 = first.get("S3"), first.get("S2"), first.get("S4")
    out = {"machine": f"{platform.machine()} {os.cpu_count()} cores",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "compute": _mode(),
           "link_from": link_from, "device_from": device_from,
           "healthy_ms": healthy,
           "slow_link_ms": med(link_from, (s3 if s3 is not None else device_from - 1)),
           "after_s3_ms": med(s3 + 2, device_from - 1) if s3 is not None else None,
           "after_s2_ms": med(s2 + 2, s4 if s4 is not None else float("inf")) if s2 is not None else None,
           "after_s4_ms": (med(int(restart["iteration"]) + 1, float("inf")) if restart is not None else None),
           "mitigations": mitigations,
           "mitigation_step": "the trainer step at whose check the job applied it (falcon_events.jsonl's iteration)",
           "decisions": decisions, "localised": localised, "restart": restart,
           "iteration_ms": {str(k): 1e3 * v for k, v in sorted(step_s.items())}}
    out["ratios"] = {f"{k[:-3]}_over_healthy": (out[k] / healthy if out[k] is not None and healthy else None)
                     for k in ("slow_link_ms", "after_s3_ms", "after_s2_ms", "after_s4_ms")}
    out["paper_order"] = (s3 is not None and s2 is not None and s4 is not None and s3 < s2 < s4
                          and restart is not None and restart.get("num_dp") == 2
                          and restart.get("world_size") == 4)
    r = out["ratios"]["after_s4_over_healthy"]
    out["within_1_15x"] = r is not None and r <= 1.15
    out.update(extra or {})
    return out


def plot_compound(res: dict, path: str) -> None:
    """Falcon Fig. 17's layout: throughput (iterations/s) over the training steps, the faults' onsets
    dashed and each applied mitigation a labelled vertical line."""
    from titan_ext.plan.export import pyplot

    plt = pyplot()
    steps = sorted(int(k) for k in res["iteration_ms"])
    thr = [1e3 / res["iteration_ms"][str(k)] for k in steps]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.plot(steps, thr, "-o", ms=3, lw=1.2, color="#4C72B0", label="throughput")
    if res.get("healthy_ms"):
        ax.axhline(1e3 / res["healthy_ms"], color="grey", lw=0.8, ls=":", label="healthy (median)")
    top = max(thr) * 1.12
    for x, what in ((res["link_from"], "slow DP link"), (res["device_from"], "slow device")):
        ax.axvline(x - 0.5, color="#C44E52", ls="--", lw=1)
        ax.text(x - 0.3, top * 0.97, what, color="#C44E52", fontsize=8, va="top")
    for m in res["mitigations"]:
        ax.axvline(m["step"] + 0.5, color="#55A868", lw=1.2)
        ax.text(m["step"] + 0.7, top * 0.86, m["strategy"], color="#55A868", fontsize=9, va="top",
                fontweight="bold")
    ax.set_ylim(0, top)
    ax.set_xlabel("training step")
    ax.set_ylabel("iterations / s")
    ax.set_title("Falcon §7.3 compound sequence, TorchTitan DP 2 x PP 2 (CPU, gloo)", fontsize=10)
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_compound(res: dict) -> None:
    """The compound run's table: each phase's median step over healthy."""
    print(f"Compute: {res['compute']}; faults {res.get('faults')}; spares {res.get('spares')}\n")
    print("| phase | median step ms | / healthy |")
    print("|---|---|---|")
    for key, name in (("healthy_ms", "healthy"), ("slow_link_ms", "slow DP link, before S3"),
                      ("after_s3_ms", "after S3"), ("after_s2_ms", "slow device + link, after S2"),
                      ("after_s4_ms", "after S4 onto the spare")):
        v = res.get(key)
        ratio = "-" if v is None or not res["healthy_ms"] else f"{v / res['healthy_ms']:.2f}"
        print(f"| {name} | {'-' if v is None else f'{v:.0f}'} | {ratio} |")
    print("\nmitigations: " + ", ".join(f"{m['step']}:{m['strategy']}" for m in res["mitigations"]))
    print(f"paper order S3 < S2 < S4 onto a spare (DP kept): {res['paper_order']}; "
          f"after S4 within 1.15x healthy: {res['within_1_15x']}")


def replay_onset_step(log: list[dict], tracking: bool) -> int | None:
    """The step at which a monitor fed a job's recorded series (``falcon.jsonl``: the iteration time
    and the per-group times of every step after the warm-up, as the job's monitor saw them)
    confirms its first onset; ``tracking``: Falcon's group tracking on or off."""
    from titan_ext.runtime.falcon import FalconConfig

    names = [k[len("falcon/group_s/"):] for k in log[-1] if k.startswith("falcon/group_s/")]
    mon = FalconMonitor(FalconConfig(group_tracking=tracking), dp_groups=[g for g in names if g.startswith("dp")],
                        pp_groups=[g for g in names if not g.startswith("dp")])
    for r in log:
        if r.get("falcon/warmup"):
            continue
        groups = {g: r[f"falcon/group_s/{g}"] for g in names}
        if mon.observe(r["falcon/iteration_time_s"], groups).get("falcon/event") == "onset":
            return r["step"]
    return None


def bench_group_tracking(runs: int, steps: int, slow_from: int, link_factor: float, workdir: str) -> dict:
    """Detection with and without group tracking on the same recorded series: ``runs`` detect-only
    jobs (``falcon_apply`` false) each of the healthy and the slow-DP-link scenario, every series
    replayed through both monitors (:func:`replay_onset_step`). S3 by step 12 needs the onset
    confirmed by step 11 (S3 is decided and applied the step after)."""
    rows = []
    for i in range(runs):
        for name, extra in (("healthy", []), ("slow DP link", ["--titan_ext.emulate_slow_link",
                                                              f"0-1:x{link_factor:g}@{slow_from}"])):
            log = _e2e_run(os.path.join(workdir, f"gt_{i}_{name.replace(' ', '_')}"), steps,
                           extra + ["--titan_ext.no-falcon_apply"])
            rows.append({"run": i, "scenario": name,
                         "onset_with_group_tracking": replay_onset_step(log, True),
                         "onset_iteration_time_only": replay_onset_step(log, False),
                         "series_s": [round(r["falcon/iteration_time_s"], 4) for r in log]})
    print("| scenario | run | onset step, group tracking | onset step, iteration time only (Falcon §4.2) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['scenario']} | {r['run']} | {r['onset_with_group_tracking'] or '-'} | "
              f"{r['onset_iteration_time_only'] or '-'} |")
    for name in ("healthy", "slow DP link"):
        sel = [r for r in rows if r["scenario"] == name]
        for key in ("onset_with_group_tracking", "onset_iteration_time_only"):
            hits = sum(r[key] is not None and (name == "healthy" or r[key] <= 11) for r in sel)
            what = "false onsets" if name == "healthy" else "onsets by step 11"
            print(f"{name}, {key}: {what} in {hits} of {len(sel)} runs")
    return {"runs": runs, "steps": steps, "slow_from": slow_from, "link_factor": link_factor, "rows": rows}


def _located(row: dict) -> str:
    """``" (dp_stage0)"`` when a group's change-point located the onset (Falcon's group tracking)."""
    by = row.get("onset_located_by")
    return f" ({by})" if by and by != "iteration_time" else ""


def print_table(rows: list[dict]) -> None:
    """The markdown table of :func:`bench_end_to_end`'s rows ("with / healthy": over the healthy
    scenario's applying run)."""
    healthy = next((r["iteration_s_with"] for r in rows if r["scenario"] == "healthy"), float("nan"))
    print("| scenario | iteration s without Falcon | with Falcon | with / without | with / healthy | "
          "root cause | onset step | decisions (step:strategies) | applied (step:S) | "
          "S3 cost s measured (estimated) | time to mitigation s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ttm = "-" if r["time_to_mitigation_s"] is None else f"{r['time_to_mitigation_s']:.1f}"
        s3 = ("-" if r["s3_measured_cost_s"] is None else
              f"{r['s3_measured_cost_s']:.3f} ({r['s3_estimated_cost_s']:.3f})")
        r["with_over_healthy"] = r["iteration_s_with"] / healthy
        print(f"| {r['scenario']} | {r['iteration_s_without']:.3f} | {r['iteration_s_with']:.3f} | "
              f"{r['iteration_s_with'] / r['iteration_s_without']:.2f} | {r['with_over_healthy']:.2f} | "
              f"{r['root_cause'] or '-'} | "
              f"{r['onset_step'] or '-'}{_located(r)} | {'; '.join(r['decisions']) or '-'} | "
              f"{'; '.join(r['applied']) or '-'} | {s3} | {ttm} |")


def _emit(res: dict, path: str | None) -> None:
    """Print a result as a JSON block and write it to ``path`` (the script's ``--json``)."""
    text = json.dumps(res, indent=2)
    print("\n```json\n" + text + "\n```")
    if path:
        with open(path, "w") as f:
            f.write(text)


def main():
    global SEQ_LEN, DEVICE_PASS_MS
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--per-category", type=int, default=100)
    ap.add_argument("--seed0", type=int, default=50000)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-hooks", action="store_true", help="skip the gloo hook-overhead part")
    ap.add_argument("--end-to-end", action="store_true",
                    help="only the DP 2 x PP 2 TorchTitan table (8 torchrun jobs, minutes)")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--slow-from", type=int, default=5)
    ap.add_argument("--device-factor", type=float, default=4.0, help="the slow device's factor")
    ap.add_argument("--link-factor", type=float, default=6.0,
                    help="the slow DP link's factor (6: its all-reduce +5x its healthy time)")
    ap.add_argument("--second-from", type=int, default=0,
                    help="the combined scenario's second fault (the DP link) from this step (default: --slow-from + 8)")
    ap.add_argument("--scenarios", default="", help="comma-separated substrings of scenario names "
                    "(e.g. 'healthy,slow device'); default all")
    ap.add_argument("--workdir", default="outputs/bench_falcon_e2e")
    ap.add_argument("--seq-len", type=int, default=SEQ_LEN, help="tokens per sample of the end-to-end jobs")
    ap.add_argument("--device-pass-ms", type=float, default=0.0,
                    help="emulated dedicated devices: every forward this many ms, every backward twice "
                    "that (emulate_device_pass_ms; 0 = real compute on the shared cores)")
    ap.add_argument("--group-tracking", type=int, default=0, metavar="RUNS",
                    help="with --end-to-end: RUNS detect-only jobs each of healthy and slow DP link, "
                    "their series replayed with and without group tracking (bench_group_tracking)")
    ap.add_argument("--s4", action="store_true", help="with --end-to-end: only the slow-device S2 -> S4 "
                    "run (bench_s4_slow_device; --steps, --slow-from, --device-factor)")
    ap.add_argument("--compound", action="store_true",
                    help="Falcon §7.3's compound sequence in the DP 2 x PP 2 job (bench_compound): slow DP link "
                    "-> S3, slow device -> S2, S4 onto a spare device; --json PATH, the plot beside it (.png); "
                    "defaults COMPOUND_DEFAULTS unless --steps/--link-factor/--device-factor/--device-pass-ms given")
    ap.add_argument("--link-from", type=int, default=8, help="--compound: the slow DP link from this step")
    ap.add_argument("--device-from", type=int, default=28, help="--compound: the slow device from this step")
    ap.add_argument("--fig19", action="store_true", help="PipeMorph §7.3 Fig. 19: DP 2 x PP 4 (8 processes), "
                    "a latency fault on DP link 0-1, four arms (bench_fig19)")
    ap.add_argument("--fault-ms", default="30", help="--fig19: the DP link's added latency in ms, comma-separated "
                    "sizes each run --repeat times (e.g. 10,20,30); --calibrate-hol: the PP link's (30, Fig. 6)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="--fig19: invocations per fault size, each with its own healthy arm (medians + spread)")
    ap.add_argument("--hol-hold", type=float, default=None,
                    help="--fig19: emulate_link_hol_hold (default: the calibrated value in "
                    f"{HOL_CALIBRATION}, 1.0 without one)")
    ap.add_argument("--calibrate-hol", action="store_true",
                    help="measure the head-of-line emulation's slowdown on PipeMorph Fig. 6's scenario (30 ms "
                    "between PP stages 0 and 1 of the fixed ZB plan) and pick emulate_link_hol_hold for its "
                    f"1.9x; written to --json (default {HOL_CALIBRATION})")
    ap.add_argument("--microbatches", type=int, default=16,
                    help="--fig19: microbatches of one pipeline step (one of a replica's 2 chunks)")
    ap.add_argument("--window-kib", type=float, default=32.0,
                    help="--fig19: the latency-bound window of the faulty link (emulate_link_window_kib; "
                    "32 = one activation message of the bench's model, which then pays the fault once, "
                    "as the paper's 'inter-PP stage latency' — its per-packet delays cost a transfer in "
                    "proportion to its bytes)")
    ap.add_argument("--no-hol", action="store_true",
                    help="--fig19: the moved link delays arrivals only (gloo), without NCCL's head-of-line "
                    "blocking of the direct path (emulate_link_hol)")
    args = ap.parse_args()
    SEQ_LEN, DEVICE_PASS_MS = args.seq_len, args.device_pass_ms
    if args.compound:
        given = {a.dest for a in ap._actions for o in a.option_strings
                 for x in sys.argv[1:] if x == o or x.startswith(o + "=")}
        for key, value in COMPOUND_DEFAULTS.items():  # the compound run's own, unless given
            if key not in given:
                setattr(args, key, value)
        DEVICE_PASS_MS = args.device_pass_ms
        res = bench_compound(args.steps, args.link_from, args.device_from, args.link_factor, args.device_factor,
                             args.workdir.replace("bench_falcon_e2e", "bench_falcon_compound"), DEVICE_PASS_MS)
        print_compound(res)
        if args.json:
            res["plot"] = os.path.splitext(args.json)[0] + ".png"
            plot_compound(res, res["plot"])
        _emit(res, args.json)
        return
    if args.calibrate_hol:
        SEQ_LEN, DEVICE_PASS_MS = 32, args.device_pass_ms or 10.0
        res = calibrate_hol(args.steps, args.slow_from, float(args.fault_ms.split(",")[0]), args.window_kib,
                            args.workdir.replace("bench_falcon_e2e", "bench_falcon_hol"), args.microbatches)
        res["command"] = " ".join(sys.argv)
        _emit(res, args.json or HOL_CALIBRATION)
        return
    if args.fig19:
        SEQ_LEN, DEVICE_PASS_MS = 32, args.device_pass_ms or 10.0
        hold = calibrated_hold() if args.hol_hold is None else args.hol_hold
        res = bench_fig19_repeated([float(x) for x in args.fault_ms.split(",")], args.repeat, args.steps,
                                   args.slow_from, args.window_kib,
                                   args.workdir.replace("bench_falcon_e2e", "bench_falcon_fig19"),
                                   args.microbatches, hol=not args.no_hol, hol_hold=hold,
                                   partial=args.json and args.json + ".partial")
        res["command"] = " ".join(sys.argv)
        print_fig19(res)
        _emit(res, args.json)
        if args.json and os.path.exists(args.json + ".partial"):
            os.remove(args.json + ".partial")
        return
    if args.end_to_end and (args.s4 or args.group_tracking):
        res = (bench_s4_slow_device(args.steps, args.slow_from, args.device_factor, args.workdir) if args.s4 else
               bench_group_tracking(args.group_tracking, args.steps, args.slow_from, args.link_factor, args.workdir))
        res["compute"] = _mode()
        _emit(res, args.json)
        return
    if args.end_to_end:
        rows = bench_end_to_end(args.steps, args.slow_from, args.workdir, args.scenarios,
                                args.device_factor, args.link_factor, args.second_from)
        print(f"Compute: {_mode()}\n")
        print_table(rows)
        text = json.dumps({"machine": f"{platform.machine()} {os.cpu_count()} cores", "compute": _mode(),
                           "steps": args.steps, "slow_from": args.slow_from,
                           "device_factor": args.device_factor, "link_factor": args.link_factor,
                           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}, indent=2)
        print("\n```json\n" + text + "\n```")
        if args.json:
            with open(args.json, "w") as f:
                f.write(text)
        return

    res = {"machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}"}
    res["detection"] = bench_detection(args.per_category, args.seed0)
    res["latency_vs_step"] = bench_latency_vs_step()
    res["monitor"] = bench_monitor_cost()
    res["monitor_without_group_tracking"] = bench_monitor_cost(group_tracking=False)
    if not args.no_hooks:
        res["hooks"] = bench_hook_overhead()
    det = res["detection"]
    step_us = det["detector_step_us"]["mean"]
    mon_us = res["monitor"]["mean_us"]
    step_cpu = det["detector_step_us"]["cpu_mean"]
    mon_cpu = res["monitor"]["cpu_mean_us"]
    res["cost_fraction"] = {
        f"iter_{s:.3g}s": {"detector": step_us * 1e-6 / s, "monitor": mon_us * 1e-6 / s,
                          "detector_cpu": step_cpu * 1e-6 / s, "monitor_cpu": mon_cpu * 1e-6 / s}
        for s in (0.05, 0.1, 1.0, det["mean_iteration_s_in_traces"])
    }

    print("## Detection on labelled synthetic traces")
    print(f"{det['traces']} traces, seeds {args.seed0}..{args.seed0 + det['traces'] - 1}; "
          f"overall accuracy {det['accuracy']:.4f}\n")
    print("| category | n | accuracy | false positives | latency mean / p50 / p95 / max (iters after onset) |")
    print("|---|---|---|---|---|")
    for c, st in det["per_category"].items():
        lat = ("-" if st["latency_iters_mean"] is None else
               f"{st['latency_iters_mean']:.2f} / {st['latency_iters_p50']:.0f} / "
               f"{st['latency_iters_p95']:.1f} / {st['latency_iters_max']}")
        print(f"| {c} | {st['n']} | {st['accuracy']:.3f} | {st['false_positives']} | {lat} |")
    print("\n## Latency vs step size (2 % jitter, onset at iteration 100)\n")
    print("| step factor | seeds | missed | latency mean | latency max |")
    print("|---|---|---|---|---|")
    for r in res["latency_vs_step"]:
        lm = "-" if r["latency_mean"] is None else f"{r['latency_mean']:.2f}"
        print(f"| {r['factor']} | {r['seeds']} | {r['missed']} | {lm} | {r['latency_max']} |")
    print("\n## Per-iteration cost\n")
    print("| what | wall mean µs | wall p50 µs | wall p99 µs | CPU mean µs |")
    print("|---|---|---|---|---|")
    d = det["detector_step_us"]
    print(f"| SlowIterationDetector.observe | {d['mean']:.1f} | {d['p50']:.1f} | {d['p99']:.1f} | {d['cpu_mean']:.1f} |")
    m = res["monitor"]
    print(f"| FalconMonitor.observe | {m['mean_us']:.1f} | {m['p50_us']:.1f} | {m['p99_us']:.1f} | {m['cpu_mean_us']:.1f} |")
    m = res["monitor_without_group_tracking"]
    print(f"| FalconMonitor.observe, group_tracking off | {m['mean_us']:.1f} | {m['p50_us']:.1f} | "
          f"{m['p99_us']:.1f} | {m['cpu_mean_us']:.1f} |")
    if "hooks" in res:
        h = res["hooks"]
        print(f"\nCallRecorder overhead: {h['overhead_us_per_call']:.2f} µs per torch.distributed call "
              f"({h['plain_us_per_call']:.1f} → {h['hooked_us_per_call']:.1f} µs, 1-rank gloo all_reduce 4 KiB)")
    print("\n| iteration time | detector (wall) | monitor (wall) | detector (CPU) | monitor (CPU) |")
    print("|---|---|---|---|---|")
    for k, v in res["cost_fraction"].items():
        print(f"| {k[5:]} | {100 * v['detector']:.4f} % | {100 * v['monitor']:.4f} % | "
              f"{100 * v['detector_cpu']:.4f} % | {100 * v['monitor_cpu']:.4f} % |")
    text = json.dumps(res, indent=2)
    print("\n```json\n" + text + "\n```")
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
