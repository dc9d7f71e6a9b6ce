#!/usr/bin/env python
"""Multi-stage mode of ``scripts/bench_runtime.py``: 4 gloo ranks × 2 stages
per rank, a delay of 0 / 30 / 60 ms on one rank link, torch's ScheduleInterleaved1F1B ("loop") and
ScheduleZBVZeroBubble ("v") against PipeMorph with several stages per rank (both placements), all in
one invocation.

Compute: every stage's F / I / W sleeps (``SleepComputeStage``); ``--f-ms/--i-ms/--w-ms`` are a
rank's times, each of its two stages takes half (the convention of ``simulate --builtin ZBVZeroBubble``
and ``titan-ext plan --virtual-stages 2``).  Real tensors cross the links; the delay is injected on
the real messages (``runtime/emulate/delay_injection.py``).

Per cell: median over --steps iterations after --warmup iterations; an iteration's time is the max over
ranks of (step end − common barrier exit).  For each delay all schedules are alive at once and their
iterations interleaved round-robin, so load from other jobs hits all alike.  Ratio: best torch
schedule / ours (speed-up; targets ≥ 2× at 60 ms, ≥ 0.97× at 0 ms).

    .venv/bin/python scripts/bench_runtime.py --mode multistage --json bench_runtime_multistage.json

``--memory-cap zbv``: PipeMorph gets a per-rank activation budget of ZBV's peak on that rank
(chunk activations counted from torch's own ZBV order) × the bytes one chunk's forward saves (+ half a
chunk of rounding room), so its run-time per-rank cap K_r (``runtime/execute/memory.py``) is ZBV's peak.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as Fn

from titan_ext.testing import run_ranks, timed_step

V = 2
TORCH = ("Interleaved1F1B", "ZBVZeroBubble")
OURS = ("PipeMorph-loop", "PipeMorph-v")
PLACEMENT = {"Interleaved1F1B": "loop", "ZBVZeroBubble": "v", "PipeMorph-loop": "loop", "PipeMorph-v": "v"}


def _local(kind: str, rank: int, world: int) -> list[int]:
    from titan_ext.plan.virtual import virtual_stage_to_rank

    s2r = virtual_stage_to_rank(world, V, PLACEMENT[kind])
    return [s for s in range(world * V) if s2r[s] == rank]


def _build(kind: str, rank: int, world: int, args) -> tuple:
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble

    from titan_ext.runtime import PipeMorph
    from titan_ext.testing import SleepComputeStage

    S = world * V
    local = _local(kind, rank, world)
    mods = [SleepComputeStage(args.dim, args.f_ms / V, args.i_ms / V, args.w_ms / V, seed=s) for s in local]
    stages = [PipelineStage(m, s, S, torch.device("cpu")) for m, s in zip(mods, local)]
    n = args.microbatches
    if kind == "Interleaved1F1B":
        sched = ScheduleInterleaved1F1B(stages, n, loss_fn=Fn.mse_loss)
    elif kind == "ZBVZeroBubble":
        sched = ScheduleZBVZeroBubble(stages, n, loss_fn=Fn.mse_loss)
    else:
        budget = _zbv_budget(mods[0], rank, world, args) if getattr(args, "memory_cap", "none") == "zbv" else None
        sched = PipeMorph(stages, n, loss_fn=Fn.mse_loss, memory_budget_bytes=budget)
    params = [p for m in mods for p in m.parameters()]
    return sched, local, torch.optim.SGD(params, lr=1e-3)


def _chunk_bytes(mod, args) -> int:
    """Bytes autograd saves for one microbatch of one chunk (parameters excluded, as the executor counts)."""
    params = {p.untyped_storage().data_ptr() for p in mod.parameters()}
    total = [0]

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            total[0] += t.numel() * t.element_size()
        return t

    x = torch.zeros(args.mb_size, args.dim, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mod(x)
    return total[0]


def _zbv_budget(mod, rank: int, world: int, args) -> float:
    """ZBV's peak on this rank (chunk activations, from torch's order) × one chunk's bytes, + half a chunk."""
    from titan_ext.plan.builtin import builtin_plan
    from titan_ext.plan.result import rank_peak_inflight

    plan, _ = builtin_plan("ZBVZeroBubble", world, args.microbatches)
    return (rank_peak_inflight(plan)[rank] + 0.5) * _chunk_bytes(mod, args)


def _step(sched, local: list[int], S: int, x, y) -> None:
    args = (x,) if 0 in local else ()
    sched.step(*args, **({"target": y} if S - 1 in local else {}))


def _worker(rank: int, world: int, args) -> dict:
    from titan_ext.runtime import inject_link_delays

    injector = inject_link_delays("")
    S, link = world * V, args.link
    cells = []
    for delay in args.delays:
        injector.update(f"{link}:{delay:g}" if delay > 0 else "")
        runs = {kind: (*_build(kind, rank, world, args), []) for kind in TORCH + OURS}
        for k in range(args.warmup + args.steps):
            g = torch.Generator().manual_seed(k)
            b = args.microbatches * args.mb_size
            x, y = torch.randn(b, args.dim, generator=g), torch.randn(b, args.dim, generator=g)
            for kind, (sched, local, opt, times) in runs.items():
                times.append(timed_step(opt, lambda: _step(sched, local, S, x, y)))
        for kind, (sched, local, opt, times) in runs.items():
            cell = {"delay_ms": delay, "schedule": kind, "times_ms": times,
                    "median_ms": statistics.median(times[args.warmup:])}
            if kind in OURS:
                log = list(sched.decision_log)
                cell.update({
                    "deploys": [(e["iteration"], e["kind"], e["reason"]) for e in log if e["decision"] == "deploy"],
                    "rejects": [(e["iteration"], e["reason"]) for e in log if e["decision"] == "reject"],
                    "measured_link_delay_ms": sched.last_metrics.get("link_delay_estimate_ms"),
                    "measured_compute_ms": sched.last_metrics.get("compute_ms"),
                    "background_plan_ms_max": max((m.get("plan_ms", 0.0) for m in sched.metrics_history
                                                   if m.get("deployed")), default=0.0),
                    "rank_memory_limit": sched.rank_memory_limit,
                    "deployed_peak_memory_per_rank": _peaks(sched.deployed.actions),
                })
            cells.append(cell)
        del runs
    injector.update("")
    return {"cells": cells}


def _peaks(actions) -> list[float]:
    from titan_ext.plan.result import peak_memory_per_rank

    return list(peak_memory_per_rank(actions).values())


def run(args) -> dict:
    """Run the mode, print its table, return the report part (``bench_runtime.py`` writes the JSON)."""
    t0 = time.time()
    res = run_ranks(_worker, args.world, args, backend="gloo")[0]  # timings: plain gloo
    print(f"\n== mode: multistage; {args.world} gloo ranks x {V} stages, N={args.microbatches}, sleep compute "
          f"F={args.f_ms:g} I={args.i_ms:g} W={args.w_ms:g} ms per rank ({V} stages of half), delay on rank link "
          f"{args.link}; median of {args.steps} iterations after {args.warmup} warm-up [{time.time() - t0:.0f} s]")
    print(f"{'delay ms':>8} | " + " | ".join(f"{s:>15}" for s in TORCH + OURS)
          + " | best torch / PipeMorph-v | best torch / PipeMorph-loop")
    for delay in args.delays:
        cells = {c["schedule"]: c for c in res["cells"] if c["delay_ms"] == delay}
        best = min(cells[s]["median_ms"] for s in TORCH)
        for s in OURS:
            cells[s]["speedup_vs_best_torch"] = best / cells[s]["median_ms"]
        print(f"{delay:>8g} | " + " | ".join(f"{cells[s]['median_ms']:>15.1f}" for s in TORCH + OURS)
              + f" | {cells['PipeMorph-v']['speedup_vs_best_torch']:>23.2f}x"
              + f" | {cells['PipeMorph-loop']['speedup_vs_best_torch']:>26.2f}x")
    for c in res["cells"]:
        if c["schedule"] in OURS:
            delays = {k: round(v, 1) for k, v in (c["measured_link_delay_ms"] or {}).items()}
            print(f"   {c['schedule']} @ {c['delay_ms']:g} ms: deploys {[(i, k) for i, k, _ in c['deploys']]}, "
                  f"rejects {len(c['rejects'])}, link delay estimate {delays}, "
                  f"background planning max {c['background_plan_ms_max']:.0f} ms, per-rank cap "
                  f"{c['rank_memory_limit']}, deployed plan's peak per rank {c['deployed_peak_memory_per_rank']}")
    return res
