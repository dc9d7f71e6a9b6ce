"""``titan-ext`` command line: plan and simulate pipeline schedules without any process group.

    titan-ext plan --stages 4 --microbatches 12 --times 10,10,10 --delay 0:20 --json
    titan-ext simulate --builtin ZBVZeroBubble --stages 4 --microbatches 12 --times 10,10,10 --hol

Bad arguments print one line on stderr and exit with code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Sequence

from .plan import LinkProfile, PipelineProfile, simulate
from .plan.schedules import CROSSPIPE_SCHEDULES
from .plan.pipemorph import SCHEDULES, plan_pipemorph
from .plan.warmup import slackness


class UsageError(Exception):
    """Bad command-line input: reported in one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not argparse's usage block
        raise UsageError(f"{self.prog}: {message}")


def _times(text: str) -> tuple[float, float, float]:
    parts = text.split(",")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"--times wants F,B,W in ms (e.g. 10,10,10), got {text!r}")
    try:
        return tuple(float(p) for p in parts)  # type: ignore[return-value]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--times wants three numbers F,B,W, got {text!r}") from None


def _link_value(text: str) -> tuple[int, float]:
    link, sep, value = text.partition(":")
    try:
        if not sep:
            raise ValueError
        out = int(link), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LINK:VALUE (e.g. 2:30), got {text!r}") from None
    if out[0] < 0 or not math.isfinite(out[1]) or out[1] < 0:
        raise argparse.ArgumentTypeError(f"expected a link >= 0 and a finite value >= 0, got {text!r}")
    return out


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stages", type=int, help="pipeline stages (= PP ranks)")
    p.add_argument("--microbatches", type=int, help="microbatches per iteration")
    p.add_argument("--times", type=_times, help="per-stage F,B,W times in ms (B = backward-input)")
    p.add_argument("--profile", type=Path, help="profile JSON (fields of PipelineProfile); flags override it")
    p.add_argument("--delay", type=_link_value, action="append", default=[], metavar="LINK:MS",
                   help="one-way latency of link LINK (joins stage LINK and LINK+1), repeatable")
    p.add_argument("--bandwidth", type=_link_value, action="append", default=[], metavar="LINK:GBPS",
                   help="bandwidth of link LINK in GB/s (1e9 bytes/s); needs --message-mb")
    p.add_argument("--message-mb", type=float, default=None,
                   help="size of one activation/gradient message in MB (1e6 bytes)")
    p.add_argument("--json", action="store_true", help="end with one JSON object on the last line")


def _profile_from_args(args: argparse.Namespace) -> PipelineProfile:
    base: dict = {}
    if args.profile is not None:
        try:
            base = json.loads(args.profile.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise UsageError(f"--profile {args.profile}: {e}") from None
        if not isinstance(base, dict):
            raise UsageError(f"--profile {args.profile}: expected a JSON object")
    S = args.stages if args.stages is not None else base.get("num_stages")
    N = args.microbatches if args.microbatches is not None else base.get("num_microbatches")
    if S is None or N is None:
        raise UsageError("--stages and --microbatches are required (or a --profile that has them)")
    if args.times is not None:
        f, b, w = args.times
    elif "f_ms" in base:
        f, b, w = base["f_ms"], base.get("b_ms"), base.get("w_ms")
    else:
        raise UsageError("--times F,B,W is required (or a --profile with f_ms, b_ms, w_ms)")
    try:
        links = [LinkProfile(**link) for link in base["links"]] if base.get("links") else [LinkProfile()] * (S - 1)
    except (TypeError, ValueError) as e:
        raise UsageError(f"--profile links: {e}") from None
    for link, _ in args.delay + args.bandwidth:
        if not 0 <= link < S - 1:
            raise UsageError(f"link {link} does not exist: links are 0..{S - 2} for {S} stages")
    if args.bandwidth and args.message_mb is None:
        raise UsageError("--bandwidth needs --message-mb (the size of one message)")
    from dataclasses import replace

    for link, ms in args.delay:
        links[link] = replace(links[link], latency_ms=ms)
    for link, gbps in args.bandwidth:
        if gbps <= 0:
            raise UsageError(f"--bandwidth {link}:{gbps}: bandwidth must be > 0")
        links[link] = replace(links[link], bandwidth_bytes_per_s=gbps * 1e9)
    if args.message_mb is not None:
        links = [replace(link, message_bytes=args.message_mb * 1e6) for link in links]
    try:
        return PipelineProfile(
            S, N, f, b, w, tuple(links),
            activation_bytes=base.get("activation_bytes"),
            memory_budget_bytes=base.get("memory_budget_bytes"),
        )
    except ValueError as e:
        raise UsageError(str(e)) from None


def _report(timeline, extra: dict, args: argparse.Namespace) -> None:
    print(f"makespan    {timeline.makespan_ms:.3f} ms")
    print(f"bubble rate {timeline.bubble_rate:.2%}")
    for key, value in extra.items():
        if key not in ("makespan_ms", "bubble_rate"):
            print(f"{key:<11} {value}")
    print(f"peak in-flight activations per stage: {list(timeline.peak_inflight.values())}")
    if args.json:
        print(json.dumps({**timeline.to_dict(), **extra}))


def cmd_plan(args: argparse.Namespace) -> None:
    profile = _profile_from_args(args)
    if args.virtual_stages is None and args.placement is not None:
        raise UsageError("--placement needs --virtual-stages V (stages per rank, >= 2)")
    if args.virtual_stages is not None:
        return _cmd_plan_virtual(profile, args)
    if args.memory_limit is not None and args.memory_limit < 1:
        raise UsageError("--memory-limit must be >= 1 activation")
    if args.slack_floor < 1:
        raise UsageError("--slack-floor must be >= 1")
    if args.backward != "split" and args.schedule in CROSSPIPE_SCHEDULES:
        raise UsageError(f"--backward {args.backward}: CrossPipe plans split backwards only")
    if args.schedule in CROSSPIPE_SCHEDULES:
        return _cmd_plan_crosspipe(profile, args)
    plan = plan_pipemorph(
        profile, schedule=args.schedule, slack_floor=args.slack_floor, memory_limit=args.memory_limit,
        backward=args.backward,
    )
    timeline = simulate(plan.actions, profile)  # always under the given delays
    if args.out_csv:
        from .plan.export import write_torch_csv

        write_torch_csv(plan.actions, args.out_csv)
    _write_views(timeline, args)
    _report(
        timeline,
        {
            "schedule": args.schedule,
            "backward": args.backward,
            "warmup_counts": plan.warmup_counts,
            "slackness": plan.slackness,
            "plan_ms": round(plan.plan_ms, 3),
        },
        args,
    )


def _cmd_plan_virtual(profile: PipelineProfile, args: argparse.Namespace) -> None:
    """R ranks × V stages per rank (issue 14, docs/multistage.md): --stages is R, --times are per rank and
    split evenly over its V stages, --delay LINK:MS slows rank link LINK (ranks LINK and LINK+1)."""
    from .plan.virtual import VIRTUAL_SCHEDULES, plan_virtual, rank_peak_inflight

    if args.virtual_stages < 2:
        raise UsageError("--virtual-stages must be >= 2 (one stage per rank: leave it out)")
    if args.schedule not in VIRTUAL_SCHEDULES:
        choices = ", ".join(VIRTUAL_SCHEDULES)
        raise UsageError(f"--schedule {args.schedule}: with --virtual-stages choose one of {choices}")
    if args.backward != "split":
        raise UsageError("--backward full: multi-stage plans split backwards only")
    if args.memory_limit is not None and args.memory_limit < 1:
        raise UsageError("--memory-limit must be >= 1 activation")
    placement = args.placement or "loop"
    try:
        plan = plan_virtual(profile, args.virtual_stages, placement, schedule=args.schedule,
                            memory_limit=args.memory_limit)
    except ValueError as e:
        raise UsageError(f"{args.schedule} ({placement}, {args.virtual_stages} stages per rank): {e}") from None
    timeline = simulate(plan.actions, plan.profile, stage_to_rank=dict(enumerate(plan.stage_to_rank)))
    if args.out_csv:
        from .plan.export import write_torch_csv

        write_torch_csv(plan.actions, args.out_csv)
    _write_views(timeline, args)
    _report(
        timeline,
        {"schedule": args.schedule, "placement": placement, "virtual_stages": args.virtual_stages,
         "stage_to_rank": list(plan.stage_to_rank), "source": plan.source, "warmup_counts": plan.warmup_counts,
         "candidates": plan.candidates, "peak_inflight_per_rank": list(rank_peak_inflight(plan.ops).values()),
         "plan_ms": round(plan.plan_ms, 3)},
        args,
    )


def _crosspipe_actions(profile: PipelineProfile, args: argparse.Namespace):
    """CrossPipe greedy / CP-SAT plan (issue 6) → (actions, profile to simulate with, info)."""
    from .plan.schedules import plan_crosspipe_by_name

    if args.time_limit <= 0:
        raise UsageError("--time-limit must be > 0")
    if getattr(args, "memory_limit", None) is not None and args.memory_limit < 1:
        raise UsageError("--memory-limit must be >= 1 activation")
    try:
        actions, sim_profile, _, info = plan_crosspipe_by_name(
            profile, args.schedule, memory_limit=getattr(args, "memory_limit", None), time_limit_s=args.time_limit
        )
    except (ImportError, ValueError) as e:
        raise UsageError(f"{args.schedule}: {e}") from None
    return actions, sim_profile, info


def _cmd_plan_crosspipe(profile: PipelineProfile, args: argparse.Namespace) -> None:
    actions, sim_profile, info = _crosspipe_actions(profile, args)
    timeline = simulate(actions, sim_profile)  # always under the given delays
    if args.out_csv:
        from .plan.export import write_torch_csv

        write_torch_csv(actions, args.out_csv)
    _write_views(timeline, args)
    from .plan.ir import as_ops

    x = _warmup_of(as_ops(actions))
    _report(timeline, {"schedule": args.schedule, "warmup_counts": x, "slackness": slackness(x), **info}, args)


def cmd_simulate(args: argparse.Namespace) -> None:
    profile = _profile_from_args(args)
    t0 = time.perf_counter()
    if args.schedule is not None:
        actions, profile, _ = _crosspipe_actions(profile, args)
        source = args.schedule
    elif args.csv is not None:
        from .plan.export import read_torch_csv

        try:
            actions = read_torch_csv(args.csv)
        except (OSError, ValueError) as e:
            raise UsageError(f"--csv {args.csv}: {e}") from None
        source = str(args.csv)
    else:
        from .plan.builtin import builtin_plan

        try:
            actions, _ = builtin_plan(args.builtin, profile.num_stages, profile.num_microbatches)
        except ValueError as e:
            raise UsageError(str(e)) from None
        source = args.builtin
    from .plan.ir import as_ops
    from .plan.validate import PlanValidationError, validate_plan

    ops = as_ops(actions)
    num_stages = len({s for rank_ops in ops.values() for s, _, _ in rank_ops})
    try:
        validate_plan(ops, num_stages, profile.num_microbatches)
        timeline = simulate(ops, profile, hol=args.hol)
    except (PlanValidationError, ValueError) as e:
        raise UsageError(f"{source}: {e}") from None
    plan_ms = (time.perf_counter() - t0) * 1e3
    x = _warmup_of(ops)
    _write_views(timeline, args)
    _report(
        timeline,
        {"schedule": source, "hol": args.hol, "warmup_counts": x, "slackness": slackness(x),
         "plan_ms": round(plan_ms, 3)},
        args,
    )


def _warmup_of(ops) -> list[int]:
    """Forwards each rank runs before its first backward (x_i of the plan as written)."""
    out = []
    for rank in sorted(ops):
        n = 0
        for _, kind, _ in ops[rank]:
            if kind != "F":
                break
            n += 1
        out.append(n)
    return out


def _write_views(timeline, args: argparse.Namespace) -> None:
    from .plan.export import write_chrome_trace, write_gantt_png

    if getattr(args, "trace", None):
        write_chrome_trace(timeline, args.trace)
    if getattr(args, "gantt", None):
        write_gantt_png(timeline, args.gantt)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="titan-ext", description="Plan and simulate straggler-resilient PP schedules.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("plan", help="plan a schedule (PipeMorph Alg.1/2 + Alg.3/4) and simulate it",
                       description="Plan a schedule and print its simulated makespan under the given delays.")
    _add_common(p)
    p.add_argument("--schedule", choices=SCHEDULES + CROSSPIPE_SCHEDULES, default="pipemorph",
                   help="pipemorph: Alg.1 without delays, Alg.2 with them; zb: the ZeroBubble plan of "
                        "PipeMorph Fig.4 (x_i = 2(S-i)-1) planned as if no link were slow; zb-h1: x_i = S-i; "
                        "crosspipe-ud|udsub|wave: CrossPipe greedy (docs/crosspipe.md; wave cuts every stage "
                        "into two half chunks, V-shape); optimal: CP-SAT optimum (needs titan-ext[solver])")
    p.add_argument("--time-limit", type=float, default=60.0, metavar="SEC", help="solver time limit (optimal)")
    p.add_argument("--virtual-stages", type=int, default=None, metavar="V",
                   help="stages per rank (>= 2): --stages is then the number of ranks R, --times are per rank "
                        "(each of its V stages takes 1/V), --delay LINK:MS slows rank link LINK; "
                        "--schedule pipemorph|crosspipe-wave (docs/multistage.md)")
    p.add_argument("--placement", choices=("loop", "v"), default=None,
                   help="with --virtual-stages: loop (rank r holds r, r+R, ...: Interleaved) or "
                        "v (rank r holds r and 2R-1-r: ZBV / DualPipeV); default loop")
    p.add_argument("--memory-limit", type=int, default=None, metavar="K",
                   help="max in-flight activations per stage (Alg.1's x_max; caps Alg.2)")
    p.add_argument("--slack-floor", type=int, default=2, metavar="D",
                   help="Alg.2's lower bound on every slackness (paper: 2; 1 saves memory)")
    p.add_argument("--backward", choices=("split", "full"), default="split",
                   help="split: I and W actions (W fills bubbles); full: one full backward B per microbatch "
                        "(1F1B-style) with the same warm-up planning")
    p.add_argument("--out-csv", type=Path, help="write the plan as a torch compute-only CSV")
    p.add_argument("--trace", type=Path, help="write a Chrome/Perfetto trace JSON of the simulated timeline")
    p.add_argument("--gantt", type=Path, help="write a Gantt PNG of the simulated timeline")
    p.set_defaults(func=cmd_plan)

    s = sub.add_parser("simulate", help="simulate a plan from a torch CSV or one of torch's built-in schedules",
                       description="Simulate a compute-only plan under per-link delays.")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--csv", type=Path, help="compute-only torch schedule CSV (one row per rank)")
    src.add_argument("--builtin", help="torch schedule: 1F1B, GPipe, Interleaved1F1B, InterleavedZeroBubble, "
                                       "ZBVZeroBubble, DualPipeV")
    src.add_argument("--schedule", choices=CROSSPIPE_SCHEDULES,
                     help="plan a CrossPipe schedule (or the CP-SAT optimum) for these delays, then simulate it")
    _add_common(s)
    s.add_argument("--hol", action="store_true", help="head-of-line blocking: sends block the compute behind them")
    s.add_argument("--memory-limit", type=int, default=None, metavar="K",
                   help="with --schedule: max in-flight activations per stage")
    s.add_argument("--time-limit", type=float, default=60.0, metavar="SEC", help="with --schedule optimal: solver time limit")
    s.add_argument("--trace", type=Path, help="write a Chrome/Perfetto trace JSON")
    s.add_argument("--gantt", type=Path, help="write a Gantt PNG")
    s.set_defaults(func=cmd_simulate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        args.func(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
