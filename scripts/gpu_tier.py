"""The runtime on CUDA stages, on a machine with one GPU (scripts/check_gpu.sh's ``runtime`` step).

    python scripts/gpu_tier.py --json gpu_tier.json [--worlds 2,4] [--steps 6]

For 2 and 4 ranks sharing the one GPU, each schedule — torch's Schedule1F1B and ScheduleZBVZeroBubble,
our PipeMorph and CrossPipe, and PipeMorph with every message through the delegates
(``PipeMorph(delegation="always")``) — trains an MLP in float64 on CUDA stages, with no delay and
with +60 ms on one link (link ``world - 2``; delegated PipeMorph without delay only, see ``_batches``), and reports against independent references:

* **losses and parameters** equal (rtol 1e-9) to the same schedule run on the CPU in the same process;
* **peak CUDA memory** of the last step above what was allocated before it
  (``torch.cuda.max_memory_allocated``) against the planner's prediction for our schedules: the deployed
  plan's peak in-flight activations per stage × the executor's measured bytes per microbatch;
* **device time**: the forward time the runtime books for stage 0 (CUDA events through the device layer)
  against the same module's forward timed alone with two CUDA events (median of 7);
* **host syncs** per steady-state iteration (``titan_ext.runtime.host_syncs``, by call site; the
  staging transport's own blocking copies excluded);
* iteration times (median of the steady steps, ms) and their ratio to torch's 1F1B at the same delay.

Messages: torch's and our non-delegated schedules go through :class:`~titan_ext.runtime.shared_gpu.HostStagedP2P`
(NCCL refuses two ranks on one GPU; gloo sends host memory), delegated PipeMorph through the delegates'
pinned slots with async D2H/H2D copies. The delay is injected by ``inject_link_delays`` on the staged path.
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
import torch.nn.functional as Fn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from titan_ext.testing import mlp_stages, run_ranks, seeded_batch, static_stage_shapes  # noqa: E402

SCHEDULES = ("1F1B", "ZBV", "PipeMorph", "CrossPipe", "PipeMorph-delegated")
DELAY_MS = 60.0


def _stages_of(kind: str, rank: int, world: int) -> list[int]:
    return [rank, 2 * world - 1 - rank] if kind == "ZBV" else [rank]


def _build(kind: str, rank: int, world: int, device: torch.device, args) -> tuple:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleZBVZeroBubble

    from titan_ext.runtime import CrossPipe, PipeMorph

    n_stages = 2 * world if kind == "ZBV" else world
    mods = mlp_stages(n_stages, args.dim)
    mb = args.mb_rows
    example = torch.zeros(mb, args.dim, dtype=torch.float64, device=device)
    own = [mods[s].to(device) for s in _stages_of(kind, rank, world)]
    stages = [PipelineStage(m, s, n_stages, device, **static_stage_shapes(example))
              for m, s in zip(own, _stages_of(kind, rank, world))]
    n, loss = args.microbatches, Fn.mse_loss
    if kind == "1F1B":
        sched = Schedule1F1B(stages[0], n, loss_fn=loss)
    elif kind == "ZBV":
        sched = ScheduleZBVZeroBubble(stages, n, loss_fn=loss)
    elif kind == "PipeMorph":
        sched = PipeMorph(stages, n, loss_fn=loss)
    elif kind == "CrossPipe":
        sched = CrossPipe(stages, n, loss_fn=loss)
    else:
        sched = PipeMorph(stages[0], n, loss_fn=loss, delegation="always")
    return own, stages, sched


def _step(sched, kind: str, rank: int, world: int, x, y, losses: list) -> None:
    first = rank == 0
    last = (rank == 0) if kind == "ZBV" else (rank == world - 1)
    kw = {}
    if last:
        kw.update(target=y, losses=losses)
    sched.step(x, **kw) if first else sched.step(**kw)


def _forward_ref_ms(mod, x) -> float:
    """The module's forward on one microbatch, timed alone with two CUDA events (median of 7)."""
    times = []
    with torch.no_grad():
        for _ in range(8):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            mod(x)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
    return statistics.median(times[1:])


def _run(kind: str, rank: int, world: int, device: torch.device, delay: float, args) -> dict:
    import torch.distributed as dist

    from titan_ext.plan.ir import as_ops
    from titan_ext.plan.result import peak_inflight
    from titan_ext.runtime.memory import RELEASE
    from titan_ext.runtime import inject_link_delays
    from titan_ext.runtime.shared_gpu import HostStagedP2P

    from titan_ext.runtime import host_syncs
    cuda = device.type == "cuda"
    staged = HostStagedP2P().install()  # CUDA tensors staged; on CPU it only matches torch 2.11's self-sends
    link = world - 2
    injector = inject_link_delays(f"{link}:{delay}" if delay > 0 else "") if args.delays else None
    own, stages, sched = _build(kind, rank, world, device, args)
    params = [p for m in own for p in m.parameters()]
    initial = [p.detach().cpu().clone() for p in params]
    opt = torch.optim.SGD(params, lr=0.05)
    out: dict = {"losses": [], "times_ms": []}
    syncs: list = []
    try:
        for k in range(args.steps):
            x, y = (t.to(device) for t in seeded_batch(700 + k, args.microbatches * args.mb_rows, args.dim))
            losses: list = []
            opt.zero_grad()
            if cuda and k == args.steps - 1:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            dist.barrier()
            t0 = time.perf_counter()
            if k >= args.warmup:
                with host_syncs.counting() as counter:
                    _step(sched, kind, rank, world, x, y, losses)
                # the staging transport's own copies (shared_gpu.py) are this test's, not the runtime's
                sites = {f"{kind_}@{site}": n for (kind_, site), n in counter.by_site.items()
                         if "shared_gpu.py" not in site}
                syncs.append((sum(sites.values()), sites))
            else:
                _step(sched, kind, rank, world, x, y, losses)
            if cuda:
                torch.cuda.synchronize()
            elapsed = torch.tensor([1e3 * (time.perf_counter() - t0)], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            opt.step()
            out["times_ms"].append(elapsed.item())
            out["losses"].append([float(v.detach()) for v in losses])
        out["params"] = [p.detach().cpu() for p in params]
        # training reached this rank: every parameter tensor moved (a static-shape stage whose received
        # activations need no gradient leaves the earlier stages' gradients zero, equal on CPU and GPU)
        out["params_moved"] = all(not torch.equal(a, b) for a, b in zip(out["params"], initial))
        out["median_ms"] = statistics.median(out["times_ms"][args.warmup:])
        if syncs:
            worst = max(syncs, key=lambda t: t[0])
            out["host_syncs_per_step_max"], out["host_sync_sites"] = worst
        if cuda:
            out["peak_bytes"] = torch.cuda.max_memory_allocated(device) - before
        if hasattr(sched, "deployed"):  # on any device: the CPU smoke run checks this part too
            act = getattr(sched.executor, "activation_bytes", 0) or 0
            inflight = peak_inflight(as_ops(sched.deployed.actions), RELEASE)
            mine = [s.stage_index for s in stages]
            out["predicted_activation_bytes"] = sum(inflight.get(s, 0) for s in mine) * act
            out["plan_version"] = sched.plan_version
            prof = getattr(sched, "last_profile", None)
            f_ms = [1e3 * (a.end - a.start) for a in (prof.actions if prof else [])
                    if a.kind == "F" and a.stage == mine[0] and a.end == a.end]
            if f_ms:
                out["booked_forward_ms"] = statistics.median(f_ms)
                if cuda and rank == 0:
                    xs = seeded_batch(1, args.mb_rows, args.dim)[0].to(device)
                    out["event_forward_ms"] = _forward_ref_ms(own[0], xs)
    finally:
        if getattr(sched, "delegation", None) is not None:  # an adaptive schedule's transport
            sched.delegation.close()
        if injector is not None:
            injector.remove()
        staged.remove()
    return out


def _worker(rank: int, world: int, args, kinds: list[str], delays: list[float]) -> list[dict]:
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # every rank shares the one GPU
    if args.stack_dump_s > 0:  # a hang shows where every thread of every rank is
        import faulthandler

        faulthandler.dump_traceback_later(args.stack_dump_s, exit=True)
    cells = []
    for kind in kinds:
        # the CPU reference: the same schedule (delegated PipeMorph's is PipeMorph: one delegate pool per
        # process, see main())
        ref = _run("PipeMorph" if kind == "PipeMorph-delegated" else kind, rank, world, torch.device("cpu"), 0.0, args)
        # and torch's Schedule1F1B on CPU, the independent reference for our schedules (same model split)
        torch_ref = None if kind in ("1F1B", "ZBV") else _run("1F1B", rank, world, torch.device("cpu"), 0.0, args)
        for delay in delays:
            try:
                got = _run(kind, rank, world, device, delay, args)
            except Exception as e:  # noqa: BLE001 - one schedule's failure is reported, the others run
                import traceback

                cells.append({"schedule": kind, "delay_ms": delay, "error": f"{type(e).__name__}: {e}",
                              "traceback": traceback.format_exc()[-2000:]})
                continue
            flat, ref_flat = sum(got.pop("losses"), []), sum(ref["losses"], [])
            params = got.pop("params")
            cell = {"schedule": kind, "delay_ms": delay, **got,
                    "losses_equal_cpu": len(flat) == len(ref_flat) and all(
                        abs(a - b) <= 1e-9 * max(1.0, abs(b)) for a, b in zip(flat, ref_flat)),
                    "params_equal_cpu": all(torch.allclose(a, b, rtol=1e-9, atol=1e-12)
                                            for a, b in zip(params, ref["params"])),
                    "params_equal_torch_1f1b": torch_ref is None or all(
                        torch.allclose(a, b, rtol=1e-9, atol=1e-12) for a, b in zip(ref["params"], torch_ref["params"])),
                    "params_max_abs_diff": max((float((a - b).abs().max()) for a, b in zip(params, ref["params"])),
                                               default=0.0)}
            cells.append(cell)
    return cells


def _batches(kinds: list[str], delays: bool = True) -> list[tuple[list[str], list[float]]]:
    """run_ranks calls: one per schedule (several schedules' objects in one process have been seen to
    end it after its last step), delegated PipeMorph without delay only (a delegate pool whose send
    delegate delayed messages ended its process after the run: both noted in docs/runtime.md "GPU
    correctness", not yet explained)."""
    return [([k], [0.0] if k == "PipeMorph-delegated" or not delays else [0.0, DELAY_MS]) for k in kinds]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    ap.add_argument("--schedules", type=lambda s: s.split(","), default=list(SCHEDULES))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--mb-rows", type=int, default=64)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--json", default="gpu_tier.json")
    ap.add_argument("--no-delays", dest="delays", action="store_false",
                    help="no link-delay injection at all (not even its +0 ms wrapper)")
    ap.add_argument("--stack-dump-s", type=float, default=0.0,
                    help="> 0: each rank prints every thread's stack and exits after this many seconds")
    ap.add_argument("--device", default="cuda:0", help="cpu: a smoke run of this script without a GPU")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("scripts/gpu_tier.py: no CUDA GPU")
    summary: dict = {"torch": torch.__version__, "cuda": torch.version.cuda,
                     "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "none (cpu)", "python": platform.python_version(),
                     "date": time.strftime("%Y-%m-%d"), "args": vars(args), "cells": []}
    failures = []
    for world in args.worlds:
        t0 = time.time()
        per_rank = [[] for _ in range(world)]
        for kinds, delays in _batches(args.schedules, args.delays):
            print(f"[gpu_tier] world {world}: {', '.join(kinds)} at +{delays} ms ({time.time() - t0:.0f} s)",
                  flush=True)
            for r, cells in enumerate(run_ranks(_worker, world, args, kinds, delays, backend="gloo", timeout_s=400)):
                per_rank[r] += cells
        for cells in zip(*per_rank):
            c0 = dict(cells[0])
            c0["world"] = world
            c0["losses_equal_cpu"] = all(c.get("losses_equal_cpu", False) for c in cells)
            c0["params_equal_cpu"] = all(c.get("params_equal_cpu", False) for c in cells)
            c0["params_moved"] = all(c.get("params_moved", False) for c in cells)
            c0["params_equal_torch_1f1b"] = all(c.get("params_equal_torch_1f1b", False) for c in cells)
            c0["params_max_abs_diff"] = max((c.get("params_max_abs_diff", math.nan) for c in cells), default=math.nan)
            c0["peak_bytes_per_rank"] = [c.get("peak_bytes") for c in cells]
            c0["predicted_activation_bytes_per_rank"] = [c.get("predicted_activation_bytes") for c in cells]
            c0["host_syncs_per_step_max_per_rank"] = [c.get("host_syncs_per_step_max") for c in cells]
            c0["host_sync_sites_per_rank"] = [c.get("host_sync_sites") for c in cells]
            c0.pop("host_sync_sites", None)
            c0.pop("host_syncs_per_step_max", None)
            c0.pop("peak_bytes", None)
            c0.pop("predicted_activation_bytes", None)
            errors = [c["error"] for c in cells if "error" in c]
            checks = {"differs from CPU": c0["losses_equal_cpu"] and c0["params_equal_cpu"],
                      "a rank's parameters did not move": c0["params_moved"],
                      "its CPU run differs from torch's 1F1B": c0["params_equal_torch_1f1b"]}
            if errors or not all(checks.values()):
                why = errors[0] if errors else "; ".join(k for k, ok in checks.items() if not ok)
                failures.append(f"world {world} {c0['schedule']} +{c0['delay_ms']:g} ms: {why}")
            summary["cells"].append(c0)
        summary.setdefault("seconds_per_world", {})[world] = round(time.time() - t0, 1)
    base = {(c["world"], c["delay_ms"]): c.get("median_ms") for c in summary["cells"] if c["schedule"] == "1F1B"}
    print(f"{'world':>5} {'schedule':>20} {'delay':>6} {'median ms':>10} {'vs 1F1B':>8} {'=CPU':>5} "
          f"{'peak MB/rank':>22} {'pred act MB/rank':>22} {'F ms booked/event':>18} {'syncs':>9}")
    for c in summary["cells"]:
        b = base.get((c["world"], c["delay_ms"]))
        med = c.get("median_ms")
        c["ratio_to_1f1b"] = round(b / med, 3) if med and b else None
        mb = lambda v: "/".join("-" if x is None else f"{x / 2**20:.1f}" for x in v)  # noqa: E731
        fm = (f"{c['booked_forward_ms']:.3f}/{c['event_forward_ms']:.3f}"
              if "booked_forward_ms" in c and "event_forward_ms" in c else "-")
        print(f"{c['world']:>5} {c['schedule']:>20} {c['delay_ms']:>6g} "
              f"{med if med is not None else math.nan:>10.1f} {c['ratio_to_1f1b'] or math.nan:>8.2f} "
              f"{'yes' if c['losses_equal_cpu'] and c['params_equal_cpu'] else 'NO':>5} "
              f"{mb(c['peak_bytes_per_rank']):>22} {mb(c['predicted_activation_bytes_per_rank']):>22} {fm:>18} "
              f"{'/'.join(str(v) for v in c['host_syncs_per_step_max_per_rank']):>9}")
        if "error" in c:
            print("   error:", c["error"])
    summary["failures"] = failures
    with open(args.json, "w") as fh:
        json.dump(summary, fh, indent=1)
    print(f"JSON: {args.json}; failures: {failures or 'none'}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
