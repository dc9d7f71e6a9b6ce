#!/usr/bin/env python3
"""Several stages per rank: our multi-stage planner vs torch's own schedules, in simulation.

For R ranks × 2 stages, N microbatches, uniform per-rank times F,B,W (each stage 1/2 of them, the
convention of `titan-ext simulate --builtin ZBVZeroBubble --stages R`) and a one-way delay on one rank
link, in one process: torch's ZBVZeroBubble, DualPipeV, Interleaved1F1B and InterleavedZeroBubble
(taken from torch, simulated by titan_ext.plan.simulate), CrossWave, and ours (plan_virtual, both
placements). Memory-matched: each torch schedule beside ours in its placement planned at
its own peak per-rank memory (``--memory-limit``, activations of a rank's whole model part, a chunk
counting 1/2) and our one-stage-per-rank plan at that memory. Then random heterogeneous cases (per-rank
times, one slow link): ours / the best torch schedule, and ours / each torch schedule at its memory.
Prints tables and writes JSON (default docs/benchmarks/multistage.json).

    .venv/bin/python scripts/bench_multistage.py
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_ext.plan import PipelineProfile, simulate  # noqa: E402
from titan_ext.plan.builtin import builtin_plan  # noqa: E402
from titan_ext.plan.schedules import plan_by_name  # noqa: E402
from titan_ext.plan.result import peak_memory_per_rank  # noqa: E402
from titan_ext.plan.virtual import plan_virtual  # noqa: E402

TORCH = ("ZBVZeroBubble", "DualPipeV", "Interleaved1F1B", "InterleavedZeroBubble")
PLACEMENT = {"ZBVZeroBubble": "v", "DualPipeV": "v", "Interleaved1F1B": "loop", "InterleavedZeroBubble": "loop"}


def rank_peak(plan) -> float:
    """The busiest rank's peak, in activations of its whole model part (a chunk counts 1/V)."""
    return max(peak_memory_per_rank(plan).values())


def memory_matched(profile: PipelineProfile, torch: dict[str, dict]) -> dict[str, dict]:
    """Per torch schedule: ours in its placement at its per-rank peak, and ours with one stage per rank."""
    out = {}
    for name in TORCH:
        K = torch[name]["peak_per_rank"]
        ours = plan_virtual(profile, 2, PLACEMENT[name], memory_limit=K)
        one = plan_by_name(profile, "pipemorph", memory_limit=int(K))
        out[name] = {"memory_limit": K, "torch_ms": torch[name]["makespan_ms"],
                     "ours_ms": simulate(ours.actions, ours.profile).makespan_ms, "ours_source": ours.source,
                     "ours_peak_per_rank": rank_peak(ours.actions),
                     "ours_one_stage_ms": simulate(one.actions, profile).makespan_ms}
    return out


def torch_row(profile: PipelineProfile) -> dict[str, dict]:
    row = {}
    for name in TORCH:
        plan, s2r = builtin_plan(name, profile.num_stages, profile.num_microbatches)
        row[name] = {"makespan_ms": simulate(plan, profile, stage_to_rank=s2r).makespan_ms,
                     "peak_per_rank": rank_peak(plan)}
    return row


def uniform_cases(R: int, N: int, t: tuple[float, float, float], link: int, delays) -> list[dict]:
    rows = []
    for delay in delays:
        profile = PipelineProfile.uniform(R, N, *t, delays_ms={link: delay} if delay else {})
        row = {"delay_ms": delay, "torch": torch_row(profile)}
        wave = plan_by_name(profile, "crosspipe-wave")
        row["crosswave_ms"] = simulate(wave.actions, wave.profile).makespan_ms
        for placement in ("loop", "v"):
            plan = plan_virtual(profile, 2, placement)
            row[f"ours_{placement}"] = {
                "makespan_ms": simulate(plan.actions, plan.profile).makespan_ms,
                "source": plan.source, "warmup_counts": plan.warmup_counts,
                "peak_per_rank": rank_peak(plan.actions), "plan_ms": round(plan.plan_ms, 1),
            }
        row["memory_matched"] = memory_matched(profile, row["torch"])
        rows.append(row)
    return rows


def random_cases(seeds: int, with_memory: bool = True) -> list[dict]:
    out = []
    for seed in range(seeds):
        rng = random.Random(1000 + seed)
        R = rng.choice((3, 4, 6))
        N = rng.choice((2 * R, 4 * R))
        f, b, w = ([rng.uniform(5, 15) for _ in range(R)] for _ in range(3))
        link, delay = rng.randrange(R - 1), rng.choice((0.0, 15.0, 40.0, 90.0))
        profile = PipelineProfile(R, N, f, b, w).with_delays({link: delay})
        best_torch = min(v["makespan_ms"] for v in torch_row(profile).values())
        case = {"seed": 1000 + seed, "R": R, "N": N, "link": link, "delay_ms": delay, "best_torch_ms": best_torch}
        for placement in ("loop", "v"):
            plan = plan_virtual(profile, 2, placement)
            case[f"ours_{placement}_ms"] = simulate(plan.actions, plan.profile).makespan_ms
        if with_memory:
            matched = memory_matched(profile, torch_row(profile))
            case["at_memory"] = {k: v["ours_ms"] / v["torch_ms"] for k, v in matched.items()}
        out.append(case)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--times", default="10,10,10")
    ap.add_argument("--link", type=int, default=2)
    ap.add_argument("--delays", default="0,30,60,120")
    ap.add_argument("--random", type=int, default=30, help="random heterogeneous cases")
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks/multistage.json"))
    args = ap.parse_args()
    t = tuple(float(x) for x in args.times.split(","))
    rows = uniform_cases(args.ranks, args.microbatches, t, args.link, [float(x) for x in args.delays.split(",")])

    print(f"R={args.ranks} × 2 stages, N={args.microbatches}, t={args.times} ms per rank, delay on rank link {args.link}")
    print(f"{'delay':>6} | {'ZBV':>7} {'DualPV':>7} {'I1F1B':>7} {'IZB':>7} | {'CrossWave':>9} | "
          f"{'ours v':>7} {'ours loop':>9} | {'v/best':>6} {'loop/best':>9} {'v/ZBV':>6} | peak/rank ZBV, v, loop")
    for r in rows:
        tm = {k: v["makespan_ms"] for k, v in r["torch"].items()}
        best = min(tm.values())
        ov, ol = r["ours_v"]["makespan_ms"], r["ours_loop"]["makespan_ms"]
        r["ratios"] = {"v_over_best_torch": ov / best, "loop_over_best_torch": ol / best,
                       "v_over_zbv": ov / tm["ZBVZeroBubble"], "loop_over_izb": ol / tm["InterleavedZeroBubble"]}
        print(f"{r['delay_ms']:6.0f} | {tm['ZBVZeroBubble']:7.0f} {tm['DualPipeV']:7.0f} {tm['Interleaved1F1B']:7.0f} "
              f"{tm['InterleavedZeroBubble']:7.0f} | {r['crosswave_ms']:9.0f} | {ov:7.0f} {ol:9.0f} | "
              f"{ov / best:6.3f} {ol / best:9.3f} {ov / tm['ZBVZeroBubble']:6.3f} | "
              f"{r['torch']['ZBVZeroBubble']['peak_per_rank']:g}, {r['ours_v']['peak_per_rank']:g}, "
              f"{r['ours_loop']['peak_per_rank']:g}")
    print("\nmemory-matched: ours planned at each torch schedule's peak per rank (same placement; one stage per rank)")
    print(f"{'delay':>6} | " + " | ".join(f"{n[:14]:>14} K  torch   ours  1-stage" for n in TORCH))
    for r in rows:
        cells = [f"{m['memory_limit']:>16g} {m['torch_ms']:6.0f} {m['ours_ms']:6.0f} {m['ours_one_stage_ms']:8.0f}"
                 for m in (r["memory_matched"][n] for n in TORCH)]
        print(f"{r['delay_ms']:6.0f} | " + " | ".join(cells))
    cases = random_cases(args.random)
    worst = {p: max(c[f"ours_{p}_ms"] / c["best_torch_ms"] for c in cases) for p in ("loop", "v")}
    mean = {p: sum(c[f"ours_{p}_ms"] / c["best_torch_ms"] for c in cases) / len(cases) for p in ("loop", "v")}
    print(f"\n{len(cases)} random heterogeneous cases (R ∈ 3,4,6; per-rank F,B,W ∈ [5,15] ms; one link 0/15/40/90 ms):")
    print(f"  ours / best of torch's four: loop mean {mean['loop']:.3f} worst {worst['loop']:.3f}; "
          f"v mean {mean['v']:.3f} worst {worst['v']:.3f}")
    for delayed in (False, True):
        ratios = {n: [c["at_memory"][n] for c in cases if (c["delay_ms"] > 0) == delayed] for n in TORCH}
        if ratios[TORCH[0]]:
            print(f"  at each torch schedule's memory, {'with' if delayed else 'no'} delay: ours / torch " + ", ".join(
                f"{n} mean {sum(v) / len(v):.3f} worst {max(v):.3f}" for n, v in ratios.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "date": date.today().isoformat(), "machine": platform.machine(), "python": platform.python_version(),
        "command": "scripts/bench_multistage.py " + " ".join(sys.argv[1:]),
        "uniform": rows, "random": cases, "random_summary": {"worst": worst, "mean": mean},
    }, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
