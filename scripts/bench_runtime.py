#!/usr/bin/env python
"""Iteration time of torch's Schedule1F1B, a ZeroBubble baseline and PipeMorph under an injected delay
on the last PP link, 4 gloo ranks on loopback, all in one invocation (baselines side by side).

Compute modes (named in the output):
  sleep  — emulated device compute: every stage's F / I / W sleeps a fixed time (default 10 ms each,
           the uniform t of PipeMorph §3.1); the achieved times are measured by PipeMorph's profiler and
           printed (calibration check).  Real tensors cross the links.
  model  — a real small transformer (4 stages) computing on the CPU (2 cores time-shared by 4 ranks).

ZeroBubble baseline: torch's ScheduleInterleavedZeroBubble with one stage per rank ("torch-ZB1P");
if torch refuses that layout, our ZB plan (PipeMorph Fig.4, x_i = 2(S−i)−1) run statically.

"torch-runtime" is torch's own _PipelineScheduleRuntime running PipeMorph's deployed plan (reloaded
whenever PipeMorph swaps), so PipeMorph / torch-runtime − 1 is what our executor, profiler and boundary
cost on the same actions.

Per cell: median over --steps iterations after --warmup iterations; an iteration's time is the max over
ranks of (step end − common barrier exit).  For each delay the three schedules are built side by side and
their iterations interleaved round-robin (the order reversed every other round), so load from other jobs on a shared machine hits all alike.  Ratios: best baseline / PipeMorph (speed-up), PipeMorph /
best baseline − 1 (overhead).  Also reports PipeMorph's re-plan cost on the critical path (agreement + swap at the boundary) as % of
iteration time, and the background planning + validation + lowering time.

    .venv/bin/python scripts/bench_runtime.py --mode sleep --json bench_runtime_sleep.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as Fn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from titan_ext.testing import run_ranks, step_rank, timed_step  # noqa: E402

#: "torch-runtime": torch's own _PipelineScheduleRuntime running PipeMorph's deployed plan (the same
#: actions, no instrumentation): PipeMorph / torch-runtime − 1 is the cost of our executor + boundary
SCHEDULES = ("1F1B", "ZB", "PipeMorph", "torch-runtime")


def _build(kind: str, mode: str, rank: int, world: int, args) -> tuple:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleavedZeroBubble
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    from titan_ext.runtime import PipeMorph
    from titan_ext.runtime.decide.planning import PipeMorphPlanner
    from titan_ext.testing import SleepComputeStage, TinyTransformerStage

    if mode == "sleep":
        mod = SleepComputeStage(args.dim, args.f_ms, args.i_ms, args.w_ms, seed=rank)
    else:
        mod = TinyTransformerStage(args.vocab, args.model_dim, args.layers, 4, rank == 0, rank == world - 1, seed=rank)
    stage = PipelineStage(mod, rank, world, torch.device("cpu"))
    n = args.microbatches
    loss = _loss(mode)
    label = kind
    if kind == "1F1B":
        sched = Schedule1F1B(stage, n, loss_fn=loss)
    elif kind == "ZB":
        try:
            sched = ScheduleInterleavedZeroBubble([stage], n, loss_fn=loss)
            label = "torch-ZB1P"
        except Exception:  # noqa: BLE001
            sched = PipeMorph([stage], n, loss_fn=loss, adaptive=False, planner=PipeMorphPlanner("zb"))
            label = "ZB-static"
    elif kind == "torch-runtime":
        sched = _PipelineScheduleRuntime([stage], n, loss_fn=loss)  # plan loaded from PipeMorph's each step
        sched.loaded_hash = None
    else:
        sched = PipeMorph([stage], n, loss_fn=loss)
    return mod, sched, label


def _load_deployed(torch_runtime, pipemorph) -> None:
    """Give torch's runtime PipeMorph's deployed compute-only plan (lowered by torch itself)."""
    if torch_runtime.loaded_hash != pipemorph.deployed.hash:
        torch_runtime._prepare_schedule_with_comms({r: list(a) for r, a in pipemorph.deployed.actions.items()})
        torch_runtime.loaded_hash = pipemorph.deployed.hash


def _loss(mode: str):
    if mode == "sleep":
        return Fn.mse_loss
    return lambda out, tgt: Fn.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1))


def _inputs(mode: str, step: int, args) -> tuple:
    g = torch.Generator().manual_seed(step)
    b = args.microbatches * args.mb_size
    if mode == "sleep":
        return torch.randn(b, args.dim, generator=g), torch.randn(b, args.dim, generator=g)
    x = torch.randint(0, args.vocab, (b, args.seq), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _worker(rank: int, world: int, mode: str, args) -> dict:
    from titan_ext.runtime import inject_link_delays

    injector = inject_link_delays("")
    link = world - 2
    out: dict = {"cells": []}
    for delay in args.delays:
        injector.update(f"{link}:{delay}" if delay > 0 else "")
        # all schedules alive at once, iterations interleaved round-robin, the order reversed every other
        # round (1F1B k, ZB k, PipeMorph k, torch-runtime k, torch-runtime k+1, PipeMorph k+1, ...): load
        # from anything else on the machine, and what one schedule leaves the next (a GC pass, cold
        # caches), hits every schedule alike
        runs = {}
        for kind in SCHEDULES:
            mod, sched, label = _build(kind, mode, rank, world, args)
            runs[kind] = (mod, sched, label, torch.optim.SGD(mod.parameters(), lr=1e-3), [], [])
        for k in range(args.warmup + args.steps):
            x, y = _inputs(mode, k, args)
            for kind, (mod, sched, label, opt, times, metrics) in list(runs.items())[::1 if k % 2 == 0 else -1]:
                if kind == "torch-runtime":
                    _load_deployed(sched, runs["PipeMorph"][1])
                times.append(timed_step(opt, lambda: step_rank(sched, rank, world, x, y)))
                if kind == "PipeMorph" and hasattr(sched, "last_metrics"):
                    m = sched.last_metrics
                    metrics.append({k2: m[k2] for k2 in (
                        "iteration", "decision", "deployed", "plan_version", "warmup_counts", "backward", "replan_ms", "plan_ms",
                        "plan_cpu_ms",
                        "exchange_ms", "check", "boundary_ms", "bubble_rate", "link_delay_ms", "compute_ms",
                        "iteration_time_ms", "profile_every", "inflight_cap")})
        for kind, (mod, sched, label, opt, times, metrics) in runs.items():
            cell = {"delay_ms": delay, "schedule": label, "times_ms": times,
                    "median_ms": statistics.median(times[args.warmup:])}
            if metrics:
                steady = metrics[args.warmup:]
                swaps = [m for m in metrics if m["deployed"]]
                cell.update({
                    "metrics": metrics,
                    "replan_swap_ms_max": max((m["replan_ms"] for m in swaps), default=0.0),
                    "background_plan_ms_max": max((m["plan_ms"] for m in swaps), default=0.0),
                    "background_plan_cpu_ms_max": max((m["plan_cpu_ms"] for m in swaps), default=0.0),
                    "final_backward": metrics[-1]["backward"],
                    "exchange_ms_median": statistics.median(m["exchange_ms"] for m in steady),
                    "boundary_ms_median": statistics.median(m["boundary_ms"] for m in steady),
                    "final_warmup_counts": metrics[-1]["warmup_counts"],
                    "decisions": [(m["iteration"], m["decision"]) for m in metrics if m["decision"] not in ("keep",)],
                    "swapped_at": [m["iteration"] for m in swaps],
                    "measured_compute_ms": metrics[-1]["compute_ms"],
                    "measured_link_delay_ms": metrics[-1]["link_delay_ms"],
                    "bubble_rate_median": statistics.median(
                        [m["bubble_rate"] for m in steady if m["bubble_rate"] == m["bubble_rate"]] or [float("nan")]),
                    "plan_versions": metrics[-1]["plan_version"],
                    "profile_every_final": metrics[-1]["profile_every"],
                })
            out["cells"].append(cell)
        del runs
    return out


def _schedule_names(text: str) -> tuple[str, ...]:
    from bench_frontier import ONE, TWO

    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in ONE + TWO]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown schedule(s) {unknown or text!r}; choose from {', '.join(ONE + TWO)}")
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["sleep", "model", "both", "multistage", "frontier"], default="both",
                    help="multistage: 4 ranks x 2 stages vs torch's Interleaved1F1B / ZBV "
                         "(scripts/bench_runtime_multistage.py); frontier: every torch schedule at its measured "
                         "memory and PipeMorph at the same memory (scripts/bench_frontier.py)")
    ap.add_argument("--compute", choices=["sleep", "model"], default="sleep", help="frontier: compute mode")
    ap.add_argument("--optimal-s", type=float, default=60.0, help="frontier: CP-SAT time limit per row")
    ap.add_argument("--plot", default=None, help="frontier: write the time-vs-memory plot (PNG) here")
    ap.add_argument("--schedules", type=_schedule_names, default=None, metavar="A,B",
                    help="frontier: only these torch schedules (default: GPipe, 1F1B, Interleaved1F1B, "
                         "InterleavedZeroBubble, ZBVZeroBubble, DualPipeV)")
    ap.add_argument("--link", type=int, default=2, help="multistage: the delayed rank link")
    ap.add_argument("--memory-cap", choices=["none", "zbv"], default="none",
                    help="multistage: zbv caps PipeMorph per rank at ZBV's peak")
    ap.add_argument("--delays", type=lambda s: [float(x) for x in s.split(",")], default=None,
                    help="ms on the delayed link (default 0,30,60; frontier 0,60)")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--dp", type=int, default=1,
                    help="frontier: DP replicas (world = DP x PP, every PP group delayed on --link; the "
                         "iteration includes the DP gradient mean)")
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--mb-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=12,
                    help="iterations before measuring (PipeMorph calibrates, adapts and, with backward=auto, "
                         "compares split and full backward inside them)")
    ap.add_argument("--f-ms", type=float, default=None, help="sleep compute per rank (default 10; frontier 2)")
    ap.add_argument("--i-ms", type=float, default=None)
    ap.add_argument("--w-ms", type=float, default=None)
    ap.add_argument("--dim", type=int, default=64, help="sleep mode: activation width")
    ap.add_argument("--model-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2, help="transformer layers per stage")
    ap.add_argument("--json", default="bench_runtime.json")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl_rules"],
                    help="process-group backend (nccl_rules: the NCCL-rules test backend, slower)")
    args = ap.parse_args()
    frontier = args.mode == "frontier"
    if args.dp < 1 or args.world % args.dp or (args.dp > 1 and not frontier):
        ap.error(f"--dp {args.dp}: frontier mode only, and it must divide --world {args.world}")
    if frontier and not 0 <= args.link < args.world // args.dp - 1:
        ap.error(f"--link {args.link}: the PP group has {args.world // args.dp} ranks (links 0..{args.world // args.dp - 2})")
    for name in ("f_ms", "i_ms", "w_ms"):
        if getattr(args, name) is None:
            setattr(args, name, 2.0 if frontier else 10.0)
    if args.delays is None:
        args.delays = [0.0, 60.0] if frontier else [0.0, 30.0, 60.0]
    modes = ["sleep", "model"] if args.mode == "both" else [args.mode]
    if args.mode == "multistage":
        from bench_runtime_multistage import run as run_multistage
    if frontier:
        from bench_frontier import run as run_frontier
    report = {"command": " ".join(sys.argv), "machine": f"{platform.node()} {os.cpu_count()} cpus, torch {torch.__version__}",
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(args), "modes": {}}
    for mode in modes:
        t0 = time.time()
        if mode == "multistage":
            report["modes"][mode] = run_multistage(args)
            continue
        if mode == "frontier":
            report.update(run_frontier(args))  # "rows" at the top level
            continue
        res = run_ranks(_worker, args.world, mode, args, backend=args.backend)[0]
        report["modes"][mode] = res
        name = ("sleep-compute (emulated device: F=%g I=%g W=%g ms sleeps)" % (args.f_ms, args.i_ms, args.w_ms)
                if mode == "sleep" else
                "real-model (transformer dim=%d, %d layers/stage, seq=%d, %d seq/microbatch, CPU)"
                % (args.model_dim, args.layers, args.seq, args.mb_size))
        print(f"\n== mode: {name}; {args.world} gloo ranks, N={args.microbatches}, delay on link "
              f"{args.world - 2} (last); median of {args.steps} iterations after {args.warmup} warm-up "
              f"[{time.time() - t0:.0f} s]")
        print(f"{'delay ms':>8} | " + " | ".join(f"{s:>12}" for s in ("1F1B", "ZB", "PipeMorph", "torch-runtime"))
              + " | vs 1F1B | speed-up vs best | vs torch-runtime | swap % of iter | planning CPU % of iter"
              + " | versions | final x | backward")
        for delay in args.delays:
            cells = {c["schedule"]: c for c in res["cells"] if c["delay_ms"] == delay}
            pm = cells["PipeMorph"]
            zb = next(c for s, c in cells.items() if s not in ("1F1B", "PipeMorph", "torch-runtime"))
            tr = cells["torch-runtime"]
            pm["ratio_vs_1f1b"] = cells["1F1B"]["median_ms"] / pm["median_ms"]
            pm["overhead_vs_torch_runtime"] = pm["median_ms"] / tr["median_ms"] - 1
            best = min(cells["1F1B"]["median_ms"], zb["median_ms"])
            pm["speedup_vs_best_baseline"] = best / pm["median_ms"]
            pm["overhead_vs_best_baseline"] = pm["median_ms"] / best - 1
            pm["replan_swap_pct_of_iteration"] = 100 * pm["replan_swap_ms_max"] / pm["median_ms"]
            pm["replan_total_pct_of_iteration"] = 100 * (pm["replan_swap_ms_max"] + pm["background_plan_cpu_ms_max"]) / pm["median_ms"]
            print(f"{delay:>8g} | {cells['1F1B']['median_ms']:>12.1f} | {zb['median_ms']:>12.1f} | "
                  f"{pm['median_ms']:>12.1f} | {tr['median_ms']:>13.1f} | {pm['ratio_vs_1f1b']:>6.2f}x | "
                  f"{pm['speedup_vs_best_baseline']:>15.2f}x | {100 * pm['overhead_vs_torch_runtime']:>+15.1f}% | "
                  f"{pm['replan_swap_pct_of_iteration']:>12.2f} | {pm['replan_total_pct_of_iteration']:>21.2f} | "
                  f"{pm['plan_versions']:>8} | {pm['final_warmup_counts']} | {pm['final_backward']}")
        print(f"   ZB baseline used: {zb['schedule']}")
        for delay in args.delays:
            pm = next(c for c in res["cells"] if c["delay_ms"] == delay and c["schedule"] == "PipeMorph")
            comp = {k: [round(v, 1) for v in vs] for k, vs in pm["measured_compute_ms"].items()}
            print(f"   PipeMorph @ {delay:g} ms: decisions {pm['decisions']}, swapped at {pm['swapped_at']} "
                  f"(critical path {pm['replan_swap_ms_max']:.2f} ms, background planning "
                  f"{pm['background_plan_ms_max']:.1f} ms wall / {pm['background_plan_cpu_ms_max']:.1f} ms CPU), measured compute {comp}, "
                  f"link delays {{{', '.join(f'{k}: {v:.1f}' for k, v in pm['measured_link_delay_ms'].items())}}}, "
                  f"bubble {pm['bubble_rate_median']:.2f}, exchange {pm['exchange_ms_median']:.2f} ms, "
                  f"boundary {pm['boundary_ms_median']:.2f} ms, final check period {pm['profile_every_final']}")
    with open(args.json, "w") as fh:
        json.dump(report, fh, indent=1, default=str)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
