"""PipeMorph over real NCCL, one process per GPU, on a machine with two GPUs or more
(scripts/check_gpu.sh's ``multi`` step).

    python scripts/gpu_tier_multi.py --json gpu_tier_multi.json [--gpus N] [--steps 6] [--action-ms 50]

One process per GPU (``torch.multiprocessing`` spawn), rank = local rank = GPU index; each calls
``torch.cuda.set_device(local_rank)`` before anything else and joins the default group on NCCL with
``device_id`` (eager communicator creation), the PP group.  PipeMorph (``profile_every=2``, and a
``timeout_s`` as every TorchTitan job has: the PP watch thread that polls ``Work.is_completed()``)
trains an MLP in float64 whose every action runs a ``--action-ms`` spin kernel (scripts/gpu_tier.py's
:class:`~gpu_tier.TimedStage`), so the device is behind the host.  Checked:

* **one CUDA context per GPU**: after the steady steps, while every rank still holds its context,
  ``nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader`` must list each
  rank's pid on exactly one GPU, its own (``torch.cuda.get_device_properties(i).uuid``): a rank with
  a context on another GPU — GPU 0, where a side thread that never selected its device lands — fails
  (:func:`check_contexts`).  Each rank also asks the CUDA driver which devices hold a primary
  context in its own process (``cuDevicePrimaryCtxGetState``: no PID namespace involved), which
  decides when nvidia-smi lists none of the ranks' pids (a container) and must agree otherwise;
* **host syncs per steady step** on the training thread (``host_syncs.counting()``), held to the budget
  of scripts/gpu_tier.py (:data:`gpu_tier.EXCHANGE_BUDGET` with a profile exchange, none without),
  the host ahead of the device at each boundary without an exchange, the GPU idle fraction from events;
* losses and parameters against the same model trained on the CPU in one process (rtol 1e-9).

With fewer than 2 GPUs (or no CUDA, or no NCCL) it prints why, writes ``{"skipped": true, "reason": ...}``
and exits 0: NCCL refuses two ranks on one device, and scripts/gpu_tier.py covers one GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as Fn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import gpu_tier as tier  # noqa: E402
from titan_ext.testing import free_port, mlp_stages, seeded_batch, static_stage_shapes  # noqa: E402

SMI_APPS = ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader"]
SMI_GPUS = ["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"]


# --------------------------------------------------------------------------------------------------
# pure parts (tested on CPU with sample outputs)
# --------------------------------------------------------------------------------------------------
def skip_reason(cuda_available: bool, gpus: int, nccl_available: bool) -> str | None:
    """Why this machine cannot run the multi-GPU tier (None: it can)."""
    if not cuda_available:
        return "no CUDA GPU (torch.cuda.is_available() is False)"
    if gpus < 2:
        return (f"{gpus} GPU: PipeMorph over real NCCL needs one process per GPU and at least 2 GPUs "
                f"(NCCL refuses two ranks on one device; scripts/gpu_tier.py covers one GPU)")
    if not nccl_available:
        return "this torch has no NCCL (torch.distributed.is_nccl_available() is False)"
    return None


def norm_uuid(text: str) -> str:
    """A GPU UUID as nvidia-smi (``GPU-xxxxxxxx-...``) or torch (``xxxxxxxx-...``) writes it → bare, lower case."""
    u = str(text).strip().lower()
    return u[4:] if u.startswith("gpu-") else u


def parse_compute_apps(text: str) -> list[tuple[int, str]]:
    """``(pid, uuid)`` per line of ``nvidia-smi --query-compute-apps=pid,gpu_uuid,... --format=csv,noheader``
    (other lines — "No running processes found", blanks, warnings — are skipped)."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[0].isdigit() and parts[1]:
            out.append((int(parts[0]), norm_uuid(parts[1])))
    return out


def check_contexts(smi_text: str, expected: dict[int, str], labels: dict[int, str] | None = None,
                   none_expected: Sequence[int] = ()) -> dict:
    """Each pid of ``expected`` (pid → its GPU's UUID) must hold a context on its GPU and on no other;
    the pids of ``none_expected`` (the launcher) none at all.  Returns ``{"ok", "problems", "contexts"}``;
    ``ok`` is None (inconclusive) when nvidia-smi lists none of the expected pids (another PID namespace)."""
    labels = labels or {}
    seen: dict[int, set[str]] = {}
    for pid, uuid in parse_compute_apps(smi_text):
        seen.setdefault(pid, set()).add(uuid)
    want = {pid: norm_uuid(u) for pid, u in expected.items()}
    contexts = {str(pid): sorted(seen.get(pid, ())) for pid in (*want, *none_expected)}
    if not any(pid in seen for pid in want):
        return {"ok": None, "contexts": contexts,
                "problems": ["nvidia-smi lists none of the ranks' pids (another PID namespace, e.g. a container?)"]}
    problems = []
    for pid, uuid in want.items():
        who = f"{labels.get(pid, 'pid')} (pid {pid})"
        got = seen.get(pid, set())
        if uuid not in got:
            problems.append(f"{who}: no context on its own GPU-{uuid}")
        extra = sorted(got - {uuid})
        if extra:
            problems.append(f"{who}: a context on {', '.join('GPU-' + u for u in extra)} besides its own GPU-{uuid}")
    for pid in none_expected:
        if seen.get(pid):
            problems.append(f"launcher (pid {pid}): a context on {', '.join('GPU-' + u for u in sorted(seen[pid]))}")
    return {"ok": not problems, "problems": problems, "contexts": contexts}


def driver_check(primary: Sequence[Sequence[int] | None], own: Sequence[int]) -> dict:
    """Each rank's devices with a primary context in its own process (``cuDevicePrimaryCtxGetState``)
    must be exactly its own.  ``ok`` None when the driver could not be asked on some rank."""
    if any(p is None for p in primary):
        return {"ok": None, "problems": ["the CUDA driver API (libcuda) could not be asked on every rank"]}
    problems = [f"rank {r}: primary contexts on devices {list(p)}, expected only [{d}]"
                for r, (p, d) in enumerate(zip(primary, own)) if sorted(p) != [d]]
    return {"ok": not problems, "problems": problems}


def verdict(smi: dict | None, drv: dict) -> dict:
    """One context per GPU: every conclusive check must pass, and at least one must be conclusive."""
    decided = [name for name, c in (("nvidia-smi", smi), ("cuDevicePrimaryCtxGetState", drv))
               if c is not None and c["ok"] is not None]
    problems = [p for c in (smi, drv) if c is not None and c["ok"] is False for p in c["problems"]]
    if not decided:
        problems = [p for c in (smi, drv) if c is not None for p in c["problems"]] or ["no check could run"]
        problems.insert(0, "neither nvidia-smi nor the CUDA driver could tell where each rank's contexts are")
    return {"ok": bool(decided) and not problems, "decided_by": decided, "problems": problems}


def cpu_reference(world: int, steps: int, microbatches: int, mb_rows: int, dim: int, lr: float = 0.05) -> list[list[torch.Tensor]]:
    """The same MLP trained on the CPU in one process: per step, the mean over microbatches of each
    microbatch's MSE loss (what the pipeline's ``scale_grads`` computes), SGD.  Parameters by stage."""
    mods = mlp_stages(world, dim)
    model = nn.Sequential(*mods)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for k in range(steps):
        x, y = seeded_batch(700 + k, microbatches * mb_rows, dim)
        opt.zero_grad()
        loss = sum(Fn.mse_loss(model(xm), ym) for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches)))
        (loss / microbatches).backward()
        opt.step()
    return [[p.detach().clone() for p in m.parameters()] for m in mods]


# --------------------------------------------------------------------------------------------------
# device facts of one rank
# --------------------------------------------------------------------------------------------------
def primary_contexts() -> list[int] | None:
    """The device ordinals with an active primary context in this process (CUDA driver API; None if
    libcuda cannot be asked).  Asking creates none."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    n = ctypes.c_int()
    if cu.cuInit(0) != 0 or cu.cuDeviceGetCount(ctypes.byref(n)) != 0:
        return None
    active = []
    for i in range(n.value):
        dev, flags, on = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        if cu.cuDeviceGet(ctypes.byref(dev), i) != 0 or cu.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(on)) != 0:
            return None
        if on.value:
            active.append(i)
    return active


def _smi(cmd: list[str]) -> tuple[str | None, str | None]:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{' '.join(cmd[:2])}: {e}"
    if proc.returncode != 0:
        return None, f"{' '.join(cmd[:2])}: exit {proc.returncode}: {proc.stderr.strip()[-300:]}"
    return proc.stdout, None


def contexts_now(everyone: Sequence[dict], launcher_pid: int) -> dict:
    """Where the ranks (``{"rank", "pid", "device", "uuid", "primary_contexts"}`` each) hold contexts now:
    nvidia-smi's view and the driver's, and the verdict."""
    apps, err = _smi(SMI_APPS)
    gpus, _ = _smi(SMI_GPUS)
    smi = None if apps is None else check_contexts(
        apps, {e["pid"]: e["uuid"] for e in everyone}, {e["pid"]: f"rank {e['rank']}" for e in everyone},
        none_expected=[launcher_pid])
    if smi is not None:
        smi["raw"] = apps.strip().splitlines()
    drv = driver_check([e["primary_contexts"] for e in everyone], [e["device"] for e in everyone])
    return {"ranks": list(everyone), "nvidia_smi": smi, "nvidia_smi_error": err, "driver": drv,
            "gpus": (gpus or "").strip().splitlines(), **verdict(smi, drv)}


# --------------------------------------------------------------------------------------------------
# one rank
# --------------------------------------------------------------------------------------------------
def _train(rank: int, world: int, device: torch.device, control: Any, args) -> dict:
    from torch.distributed.pipelining import PipelineStage

    from titan_ext.runtime import PipeMorph
    from titan_ext.testing import host_syncs

    cuda = device.type == "cuda"  # cpu: tests/runtime/test_runtime_gpu_tier_multi.py runs this on gloo
    cycles_per_ms = tier.calibrate_spin(device) if cuda else 0.0  # this rank's own GPU: nobody else runs on it
    log = tier.ActionLog(cuda, int(args.action_ms * cycles_per_ms), spin_ms=args.action_ms)
    mod = mlp_stages(world, args.dim)[rank].to(device)
    example = torch.zeros(args.mb_rows, args.dim, dtype=torch.float64, device=device)
    stage = PipelineStage(tier.TimedStage(mod, log), rank, world, device, **static_stage_shapes(example))
    sched = PipeMorph(stage, args.microbatches, loss_fn=Fn.mse_loss, profile_every=args.profile_every,
                      timeout_s=args.pp_timeout_s)
    params = list(mod.parameters())
    opt = torch.optim.SGD(params, lr=0.05)
    batches = [tuple(t.to(device) for t in seeded_batch(700 + k, args.microbatches * args.mb_rows, args.dim))
               for k in range(args.steps)]
    steady: list[dict] = []
    losses_dev = []
    for k in range(args.steps):
        x, y = batches[k]
        losses: list = []
        kw = {"target": y, "losses": losses} if rank == world - 1 else {}
        if k == args.warmup:
            if cuda:
                torch.cuda.synchronize()
            dist.barrier(group=control)
            t0 = time.perf_counter()
        log.step = k
        if k >= args.warmup:
            with host_syncs.counting() as counter:
                opt.zero_grad()
                sched.step(x, **kw) if rank == 0 else sched.step(**kw)
                opt.step()
            done = log.last_done()
            by_kind: dict[str, int] = {}
            for (what, _site), n in counter.by_site.items():
                by_kind[what] = by_kind.get(what, 0) + n
            steady.append({"step": k, "exchange": tier.exchanged(sched), "syncs": counter.total, "by_kind": by_kind,
                           "sites": {f"{what}@{site}": n for (what, site), n in counter.by_site.items()},
                           "host_ahead": None if done is None else not done})
        else:
            opt.zero_grad()
            sched.step(x, **kw) if rank == 0 else sched.step(**kw)
            opt.step()
        losses_dev.append(torch.stack([v.detach() for v in losses]) if losses else None)
    if cuda:
        torch.cuda.synchronize()
    step_ms = 1e3 * (time.perf_counter() - t0) / (args.steps - args.warmup)
    spans = [(k, s, e) for k, s, e in log.intervals_ms() if k >= args.warmup]
    gaps = tier.boundary_gaps(spans)
    ref = cpu_reference(world, args.steps, args.microbatches, args.mb_rows, args.dim)[rank]
    got = [p.detach().cpu() for p in params]
    out = {"rank": rank, "step_ms": step_ms, "steady_steps": steady,
           "idle_fraction": tier.idle_fraction([(s, e) for _, s, e in spans]),
           "boundary_gap_ms_max": max(gaps) if gaps else None,
           "action_ms_median": statistics.median([e - s for _, s, e in spans]) if spans else None,
           "cycles_per_ms": round(cycles_per_ms),
           "losses": [t.cpu().tolist() if t is not None else [] for t in losses_dev],
           "params_equal_cpu": all(torch.allclose(a, b, rtol=1e-9, atol=1e-12) for a, b in zip(got, ref)),
           "params_max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(got, ref)),
           "budget_violations": tier.budget_violations(steady)}
    out.update(tier.plan_readout(sched, [stage]))
    if getattr(sched, "delegation", None) is not None:
        sched.delegation.close()
    return out


def _rank(local_rank: int, world: int, port: int, outdir: str, args) -> None:
    torch.cuda.set_device(local_rank)  # before anything touches CUDA: every later call defaults to this GPU
    device = torch.device("cuda", local_rank)
    path = os.path.join(outdir, f"rank{local_rank}.json")
    try:
        dist.init_process_group("nccl", rank=local_rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
                                device_id=device)
        control = dist.new_group(backend="gloo")  # host data: pids, barriers
        out = _train(local_rank, world, device, control, args)
        mine = {"rank": local_rank, "pid": os.getpid(), "device": local_rank,
                "uuid": norm_uuid(str(torch.cuda.get_device_properties(local_rank).uuid)),
                "primary_contexts": primary_contexts()}
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine, group=control)
        if local_rank == 0:  # every rank still holds its context: it waits at the barrier below
            out["contexts"] = contexts_now(everyone, args.launcher_pid)
        dist.barrier(group=control)
        result = {"status": "ok", **out}
    except BaseException:  # noqa: BLE001 - reported to the launcher
        result = {"status": "error", "rank": local_rank, "error": traceback.format_exc()[-4000:]}
    with open(path + ".tmp", "w") as fh:
        json.dump(result, fh)
    os.replace(path + ".tmp", path)
    if result["status"] == "ok":
        dist.destroy_process_group()
    os._exit(0 if result["status"] == "ok" else 1)


def _launch(world: int, args) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_rank, args=(world, free_port(), outdir, args), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + args.timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not finish in {args.timeout_s:g} s")
        except Exception as e:  # noqa: BLE001 - a failed or hung rank: the others are ended, results read
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            print(f"[gpu_tier_multi] {type(e).__name__}: {e}", flush=True)
        results = []
        for r in range(world):
            path = os.path.join(outdir, f"rank{r}.json")
            results.append(json.load(open(path)) if os.path.exists(path) else
                           {"status": "error", "rank": r, "error": "no result (killed, or ended by a failed peer)"})
        return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=0, help="ranks (one per GPU); 0: every visible GPU")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--mb-rows", type=int, default=64)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--action-ms", type=float, default=50.0)
    ap.add_argument("--profile-every", type=int, default=2)
    ap.add_argument("--pp-timeout-s", type=float, default=300.0,
                    help="PipeMorph's timeout_s, as a TorchTitan job sets it (starts the PP watch thread)")
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--json", default="gpu_tier_multi.json")
    args = ap.parse_args()
    if args.steps <= args.warmup:
        sys.exit("scripts/gpu_tier_multi.py: --steps must exceed --warmup")
    args.launcher_pid = os.getpid()
    available = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if available else 0
    summary: dict = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
                     "date": time.strftime("%Y-%m-%d"), "gpus": gpus, "args": vars(args)}
    reason = skip_reason(available, gpus, dist.is_available() and dist.is_nccl_available())
    if reason is not None:
        print(f"scripts/gpu_tier_multi.py: skipped: {reason}")
        summary.update(skipped=True, reason=reason, failures=[])
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=1)
        sys.exit(0)
    world = min(gpus, args.gpus) if args.gpus > 0 else gpus
    started = time.time()
    results = _launch(world, args)
    summary.update(skipped=False, world=world, backend="nccl", ranks=results, seconds=round(time.time() - started, 1))
    failures = [f"rank {r['rank']}: {r['error'].strip().splitlines()[-1] if r.get('error') else '?'}"
                for r in results if r.get("status") != "ok"]
    ok = [r for r in results if r.get("status") == "ok"]
    if len(ok) == world:
        contexts = results[0].get("contexts") or {}
        summary["contexts"] = contexts
        if not contexts.get("ok"):
            failures += [f"one context per GPU: {p}" for p in contexts.get("problems", ["not checked"])]
        for r in ok:
            failures += [f"rank {r['rank']} host syncs: {v}" for v in r["budget_violations"]]
            if not r["params_equal_cpu"]:
                failures.append(f"rank {r['rank']}: parameters differ from the CPU reference "
                                f"(max abs diff {r['params_max_abs_diff']:.3g})")
            if (r.get("action_ms_median") or 0.0) < tier.ACTION_MS_FLOOR * args.action_ms:
                failures.append(f"rank {r['rank']}: actions of {r.get('action_ms_median')} ms (the device is not behind)")
        ahead = [st["host_ahead"] for r in ok for st in r["steady_steps"] if not st["exchange"]]
        summary["host_ahead_at_boundaries"] = f"{sum(ahead)}/{len(ahead)}"
        if ahead and not all(ahead):
            failures.append(f"host behind the device at {len(ahead) - sum(ahead)} of {len(ahead)} steady boundaries "
                            f"without an exchange")
        idle = "/".join("%.2f" % r["idle_fraction"] for r in ok)
        syncs = "/".join(str(max((s["syncs"] for s in r["steady_steps"]), default=0)) for r in ok)
        print(f"[gpu_tier_multi] {world} GPUs over NCCL: step {max(r['step_ms'] for r in ok):.1f} ms, idle {idle}, "
              f"host ahead {summary['host_ahead_at_boundaries']}, syncs/step max {syncs}, one context per GPU: "
              f"{contexts.get('ok')} ({', '.join(contexts.get('decided_by', [])) or '-'})")
    tier.finish(summary, failures, args.json)


if __name__ == "__main__":
    main()
