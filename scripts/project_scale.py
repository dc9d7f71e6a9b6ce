#!/usr/bin/env python3
"""A projection to cluster scale: PipeMorph's iteration overhead when healthy and its speed-up under a
straggler for PP 8-16 x DP 8-64, with Llama-3 8B and 70B stage times, from measured inputs.

What is measured and what is modelled:

* **stage times** (modelled): TorchTitan's own FLOP count for Llama 3 (``get_nparams_and_flops``:
  6 x the non-embedding parameters + 12 x layers x dim x seq per token for forward + backward; the
  forward a third of it), layers split evenly over the stages, the output projection on the last one,
  at ``--tflops`` (400) achieved per GPU, sequence 8192, microbatch 1, full activation checkpointing
  (the backward for the input recomputes the forward: I = 2F, W = F), N = 4 x PP microbatches;
* **the planner's time** (measured here, in this process): ``plan_by_name(..., "pipemorph")`` as the
  runtime calls it, wall and CPU seconds, at S = 8, 16, 32, 64 stages. The runtime plans on a
  background thread (docs/runtime.md), so this is re-plan latency, not time on the critical path;
* **the control plane's cost per check** (measured, read from ``scripts/bench_runtime.py`` JSON files):
  the median boundary time of PipeMorph's check iterations (profile exchange + decision) minus that of
  its other iterations, per PP degree found in the files. PipeMorph's control plane is one gloo group
  per PP group (``runtime/comm/control_plane.py``): its cost does not depend on the DP degree. Beyond the measured
  PP degrees it is extrapolated as a + b log2(PP) (least squares over the measured ones; one measured
  degree: b = a / log2(that degree), i.e. proportional to log2(PP), the issue's bound, and the JSON says
  ``"extrapolated": "assumed log2"``). Spread over ``profile_every_max`` (4) iterations once settled;
* **the iteration times** (simulated, ``titan_ext.plan.simulate`` through the planners): 1F1B and
  PipeMorph's plan, healthy and with ``--delay-f`` (2 and 6) x F one-way delay added on the middle PP link, at
  PipeMorph's unconstrained memory and at 1F1B's (stage s holds S - s).

What is not projected: the DP gradient all-reduce (the same for both schedules), the executor's host
time per action (hidden while the host runs ahead of the device, docs/runtime.md "GPU correctness"),
Falcon's control plane (its own benchmark). Nothing here ran on a cluster.

    .venv/bin/python scripts/project_scale.py [--runtime-json docs/benchmarks/runtime_healthy_w4_*.json]
        [--json docs/benchmarks/projection_2026-11-29.json]
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_ext.plan import PipelineProfile  # noqa: E402
from titan_ext.plan.schedules import plan_by_name  # noqa: E402

#: Llama 3 shapes (TorchTitan's ``llama3_args``): layers, dim, FFN hidden, vocabulary; both have 8 KV heads of 128
MODELS = {"8B": (32, 4096, 14336, 128256), "70B": (80, 8192, 28672, 128256)}
KV_DIM = 8 * 128
SEQ, MICROBATCH = 8192, 1
PP_DEGREES, DP_DEGREES = (8, 16), (8, 16, 32, 64)
PLANNER_STAGES = (8, 16, 32, 64)
CHECK_EVERY = 4  # runtime.control.config.AdaptiveConfig.profile_every_max: a check every 4th iteration once settled


def layer_params(dim: int, ffn: int) -> int:
    """One Llama 3 block's matmul parameters: wq, wo (dim x dim), wk, wv (dim x 8 KV heads x 128), the FFN's three."""
    return 2 * dim * dim + 2 * dim * KV_DIM + 3 * dim * ffn


def stage_forward_ms(model: str, stages: int, tflops: float) -> list[float]:
    """Forward time per stage (TorchTitan's FLOPs per token / 3), layers split evenly, the output
    projection on the last stage."""
    layers, dim, ffn, vocab = MODELS[model]
    tokens = SEQ * MICROBATCH
    per_layer = (6 * layer_params(dim, ffn) + 12 * dim * SEQ) / 3 * tokens
    head = 6 * dim * vocab / 3 * tokens
    base, extra = divmod(layers, stages)
    counts = [base + (1 if s < extra else 0) for s in range(stages)]
    flops = [c * per_layer + (head if s == stages - 1 else 0.0) for s, c in enumerate(counts)]
    return [f / (tflops * 1e12) * 1e3 for f in flops]


def profile(f_ms: list[float], n: int, delay_link: int | None = None, delay_ms: float = 0.0,
            at_1f1b_memory: bool = False) -> PipelineProfile:
    """Stage times F, I = 2F (full checkpointing recomputes the forward), W = F; W releases
    (torch's split backward); ``at_1f1b_memory``: stage s holds at most S - s activations."""
    S = len(f_ms)
    memory = {"activation_bytes": (1.0,) * S, "memory_budget_bytes": tuple(float(S - s) for s in range(S))} \
        if at_1f1b_memory else {}
    return PipelineProfile.uniform(S, n, tuple(f_ms), tuple(2 * f for f in f_ms), tuple(f_ms),
                                   delays_ms={delay_link: delay_ms} if delay_ms > 0 else None, release="W", **memory)


def planner_seconds(model: str, tflops: float) -> dict:
    """Wall and CPU seconds of the runtime's planner call at each S of :data:`PLANNER_STAGES`."""
    out = {}
    for S in PLANNER_STAGES:
        f = stage_forward_ms(model, min(S, MODELS[model][0]), tflops)
        if len(f) < S:  # more stages than layers: the time per stage of a finer split
            f = [sum(f) / S] * S
        p = profile(f, 4 * S, S // 2 - 1, 2 * f[S // 2])
        wall, cpu = time.perf_counter(), time.process_time()
        res = plan_by_name(p, "pipemorph")
        out[S] = {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                  "makespan_ms": res.predicted_makespan_ms}
    return out


def check_cost_ms(history: list[dict]) -> dict:
    """The control plane's cost per check on one rank, from its per-iteration metrics: the median over checks
    of a check's boundaries (exchange, agreement, decision, metrics) less the median boundary without one; a
    check that ran behind (``check`` "posted", then "decided" at the next boundary: runtime/control/cadence.py)
    costs its two boundaries.  ``check_cost_ms`` in wall time (``boundary_ms``: on a host the ranks share,
    it includes the time other ranks held the core), ``check_cpu_ms`` in the boundary thread's CPU time
    (``boundary_cpu_ms``: what a rank on a core of its own pays; None in metrics without it).  None without a
    check.  Also what ``bench_frontier.py`` reports per rank."""
    def kind(m: dict) -> str:  # metrics written before checks could run behind have no "check"
        return m.get("check", "exchange" if m.get("exchange_ms", 0) > 0 else "")

    def cost(key: str) -> tuple[float | None, int]:
        if any(key not in m for m in history):
            return None, 0
        others = [m[key] for m in history if not kind(m)]
        base = statistics.median(others) if others else 0.0
        costs, posted = [], None
        for m in history:
            if kind(m) == "exchange":
                costs.append(m[key] - base)
            elif kind(m) == "posted":
                posted = m[key] - base
            elif kind(m) == "decided" and posted is not None:
                costs.append(posted + m[key] - base)
                posted = None
        return (statistics.median(costs) if costs else None), len(costs)

    wall, checks = cost("boundary_ms")
    return {"check_cost_ms": wall, "check_cpu_ms": cost("boundary_cpu_ms")[0], "checks": checks,
            "iterations": len(history)}


def control_costs(paths: list[str]) -> dict[int, float]:
    """PP degree -> median extra boundary ms of a check iteration (PipeMorph, no delay), from
    ``bench_runtime.py`` JSON files (several files of one degree: the median of theirs)."""
    per: dict[int, list[float]] = {}
    for path in paths:
        data = json.load(open(path))
        world = int(data["args"]["world"])
        for mode in data["modes"].values():
            for cell in mode["cells"]:
                if cell["schedule"] != "PipeMorph" or cell["delay_ms"] != 0 or "metrics" not in cell:
                    continue
                cost = check_cost_ms(cell["metrics"][int(data["args"].get("warmup", 0)):])["check_cost_ms"]
                if cost is not None:
                    per.setdefault(world, []).append(cost)
    return {w: statistics.median(v) for w, v in sorted(per.items())}


def fit_log2(costs: dict[int, float]) -> tuple[float, float, str]:
    """(a, b, how) of cost(P) = a + b log2(P)."""
    if not costs:
        raise SystemExit("project_scale.py: no PipeMorph check iterations in the --runtime-json files")
    xs, ys = [math.log2(p) for p in costs], list(costs.values())
    if len(xs) == 1:
        return 0.0, ys[0] / xs[0], "assumed log2"
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b, "least squares"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runtime-json", nargs="+",
                    default=sorted(glob.glob(str(Path(__file__).resolve().parents[1]
                                                 / "docs/benchmarks/runtime_healthy_w*_*.json"))))
    ap.add_argument("--tflops", type=float, default=400.0)
    ap.add_argument("--delay-f", default="2,6", help="the stragglers: one-way delays in units of the middle stage's F")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    delay_factors = [float(x) for x in args.delay_f.split(",")]
    costs = control_costs(args.runtime_json)
    a, b, how = fit_log2(costs)
    print(f"control plane per check (measured, PP degree -> ms): {costs}; cost(PP) = {a:.3f} + {b:.3f} log2(PP) "
          f"({how})")
    plan_by_name(profile(stage_forward_ms("8B", 8, args.tflops), 32), "pipemorph")  # imports, first-call caches
    rows, planner = [], {}
    for model in MODELS:
        planner[model] = planner_seconds(model, args.tflops)
        print(f"planner ({model}): " + ", ".join(f"S={S} {v['wall_s']:.2f} s" for S, v in planner[model].items()))
        for S, factor in ((S, x) for S in PP_DEGREES for x in delay_factors):
            f = stage_forward_ms(model, S, args.tflops)
            n, link, delay = 4 * S, S // 2 - 1, factor * f[S // 2]

            def ms(name, delay_ms=0.0, at_1f1b_memory=False):
                return plan_by_name(profile(f, n, link, delay_ms, at_1f1b_memory), name).predicted_makespan_ms

            per_check = a + b * math.log2(S)
            overhead = per_check / CHECK_EVERY
            baselines = {"1F1B": ms("1F1B"), "ZB-H1": ms("zb-h1")}  # both hold 1F1B's S - s
            healthy = ms("pipemorph", at_1f1b_memory=True) + overhead
            slow_1f1b = ms("1F1B", delay)
            slow = ms("pipemorph", delay) + overhead
            slow_capped = ms("pipemorph", delay, at_1f1b_memory=True) + overhead
            rows.append({
                "model": model, "pp": S, "dp": list(DP_DEGREES), "microbatches": n, "f_ms": [round(x, 3) for x in f],
                "healthy_baselines_ms": baselines, "healthy_pipemorph_at_1f1b_memory_ms": healthy,
                "healthy_ratio": min(baselines.values()) / healthy,
                "control_ms_per_check": per_check, "control_overhead": overhead / healthy,
                "delay_f": factor, "delay_ms": delay, "delay_link": link, "straggler_1f1b_ms": slow_1f1b,
                "straggler_pipemorph_ms": slow, "straggler_pipemorph_at_1f1b_memory_ms": slow_capped,
                "speedup": slow_1f1b / slow, "speedup_at_1f1b_memory": slow_1f1b / slow_capped,
                "replan_latency_iterations": planner[model][S]["wall_s"] * 1e3 / slow})
    print("per PP group (the same for DP 8, 16, 32, 64: PipeMorph's control plane is one group per PP group)")
    print(f"{'model':>5} {'PP':>3} {'best torch':>10} {'PM@1F1B':>9} {'ratio':>6} {'ctrl %':>7} {'delay ms':>8} "
          f"{'1F1B slow':>9} {'PM slow':>9} {'speedup':>7} {'@1F1B mem':>9} {'replan it':>9}")
    for r in rows:
        print(f"{r['model']:>5} {r['pp']:>3} {min(r['healthy_baselines_ms'].values()):>10.0f} "
              f"{r['healthy_pipemorph_at_1f1b_memory_ms']:>9.0f} {r['healthy_ratio']:>5.3f}x "
              f"{100 * r['control_overhead']:>7.3f} {r['delay_ms']:>8.1f} {r['straggler_1f1b_ms']:>9.0f} "
              f"{r['straggler_pipemorph_ms']:>9.0f} {r['speedup']:>6.2f}x {r['speedup_at_1f1b_memory']:>8.2f}x "
              f"{r['replan_latency_iterations']:>9.2f}")
    if args.json:
        out = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
               "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "machine": f"{platform.node()} {os.cpu_count()} CPUs, {platform.machine()}",
               "inputs": {"runtime_json": [os.path.relpath(p) for p in args.runtime_json], "tflops": args.tflops,
                          "seq": SEQ, "microbatch": MICROBATCH, "delay_f": delay_factors, "check_every": CHECK_EVERY},
               "control_ms_per_check_measured": costs, "control_fit": {"a_ms": a, "b_ms": b, "extrapolated": how},
               "planner": planner, "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
