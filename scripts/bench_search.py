#!/usr/bin/env python
"""Compiled CrossPipe descent (``titan_ext/plan/_search.c``): incremental re-timing vs re-timing from scratch.

Every candidate of the critical-path descent differs from the current plan on one rank at a few
positions.  ``incremental=True`` (the planner's default) restarts the timing at the first moved
operation, as ``crosspipe.retime.Retimer.rerun`` does; ``incremental=False`` (the baseline) times the
whole plan again.  Both return the same plan (checked here and in
tests/plan/test_crosspipe_engine.py); this measures what the restart buys per evaluation.  (The annealing
times its candidates from scratch: the restart measured no faster there, docs/crosspipe.md.)

Cases: scripts/bench_optimality.py's configurations (A–D, seeds 0–2), each started from its default
CrossUDSub plan under the benchmark's memory limit.  Per case and mode: fastest of ``--repeat`` runs,
the two modes interleaved (the machine is shared); reported as µs per evaluation and the ratio.

    .venv/bin/python scripts/bench_search.py --json docs/benchmarks/crosspipe_search.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_optimality import CONFIGS, make_profile  # noqa: E402
from titan_ext.plan.crosspipe import placed_from_profile, plan_crosspipe  # noqa: E402
from titan_ext.plan.crosspipe import _compiled  # noqa: E402
from titan_ext.plan.crosspipe.retime import Retimer  # noqa: E402
from titan_ext.plan.timing import to_ms  # noqa: E402
from titan_ext.plan.crosspipe.tuning import TUNING  # noqa: E402


def _fastest(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def bench_case(name: str, stages: int, micro: int, slow: dict, seed: int, args) -> dict:
    prof = make_profile(stages, micro, slow, seed)
    problem = placed_from_profile(prof, "udsub", memory_limit=stages)
    start = plan_crosspipe(prof, "udsub", memory_limit=stages, validate=False)
    model = Retimer(problem)
    eng = _compiled.engine()
    cap = eng.model(model.spec())
    ids, limit = model.ids(start.orders), tuple(problem.memory_limit)
    calls = {"descent": lambda inc: eng.descent(cap, ids, limit, args.evals, TUNING.depth, 1, 1, inc)}
    row = {"case": f"{name}{seed}", "stages": stages, "microbatches": micro, "operations": model.n}
    for what, call in calls.items():
        times = {True: float("inf"), False: float("inf")}
        results = {}
        for _ in range(args.repeat):  # interleaved: both modes see the same machine load
            for inc in (False, True):
                t, out = _fastest(lambda: call(inc), 1)
                times[inc] = min(times[inc], t)
                results[inc] = out
        assert results[True] == results[False], f"{name}{seed} {what}: the two modes disagree"
        evals = max(1, results[True][2])
        row[what] = {"evals": evals, "makespan_ms": to_ms(results[True][1]),
                     "scratch_us_per_eval": times[False] / evals * 1e6,
                     "incremental_us_per_eval": times[True] / evals * 1e6,
                     "speedup": times[False] / times[True]}
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--evals", type=int, default=2000, help="evaluation cap per descent call (a descent stops earlier at a local optimum)")
    ap.add_argument("--repeat", type=int, default=5, help="timing repetitions per mode (fastest kept)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per configuration (0..n-1)")
    ap.add_argument("--configs", default="ABCD", help="subset of configurations, e.g. D")
    ap.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if not _compiled.available():
        print("the compiled engine is not built (scripts/setup.sh builds it)")
        return 2
    rows = []
    print("| case | ops | descent evals | scratch µs/eval | incremental µs/eval | speedup |")
    print("|---|---|---|---|---|---|")
    for name, stages, micro, slow in CONFIGS:
        if name not in args.configs:
            continue
        for seed in range(args.seeds):
            r = bench_case(name, stages, micro, slow, seed, args)
            rows.append(r)
            d = r["descent"]
            print(f"| {r['case']} | {r['operations']} | {d['evals']} | {d['scratch_us_per_eval']:.2f} | "
                  f"{d['incremental_us_per_eval']:.2f} | {d['speedup']:.2f}× |")
    summary = {"descent_geomean_speedup": statistics.geometric_mean(r["descent"]["speedup"] for r in rows)}
    print(f"geometric mean speedup (descent): {summary['descent_geomean_speedup']:.2f}×")
    if args.json:
        meta = {"command": " ".join(sys.argv), "python": platform.python_version(), "machine": platform.machine(),
                "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
        args.json.write_text(json.dumps({"meta": meta, "summary": summary, "cases": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
