"""``titan-ext`` command line: plan and simulate pipeline schedules without any process group.

    titan-ext plan --stages 4 --microbatches 12 --times 10,10,10 --delay 0:20 --json
    titan-ext simulate --builtin ZBVZeroBubble --stages 4 --microbatches 12 --times 10,10,10 --hol

Bad arguments, and files that cannot be written, print one line on stderr and exit with code 2
(files already written by that command are removed: no partial output). A closed pipe (``| head``)
ends the command quietly.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Sequence

from .plan import LinkProfile, PipelineProfile, PlanResult, simulate
from .plan.result import rank_peak_inflight, warmup_counts_of
from .plan.schedules import AUTO_SCHEDULES, CROSSPIPE_SCHEDULES, plan_by_name
from .plan.virtual import VIRTUAL_SCHEDULES
from .plan.warmup import slackness


class UsageError(Exception):
    """Bad command-line input: reported in one line, exit code 2."""


# Bounds on the input, so that a typo is refused at once instead of planning for minutes or
# overflowing: S·N ops plan in about 3 s at the bound (S=64, N=512 takes 1.4 s, BENCHMARKS.md).
MAX_OPS = 65536  # stages x microbatches
MAX_MS = 1e9     # any time or delay, ms (11.6 days)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" for options that have a real default (not None / off / empty)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)  # defaults in --help
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # one line, not argparse's usage block
        raise UsageError(f"{self.prog}: {message}")


def _times(text: str) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """``F,B,W`` (every stage) or ``F,B,W/F,B,W/...`` (one triple per stage) → (f, b, w) tuples."""
    triples = []
    for item in text.split("/"):
        parts = item.split(",")
        try:
            triple = tuple(float(p) for p in parts)
        except ValueError:
            triple = ()
        if len(triple) != 3 or not all(abs(t) <= MAX_MS for t in triple):  # the profile checks signs
            raise argparse.ArgumentTypeError(
                f"--times wants F,B,W in ms, each at most {MAX_MS:g} (e.g. 10,10,10), or one triple "
                f"per stage separated by '/' (e.g. 10,10,10/12,12,12), got {item!r}")
        triples.append(triple)
    return tuple(zip(*triples))  # type: ignore[return-value]


def _link_value(text: str) -> tuple[int, float]:
    link, sep, value = text.partition(":")
    try:
        if not sep:
            raise ValueError
        out = int(link), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LINK:VALUE (e.g. 2:30), got {text!r}") from None
    if out[0] < 0 or not 0 <= out[1] <= MAX_MS:
        raise argparse.ArgumentTypeError(f"expected a link >= 0 and a value in [0, {MAX_MS:g}], got {text!r}")
    return out


def _megabytes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1e9:  # also NaN
        raise argparse.ArgumentTypeError(f"expected a size in MB in [0, 1e9], got {text!r}")
    return value


def _memory_limit(text: str) -> float:
    """--memory-limit K: activations of one rank's whole model part (a number >= 1; issue 21)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 activation, got {text!r}")
    return value


def _rank_limit(args: argparse.Namespace, stages_per_rank: int) -> float | None:
    """--memory-limit as a per-rank limit for ranks holding ``stages_per_rank`` stages: K·V must be whole
    (a chunk counts 1/V); with one stage per rank K is a whole number of activations."""
    K = getattr(args, "memory_limit", None)
    if K is not None and abs(K * stages_per_rank - round(K * stages_per_rank)) > 1e-9:
        if stages_per_rank == 1:
            raise UsageError(f"--memory-limit {K:g}: with one stage per rank it must be a whole number of activations")
        raise UsageError(f"--memory-limit {K:g}: with {stages_per_rank} stages per rank it must be a multiple of "
                         f"1/{stages_per_rank} (a chunk counts 1/{stages_per_rank} of a rank's activation)")
    return K


def _profile_int(base: dict, key: str, flag: str) -> int | None:
    value = base.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise UsageError(f"--profile field {key} must be an integer, got {value!r} (or give {flag})")
    return value


def _per_link(pairs: list[tuple[int, float]], flag: str) -> None:
    links = [link for link, _ in pairs]
    dup = sorted({link for link in links if links.count(link) > 1})
    if dup:
        raise UsageError(f"{flag} given more than once for link {dup[0]}")


PROFILE_FIELDS = ("num_stages", "num_microbatches", "f_ms", "b_ms", "w_ms", "links",
                  "activation_bytes", "memory_budget_bytes")
PROFILE_HELP = (
    'profile JSON with the fields of PipelineProfile; flags override it. Times in ms, a number for '
    'every stage or a list with one per stage; links: one object per link (link i joins stage i and '
    'i+1) with latency_ms, bandwidth_bytes_per_s, message_bytes. Example: {"num_stages": 4, '
    '"num_microbatches": 12, "f_ms": 10, "b_ms": 10, "w_ms": [10, 10, 10, 12], "links": '
    '[{"latency_ms": 0}, {"latency_ms": 20, "bandwidth_bytes_per_s": 1e9, "message_bytes": 4e6}, '
    '{}]}. Optional: activation_bytes, memory_budget_bytes')


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stages", type=int, help="pipeline stages (= PP ranks)")
    p.add_argument("--microbatches", type=int, help="microbatches per iteration")
    p.add_argument("--times", type=_times, metavar="F,B,W[/F,B,W...]",
                   help="compute times in ms (B = backward-input): one F,B,W for every stage, or one "
                        "triple per stage separated by '/' (e.g. 10,10,10/12,12,12/10,10,10/14,14,14)")
    p.add_argument("--profile", type=Path, help=PROFILE_HELP.replace("%", "%%"))
    p.add_argument("--delay", type=_link_value, action="append", default=[], metavar="LINK:MS",
                   help="one-way latency of link LINK (joins stage LINK and LINK+1), repeatable")
    p.add_argument("--bandwidth", type=_link_value, action="append", default=[], metavar="LINK:GBPS",
                   help="bandwidth of link LINK in GB/s (1e9 bytes/s); needs --message-mb")
    p.add_argument("--message-mb", type=_megabytes, default=None,
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
        unknown = sorted(set(base) - set(PROFILE_FIELDS))
        if unknown:
            raise UsageError(f"--profile {args.profile}: unknown field(s) {', '.join(unknown)} "
                             f"(known: {', '.join(PROFILE_FIELDS)})")
    S = args.stages if args.stages is not None else _profile_int(base, "num_stages", "--stages")
    N = args.microbatches if args.microbatches is not None else _profile_int(
        base, "num_microbatches", "--microbatches")
    if S is None or N is None:
        raise UsageError("--stages and --microbatches are required (or a --profile that has them)")
    if S < 1 or N < 1:
        raise UsageError(f"stages ({S}) and microbatches ({N}) must be >= 1")
    if S * N > MAX_OPS:
        raise UsageError(f"{S} stages x {N} microbatches = {S * N} is beyond the bound of {MAX_OPS} "
                         f"(planning time grows fast with it)")
    _per_link(args.delay, "--delay")
    _per_link(args.bandwidth, "--bandwidth")
    if args.times is not None:
        f, b, w = (t[0] if len(t) == 1 else t for t in args.times)
        if len(args.times[0]) not in (1, S):
            raise UsageError(f"--times has {len(args.times[0])} F,B,W triples for {S} stages "
                             f"(give one for all stages or one per stage)")
    elif any(k in base for k in ("f_ms", "b_ms", "w_ms")):
        missing = [k for k in ("f_ms", "b_ms", "w_ms") if k not in base]
        if missing:
            raise UsageError(f"--profile {args.profile}: missing field(s) {', '.join(missing)}")
        f, b, w = base["f_ms"], base["b_ms"], base["w_ms"]
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
    except (TypeError, ValueError) as e:  # a mistyped profile field: the profile names it
        raise UsageError(str(e)) from None


def _report(timeline, extra: dict, args: argparse.Namespace) -> None:
    print(f"makespan    {timeline.makespan_ms:.3f} ms")
    print(f"bubble rate {timeline.bubble_rate:.2%}")
    for key, value in extra.items():
        if key not in ("makespan_ms", "bubble_rate", "notes", "peak_inflight"):
            print(f"{key:<11} {value}")
    print(f"peak in-flight activations per stage: {list(timeline.peak_inflight.values())}")
    print(f"peak memory per rank (activations of the rank's model part): "
          f"{[round(v, 3) for v in timeline.peak_memory_per_rank.values()]}")
    if args.json:
        print(json.dumps({**timeline.to_dict(), **extra}))


def cmd_plan(args: argparse.Namespace) -> None:
    """One planning path for every schedule (plan.schedules.plan_by_name), simulated under the given delays."""
    profile = _profile_from_args(args)
    result = _plan(profile, args)
    for note in result.notes:
        print(f"note: {note}")
    timeline = _simulate_result(result)
    _write_outputs(result.actions, timeline, args)
    extra = {**result.summary(), "backward": args.backward,
             "validated_by": "ours+torch" if args.strict and args.schedule in AUTO_SCHEDULES else "ours"}
    if result.stages_per_rank > 1 and args.virtual_stages is not None:
        extra.update(placement=result.placement, virtual_stages=result.stages_per_rank,
                     peak_inflight_per_rank=list(rank_peak_inflight(result.ops).values()))
    extra.update(memory_limit=args.memory_limit, stage_memory_limit=args.stage_memory_limit,
                 inflight_limit=result.inflight_limit)
    _report(timeline, extra, args)


def _plan(profile: PipelineProfile, args: argparse.Namespace) -> PlanResult:
    """``plan_by_name`` for the command line's flags (the library checks the values: ValueError → usage)."""
    if args.virtual_stages is None and args.placement is not None:
        raise UsageError("--placement needs --virtual-stages V (stages per rank, >= 2)")
    if args.virtual_stages is not None and args.virtual_stages < 2:
        raise UsageError("--virtual-stages must be >= 2 (one stage per rank: leave it out)")
    if args.virtual_stages is not None and args.schedule not in VIRTUAL_SCHEDULES:
        raise UsageError(f"--schedule {args.schedule}: with --virtual-stages choose one of "
                         f"{', '.join(VIRTUAL_SCHEDULES)}")
    if getattr(args, "time_limit", 1.0) <= 0:
        raise UsageError("--time-limit must be > 0")
    options = {}
    if args.schedule in AUTO_SCHEDULES:
        if args.slack_floor < 1:
            raise UsageError("--slack-floor must be >= 1")
        options = {"slack_floor": args.slack_floor, "validate": "torch" if args.strict else True}
    if args.virtual_stages is not None:
        options["placement"] = args.placement or "loop"
    try:
        return plan_by_name(profile, args.schedule, virtual_stages=args.virtual_stages or 1,
                            memory_limit=_rank_limit(args, args.virtual_stages or 1),
                            stage_memory_limit=getattr(args, "stage_memory_limit", None), time_limit_s=args.time_limit,
                            backward=args.backward, **options)
    except (ImportError, ValueError) as e:
        where = args.schedule
        if args.virtual_stages is not None:
            where += f" ({args.placement or 'loop'}, {args.virtual_stages} stages per rank)"
        raise UsageError(f"{where}: {_flag_names(e)}") from None


def _flag_names(e: Exception) -> str:
    """The library's message with its argument names spelled as the command line's flags."""
    text = str(e)
    for name, flag in (("stage_memory_limit", "--stage-memory-limit"), (" memory_limit", " --memory-limit"),
                       ("backward ", "--backward "),
                       ("slack_floor", "--slack-floor")):
        text = text.replace(name, flag)
    return text


def _simulate_result(result: PlanResult, hol: bool = False):
    """The reference simulator's timeline of a plan under the (stage-level) profile it was planned for."""
    return simulate(result.actions, result.profile, hol=hol, stage_to_rank=dict(enumerate(result.stage_to_rank)))


def cmd_simulate(args: argparse.Namespace) -> None:
    if args.schedule is None and args.memory_limit is not None:
        raise UsageError("--memory-limit applies to --schedule only (a --csv or --builtin plan is "
                         "simulated as it is)")
    profile = _profile_from_args(args)
    t0 = time.perf_counter()
    if args.schedule is not None:
        args.virtual_stages = args.placement = None
        args.backward, args.strict = "split", False
        result = _plan(profile, args)
        actions, profile, source = result.actions, result.profile, args.schedule
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
    ops, timeline = _evaluate(actions, profile, args.hol, source)
    plan_ms = (time.perf_counter() - t0) * 1e3
    x = warmup_counts_of(ops)
    _write_outputs(None, timeline, args)
    _report(
        timeline,
        {"schedule": source, "hol": args.hol, "warmup_counts": x, "slackness": slackness(x),
         "plan_ms": round(plan_ms, 3)},
        args,
    )


def _evaluate(actions, profile: PipelineProfile, hol: bool, source: str):
    """Validate a plan from outside our planners and simulate it → (ops, timeline)."""
    from .plan.ir import as_ops
    from .plan.validate import PlanValidationError, validate_plan

    ops = as_ops(actions)
    num_stages = len({s for rank_ops in ops.values() for s, _, _ in rank_ops})
    try:
        validate_plan(ops, num_stages, profile.num_microbatches)
        return ops, simulate(ops, profile, hol=hol)
    except (PlanValidationError, ValueError) as e:
        raise UsageError(f"{source}: {e}") from None


def _compare_candidates(profile: PipelineProfile, hol: bool):
    """(name, timeline or the reason it does not apply) for PipeMorph, CrossPipe, torch's built-ins and
    ZB-H1 (the ZB paper's 1F1B-memory schedule, x_i = S − i; torch ships none)."""
    from .plan.builtin import BUILTINS, builtin_plan

    yield "PipeMorph", _simulate_result(plan_by_name(profile, "pipemorph"), hol)
    for name in ("crosspipe-udsub", "crosspipe-wave"):
        try:
            yield f"CrossPipe ({name[10:]})", _simulate_result(plan_by_name(profile, name), hol)
        except (ImportError, ValueError) as e:
            yield f"CrossPipe ({name[10:]})", str(e).splitlines()[0]
    yield "ZB-H1 (ZB paper)", simulate(plan_by_name(profile, "zb-h1").actions, profile, hol=hol)
    for name in BUILTINS:
        try:
            actions, _ = builtin_plan(name, profile.num_stages, profile.num_microbatches)
            yield f"torch {name}", _evaluate(actions, profile, hol, name)[1]
        except (UsageError, ValueError) as e:
            yield f"torch {name}", str(e).splitlines()[0]


# the schedules our plans are matched against (issue 21): name → placement of ours (None: one stage per rank)
_REPLACES = {"ZB-H1 (ZB paper)": None, "torch 1F1B": None, "torch Interleaved1F1B": "loop",
             "torch InterleavedZeroBubble": "loop", "torch ZBVZeroBubble": "v", "torch DualPipeV": "v"}


def _ours_at(profile: PipelineProfile, placement: str | None, peak_per_rank: float, hol: bool) -> float | str:
    """Makespan of our plan at a per-rank memory limit (the peak of the schedule it would replace):
    one stage per rank (PipeMorph, the limit rounded down to whole activations) or R × 2 stages in
    ``placement`` (the plan_virtual portfolio)."""
    from .plan.virtual import plan_virtual

    try:
        if placement is None:
            plan = plan_by_name(profile, "pipemorph", memory_limit=max(1, math.floor(peak_per_rank + 1e-9)))
            return simulate(plan.actions, profile, hol=hol).makespan_ms
        vp = plan_virtual(profile, 2, placement, memory_limit=peak_per_rank, validate=False)
        return simulate(vp.actions, vp.profile, hol=hol).makespan_ms
    except ValueError as e:
        return "n/a: " + str(e).splitlines()[0]


def _ms(value: float | str | None) -> str:
    return "" if value is None else value if isinstance(value, str) else f"{value:.1f}"


def cmd_compare(args: argparse.Namespace) -> None:
    """PipeMorph, CrossPipe and torch's built-ins side by side for one profile, each torch schedule (and
    ZB-H1) also beside our plans at its own peak per-rank memory (docs/choosing.md)."""
    profile = _profile_from_args(args)
    rows = list(_compare_candidates(profile, args.hol))
    torch_best = min((t.makespan_ms for name, t in rows if name.startswith("torch ")
                      and not isinstance(t, str)), default=math.nan)
    print(f"{'schedule':<28} {'makespan ms':>12} {'bubble':>8} {'peak/stage':>10} {'peak/rank':>9} "
          f"{'vs best torch':>14} {'ours at its memory':>19} {'ours 1 stage/rank':>18}")
    out = []
    for name, t in rows:
        if isinstance(t, str):
            print(f"{name:<28} {'n/a: ' + t}")
            out.append({"schedule": name, "error": t})
            continue
        peak = max(t.peak_inflight.values())
        rank_peak = max(t.peak_memory_per_rank.values())
        row = {"schedule": name, "makespan_ms": t.makespan_ms, "bubble_rate": t.bubble_rate,
               "peak_inflight": peak, "peak_memory_per_rank": rank_peak}
        matched = one_stage = None
        if name in _REPLACES:
            one_stage = _ours_at(profile, None, rank_peak, args.hol)
            placement = _REPLACES[name]
            matched = one_stage if placement is None else _ours_at(profile, placement, rank_peak, args.hol)
            row["memory_matched"] = {"memory_limit": rank_peak, "placement": placement or "one stage per rank",
                                     "ours_ms": matched, "ours_one_stage_ms": one_stage}
        print(f"{name:<28} {t.makespan_ms:>12.1f} {t.bubble_rate:>8.1%} {peak:>10} {rank_peak:>9.3g} "
              f"{torch_best / t.makespan_ms:>13.2f}x {_ms(matched):>19} {_ms(one_stage):>18}")
        out.append(row)
    print("peak/stage: activations the busiest stage holds (2-chunk schedules: half-size chunks); peak/rank: "
          "the busiest rank's, in activations of its whole model part (a chunk counts 1/2); vs best torch: "
          "the best torch built-in's makespan / this one's; ours at its memory: our plan in the same placement "
          "(2 stages per rank for torch's 2-chunk schedules) limited to this row's peak/rank; ours 1 stage/rank: "
          "our one-stage-per-rank plan at that memory (rounded down to whole activations)")
    if args.json:
        print(json.dumps({"hol": args.hol, "schedules": out}))


_GANTT_FORMATS = (".png", ".pdf", ".svg")


def _write_outputs(actions, timeline, args: argparse.Namespace) -> None:
    """--out-csv, --trace, --gantt: all or nothing (a failed write removes the files written before)."""
    from .plan.export import write_chrome_trace, write_gantt_png, write_torch_csv

    gantt = getattr(args, "gantt", None)
    if gantt is not None and gantt.suffix.lower() not in _GANTT_FORMATS:
        raise UsageError(f"--gantt {gantt}: unsupported extension {gantt.suffix!r} "
                         f"(use {', '.join(_GANTT_FORMATS)})")
    jobs = [(flag, path, write) for flag, path, write in (
        ("--out-csv", getattr(args, "out_csv", None), lambda p: write_torch_csv(actions, p)),
        ("--trace", getattr(args, "trace", None), lambda p: write_chrome_trace(timeline, p)),
        ("--gantt", gantt, lambda p: write_gantt_png(timeline, p)),
    ) if path is not None]
    written: list[Path] = []
    for flag, path, write in jobs:
        try:
            write(path)
            written.append(path)
        except OSError as e:
            for done in [*written, path]:
                if done.is_file():
                    done.unlink()
            raise UsageError(f"{flag} {path}: {e.strerror or e}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="titan-ext", description="Plan and simulate straggler-resilient PP schedules.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("plan", help="plan a schedule (PipeMorph Alg.1/2 + Alg.3/4) and simulate it",
                       description="Plan a schedule and print its simulated makespan under the given delays.")
    _add_common(p)
    p.add_argument("--schedule", choices=AUTO_SCHEDULES + CROSSPIPE_SCHEDULES, default="pipemorph",
                   help="auto: the faster of pipemorph and crosspipe-ud; pipemorph: Alg.1 without delays, "
                        "Alg.2 with them, or the fastest of the cheap alternatives (uncapped, slack floor 1, "
                        "zb, zb-h1, 1F1B) that fits --memory-limit; zb: the ZeroBubble plan of "
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
    p.add_argument("--memory-limit", type=_memory_limit, default=None, metavar="K",
                   help="at most K activations of one rank's whole model part held on any rank (a chunk "
                        "of a rank with V stages counts 1/V, so K*V must be whole); one stage per rank: "
                        "Alg.1's x_max, caps Alg.2 (docs/multistage.md, Memory)")
    p.add_argument("--stage-memory-limit", type=int, default=None, metavar="K",
                   help="at most K in-flight activations on any one stage (chunk)")
    p.add_argument("--strict", action="store_true",
                   help="also validate with torch's checker, lowering and dry run (slower; default: ours)")
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
    s.add_argument("--memory-limit", type=_memory_limit, default=None, metavar="K",
                   help="with --schedule: max in-flight activations per rank (whole number)")
    s.add_argument("--time-limit", type=float, default=60.0, metavar="SEC", help="with --schedule optimal: solver time limit")
    s.add_argument("--trace", type=Path, help="write a Chrome/Perfetto trace JSON")
    s.add_argument("--gantt", type=Path, help="write a Gantt PNG")
    s.set_defaults(func=cmd_simulate)

    c = sub.add_parser("compare", help="PipeMorph, CrossPipe and torch's built-ins side by side for one profile",
                       description="Plan PipeMorph (Alg.1/2) and CrossPipe for the given profile, take torch's "
                                   "built-in schedules as they are, simulate all under the same delays and "
                                   "print makespan, bubble rate and peak in-flight activations "
                                   "(docs/choosing.md says when to use which).")
    _add_common(c)
    c.add_argument("--hol", action="store_true", help="head-of-line blocking: sends block the compute behind them")
    c.set_defaults(func=cmd_compare)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        args.func(args)
        sys.stdout.flush()
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, like other Unix tools
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit's flush
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
