#!/usr/bin/env python
"""How close are the greedy generators to the optimum?  (BENCHMARKS.md "CrossPipe greedy vs CP-SAT optimum")

For four configurations (3–8 stages, 6–32 microbatches, random per-stage F/B/W times with fixed seeds,
some with a slow link) and a few seeds each, this compares the simulated makespan of

* PipeMorph's generator (``plan_pipemorph(schedule="pipemorph")``, Alg.1/2 + Alg.3/4),
* CrossPipe's greedy generators (CrossUD, CrossUDSub; §4.2),
* with ``--polish S``: the default CrossUDSub plan polished within S seconds (``titan_ext.plan.polish``:
  CP-SAT warm-started from it, then a longer search; docs/optimality.md),

with the CP-SAT optimum of CrossPipe §4.1 (``titan_ext.plan.optimal``) — or, when the solver hits its
time limit, with its proven lower bound (then the reported gap is an upper bound on the true gap).
Every plan is validated; all plans and the solver share one per-stage memory limit on in-flight
activations (``--memory`` × S, default S, i.e. 1F1B's stage-0 budget on every stage; ``--memory 0``: no
limit for any generator nor for the solver, PipeMorph Fig.20's setting).  Solver results are cached per
memory limit (:func:`cache_key`): capped and uncapped optima never mix.

Also reported: generation time of each greedy plan (median and min of ``--repeat`` runs, and the
process CPU time per run; validation excluded) and solver time.  Targets: mean gap ≤ 0.5 %, max ≤ 1 %; greedy ≤ 10 ms per case; solver ≤
60 s per case.

    .venv/bin/python scripts/bench_optimality.py --json bench_optimality.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_ext.plan import LinkProfile, PipelineProfile, plan_pipemorph, simulate, validate_plan  # noqa: E402
from titan_ext.plan.crosspipe import DEFAULT_BUDGET, placed_from_profile, plan_crosspipe  # noqa: E402
from titan_ext.plan.polish import polish_crosspipe  # noqa: E402

# name, stages, microbatches, slow links {link: (latency ms, transfer ms per message)}
CONFIGS = [
    ("A", 3, 6, {}),
    ("B", 4, 12, {1: (15.0, 5.0)}),
    ("C", 6, 18, {}),
    ("D", 8, 32, {3: (20.0, 5.0)}),
]
MESSAGE_BYTES = 1e7  # transfer time t ms ↔ bandwidth MESSAGE_BYTES / (t/1000) B/s


def make_profile(stages: int, micro: int, slow: dict, seed: int) -> PipelineProfile:
    rng = random.Random(1000 * stages + seed)
    times = lambda: [round(rng.uniform(5.0, 15.0), 1) for _ in range(stages)]  # noqa: E731 (0.1 ms grid)
    links = [LinkProfile() for _ in range(stages - 1)]
    for i, (lat, tx) in slow.items():
        links[i] = LinkProfile(latency_ms=lat, bandwidth_bytes_per_s=MESSAGE_BYTES / (tx / 1e3), message_bytes=MESSAGE_BYTES)
    return PipelineProfile(stages, micro, times(), times(), times(), tuple(links))


def memory_arg(text: str) -> int:
    """argparse type of ``--memory``: a whole number ≥ 0 (0: no memory limit)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0 (0: no memory limit), got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0: no memory limit; K: K x S in-flight activations per "
                                         f"stage), got {value}")
    return value


def memory_limit(memory: int, stages: int) -> int | None:
    """Per-stage in-flight activation limit of ``--memory`` at S = ``stages``: MEMORY × S, None when 0."""
    return None if memory == 0 else memory * stages


def cache_key(case_id: str, memory: int) -> str:
    """The solver cache's key of a case under ``--memory``: the bare id ("B1") for the default cap of S
    (every cache written before the key held the limit was solved at that cap, so those files stay
    readable), "B1@uncapped" for ``--memory 0``, "B1@memory2" for 2 × S.  Entries also record their
    ``memory_limit`` (:func:`cached_entry` checks it)."""
    if memory == 1:
        return case_id
    return f"{case_id}@uncapped" if memory == 0 else f"{case_id}@memory{memory}"


def cached_entry(cache: dict | None, case_id: str, memory: int, limit: int | None) -> dict | None:
    """The cached solver result of ``case_id`` under ``memory`` (None when absent).  An entry that records
    a different ``memory_limit`` is an error, not a silent mix of capped and uncapped optima (entries
    without the field predate it and were solved at the cap of S: only the bare keys hold them)."""
    if cache is None:
        return None
    entry = cache.get(cache_key(case_id, memory))
    if entry is not None and "memory_limit" in entry and entry["memory_limit"] != limit:
        raise ValueError(f"solver cache entry {cache_key(case_id, memory)!r} was solved with memory_limit "
                         f"{entry['memory_limit']}, not {limit}")
    return entry


def timed(fn, repeat: int):
    """(result, median ms, min ms) over ``repeat`` runs (the machine is shared: min is the cleanest)."""
    out, ts = None, []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return out, statistics.median(ts), min(ts)


def run_case(name, stages, micro, slow, seed, args, cache=None) -> dict:
    prof = make_profile(stages, micro, slow, seed)
    limit = memory_limit(args.memory, stages)
    per_stage = None if limit is None else [limit] * stages  # the validator's per-stage limit
    row: dict = {"config": name, "stages": stages, "microbatches": micro, "seed": seed, "memory_limit": limit,
                 "slow_links": {str(k): {"latency_ms": v[0], "transfer_ms": v[1]} for k, v in slow.items()},
                 "f_ms": list(prof.f_ms), "b_ms": list(prof.b_ms), "w_ms": list(prof.w_ms), "plans": {}}
    plans = {
        "pipemorph": lambda: plan_pipemorph(prof, schedule="pipemorph", memory_limit=limit, validate=False).actions,
        # one run of Alg.1 as published (no portfolio): the paper's generator
        "crossud-alg1": lambda: plan_crosspipe(prof, "ud", memory_limit=limit, portfolio=False, validate=False).actions,
        "crossudsub-alg1": lambda: plan_crosspipe(prof, "udsub", memory_limit=limit, portfolio=False, validate=False).actions,
        # the default planners: budgeted portfolio + selection by simulation (§6.2) + local search
        "crossud": lambda: plan_crosspipe(prof, "ud", memory_limit=limit, validate=False, budget=args.budget).actions,
        "crossudsub": lambda: plan_crosspipe(prof, "udsub", memory_limit=limit, validate=False,
                                             budget=args.budget).actions,
    }
    if args.polish:  # the default plan + the bounded CP-SAT polish and search (titan_ext.plan.polish; timed once)
        plans["crossudsub-polish"] = lambda: polish_crosspipe(
            prof, plan_crosspipe(prof, "udsub", memory_limit=limit, validate=False, budget=args.budget),
            budget_s=args.polish).actions
    if args.full:  # no budget: every member, local search to a local optimum (slow; timed once)
        plans["crossudsub-full"] = lambda: plan_crosspipe(prof, "udsub", memory_limit=limit, validate=False,
                                                          budget=None).actions
    for pname, fn in plans.items():
        c0, runs = time.process_time(), 1 if pname.endswith(("-full", "-polish")) else args.repeat
        actions, gen_ms, gen_min_ms = timed(fn, runs)
        gen_cpu_ms = (time.process_time() - c0) * 1e3 / runs  # process CPU time: the least load-dependent
        validate_plan(actions, stages, micro, inflight_limit=per_stage)
        sim = simulate(actions, prof)
        row["plans"][pname] = {"makespan_ms": sim.makespan_ms, "gen_ms": gen_ms, "gen_min_ms": gen_min_ms,
                               "gen_cpu_ms": gen_cpu_ms,
                               "peak_inflight": max(sim.peak_inflight.values())}
    case_id, key = f"{name}{seed}", cache_key(f"{name}{seed}", args.memory)
    cached = cached_entry(cache, case_id, args.memory, limit) if not args.resolve else None
    from_cache = cached is not None
    if cached is None:
        from titan_ext.plan.optimal import solve_optimal_problem

        problem = placed_from_profile(prof, "ud", memory_limit=limit)
        t0 = time.perf_counter()
        res = solve_optimal_problem(problem, time_limit_s=args.time_limit, workers=args.workers)
        wall = time.perf_counter() - t0
        validate_plan(res.actions, stages, micro, inflight_limit=per_stage)
        cached = {"makespan_ms": res.makespan_ms, "bound_ms": res.bound_ms, "optimal": res.proven, "wall_s": wall,
                  "memory_limit": limit}
        if cache is not None:
            cache[key] = cached
    best_ms, bound_ms, proven = cached["makespan_ms"], cached["bound_ms"], cached["optimal"]
    ref = best_ms if proven else bound_ms
    # best known makespan: the solver's best plan or any generator's plan, whichever is shorter
    best_known = min([best_ms] + [p["makespan_ms"] for p in row["plans"].values()])
    row["solver"] = {"status": "OPTIMAL" if proven else "FEASIBLE", "proven": proven, "best_ms": best_ms,
                     "bound_ms": bound_ms, "solve_s": cached["wall_s"], "best_known_ms": best_known,
                     "reference": "optimum" if proven else "bound", "cached": from_cache,
                     "cache_key": key}
    for p in row["plans"].values():
        p["gap"] = max(0.0, (p["makespan_ms"] - ref) / ref)  # float noise below 0
        p["gap_best_known"] = max(0.0, (p["makespan_ms"] - best_known) / best_known)
        assert p["makespan_ms"] >= bound_ms - 1e-6, "a plan beat the proven bound: model mismatch"
    return row


def delay_table(stages: int = 8, micro: int = 16, tf: float = 10.0) -> list[dict]:
    """Delay ratios (T_lat/T_F, T_bw/T_F) ∈ {0, 0.5, 2}², S=8, N=16 (CrossPipe §7.1's M70 setting: 8 stages,
    GBS 16, two DCs; its ratios are {0, 0.5, 1, 2}), F=B=W=T_F (UD) or
    T_F/2 per chunk (V-shape, the same model cut in 2S chunks); the slow link is the boundary between
    two DCs of S/2 stages ("dc") or every link ("all").  Each CrossPipe plan gets its static
    counterpart's activation memory (per-stage peak for UD, per-rank peak for V-shape)."""
    from titan_ext.plan.builtin import builtin_plan
    from titan_ext.plan.crosspipe import wave_stage_to_rank
    from titan_ext.plan.result import rank_peak_inflight

    def link(lat, bw):
        if bw == 0:
            return LinkProfile(latency_ms=lat * tf)
        return LinkProfile(latency_ms=lat * tf, bandwidth_bytes_per_s=1e8 / (bw * tf / 1e3), message_bytes=1e8)

    f1b, _ = builtin_plan("1F1B", stages, micro)
    zbv, zbv_s2r = builtin_plan("ZBVZeroBubble", stages, micro)
    s2r = wave_stage_to_rank(stages)
    rows = []
    for where in ("dc", "all"):
        rank_links = [stages // 2 - 1] if where == "dc" else list(range(stages - 1))
        for lat in (0.0, 0.5, 2.0):
            for bw in (0.0, 0.5, 2.0):
                L = [LinkProfile()] * (stages - 1)
                for i in rank_links:
                    L[i] = link(lat, bw)
                ud = PipelineProfile(stages, micro, tf, tf, tf, tuple(L))
                LW = [link(lat, bw) if any({s2r[b], s2r[b + 1]} == {r, r + 1} for r in rank_links) else LinkProfile()
                      for b in range(2 * stages - 1)]
                wv = PipelineProfile(2 * stages, micro, tf / 2, tf / 2, tf / 2, tuple(LW))
                row = {"links": where, "lat_ratio": lat, "bw_ratio": bw}
                statics = {"1F1B": f1b, "zb": plan_pipemorph(ud, schedule="zb").actions,
                           "zb-h1": plan_pipemorph(ud, schedule="zb-h1").actions}
                for name, actions in statics.items():
                    ref = simulate(actions, ud)
                    limit = [ref.peak_inflight[s] for s in range(stages)]
                    cp = plan_crosspipe(ud, "ud", memory_limit=limit)
                    row[name] = ref.makespan_ms
                    row[f"crossud@{name}"] = simulate(cp.actions, ud).makespan_ms
                ref = simulate(zbv, wv, stage_to_rank=zbv_s2r)
                cw = plan_crosspipe(wv, "wave", memory_limit=list(rank_peak_inflight(zbv).values()))
                row["ZBV"] = ref.makespan_ms
                row["crosswave@ZBV"] = simulate(cw.actions, wv).makespan_ms
                rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3, help="cases per configuration (seeds FIRST..FIRST+n-1)")
    ap.add_argument("--first-seed", type=int, default=0,
                    help="first seed (0: the benchmark cases; 3 with --seeds 6: the 24 held-out cases, solved into "
                         "docs/benchmarks/crosspipe_holdout_cache.json)")
    ap.add_argument("--time-limit", type=float, default=60.0, help="CP-SAT time limit per case (s)")
    ap.add_argument("--workers", type=int, default=2, help="CP-SAT search workers")
    ap.add_argument("--repeat", type=int, default=7, help="greedy timing repetitions (median and min)")
    ap.add_argument("--memory", type=memory_arg, default=1,
                    help="memory limit per stage = MEMORY × S in-flight activations, for every generator and the "
                         "solver (default 1: S; 0: no limit, PipeMorph Fig.20's setting)")
    ap.add_argument("--configs", default="ABCD", help="subset of configurations to run, e.g. AB")
    ap.add_argument("--json", type=Path, default=None, help="write all results as JSON here")
    ap.add_argument("--solver-cache", type=Path, default=None,
                    help="JSON {case: {makespan_ms, bound_ms, optimal, wall_s, memory_limit}}: solver results are read "
                         "from it (solved and added when absent); keyed per --memory (B1, B1@uncapped, B1@memory2)")
    ap.add_argument("--resolve", action="store_true", help="re-solve every case even if cached (and update the cache)")
    ap.add_argument("--budget", type=int, default=DEFAULT_BUDGET,
                    help=f"work budget of the default planners (default {DEFAULT_BUDGET}; see plan_crosspipe)")
    ap.add_argument("--polish", type=float, default=None, metavar="SECONDS",
                    help="also the default CrossUDSub polished within this budget (titan_ext.plan.polish; timed once)")
    ap.add_argument("--full", action="store_true", help="also the unbudgeted CrossUDSub (budget=None; timed once)")
    ap.add_argument("--delay-table", action="store_true",
                    help="print the issue's delay-ratio comparison (CrossUD vs 1F1B/zb/zb-h1, CrossWave vs ZBV) and exit")
    args = ap.parse_args(argv)

    if args.delay_table:
        rows = delay_table()
        print("| links | T_lat/T_F | T_bw/T_F | 1F1B | CrossUD@1F1B | zb | CrossUD@zb | zb-h1 | CrossUD@zb-h1 | ZBV | CrossWave@ZBV |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['links']} | {r['lat_ratio']} | {r['bw_ratio']} | " + " | ".join(
                f"{r[k]:.0f}" for k in ("1F1B", "crossud@1F1B", "zb", "crossud@zb", "zb-h1", "crossud@zb-h1",
                                        "ZBV", "crosswave@ZBV")) + " |")
        if args.json:
            meta = {"command": " ".join(sys.argv), "python": platform.python_version(),
                    "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
            args.json.write_text(json.dumps({"meta": meta, "delay_table": rows}, indent=1))
        return 0

    from titan_ext.plan.ir import torch_schedules

    torch_schedules()  # import torch once, outside the timings (plans are returned in torch's IR)
    cache = None
    if args.solver_cache is not None:
        cache = json.loads(args.solver_cache.read_text()) if args.solver_cache.exists() else {}
    print("memory limit per stage: " + ("none (--memory 0)" if args.memory == 0 else f"{args.memory} x S"), flush=True)
    rows = []
    for name, stages, micro, slow in CONFIGS:
        if name not in args.configs:
            continue
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            row = run_case(name, stages, micro, slow, seed, args, cache)
            rows.append(row)
            if cache is not None:
                args.solver_cache.write_text(json.dumps(cache, indent=1, sort_keys=True) + "\n")
            s = row["solver"]
            print(
                f"{name} S={stages:<2d} N={micro:<3d} seed={seed} | opt/bound {s['best_ms']:8.1f}/{s['bound_ms']:8.1f}"
                f" {s['status']:8s} {s['solve_s']:5.1f}s | "
                + " ".join(f"{k} {v['makespan_ms']:7.1f} ({100 * v['gap']:5.2f}%, {v['gen_min_ms']:5.1f}ms)" for k, v in row["plans"].items()),
                flush=True,
            )
    summary: dict = {}
    names = list(rows[0]["plans"]) if rows else []
    for pname in names:
        gaps = [r["plans"][pname]["gap"] for r in rows]
        gens = [r["plans"][pname]["gen_ms"] for r in rows]
        mins = [r["plans"][pname]["gen_min_ms"] for r in rows]
        gb = [r["plans"][pname]["gap_best_known"] for r in rows]
        summary[pname] = {"mean_gap": statistics.mean(gaps), "max_gap": max(gaps),
                          "max_gen_cpu_ms": max(r["plans"][pname]["gen_cpu_ms"] for r in rows),
                          "mean_gap_best_known": statistics.mean(gb), "max_gap_best_known": max(gb),
                          "max_gen_ms": max(gens), "median_gen_ms": statistics.median(gens), "max_gen_min_ms": max(mins)}
    summary["solver"] = {"proven": sum(r["solver"]["proven"] for r in rows), "cases": len(rows),
                         "max_solve_s": max(r["solver"]["solve_s"] for r in rows)}
    print("\n| generator | mean gap | max gap | mean / max gap to best known | median gen (all cases) "
          "| max gen (median of repeats) | max gen (min of repeats) | max gen CPU |")
    print("|---|---|---|---|---|---|---|---|")
    for pname in names:
        x = summary[pname]
        print(f"| {pname} | {100 * x['mean_gap']:.2f} % | {100 * x['max_gap']:.2f} % | "
              f"{100 * x['mean_gap_best_known']:.2f} % / {100 * x['max_gap_best_known']:.2f} % | {x['median_gen_ms']:.1f} ms"
              f" | {x['max_gen_ms']:.1f} ms | {x['max_gen_min_ms']:.1f} ms | {x['max_gen_cpu_ms']:.1f} ms |")
    print("\n| generator | " + " | ".join(f"{c} gen min / median (max over seeds)" for c in sorted({r['config'] for r in rows})) + " |")
    print("|---|" + "---|" * len({r['config'] for r in rows}))
    by_config: dict = {}
    for pname in names:
        cells = []
        for c in sorted({r["config"] for r in rows}):
            sel = [r["plans"][pname] for r in rows if r["config"] == c]
            mn, md = max(p["gen_min_ms"] for p in sel), max(p["gen_ms"] for p in sel)
            by_config.setdefault(pname, {})[c] = {"max_gen_min_ms": mn, "max_gen_median_ms": md}
            cells.append(f"{mn:.1f} / {md:.1f} ms")
        print(f"| {pname} | " + " | ".join(cells) + " |")
    summary["gen_by_config"] = by_config
    sv = summary["solver"]
    print(f"\nsolver: {sv['proven']}/{sv['cases']} proven optimal, max {sv['max_solve_s']:.1f} s per case")
    if args.json:
        meta = {"command": " ".join(sys.argv), "python": platform.python_version(), "machine": platform.machine(),
                "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "args": {k: str(v) for k, v in vars(args).items()}}
        args.json.write_text(json.dumps({"meta": meta, "summary": summary, "cases": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
