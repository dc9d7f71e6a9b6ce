#!/usr/bin/env python
"""Frontier mode of ``scripts/bench_runtime.py``: every torch schedule at its own memory, and PipeMorph
at that same memory, one model, one invocation.

    .venv/bin/python scripts/bench_runtime.py --mode frontier --json frontier.json

4 gloo ranks, one model: one stage per rank (torch's GPipe and 1F1B) or two per rank (Interleaved1F1B,
InterleavedZeroBubble — loop placement — ZBVZeroBubble and DualPipeV — V placement), the same F/I/W per
rank (a rank's two stages take half each), N microbatches, 0 and +60 ms on one link (``--link``, the
rank link from 2 to 3 by default).

Memory: each run's **measured** peak of activation bytes alive per rank — autograd's saved tensors and the
stage outputs each stage keeps from a microbatch's forward to its backward, M^F's unit, what PipeMorph's
budget counts (``runtime.execute.memory.ActivationMeter`` with the schedule's stages around every ``step()``,
the same meter for torch's schedules and ours; parameters excluded); a row's ``peak_bytes_per_rank`` is the largest over ranks — the memory every
device must have.  PipeMorph then runs with that as its per-rank budget (``memory_budget_bytes``):
one stage per rank for every row, and with the row's placement (loop / V) for the two-stage rows;
``pipemorph_ms_at_same_memory`` is the faster of the two that fit (their own measured peak ≤ the row's).

Compute (named in the output): ``sleep`` — every F / I / W sleeps its time (emulated device compute,
``SleepComputeStage``; real tensors cross the links); ``model`` — a small transformer on the CPU.

``optimal_ms`` (one stage per rank rows): the CP-SAT optimum (``plan_by_name(..., "optimal")``) for the
F/I/W times and link delays PipeMorph measured in that run, at the in-flight limit its budget gives
(K = ⌊budget / M^F⌋, torch's memory rule: an activation is held until its W, ``plan.profile.RELEASES``).
The times are those PipeMorph plans with (``Estimator.planning_profile``): each action's measured
compute plus its rank's measured per-action cost of the executor (the median time between two actions
that is neither compute nor an input wait — posting sends and receives; every schedule on this executor
and transport pays it, torch's too); ``optimal_compute_only_ms`` is the optimum without that cost (a
bound no runtime reaches here).  ``predicted_ms``: the simulator's makespan of the plan PipeMorph
deployed, under the same planning profile.  Where the runtime misses its prediction by more than 10 %, the per-action breakdown says where
the time went: per rank, measured compute, input waits and the rest (executor, transport) against the
modelled compute and idle time of the same plan.

``--dp D`` (one-stage rows): D replicas of the pipeline (world = D x PP, PP innermost), every PP group with
the delay on its ``--link``, each replica its own batch; an iteration ends after the replicas' gradient
mean on the DP group (the same ``all_reduce`` for every schedule) and is the slowest rank's of the world.

Per cell: median over --steps iterations after --warmup; an iteration is the slowest rank's
``step()`` between a common barrier and its end.  All runs of one delay are alive at once and their
iterations interleaved round-robin, the order reversed every other round, so load from elsewhere (and what
one run leaves the next: a GC pass, cold caches) hits every schedule alike.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as Fn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from project_scale import check_cost_ms  # noqa: E402
from titan_ext.testing import run_ranks  # noqa: E402

V = 2
ONE = ("GPipe", "1F1B")
TWO = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
PLACEMENT = {"Interleaved1F1B": "loop", "InterleavedZeroBubble": "loop", "ZBVZeroBubble": "v", "DualPipeV": "v"}
#: a PipeMorph run fits a row's memory when its own measured peak is within this of the row's
FIT_SLACK = 1.02


def _stage_ids(layout: str, rank: int, world: int) -> list[int]:
    if layout == "one":
        return [rank]
    from titan_ext.plan.placement import stage_to_rank

    s2r = stage_to_rank(world, V, layout)
    return [s for s in range(world * V) if s2r[s] == rank]


def _modules(layout: str, rank: int, world: int, args) -> tuple[list[int], list[torch.nn.Module]]:
    from titan_ext.testing import SleepComputeStage, TinyTransformerStage

    k = 1 if layout == "one" else V
    S = world * k
    ids = _stage_ids(layout, rank, world)
    if args.compute == "sleep":
        mods = [SleepComputeStage(args.dim, args.f_ms / k, args.i_ms / k, args.w_ms / k, seed=s) for s in ids]
    else:
        mods = [TinyTransformerStage(args.vocab, args.model_dim, max(1, args.layers // k), 4, s == 0, s == S - 1, seed=s)
                for s in ids]
    return ids, mods


def _loss(args):
    if args.compute == "sleep":
        return Fn.mse_loss
    return lambda out, tgt: Fn.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1))


class Run:
    """One schedule on this rank: its stages, optimizer, meter and timings.  Under DP (``dp_group``) the
    iteration includes the replicas' gradient mean (one ``all_reduce`` per parameter on the DP group,
    the same for every schedule), as a DP x PP job's step does."""

    def __init__(self, name: str, layout: str, sched, ids: list[int], mods: list, S: int, dp_group=None):
        from titan_ext.runtime.execute.memory import ActivationMeter

        self.name, self.layout, self.sched, self.ids, self.S = name, layout, sched, ids, S
        self.dp_group = dp_group
        params = [p for m in mods for p in m.parameters()]
        self.params = params
        self.opt = torch.optim.SGD(params, lr=1e-4)
        # the stages' kept outputs counted too (M^F's unit, what the runtime budgets): torch's single-stage
        # schedules hold theirs in ``_stage``, the others (and ours) in ``_stages``
        stages = getattr(sched, "_stages", None) or [sched._stage]
        self.meter = ActivationMeter(params, stages)
        self.times: list[float] = []
        self.t0 = 0.0

    def step(self, x, y) -> None:
        dist.barrier()
        t0 = time.perf_counter()
        self.opt.zero_grad()
        with self.meter:
            self.sched.step(*((x,) if 0 in self.ids else ()), **({"target": y} if self.S - 1 in self.ids else {}))
        if self.dp_group is not None:
            for p in self.params:
                if p.grad is not None:
                    dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=self.dp_group)
        elapsed = torch.tensor([1e3 * (time.perf_counter() - t0)], dtype=torch.float64)
        self.opt.step()
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        self.times.append(elapsed.item())
        self.t0 = t0


class Mesh:
    """This rank's place in the DP x PP grid (``--dp``; PP innermost: global rank = dp * P + pp)."""

    def __init__(self, world: int, dp: int):  # dp divides world: bench_runtime.py checks it before any group
        self.pp_size, self.dp_size = world // dp, dp
        self.pp_group = self.dp_group = None
        rank = dist.get_rank()
        self.pp_rank, self.dp_rank = rank % self.pp_size, rank // self.pp_size
        if dp > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (dp, self.pp_size), mesh_dim_names=("dp", "pp"))
            self.pp_group, self.dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()


def _torch_run(name: str, mesh: Mesh, args) -> Run:
    from torch.distributed import pipelining as pp

    layout = "one" if name in ONE else PLACEMENT[name]
    ids, mods = _modules(layout, mesh.pp_rank, mesh.pp_size, args)
    S = mesh.pp_size * (1 if layout == "one" else V)
    stages = [pp.PipelineStage(m, s, S, torch.device("cpu"), group=mesh.pp_group) for m, s in zip(mods, ids)]
    cls = getattr(pp, f"Schedule{name}")
    sched = cls(stages[0], args.microbatches, loss_fn=_loss(args)) if layout == "one" else \
        cls(stages, args.microbatches, loss_fn=_loss(args))
    return Run(name, layout, sched, ids, mods, S, mesh.dp_group)


def _pipemorph_run(layout: str, budget: float, mesh: Mesh, args) -> Run:
    from torch.distributed.pipelining import PipelineStage

    from titan_ext.runtime import PipeMorph

    ids, mods = _modules(layout, mesh.pp_rank, mesh.pp_size, args)
    S = mesh.pp_size * (1 if layout == "one" else V)
    stages = [PipelineStage(m, s, S, torch.device("cpu"), group=mesh.pp_group) for m, s in zip(mods, ids)]
    sched = PipeMorph(stages, args.microbatches, loss_fn=_loss(args), memory_budget_bytes=budget)
    return Run(f"PipeMorph-{layout}", layout, sched, ids, mods, S, mesh.dp_group)


def _inputs(step: int, args, dp_rank: int = 0):
    g = torch.Generator().manual_seed(step + 100_003 * dp_rank)  # each DP replica its own batch
    b = args.microbatches * args.mb_size
    if args.compute == "sleep":
        return torch.randn(b, args.dim, generator=g), torch.randn(b, args.dim, generator=g)
    x = torch.randint(0, args.vocab, (b, args.seq), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _pipemorph_report(run: Run, rank: int, warmup: int) -> dict:  # rank: the PP rank
    """What a PipeMorph run deployed and measured, its plan's prediction and this rank's breakdown."""
    from titan_ext.plan import simulate

    sched = run.sched
    dep = sched.deployed
    variant = "full" if dep.backward == "full" else "split"
    profile = sched.estimator.planning_profile(variant)  # what the planner planned with (per-action cost in)
    timeline = simulate(dep.actions, profile, stage_to_rank=dict(enumerate(sched.layout.stage_to_rank)))
    modelled = [e for e in timeline.events if e.rank == rank]
    measured = sched.last_timeline
    end = max((a.end for a in measured), default=run.t0)
    busy = sum(a.end - a.start for a in measured) * 1e3
    wait = sum(a.recv_wait_ms for a in measured)
    span = (end - run.t0) * 1e3
    m_busy = sum(e.end_ms - e.start_ms for e in modelled)
    m_end = max((e.end_ms for e in modelled), default=0.0)
    log = list(sched.decision_log)
    return {
        "plan_versions": sched.plan_version,
        "deploys": [(e["iteration"], e["kind"], e["reason"]) for e in log if e["decision"] == "deploy"],
        "rejects": [(e["iteration"], e["reason"]) for e in log if e["decision"] == "reject"],
        "backward": dep.backward,
        "warmup_counts": list(dep.warmup_counts),
        "x_max": sched.memory.x_max,
        "inflight_cap": sched.memory.adaptive_limit(False),
        "rank_memory_limit": sched.rank_memory_limit,
        "activation_bytes": sched.executor.activation_bytes,
        "profile": profile.to_json(),
        "compute_only_profile": sched.estimator.profile(variant).to_json(),
        "action_cost_ms": sched.estimator.action_cost_ms(),
        "predicted_ms": timeline.makespan_ms,
        "control": check_cost_ms(list(sched.metrics_history)[warmup:]),
        "breakdown": {"rank": rank, "span_ms": span, "compute_ms": busy, "input_wait_ms": wait,
                      "other_ms": span - busy - wait, "modelled_end_ms": m_end, "modelled_compute_ms": m_busy,
                      "modelled_idle_ms": m_end - m_busy, "actions": len(measured)},
    }


def _worker(rank: int, world: int, args) -> dict:
    from titan_ext.runtime import inject_link_delays

    injector = inject_link_delays("")  # link i: PP ranks i and i + 1 of every PP group
    mesh = Mesh(world, getattr(args, "dp", 1))
    rows, runs_out = [], []
    for delay in args.delays:
        injector.update(f"{args.link}:{delay:g}" if delay > 0 else "")
        torch_runs = [_torch_run(name, mesh, args) for name in ONE + TWO
                      if getattr(args, "schedules", None) is None or name in args.schedules]
        # the torch schedules' memory first (their peak is the same every iteration: 2 suffice)
        for k in range(2):
            x, y = _inputs(k, args, mesh.dp_rank)
            for run in torch_runs:
                if k == 1:
                    run.meter.reset_peak()
                run.step(x, y)
        budgets = {run.name: _max_over_ranks(run.meter.peak_bytes) for run in torch_runs}
        pm_runs: dict[tuple[str, float], Run] = {}
        for run in torch_runs:
            for layout in ("one",) + ((PLACEMENT[run.name],) if run.name in TWO else ()):
                key = (layout, budgets[run.name])
                if key not in pm_runs:
                    pm_runs[key] = _pipemorph_run(layout, budgets[run.name], mesh, args)
        everything = torch_runs + list(pm_runs.values())
        for run in everything:
            run.times.clear()
        for k in range(args.warmup + args.steps):
            if k == args.warmup:
                for run in everything:
                    run.meter.reset_peak()
            x, y = _inputs(100 + k, args, mesh.dp_rank)
            for run in everything if k % 2 == 0 else everything[::-1]:
                run.step(x, y)
        for run in everything:
            out = {"delay_ms": delay, "schedule": run.name, "layout": run.layout, "times_ms": list(run.times),
                   "median_ms": statistics.median(run.times[args.warmup:]),
                   "peak_bytes_per_rank": _max_over_ranks(run.meter.peak_bytes)}
            if run.name.startswith("PipeMorph"):
                out["budget_bytes"] = next(b for (lay, b), r in pm_runs.items() if r is run)
                report = _pipemorph_report(run, mesh.pp_rank, args.warmup)
                gathered = [None] * world
                dist.all_gather_object(gathered, (report["breakdown"], report["control"]))
                report["breakdown"] = [b for b, _ in gathered]
                costs = [c["check_cost_ms"] for _, c in gathered if c["check_cost_ms"] is not None]
                cpu = [c["check_cpu_ms"] for _, c in gathered if c["check_cpu_ms"] is not None]
                report["control"] = {**report["control"], "check_cost_ms_per_rank": [c["check_cost_ms"] for _, c in gathered],
                                     "check_cost_ms_min": min(costs, default=None),
                                     "check_cost_ms_max": max(costs, default=None),
                                     "check_cpu_ms_per_rank": [c["check_cpu_ms"] for _, c in gathered],
                                     "check_cpu_ms_median": statistics.median(cpu) if cpu else None}
                out.update(report)
            runs_out.append(out)
        for run in torch_runs:
            rows.append({"delay_ms": delay, "schedule": run.name, "layout": run.layout,
                         "budget_bytes": budgets[run.name]})
        del torch_runs, pm_runs, everything
    injector.update("")
    return {"runs": runs_out, "rows": rows}


def _optimal_ms(pm: dict, args, key: str = "profile") -> tuple[float | None, str]:
    """The CP-SAT optimum for the profile PipeMorph measured (``key``: "profile", the measured times with
    the executor's per-action cost, as PipeMorph plans; "compute_only_profile", without it), at the
    in-flight limit of its budget."""
    from titan_ext.plan import PipelineProfile
    from titan_ext.plan.schedules import plan_by_name

    if pm["layout"] != "one":
        return None, "CP-SAT models one stage per rank only"
    profile = PipelineProfile.from_json(pm[key])
    K = pm["inflight_cap"] if pm["inflight_cap"] is not None else pm["x_max"]  # per stage once measured
    try:
        res = plan_by_name(profile, "optimal", memory_limit=K, time_limit_s=args.optimal_s)
    except ImportError as exc:
        return None, f"no solver ({exc})"
    status = (res.info or {}).get("solver_status", "?")
    return res.predicted_makespan_ms, f"{status}, K={K}"


def run(args) -> dict:
    """Run the mode, print the frontier, return the report part (``bench_runtime.py`` writes the JSON)."""
    t0 = time.time()
    res = run_ranks(_worker, args.world, args, backend="gloo")
    runs = res[0]["runs"]
    rows = []
    for row in res[0]["rows"]:
        delay, name = row["delay_ms"], row["schedule"]
        mine = next(r for r in runs if r["delay_ms"] == delay and r["schedule"] == name)
        budget = row["budget_bytes"]
        pms = [r for r in runs if r["delay_ms"] == delay and r["schedule"].startswith("PipeMorph")
               and r["budget_bytes"] == budget and (r["layout"] == "one" or r["layout"] == row["layout"])]
        fits = [r for r in pms if r["peak_bytes_per_rank"] <= budget * FIT_SLACK]
        best = min(fits or pms, key=lambda r: r["median_ms"])
        one = next(r for r in pms if r["layout"] == "one")
        optimal, note = _optimal_ms(one, args)
        compute_only, _ = _optimal_ms(one, args, "compute_only_profile")
        rows.append({
            "schedule": name, "delay_ms": delay, "peak_bytes_per_rank": mine["peak_bytes_per_rank"],
            "median_ms": mine["median_ms"], "pipemorph_ms_at_same_memory": best["median_ms"],
            "pipemorph_layout": best["layout"], "pipemorph_peak_bytes_per_rank": best["peak_bytes_per_rank"],
            "pipemorph_fits": bool(fits), "speedup": mine["median_ms"] / best["median_ms"],
            "optimal_ms": optimal, "optimal_note": note, "optimal_compute_only_ms": compute_only,
            "optimal_gap": (one["median_ms"] / optimal - 1) if optimal else None,
            "predicted_ms": best["predicted_ms"], "plan_versions": best["plan_versions"],
            "pipemorph_one_stage_ms": one["median_ms"], "pipemorph_one_stage_predicted_ms": one["predicted_ms"],
        })
    mode = ("sleep-compute (emulated device: F=%g I=%g W=%g ms sleeps per rank)" % (args.f_ms, args.i_ms, args.w_ms)
            if args.compute == "sleep" else
            "real-model (transformer dim=%d, %d layers per rank, seq=%d, %d seq/microbatch, CPU)"
            % (args.model_dim, args.layers, args.seq, args.mb_size))
    grid = f"{args.world} gloo ranks" + (f" (DP {args.dp} x PP {args.world // args.dp})" if args.dp > 1 else "")
    print(f"\n== mode: frontier, {mode}; {grid}, N={args.microbatches}, delay on PP rank link "
          f"{args.link}; median of {args.steps} iterations after {args.warmup} warm-up [{time.time() - t0:.0f} s]")
    print(f"{'delay':>5} | {'schedule':>21} | {'peak KiB/rank':>13} | {'torch ms':>8} | {'PipeMorph ms':>12} | "
          f"{'layout':>6} | {'its KiB':>8} | {'speed-up':>8} | {'predicted':>9} | {'optimal':>8} | "
          f"{'1-stage vs opt':>14} | versions")
    for r in rows:
        opt = f"{r['optimal_ms']:8.1f}" if r["optimal_ms"] else f"{'-':>8}"
        gap = f"{100 * r['optimal_gap']:+13.1f}%" if r["optimal_gap"] is not None else f"{'-':>14}"
        print(f"{r['delay_ms']:>5g} | {r['schedule']:>21} | {r['peak_bytes_per_rank'] / 1024:>13.1f} | "
              f"{r['median_ms']:>8.1f} | {r['pipemorph_ms_at_same_memory']:>12.1f} | {r['pipemorph_layout']:>6} | "
              f"{r['pipemorph_peak_bytes_per_rank'] / 1024:>8.1f}{'' if r['pipemorph_fits'] else '!'} | "
              f"{r['speedup']:>7.2f}x | {r['predicted_ms']:>9.1f} | {opt} | {gap} | {r['plan_versions']}")
    print("   speed-up: torch / PipeMorph at the torch schedule's measured memory ('!': PipeMorph's own peak "
          "exceeded it); 1-stage vs opt: PipeMorph one stage per rank against the CP-SAT optimum")
    for r in runs:
        if not r["schedule"].startswith("PipeMorph"):
            continue
        off = r["median_ms"] / r["predicted_ms"] - 1
        print(f"   {r['schedule']} @ {r['delay_ms']:g} ms, budget {r['budget_bytes'] / 1024:.1f} KiB: "
              f"{r['median_ms']:.1f} ms vs predicted {r['predicted_ms']:.1f} ({100 * off:+.1f}%), x {r['warmup_counts']}, "
              f"backward {r['backward']}, versions {r['plan_versions']} at {[i for i, _, _ in r['deploys']]}, "
              f"cap {r['inflight_cap'] if r['layout'] == 'one' else r['rank_memory_limit']}, control plane "
              + (f"{r['control']['check_cost_ms_min']:.2f} ms a check (fewest over ranks: the last to arrive waits "
                 f"for none; most {r['control']['check_cost_ms_max']:.2f} ms; its CPU {r['control']['check_cpu_ms_median']:.2f} "
                 f"ms, the median over ranks; {r['control']['checks']} checks in "
                 f"{r['control']['iterations']} iterations)" if r["control"]["check_cost_ms_min"] is not None
                 else "no check in the measured iterations"))
        if abs(off) > 0.10:
            for b in r["breakdown"]:
                print(f"      rank {b['rank']}: measured span {b['span_ms']:.1f} = compute {b['compute_ms']:.1f} + "
                      f"input waits {b['input_wait_ms']:.1f} + other {b['other_ms']:.1f} ({b['actions']} actions) | "
                      f"modelled end {b['modelled_end_ms']:.1f} = compute {b['modelled_compute_ms']:.1f} + idle "
                      f"{b['modelled_idle_ms']:.1f}")
    if args.plot:
        plot(rows, args.plot, mode)
        print(f"wrote {args.plot}")
    return {"rows": rows, "runs": runs, "compute": args.compute}


def plot(rows: list[dict], path: str, title: str) -> None:
    """Time vs measured memory, one panel per delay: each torch schedule a point at its own memory,
    PipeMorph a line through the same memories (the frontier)."""
    from titan_ext.plan.export import pyplot

    plt = pyplot()  # matplotlib is optional: the plot extra

    delays = sorted({r["delay_ms"] for r in rows})
    fig, axes = plt.subplots(1, len(delays), figsize=(6 * len(delays), 4.5), squeeze=False)
    for ax, delay in zip(axes[0], delays):
        mine = sorted((r for r in rows if r["delay_ms"] == delay), key=lambda r: r["peak_bytes_per_rank"])
        for r in mine:
            ax.scatter(r["peak_bytes_per_rank"] / 1024, r["median_ms"], label=f"torch {r['schedule']}")
        ax.plot([r["peak_bytes_per_rank"] / 1024 for r in mine], [r["pipemorph_ms_at_same_memory"] for r in mine],
                "k-o", label="PipeMorph at the same memory")
        ax.set_title(f"+{delay:g} ms on one link")
        ax.set_xlabel("measured peak saved activations per rank (KiB)")
        ax.set_ylabel("iteration (ms, median)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
