#!/usr/bin/env python
"""The same 1F1B plan under four executors, one invocation, interleaved: where PipeMorph's time goes at
1F1B's memory with nothing slow (the memory frontier's one open row, BENCHMARKS.md).

    PYTHONPATH=. .venv/bin/python scripts/bench_executor.py --json bench_executor.json [--world 4]

Runs, each on its own copy of the model (``bench_frontier``'s: ``SleepComputeStage``, F = I = W = 2 ms
sleeps per rank, ``--compute-ms``: 0 leaves only the host's work, real tensors across gloo, N = 16
microbatches of 2 rows):

* ``Schedule1F1B`` — torch's hand-written 1F1B loop (the baseline every ratio is against);
* ``torch-runtime-1F1B`` — torch's own action-list runtime (``_PipelineScheduleRuntime``) running 1F1B's
  compute order through torch's own lowering (``_prepare_schedule_with_comms``);
* ``PipeMorph-1F1B`` — PipeMorph with 1F1B's plan pinned (``adaptive=False``, warm-up S − r, full backward);
* ``PipeMorph`` — PipeMorph as a user runs it, with 1F1B's measured peak of saved activation bytes as its
  budget (the frontier's "1F1B's memory" row).

Per run: the median and fastest iteration (the slowest rank's ``step()`` between a common barrier and its
end), the ratio ``Schedule1F1B / run`` (> 1: faster than torch's 1F1B), and per rank the main thread's CPU
time of a step (``time.thread_time``).  Compute is emulated (sleeps): the output says so.

``--ablate``: two more copies of ``PipeMorph-1F1B``, each with one part of its host work taken out, to
split its CPU a step against ``Schedule1F1B``'s into parts (diagnostics only: neither is a configuration
a user can run, and without a boundary nothing is measured, exchanged or decided):

* ``PipeMorph-1F1B-no-boundary`` — the iteration boundary (timing resolution, metrics, and every few
  iterations the check: profile exchange, estimates, decision) replaced by the iteration counter;
* ``PipeMorph-1F1B-no-timing`` — the device layer's timer made a no-op (no action, send or wait stamps).

What is left between ``PipeMorph-1F1B-no-boundary`` and ``Schedule1F1B`` is the executor itself (action
dispatch, the receive handles, the timer).

``--profile-rank R``: rank R's measured steps also run under cProfile, and the functions that cost that
rank's main thread the most CPU time (blocking waits, receives, sends and sleeps left out: they are the
pipeline's, not the host's) are printed per run with their calls a step — where the host time goes
(the main-thread CPU column is then inflated on rank R by the profiler).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_frontier as bf  # noqa: E402

from titan_ext.testing import run_ranks  # noqa: E402


def _stages(rank: int, world: int, args):
    from torch.distributed.pipelining import PipelineStage

    ids, mods = bf._modules("one", rank, world, args)
    return ids, mods, [PipelineStage(m, s, world, torch.device("cpu")) for m, s in zip(mods, ids)]


def _worker(rank: int, world: int, args) -> dict:
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    from titan_ext.plan.builtin import plan_builtin
    from titan_ext.plan.ir import to_torch_plan
    from titan_ext.plan.profile import PipelineProfile
    from titan_ext.runtime import PipeMorph

    # torch's own Schedule1F1B order (full backwards, warm-up S − r), for the two runs that take a plan (its
    # order does not depend on the times: 1 ms stands for no compute)
    one_f_one_b = plan_builtin("1F1B", PipelineProfile.uniform(world, args.microbatches, *(
        t if t > 0 else 1.0 for t in (args.f_ms, args.i_ms, args.w_ms))))

    mesh = bf.Mesh(world, 1)
    baseline = bf._torch_run("1F1B", mesh, args)
    baseline.name = "Schedule1F1B"
    for k in range(2):  # its measured peak of saved activation bytes: PipeMorph's budget
        x, y = bf._inputs(k, args)
        if k == 1:
            baseline.meter.reset_peak()
        baseline.step(x, y)
    budget = bf._max_over_ranks(baseline.meter.peak_bytes)
    runs = [baseline]

    ids, mods, stages = _stages(rank, world, args)
    rt = _PipelineScheduleRuntime(stages, args.microbatches, loss_fn=bf._loss(args))
    order = to_torch_plan(one_f_one_b.ops)
    rt.pipeline_order = order
    rt._prepare_schedule_with_comms(order)
    runs.append(bf.Run("torch-runtime-1F1B", "one", rt, ids, mods, world))

    ids, mods, stages = _stages(rank, world, args)
    pinned = PipeMorph(stages, args.microbatches, loss_fn=bf._loss(args), adaptive=False, backward="full")
    pinned.deploy(one_f_one_b)
    runs.append(bf.Run("PipeMorph-1F1B", "one", pinned, ids, mods, world))
    if args.ablate:
        runs += _ablations(rank, world, args, one_f_one_b)

    runs.append(bf._pipemorph_run("one", budget, mesh, args))
    runs[-1].name = "PipeMorph"

    if args.runs:  # e.g. one run alone under a native profiler (perf), the others built but not stepped
        runs = [r for r in runs if r.name in args.runs]
    cpu: dict[str, list[float]] = {r.name: [] for r in runs}
    proc: dict[str, list[float]] = {r.name: [] for r in runs}  # every thread of the process
    profiles = {r.name: cProfile.Profile() for r in runs} if rank == args.profile_rank else {}
    for r in runs:
        r.times.clear()
    for k in range(args.warmup + args.steps):
        x, y = bf._inputs(100 + k, args)
        for r in runs if k % 2 == 0 else runs[::-1]:
            prof = profiles.get(r.name) if k >= args.warmup else None
            c0, p0 = time.thread_time(), time.process_time()
            if prof is not None:
                prof.enable()
            r.step(x, y)
            if prof is not None:
                prof.disable()
            cpu[r.name].append(1e3 * (time.thread_time() - c0))
            proc[r.name].append(1e3 * (time.process_time() - p0))
    out = {}
    for r in runs:
        times = r.times[args.warmup:]
        cell = {"median_ms": statistics.median(times), "min_ms": min(times),
                "main_thread_cpu_ms": statistics.median(cpu[r.name][args.warmup:]),
                "process_cpu_ms": statistics.median(proc[r.name][args.warmup:])}
        if r.name.startswith("PipeMorph"):
            last = r.sched.metrics_history[-1] if r.sched.metrics_history else {}
            cell.update(plan_versions=r.sched.plan_version, warmup_counts=last.get("warmup_counts"),
                        backward=last.get("backward"))
        if r.name in profiles:
            cell["host_cpu_top"] = _host_cpu_top(profiles[r.name], args.steps)
        out[r.name] = cell
    return out


def _ablations(rank: int, world: int, args, plan) -> list:
    """``PipeMorph-1F1B`` without its boundary, and without its timer (``--ablate``, module docstring)."""
    from titan_ext.runtime import PipeMorph
    from titan_ext.runtime.execute.device import Timer

    class NoTiming(Timer):  # the host timer's interface, recording nothing
        def start(self, rec):
            return None

        def stop(self, rec, token):
            pass

        def mark(self, stamps):
            pass

        def recv_wait_begin(self):
            return None

        def recv_wait_ms(self, rec, token):
            pass

    out = []
    for name in ("PipeMorph-1F1B-no-boundary", "PipeMorph-1F1B-no-timing"):
        ids, mods, stages = _stages(rank, world, args)
        sched = PipeMorph(stages, args.microbatches, loss_fn=bf._loss(args), adaptive=False, backward="full")
        sched.deploy(plan)
        if name.endswith("no-boundary"):
            def count(prof, iteration_ms, sched=sched):  # noqa: ARG001 - the boundary's signature
                sched.iteration += 1
            sched._iteration_boundary = count
        else:
            sched.executor.timer = NoTiming()
        out.append(bf.Run(name, "one", sched, ids, mods, world))
    return out


#: calls whose time is the pipeline's (waiting for a peer, a transfer, the emulated device), not the host's
_BLOCKING = ("time.sleep", "c10d.wait", "c10d.recv", "c10d.send", "c10d.barrier", "acquire' of '_thread.lock")


def _host_cpu_top(prof: cProfile.Profile, steps: int, top: int = 12) -> list[dict]:
    """The functions with the most own time a step under ``prof``, blocking calls left out."""
    rows = []
    for (path, line, fn), (_, ncalls, own, _, _) in pstats.Stats(prof).stats.items():
        if not any(b in fn for b in _BLOCKING):
            rows.append({"function": f"{os.path.basename(path)}:{line}({fn})", "own_ms_per_step": 1e3 * own / steps,
                         "calls_per_step": ncalls / steps})
    rows.sort(key=lambda r: -r["own_ms_per_step"])
    return [{"total_own_ms_per_step": sum(r["own_ms_per_step"] for r in rows)}] + rows[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--compute-ms", type=float, default=2.0,
                    help="F = I = W sleep per rank (0: no compute to hide the host's work behind)")
    ap.add_argument("--json", default="bench_executor.json")
    ap.add_argument("--ablate", action="store_true",
                    help="also PipeMorph-1F1B without its boundary and without its timer (diagnostics)")
    ap.add_argument("--profile-rank", type=int, default=-1, help="cProfile this rank's steps (default: none)")
    ap.add_argument("--runs", type=lambda t: [x for x in t.split(",") if x], default=None, metavar="A,B",
                    help="step only these runs (names above; default: all four)")
    args = ap.parse_args()
    t = args.compute_ms
    for name, v in (("compute", "sleep"), ("dim", 64), ("f_ms", t), ("i_ms", t), ("w_ms", t), ("mb_size", 2),
                    ("layers", 2), ("vocab", 64), ("model_dim", 64)):
        setattr(args, name, v)
    per_rank = run_ranks(_worker, args.world, args, backend="gloo", timeout_s=1200)
    base = per_rank[0].get("Schedule1F1B", {}).get("median_ms", float("nan"))  # nan: not stepped (--runs)
    rows = []
    print(f"compute: sleep (F = I = W = {args.f_ms:g} ms per rank, emulated), {args.world} gloo ranks, "
          f"N = {args.microbatches}, {args.steps} iterations after {args.warmup}")
    print(f"{'run':>20} {'median ms':>10} {'min ms':>8} {'1F1B/run':>9} {'main-thread CPU ms per rank':>30} {'process':>8}  plan")
    for name, cell in per_rank[0].items():
        row = {"run": name, **cell, "ratio_vs_schedule1f1b": base / cell["median_ms"],
               "main_thread_cpu_ms_per_rank": [pr[name]["main_thread_cpu_ms"] for pr in per_rank],
               "process_cpu_ms_per_rank": [pr[name]["process_cpu_ms"] for pr in per_rank]}
        row.pop("main_thread_cpu_ms")
        row.pop("process_cpu_ms")
        rows.append(row)
        plan = f"{row.get('warmup_counts')} {row.get('backward')} v{row.get('plan_versions')}" if "plan_versions" in row else ""
        print(f"{name:>20} {row['median_ms']:>10.1f} {row['min_ms']:>8.1f} {row['ratio_vs_schedule1f1b']:>9.3f} "
              f"{'/'.join(f'{c:.1f}' for c in row['main_thread_cpu_ms_per_rank']):>30} "
              f"{statistics.mean(row['process_cpu_ms_per_rank']):>8.1f}  {plan}")
    for name, cell in per_rank[max(args.profile_rank, 0)].items():
        if "host_cpu_top" in cell:
            total, *top = cell["host_cpu_top"]
            print(f"\n{name}, rank {args.profile_rank}: {total['total_own_ms_per_step']:.2f} ms of host CPU a step "
                  f"under cProfile (blocking calls left out); the most:")
            for t in top:
                print(f"  {t['own_ms_per_step']:6.3f} ms  {t['calls_per_step']:6.1f} calls  {t['function']}")
    doc = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": f"{platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
           "compute": "sleep (emulated device compute)", "args": vars(args), "rows": rows}
    with open(args.json, "w") as fh:
        json.dump(doc, fh, indent=1)
    print(f"JSON: {args.json}")


if __name__ == "__main__":
    main()
