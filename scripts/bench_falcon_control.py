#!/usr/bin/env python
"""Falcon's per-check control-plane cost in the DP x PP job, before and after, on loopback gloo.

The job's control plane is :class:`titan_ext.runtime.falcon.measure.ObservationExchange`: every rank's
step numbers (Falcon §4.2's iteration time, §4.3's per-group times) reduced with MAX on the world's
gloo control group.  Three arms, on the real class, over the same steps, interleaved check by check in
one invocation per world size (load from other jobs on a shared host hits all alike):

  before    one exchange **every step** (window 6), gloo's ``all_reduce`` (a ring: 2 (n - 1) message
            hops): a check of K steps costs K of them;
  ring@K    one exchange every K steps (window K + 5), gloo's ``all_reduce``: the cadence alone;
  after     one exchange every K steps (window K + 5), recursive doubling
            (:func:`titan_ext.runtime.falcon.exchange.max_all_reduce`: log2 n hops): what the job runs.

A check's cost on a rank is the wall time of its exchange calls (each entered after a barrier on another
gloo group, so a rank's time is the exchange's, not a peer's lateness); the table shows the median over
checks of the slowest rank's.  Every arm must feed every step, the same numbers on every rank, in order
(checked: the run fails otherwise).  Ratios: before / after and ring@K / after (> 1: after is cheaper).

    .venv/bin/python scripts/bench_falcon_control.py --layouts 2x2,4x2,2x4,8x2 --every 4 \
        --json docs/benchmarks/falcon_control_<date>.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from titan_ext.runtime.falcon.exchange import exchange_rounds  # noqa: E402
from titan_ext.testing import run_ranks  # noqa: E402

OLD_WINDOW = 6  # STEPS_IN_FLIGHT + 2: the per-step exchange's window before the cadence


def _step(index: int, rank: int, dp: int, pp: int, num_pp: int, num_dp: int):
    """A read step of this rank with made-up but rank- and step-dependent numbers."""
    from titan_ext.runtime.falcon.measure import StepRecord

    step = StepRecord(index, None)
    step.seconds = 0.1 + 1e-3 * ((7 * index + 3 * rank) % 11)
    base = float(index)
    step.at = {"step_start": base, "dp_start": base + 0.05 + 1e-3 * rank, "dp_reduce": base + 0.06,
               "dp_end": base + 0.07 + 1e-4 * rank}
    step.host = {"split": [3] * num_dp, "dp_index": dp, "pp_index": pp,
                 "link_delay_ms": {i: 1.0 + i for i in range(num_pp - 1)}, "trainer_step": index + 1,
                 "version": 0}
    return step


def _worker(rank: int, world: int, num_dp: int, num_pp: int, every: int, checks: int, warmup: int) -> dict:
    from titan_ext.runtime.falcon.device_clock import control_group
    from titan_ext.runtime.falcon.measure import ObservationExchange

    control, fence = control_group(), dist.new_group(backend="gloo")
    grid = [[d * num_pp + s for s in range(num_pp)] for d in range(num_dp)]
    dp, pp = divmod(rank, num_pp)
    arms = {"before": ObservationExchange(control, num_pp, num_dp, every=1, window=OLD_WINDOW, algorithm="ring"),
            f"ring@{every}": ObservationExchange(control, num_pp, num_dp, every=every, algorithm="ring"),
            "after": ObservationExchange(control, num_pp, num_dp, every=every)}
    for ex in arms.values():
        ex.order(grid)
    times = {name: [] for name in arms}
    fed = {name: [] for name in arms}
    step = 0
    for check in range(warmup + checks):
        for name, ex in arms.items():
            spent = 0.0
            for k in range(every):
                ex.add(_step(step + k, rank, dp, pp, num_pp, num_dp))
                if name == "before" or k == every - 1:
                    dist.barrier(group=fence)
                    t0 = time.perf_counter()
                    out = ex.exchange()
                    spent += time.perf_counter() - t0
                    fed[name] += [(s.index, obs.iteration_time_s) for s, obs, _ in out]
            if check >= warmup:
                times[name].append(spent)
        step += every
    return {"times": times, "fed": fed}


def run_layout(num_dp: int, num_pp: int, every: int, checks: int, warmup: int) -> dict:
    world = num_dp * num_pp
    results = run_ranks(_worker, world, num_dp, num_pp, every, checks, warmup, backend="gloo", timeout_s=1800)
    fed0 = results[0]["fed"]
    steps = (warmup + checks) * every
    for name, series in fed0.items():
        assert all(r["fed"][name] == series for r in results), f"{name}: ranks fed different series"
        assert [i for i, _ in series] == list(range(steps)), f"{name}: not every step fed in order"
        assert series == fed0["before"], f"{name}: other numbers than before"
    row = {"dp": num_dp, "pp": num_pp, "world": world, "every": every, "checks": checks,
           "rounds_after": exchange_rounds(world), "hops_ring": 2 * (world - 1)}
    for name in fed0:
        slowest = [max(r["times"][name][c] for r in results) for c in range(checks)]
        row[f"{name}_ms"] = 1e3 * statistics.median(slowest)
        row[f"{name}_p90_ms"] = 1e3 * sorted(slowest)[int(0.9 * (len(slowest) - 1))]
    row["before_over_after"] = row["before_ms"] / row["after_ms"]
    row[f"ring@{every}_over_after"] = row[f"ring@{every}_ms"] / row["after_ms"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="2x2,4x2,2x4,8x2", help="DPxPP grids, comma-separated")
    ap.add_argument("--every", type=int, default=4, help="the check cadence K (falcon_check_every)")
    ap.add_argument("--checks", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    rows = []
    for layout in args.layouts.split(","):
        num_dp, num_pp = (int(x) for x in layout.lower().split("x"))
        rows.append(run_layout(num_dp, num_pp, args.every, args.checks, args.warmup))
        r = rows[-1]
        print(f"DP{r['dp']} x PP{r['pp']} done", flush=True)
    k = args.every
    head = (f"{'DPxPP':>6} {'world':>5} {'hops ring':>9} {'rounds':>6} {'before ms':>9} {f'ring@{k} ms':>9} "
            f"{'after ms':>8} {'before/after':>12} {f'ring@{k}/after':>12}")
    print(f"\nper check of {k} steps: median over {args.checks} checks of the slowest rank's exchange time")
    print(head)
    for r in rows:
        print(f"{r['dp']}x{r['pp']:<4} {r['world']:>5} {r['hops_ring']:>9} {r['rounds_after']:>6} "
              f"{r['before_ms']:>9.2f} {r[f'ring@{k}_ms']:>9.2f} {r['after_ms']:>8.2f} "
              f"{r['before_over_after']:>12.2f} {r[f'ring@{k}_over_after']:>12.2f}")
    if args.json:
        out = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]),
               "host": {"platform": platform.platform(), "cpus": os.cpu_count(),
                        "loadavg_at_end": list(os.getloadavg()), "torch": torch.__version__},
               "every": k, "rows": rows,
               "note": "per check of K steps: 'before' = K per-step gloo all_reduce exchanges (window 6); "
                       "'ring@K' = one gloo all_reduce of the K-step window; 'after' = one recursive-doubling "
                       "exchange of the same window (what FalconJob runs). Slowest rank, median over checks."}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    if any(not math.isfinite(r["after_ms"]) for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
