#!/usr/bin/env python
"""CP-SAT optimum (CrossPipe §4.1, ``titan_ext.plan.optimal``) of the benchmark cases of
scripts/bench_optimality.py, one case at a time; writes the solver cache that bench reads.

The cases are built with bench_optimality's own ``CONFIGS``, ``make_profile`` and memory limit
(``--memory`` × S in-flight activations per stage; 0: none) through ``placed_from_profile``, so the
cache matches what the bench would solve, under the bench's own per-limit keys (``cache_key``).
Every returned plan is validated and simulated: the simulated makespan must equal the solver's objective
(integer ns) and no greedy plan may beat the bound.

    .venv/bin/python scripts/solve_cases.py --cache docs/benchmarks/crosspipe_solver_cache.json
    .venv/bin/python scripts/solve_cases.py --cases B1,D1 --time-limit 60 --workers 2
    .venv/bin/python scripts/solve_cases.py --memory 0 --cache docs/benchmarks/crosspipe_solver_cache_uncapped.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan_ext.plan import simulate, validate_plan  # noqa: E402
from titan_ext.plan.crosspipe import placed_from_profile, plan_crosspipe  # noqa: E402
from titan_ext.plan.timing import to_ns  # noqa: E402
from titan_ext.plan.optimal import solve_optimal_problem  # noqa: E402


def _bench():
    spec = importlib.util.spec_from_file_location("bench_optimality", ROOT / "scripts" / "bench_optimality.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def case_problems(memory: int = 1, seeds: int = 3):
    """{case id ("A0", …): (profile, placed profile, memory limit)} exactly as bench_optimality builds them
    (memory 0: no limit, the limit is None)."""
    bench = _bench()
    out = {}
    for name, stages, micro, slow in bench.CONFIGS:
        for seed in range(seeds):
            prof = bench.make_profile(stages, micro, slow, seed)
            limit = bench.memory_limit(memory, stages)
            out[f"{name}{seed}"] = (prof, placed_from_profile(prof, "ud", memory_limit=limit), limit)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="all", help="comma-separated case ids (A0..D2) or 'all'")
    ap.add_argument("--time-limit", type=float, default=60.0, help="wall-clock limit per case (s)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--deterministic-time", type=float, default=None, help="CP-SAT max_deterministic_time")
    ap.add_argument("--seed", type=int, default=0, help="CP-SAT random_seed")
    ap.add_argument("--plain", action="store_true", help="the plain §4.1 model (no redundant constraints)")
    bench = _bench()
    ap.add_argument("--memory", type=bench.memory_arg, default=1,
                    help="per-stage limit = MEMORY × S in-flight activations (default 1; 0: no limit)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 of every configuration (the bench uses 3;"
                    " seeds 3..8 are the held-out cases of scripts/bench_optimality.py --first-seed 3 --seeds 6)")
    ap.add_argument("--cache", type=Path, default=None, help="merge results into this JSON cache")
    ap.add_argument("--log", action="store_true")
    args = ap.parse_args(argv)

    problems = case_problems(args.memory, args.seeds)
    ids = list(problems) if args.cases == "all" else args.cases.split(",")
    cache = json.loads(args.cache.read_text()) if args.cache and args.cache.exists() else {}
    for cid in ids:
        prof, prob, limit = problems[cid]
        bench.cached_entry(cache, cid, args.memory, limit)  # refuses to overwrite another limit's entry
        res = solve_optimal_problem(prob, time_limit_s=args.time_limit, workers=args.workers,
                                    random_seed=args.seed, deterministic_time=args.deterministic_time,
                                    redundant=not args.plain, log=args.log)
        validate_plan(res.actions, prob.num_stages, prob.num_microbatches,
                      inflight_limit=None if limit is None else [limit] * prob.num_stages)
        rep = to_ns(simulate(res.orders, prof).makespan_ms)
        assert rep == res.makespan_ns, (cid, rep, res.makespan_ns)
        greedy = min(plan_crosspipe(prof, v, memory_limit=limit, validate=False).makespan_ms for v in ("ud", "udsub"))
        assert res.bound_ms <= greedy + 1e-6, (cid, res.bound_ms, greedy)
        print(f"{cid}: best {res.makespan_ms:8.1f} bound {res.bound_ms:8.1f} root {res.params['root_bound_ms']:8.1f}"
              f" hint {res.hint_ms:8.1f} greedy {greedy:8.1f} {res.status:8s} {res.solve_s:6.2f} s", flush=True)
        cache[bench.cache_key(cid, args.memory)] = {"makespan_ms": round(res.makespan_ms, 6),
                                                    "bound_ms": round(res.bound_ms, 6), "optimal": res.proven,
                                                    "wall_s": round(res.solve_s, 3), "memory_limit": limit}
        if args.cache:
            args.cache.write_text(json.dumps(cache, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
