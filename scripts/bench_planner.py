#!/usr/bin/env python3
"""Planner speed: event-driven PipeMorph generation + validation vs the paper's δ-discretized Alg.4.

For each size, in one process: median wall time of (a) our event-driven generator, (b) our validator
(completeness, order, memory, dependency progress), (c) torch's own lowering + dry run
(_add_send_recv + _simulate_comms_compute), and the paper's discrete-time Alg.4 at ⌈t_o/δ⌉ = 30
(implemented here literally as the baseline), with the simulated makespan of both plans.
Prints a table and writes JSON (default docs/benchmarks/planner.json).

    .venv/bin/python scripts/bench_planner.py
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_ext.plan import PipelineProfile, adapted_warmup_counts, generate_order, simulate  # noqa: E402
from titan_ext.plan.ir import gc_paused, to_torch_plan  # noqa: E402
from titan_ext.plan.validate import validate_plan  # noqa: E402

TARGET_MS = {(8, 32): 5.0, (16, 128): 100.0, (64, 512): 2000.0}


def discrete_alg4(profile: PipelineProfile, x: list[int], limit: list[int], steps_per_op: int = 30):
    """PipeMorph Alg.4 as published: a discrete-time loop with step δ = t_o / steps_per_op; every step
    visits each stage, which picks an op with Alg.3 among those whose ready time has passed."""
    S, N = profile.num_stages, profile.num_microbatches
    t_o = max(max(profile.f_ms), max(profile.b_ms), max(profile.w_ms))
    delta = t_o / steps_per_op
    c = profile.delays_ms
    avail = [{"F": [], "I": [], "W": []} for _ in range(S)]
    avail[0]["F"] = [(0.0, m) for m in range(N)]
    busy_until = [0.0] * S
    quota, held = list(x), [0] * S
    order = [[] for _ in range(S)]
    left = 3 * N * S
    step = 0
    while left:
        t = step * delta
        for i in range(S):
            if busy_until[i] > t:
                continue
            a = avail[i]
            pick = None
            if quota[i] > 0:
                if a["F"] and a["F"][0][0] <= t:
                    pick = "F"
                    quota[i] -= 1
            elif a["I"] and a["I"][0][0] <= t:
                pick = "I"
            elif a["F"] and a["F"][0][0] <= t and held[i] < limit[i]:
                pick = "F"
            elif a["W"] and a["W"][0][0] <= t:
                pick = "W"
            if pick is None:
                continue
            _, m = a[pick].pop(0)
            done = t + {"F": profile.f_ms, "I": profile.b_ms, "W": profile.w_ms}[pick][i]
            busy_until[i] = done
            order[i].append((i, pick, m))
            left -= 1
            if pick == "F":
                held[i] += 1
                if i + 1 < S:
                    avail[i + 1]["F"].append((done + c[i], m))
                else:
                    avail[i]["I"].append((done, m))
            elif pick == "I":
                held[i] -= 1
                avail[i]["W"].append((done, m))
                if i > 0:
                    avail[i - 1]["I"].append((done + c[i - 1], m))
        step += 1
    return {i: order[i] for i in range(S)}


def profile_for(S: int, N: int, seed: int) -> PipelineProfile:
    rng = random.Random(seed)
    prof = PipelineProfile(
        S, N,
        [round(rng.uniform(8, 12), 3) for _ in range(S)],
        [round(rng.uniform(8, 14), 3) for _ in range(S)],
        [round(rng.uniform(4, 10), 3) for _ in range(S)],
    )
    return prof.with_delays({S - 2: 60.0})


def timed(fn, reps):
    out, times = None, []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return out, statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks/planner.json"))
    ap.add_argument("--quick", action="store_true", help="smaller repetition counts")
    args = ap.parse_args()

    rows = []
    for (S, N), target in TARGET_MS.items():
        prof = profile_for(S, N, seed=S * 1000 + N)
        x = adapted_warmup_counts(prof)
        reps = 3 if args.quick or S >= 64 else (7 if S >= 16 else 21)
        validate_plan(to_torch_plan(generate_order(prof, x, x).order), S, N)  # warm torch import

        def gen():
            with gc_paused():
                return generate_order(prof, x, x)

        generated, gen_ms = timed(gen, reps)

        def ours():
            with gc_paused():
                validate_plan(generated.order, S, N, inflight_limit=x, torch_dry_run=False)

        _, ours_ms = timed(ours, reps)

        def torch_check():
            with gc_paused():
                validate_plan(generated.order, S, N, inflight_limit=x, torch_dry_run=True)

        _, full_ms = timed(torch_check, reps)
        torch_ms = max(full_ms - ours_ms, 0.0)

        def disc():
            with gc_paused():
                return discrete_alg4(prof, x, x, 30)

        disc_order, disc_ms = timed(disc, 1 if S >= 64 else min(reps, 5))
        validate_plan(disc_order, S, N)
        ours_makespan = simulate(generated.order, prof).makespan_ms
        disc_makespan = simulate(disc_order, prof).makespan_ms
        rows.append({
            "stages": S, "microbatches": N,
            "generate_ms": gen_ms, "validate_ours_ms": ours_ms, "validate_torch_ms": torch_ms,
            "plan_and_validate_ms": gen_ms + ours_ms, "plan_and_full_validate_ms": gen_ms + full_ms,
            "target_ms": target,
            "discrete_alg4_ms": disc_ms, "speedup_vs_discrete": disc_ms / gen_ms,
            "makespan_ms": ours_makespan, "discrete_makespan_ms": disc_makespan,
            "makespan_ratio_discrete_over_ours": disc_makespan / ours_makespan,
            "reps": reps,
        })

    hdr = (f"{'S':>3} {'N':>4} | {'generate':>9} {'+validate':>10} {'=total':>9} {'target':>7} | "
           f"{'torch dry run':>13} | {'δ-Alg.4 (30)':>12} {'speedup':>8} | {'makespan':>9} {'δ/ours':>7}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        ok = "ok" if r["plan_and_validate_ms"] <= r["target_ms"] else "MISS"
        print(f"{r['stages']:>3} {r['microbatches']:>4} | {r['generate_ms']:>7.2f}ms {r['validate_ours_ms']:>8.2f}ms "
              f"{r['plan_and_validate_ms']:>7.2f}ms {r['target_ms']:>5.0f}{ok:>2} | {r['validate_torch_ms']:>11.1f}ms | "
              f"{r['discrete_alg4_ms']:>10.1f}ms {r['speedup_vs_discrete']:>7.0f}x | {r['makespan_ms']:>7.1f}ms "
              f"{r['makespan_ratio_discrete_over_ours']:>7.4f}")
    doc = {
        "benchmark": "planner", "date": date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.processor() or ''} python {platform.python_version()}".strip(),
        "command": "python scripts/bench_planner.py" + (" --quick" if args.quick else ""),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
