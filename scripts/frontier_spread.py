#!/usr/bin/env python
"""The spread of the memory frontier over several invocations: how far each PipeMorph cell ran from its
own plan's prediction and from the CP-SAT optimum, and its speed-up over the torch schedule, in every
invocation, with the smallest, median and largest over them.

    python scripts/frontier_spread.py docs/benchmarks/frontier60_2026-11-29_run{1,2,3}.json \
        --within 5 --json docs/benchmarks/frontier60_2026-11-29_spread.json

Reads what ``scripts/bench_runtime.py --mode frontier`` wrote (its ``rows``: ``pipemorph_ms_at_same_memory``,
the ``predicted_ms`` of the plan that run deployed, ``optimal_ms``, ``speedup``); runs nothing.
``--within P``: the exit status is 1 when any cell of any invocation is more than P % from its prediction,
or (where the row has one) from the optimum.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def cells(report: dict) -> dict[tuple[float, str], dict[str, float]]:
    """(delay, torch schedule) → PipeMorph's distance (%) from its prediction and from the optimum, and the
    speed-up, of one invocation."""
    out = {}
    for row in report["rows"]:
        ms = row["pipemorph_ms_at_same_memory"]
        opt = row.get("optimal_ms")
        out[(row["delay_ms"], row["schedule"])] = {
            "vs_predicted_pct": 100 * (ms / row["predicted_ms"] - 1),
            "vs_optimal_pct": 100 * (ms / opt - 1) if opt else float("nan"),
            "speedup": row["speedup"],
        }
    return out


def spread(reports: list[dict]) -> list[dict]:
    per = [cells(r) for r in reports]
    keys = [k for k in per[0] if all(k in p for p in per)]
    rows = []
    for key in keys:
        row = {"delay_ms": key[0], "schedule": key[1]}
        for name in ("vs_predicted_pct", "vs_optimal_pct", "speedup"):
            vals = [p[key][name] for p in per]
            row[name] = vals
            row[f"{name}_min_median_max"] = [min(vals), statistics.median(vals), max(vals)]
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", help="frontier JSON files, one per invocation")
    ap.add_argument("--within", type=float, default=None, help="fail when a cell is more than this %% off")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    reports = [json.load(open(path)) for path in args.reports]
    rows = spread(reports)
    print(f"{len(reports)} invocations: " + ", ".join(r.get("date", "?") for r in reports))
    print(f"{'delay':>5} | {'schedule':>21} | {'vs predicted % (each; min/med/max)':>44} | "
          f"{'vs optimal %':>30} | speed-up")
    worst = 0.0
    for r in rows:
        pred, opt, sp = r["vs_predicted_pct"], r["vs_optimal_pct"], r["speedup"]
        worst = max(worst, *pred, *(v for v in opt if v == v))
        print(f"{r['delay_ms']:>5g} | {r['schedule']:>21} | {' '.join(f'{v:+5.1f}' for v in pred):>26} "
              f"({min(pred):+.1f}/{statistics.median(pred):+.1f}/{max(pred):+.1f}) | "
              f"{' '.join(f'{v:+5.1f}' for v in opt):>30} | {min(sp):.2f}-{max(sp):.2f}x")
    print(f"largest distance from a prediction or the optimum: {worst:+.1f} %")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "scripts/frontier_spread.py " + " ".join(sys.argv[1:]), "reports": args.reports,
                       "dates": [r.get("date") for r in reports], "commands": [r.get("command") for r in reports],
                       "rows": rows, "largest_pct": worst}, f, indent=1)
    return 1 if args.within is not None and worst > args.within else 0


if __name__ == "__main__":
    sys.exit(main())
