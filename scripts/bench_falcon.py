#!/usr/bin/env python
"""Falcon benchmark: detection latency (iterations after onset) and per-iteration detector cost.

Usage:
    .venv/bin/python scripts/bench_falcon.py [--per-category 100] [--seed0 50000] [--json out.json]
    .venv/bin/python scripts/bench_falcon.py --end-to-end [--steps 24] [--slow-from 6] [--json out.json]
    .venv/bin/python scripts/bench_falcon.py --end-to-end --s4 [--steps 80] [--device-factor 4] [--json out.json]
    .venv/bin/python scripts/bench_falcon.py --end-to-end --group-tracking 6 [--steps 30] [--json out.json]
    .venv/bin/python scripts/bench_falcon.py --fig19 [--fault-ms 30] [--steps 24] [--json fig19.json]

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
from titan_ext.runtime.falcon.traces import CATEGORIES, make_traces  # noqa: E402


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


def bench_fig19(steps: int, fault_from: int, fault_ms: float, window_kib: float, workdir: str,
                microbatches: int = 16, hol: bool = True) -> dict:
    """PipeMorph §7.3 (Fig. 19: 1 TP / 2 DP / 4 PP, a 10/20/30 ms latency fault on a DP link; the fixed
    ZB schedule 8.04x slower, Falcon's S3 a 3.6x speed-up over it (0.28x its time), PipeMorph's
    re-planning + delegation a further 1.96x) as a
    DP 2 x PP 4 CPU job (train_configs/debug_cpu_dp2_pp4.toml, 8 gloo ranks, dedicated-device
    emulation so that 8 ranks on 2 cores run like 8 devices): ``fault_ms`` on DP link 0-1 (stage 0's
    DP group) from step ``fault_from``, its gradient through a ``window_kib`` window
    (``emulate_link_window_kib``), four arms with the same seed and steps (:data:`FIG19_ARMS`).
    Times: the median of the slowest rank's step over the steps from 4 after the later S3 on.
    ``hol`` (the default): once S3 made the link a PP hop, it blocks the direct path as NCCL's does
    (``emulate_link_hol``, PipeMorph §3.2: the paper's GPUs ran NCCL); False: gloo's behaviour,
    where only the message's arrival is late."""
    fault = ["--titan_ext.emulate_slow_link", f"0-1:{fault_ms:g}@{fault_from}",
             "--titan_ext.emulate_link_window_kib", f"{window_kib:g}",
             "--titan_ext.emulate_link_hol" if hol else "--titan_ext.no-emulate_link_hol"]
    logs, events = {}, {}
    for arm, extra in FIG19_ARMS.items():
        dump = os.path.join(workdir, arm)
        args = [a for x in extra for a in (fault if x == "FAULT" else [x])]
        logs[arm] = _e2e_run(dump, steps, args, nproc=8, config="train_configs/debug_cpu_dp2_pp4.toml",
                             batch=(microbatches, 4 * microbatches))
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
           "fault": f"0-1:{fault_ms:g}@{fault_from}", "window_kib": window_kib, "compute": _mode(),
           "pp_link": ("NCCL head-of-line blocking on the direct path (emulate_link_hol)" if hol else
                       "arrival delayed only (gloo)"),
           "machine": f"{platform.machine()} {os.cpu_count()} cores",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "decisions": {arm: [f"{e['iteration']}:{e['strategy']}{'' if e['applied'] else ' (not applied)'}"
                               for e in events[arm] if e["kind"] == "decision" and e["strategy"] != "S1"]
                         for arm in FIG19_ARMS}}
    out["ratios"] = {"baseline_over_healthy": out["baseline_ms"] / out["healthy_ms"],
                     "s3_over_healthy": out["s3_ms"] / out["healthy_ms"],
                     "s3_over_s3_pipemorph": out["s3_ms"] / out["s3_pipemorph_ms"],
                     "s3_over_baseline": out["s3_ms"] / out["baseline_ms"],
                     "s3_pipemorph_over_s3": out["s3_pipemorph_ms"] / out["s3_ms"]}
    return out


def _rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def bench_s4_slow_device(steps: int, slow_from: int, factor: float, workdir: str) -> dict:
    """The slow-device S2 -> S4 scenario: device 3 ``factor``x slower from ``slow_from``; Falcon applies
    S2 and, when the accumulated impact reaches S4's measured cost, S4 (titan/falcon/s4.py: TorchTitan
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
    subprocess.run([sys.executable, "-m", "titan_ext.titan.falcon.s4", "--nproc-per-node", "4",
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
    ap.add_argument("--fig19", action="store_true", help="PipeMorph §7.3 Fig. 19: DP 2 x PP 4 (8 processes), "
                    "a latency fault on DP link 0-1, four arms (bench_fig19)")
    ap.add_argument("--fault-ms", type=float, default=30.0, help="--fig19: the DP link's added latency (10/20/30)")
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
    if args.fig19:
        SEQ_LEN, DEVICE_PASS_MS = 32, args.device_pass_ms or 10.0
        res = bench_fig19(args.steps, args.slow_from, args.fault_ms, args.window_kib,
                          args.workdir.replace("bench_falcon_e2e", "bench_falcon_fig19"), args.microbatches,
                          hol=not args.no_hol)
        _emit(res, args.json)
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
