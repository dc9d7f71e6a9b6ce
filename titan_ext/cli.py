"""``titan-ext`` command line (also ``python -m titan_ext``): plan and simulate pipeline schedules without
any process group, and the tools for training runs.

    titan-ext plan --stages 4 --microbatches 12 --times 10,10,10 --delay 0:20 --json
    titan-ext simulate --builtin ZBVZeroBubble --stages 4 --microbatches 12 --times 10,10,10 --hol
    titan-ext summary outputs/run_local/PipeMorph outputs/run_local/1F1B     # runs side by side
    titan-ext wandb-offline outputs/run/wandb                               # a W&B offline run's history
    titan-ext falcon-s4 --nproc-per-node 4 -- --job.config_file X.toml      # torchrun, relaunched after S4

With ``--json`` a command writes one JSON document to stdout and nothing else (its human-readable
report goes to stderr), so ``titan-ext plan ... --json | jq`` works.

Bad arguments (non-finite, zero or absurd numbers, numbers not in ASCII digits, a repeated option, a
profile that is not a small JSON text file), output paths that cannot be written or that name a
directory (``out/``), a symbolic link or an input file (checked before any work) and work that does
not finish within ``--time-limit`` print one line on stderr and exit with code 2. Outputs are written
to temporary files and renamed into place only when all of them succeeded: a failure, Ctrl-C
(SIGINT: one line, exit 130) or SIGTERM (one line, exit 143) never touches a file the user already
had and leaves no temporary file behind. A closed pipe (``| head``) ends the command quietly.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import stat
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

from .plan import LinkProfile, PipelineProfile, PlanResult, simulate
from .args import names_a_directory, parse_float, parse_int
from .plan.interrupt import signals_deferred as _signals_deferred
from .plan.result import rank_peak_inflight, warmup_counts_of
from .plan.schedules import AUTO_SCHEDULES, CROSSPIPE_SCHEDULES, plan_by_name
from .plan.virtual import VIRTUAL_SCHEDULES
from .plan.profile import MAX_MS, check_profile_fields, links_from_json
from .plan.warmup import slackness


class UsageError(Exception):
    """Bad command-line input: reported in one line, exit code 2."""


# Bounds on the input, so that a typo is refused at once instead of planning for minutes or
# overflowing: S·N ops plan in about 3 s at the bound (S=64, N=512 takes 1.4 s, BENCHMARKS.md).
# Any time or delay is at most plan.profile.MAX_MS (11.6 days).
MAX_OPS = 65536  # stages x microbatches (x virtual stages per rank)
PROGRESS_AFTER_S = 15.0  # a big command (PROGRESS_OPS actions or more) still working then says so on stderr
PROGRESS_OPS = 4096
MAX_PROFILE_BYTES = 1 << 20  # --profile is a small JSON text
MAX_CSV_BYTES = 16 << 20  # --csv: MAX_OPS actions of a few characters each fit many times over
MAX_TIME_LIMIT_S = 86400.0


class Terminated(BaseException):
    """SIGTERM arrived (raised by the handler ``main`` installs, so that the outputs' clean-up runs)."""


EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM


def _terminate(signum, frame) -> None:
    raise Terminated


@contextlib.contextmanager
def _sigterm_raises():
    """SIGTERM raises :class:`Terminated` in the main thread while the command runs (its default action
    kills the process before any clean-up); the previous handler is put back afterwards. A SIGTERM that
    is ignored or handled by the caller stays so."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


class TimeLimitReached(BaseException):
    """The command's --time-limit passed (a BaseException, so that no ``except Exception`` in the
    library swallows it)."""


@contextlib.contextmanager
def time_limit(seconds: float | None, progress: str | None = None):
    """Raise ``TimeLimitReached`` in the main thread once ``seconds`` of wall time have passed (SIGALRM;
    nothing outside the main thread or without ``setitimer``). ``progress``: printed once on stderr
    if the work is still running after PROGRESS_AFTER_S. Nested use is not supported."""
    if seconds is None or threading.current_thread() is not threading.main_thread() \
            or not hasattr(signal, "setitimer"):
        yield
        return
    deadline = time.monotonic() + seconds

    def on_alarm(signum, frame) -> None:
        if _importing(frame):  # never interrupt an import: it would leave a half-initialised module
            signal.setitimer(signal.ITIMER_REAL, 0.05)
            return
        left = deadline - time.monotonic()
        if left > 0.01:  # the progress alarm
            print(f"titan-ext: {progress}", file=sys.stderr, flush=True)
            signal.setitimer(signal.ITIMER_REAL, left)
            return
        raise TimeLimitReached

    previous = signal.signal(signal.SIGALRM, on_alarm)
    first = min(seconds, PROGRESS_AFTER_S) if progress and seconds > 2 * PROGRESS_AFTER_S else seconds
    started = time.monotonic()
    outer, _ = signal.setitimer(signal.ITIMER_REAL, first)  # a caller's own alarm (e.g. pytest-timeout)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer > 0:  # give the caller's alarm back, less the time spent here
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - started), 0.001))


def _importing(frame) -> bool:
    """Whether ``frame`` (where a signal arrived) runs inside an import."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _stop_clock() -> None:
    """The work is done: what follows (writing the outputs) runs whatever the time."""
    if hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread():
        signal.setitimer(signal.ITIMER_REAL, 0)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" for options that have a real default (not None / off / empty)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


class _Once:
    """Mixin for argparse actions: an option given twice is refused (the last one would win silently)."""

    def __call__(self, parser, namespace, values, option_string=None):
        seen = namespace.__dict__.setdefault("_given", set())
        if self.dest in seen:
            raise argparse.ArgumentError(self, "given more than once")
        seen.add(self.dest)
        super().__call__(parser, namespace, values, option_string)


class _StoreOnce(_Once, argparse._StoreAction):
    pass


class _StoreTrueOnce(_Once, argparse._StoreTrueAction):
    pass


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)  # defaults in --help
        kwargs.setdefault("allow_abbrev", False)  # --stage is not --stages (nor a way around _Once)
        super().__init__(*args, **kwargs)
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)
        self.register("action", "store_true", _StoreTrueOnce)

    def error(self, message: str) -> None:  # one line, not argparse's usage block
        raise UsageError(f"{self.prog}: {message}")


def _number(kind: type, low: float, high: float, what: str) -> Callable[[str], float]:
    """argparse type: a ``kind`` (int or float) in [low, high], in ASCII digits (titan_ext.args.parse_int /
    parse_float); NaN, inf and overflow are refused."""

    def parse(text: str):
        try:
            value = (parse_int if kind is int else parse_float)(text, what)
        except (ValueError, OverflowError):
            value = None
        if value is None or not low <= value <= high:  # also NaN
            digits = "" if text.isascii() else " in ASCII digits"
            raise argparse.ArgumentTypeError(f"expected {what} in [{low:g}, {high:g}]{digits}, got {text!r}")
        return value

    parse.__name__ = what  # argparse's fallback message names the type
    return parse


def _times(text: str) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """``F,B,W`` (every stage) or ``F,B,W/F,B,W/...`` (one triple per stage) → (f, b, w) tuples."""
    triples = []
    for item in text.split("/"):
        parts = item.split(",")
        try:
            triple = tuple(parse_float(p, "--times") for p in parts)
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
        out = parse_int(link, "LINK"), parse_float(value, "VALUE")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LINK:VALUE (e.g. 2:30), got {text!r}") from None
    if out[0] < 0 or not 0 <= out[1] <= MAX_MS:
        raise argparse.ArgumentTypeError(f"expected a link >= 0 and a value in [0, {MAX_MS:g}], got {text!r}")
    return out


def _megabytes(text: str) -> float:
    try:
        value = parse_float(text, "--message-mb")
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1e9:  # also NaN
        raise argparse.ArgumentTypeError(f"expected a size in MB in [0, 1e9], got {text!r}")
    return value


def _memory_limit(text: str) -> float:
    """--memory-limit K: activations of one rank's whole model part (a number >= 1)."""
    try:
        value = parse_float(text, "--memory-limit")
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


PROFILE_HELP = (
    'profile JSON with the fields of PipelineProfile; flags override it. Times in ms, a number for '
    'every stage or a list with one per stage; links: one object per link (link i joins stage i and '
    'i+1) with latency_ms, bandwidth_bytes_per_s, message_bytes. Example: {"num_stages": 4, '
    '"num_microbatches": 12, "f_ms": 10, "b_ms": 10, "w_ms": [10, 10, 10, 12], "links": '
    '[{"latency_ms": 0}, {"latency_ms": 20, "bandwidth_bytes_per_s": 1e9, "message_bytes": 4e6}, '
    '{}]}. Optional: activation_bytes, memory_budget_bytes')


_COUNT = _number(int, 1, MAX_OPS, "an integer")
_TIME_LIMIT_HELP = ("wall-clock limit of the whole command in s (model building, solver, simulation): "
                    "past it the command stops with an error; optimal: the solver returns its best plan "
                    "by then")


def _add_time_limit(p: argparse.ArgumentParser, help_text: str = _TIME_LIMIT_HELP) -> None:
    p.add_argument("--time-limit", type=_number(float, 0.1, MAX_TIME_LIMIT_S, "seconds"), default=60.0,
                   metavar="SEC", help=help_text)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stages", type=_COUNT, help="pipeline stages (= PP ranks)")
    p.add_argument("--microbatches", type=_COUNT, help="microbatches per iteration")
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
    p.add_argument("--json", action="store_true",
                   help="write one JSON object to stdout and nothing else (the report goes to stderr)")


def check_input_file(path: Path, flag: str, max_bytes: int) -> None:
    """An input is a regular file (not a device, FIFO or directory) of at most ``max_bytes``."""
    try:
        st = path.stat()
    except OSError as e:
        raise UsageError(f"{flag} {path}: {e.strerror or e}") from None
    except ValueError as e:  # a NUL in the path
        raise UsageError(f"{flag} {str(path)!r}: {e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{flag} {path}: not a regular file")
    if st.st_size > max_bytes:
        raise UsageError(f"{flag} {path}: larger than {max_bytes} bytes")


def _read_profile(path: Path) -> dict:
    """--profile: a regular file of at most MAX_PROFILE_BYTES of UTF-8 JSON text holding one object."""
    check_input_file(path, "--profile", MAX_PROFILE_BYTES)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PROFILE_BYTES + 1)
    except OSError as e:
        raise UsageError(f"--profile {path}: {e.strerror or e}") from None
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise UsageError(f"--profile {path}: not UTF-8 text (a profile is JSON)") from None
    except (json.JSONDecodeError, RecursionError) as e:
        raise UsageError(f"--profile {path}: not valid JSON: {str(e)[:200]}") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise UsageError(f"--profile {path}: unreadable number: {str(e).splitlines()[0][:200]}") from None


def _profile_from_args(args: argparse.Namespace) -> PipelineProfile:
    base: dict = {}
    if args.profile is not None:
        base = _read_profile(args.profile)
        try:
            check_profile_fields(base)  # the profile's JSON format is the library's (plan/profile.py)
        except ValueError as e:
            raise UsageError(f"--profile {args.profile}: {str(e).removeprefix('profile: ')}") from None
    S = args.stages if args.stages is not None else _profile_int(base, "num_stages", "--stages")
    N = args.microbatches if args.microbatches is not None else _profile_int(
        base, "num_microbatches", "--microbatches")
    if S is None or N is None:
        raise UsageError("--stages and --microbatches are required (or a --profile that has them)")
    if S < 1 or N < 1:
        raise UsageError(f"stages ({S}) and microbatches ({N}) must be >= 1")
    V = getattr(args, "virtual_stages", None) or 1
    if S * N * V > MAX_OPS:
        what = f"{S} stages x {N} microbatches" + (f" x {V} virtual stages" if V > 1 else "")
        raise UsageError(f"{what} = {S * N * V} is beyond the bound of {MAX_OPS} "
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
        links = links_from_json(base["links"], S) if base.get("links") else [LinkProfile()] * (S - 1)
    except (TypeError, ValueError) as e:
        raise UsageError(f"--profile {str(e).removeprefix('profile ')}") from None
    for link, _ in args.delay + args.bandwidth:
        if not 0 <= link < S - 1:
            raise UsageError(f"link {link} does not exist: links are 0..{S - 2} for {S} stages")
    if args.bandwidth and args.message_mb is None:
        raise UsageError("--bandwidth needs --message-mb (the size of one message)")
    for link, gbps in args.bandwidth:
        if gbps <= 0:
            raise UsageError(f"--bandwidth {link}:{gbps}: bandwidth must be > 0")
    try:
        links = _override_links(links, args)
        return PipelineProfile(
            S, N, f, b, w, tuple(links),
            activation_bytes=base.get("activation_bytes"),
            memory_budget_bytes=base.get("memory_budget_bytes"),
        )
    except (TypeError, ValueError) as e:  # a mistyped profile field: the profile names it
        raise UsageError(str(e)) from None


def _override_links(links: list[LinkProfile], args: argparse.Namespace) -> list[LinkProfile]:
    """--delay, --bandwidth and --message-mb on top of the profile's links (LinkProfile checks the result,
    e.g. a transfer time beyond MAX_MS)."""
    from dataclasses import replace

    for link, ms in args.delay:
        links[link] = replace(links[link], latency_ms=ms)
    for link, gbps in args.bandwidth:
        links[link] = replace(links[link], bandwidth_bytes_per_s=gbps * 1e9)
    if args.message_mb is not None:
        links = [replace(link, message_bytes=args.message_mb * 1e6) for link in links]
    return links


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
        _print_json({**timeline.to_dict(), **extra}, args)


def _print_json(document: dict, args: argparse.Namespace) -> None:
    """The command's JSON document, alone on stdout (``_run`` sends everything else to stderr)."""
    stream = getattr(args, "json_stream", None) or sys.stdout
    stream.write(json.dumps(document) + "\n")


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
    if args.virtual_stages is not None and args.schedule not in VIRTUAL_SCHEDULES:
        raise UsageError(f"--schedule {args.schedule}: with --virtual-stages choose one of "
                         f"{', '.join(VIRTUAL_SCHEDULES)}")
    if args.placement == "v" and args.virtual_stages != 2:
        raise UsageError(f"--placement v holds 2 stages per rank (rank r: r and 2R-1-r), not "
                         f"{args.virtual_stages}: use --virtual-stages 2 or --placement loop")
    options = {}
    if args.schedule in AUTO_SCHEDULES:
        if "slack_floor" not in getattr(args, "_given", ()):  # the default 2 fits any N >= 2; N = 1: 1
            args.slack_floor = min(args.slack_floor, profile.num_microbatches)
        if args.slack_floor > profile.num_microbatches:
            raise UsageError(f"--slack-floor {args.slack_floor}: at most the number of microbatches "
                             f"({profile.num_microbatches}); a slackness cannot exceed it")
        options = {"slack_floor": args.slack_floor, "validate": "torch" if args.strict else True}
    if args.virtual_stages is not None:
        options["placement"] = args.placement or "loop"
    if getattr(args, "polish", None) is not None:  # plan's flag (simulate plans without it)
        options["polish_s"] = args.polish
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
                       ("slack_floor", "--slack-floor"), ("polish_s", "--polish")):
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

        check_input_file(args.csv, "--csv", MAX_CSV_BYTES)
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
    """(name, thunk → timeline) for PipeMorph, CrossPipe, ZB-H1 (the ZB paper's 1F1B-memory schedule,
    x_i = S − i; torch ships none) and torch's built-ins."""
    from .plan.builtin import BUILTINS, builtin_plan

    def planned(name):
        return _simulate_result(plan_by_name(profile, name), hol)

    def builtin(name):
        actions, _ = builtin_plan(name, profile.num_stages, profile.num_microbatches)
        return _evaluate(actions, profile, hol, name)[1]

    yield "PipeMorph", lambda: planned("pipemorph")
    for name in ("crosspipe-udsub", "crosspipe-wave"):
        yield f"CrossPipe ({name[10:]})", lambda name=name: planned(name)
    yield "ZB-H1 (ZB paper)", lambda: planned("zb-h1")
    for name in BUILTINS:
        yield f"torch {name}", lambda name=name: builtin(name)


def _budgeted(candidates: list, budget_s: float) -> list:
    """Run each (name, thunk) within its share of the budget (time left / candidates left) → (name,
    timeline, or the reason there is none: it does not apply, or it was skipped at its share)."""
    from .plan.builtin import builtin_plan  # noqa: F401  (imports first: the shares time planning, and the
    from .plan.ir import torch_schedules  # alarm waits for an import to end)

    torch_schedules()
    rows = []
    end = time.monotonic() + budget_s
    for i, (name, thunk) in enumerate(candidates):
        share = max(0.0, end - time.monotonic()) / (len(candidates) - i)
        if share < 0.05:
            rows.append((name, f"skipped: the --time-limit budget is spent"))
            continue
        try:
            with time_limit(share, f"compare: {name} still running (its budget: {share:.1f} s)"):
                rows.append((name, thunk()))
        except TimeLimitReached:
            rows.append((name, f"skipped: not finished within its budget of {share:.1f} s (--time-limit)"))
        except (ImportError, UsageError, ValueError) as e:
            rows.append((name, str(e).splitlines()[0]))
    return rows


# the schedules our plans are matched against: name → placement of ours (None: one stage per rank)
_REPLACES = {"ZB-H1 (ZB paper)": None, "torch 1F1B": None, "torch Interleaved1F1B": "loop",
             "torch InterleavedZeroBubble": "loop", "torch ZBVZeroBubble": "v", "torch DualPipeV": "v"}


def _ours_at(profile: PipelineProfile, placement: str | None, peak_per_rank: float, hol: bool) -> float | str:
    """Makespan of our plan at a per-rank memory limit (the peak of the schedule it would replace):
    one stage per rank (PipeMorph, the limit rounded down to whole activations) or R × 2 stages in
    ``placement`` (the plan_virtual portfolio)."""
    try:
        if placement is None:
            plan = plan_by_name(profile, "pipemorph", memory_limit=max(1, math.floor(peak_per_rank + 1e-9)))
        else:
            plan = plan_by_name(profile, "pipemorph", virtual_stages=2, placement=placement,
                                memory_limit=peak_per_rank, validate=False)
        return _simulate_result(plan, hol).makespan_ms
    except ValueError as e:
        return "n/a: " + str(e).splitlines()[0]


def _matched_candidates(profile: PipelineProfile, rows: list, hol: bool):
    """(name, thunk → (ours in the row's placement, ours with one stage per rank)) for every row that
    ``_REPLACES`` names and that has a timeline, each planned at the row's peak per rank."""
    for name, t in rows:
        if name in _REPLACES and not isinstance(t, str):
            K = max(t.peak_memory_per_rank.values())

            def thunk(K=K, placement=_REPLACES[name]):
                one = _ours_at(profile, None, K, hol)
                return (one if placement is None else _ours_at(profile, placement, K, hol)), one

            yield name, thunk


def _ms(value: float | str | None) -> str:
    return "" if value is None else value if isinstance(value, str) else f"{value:.1f}"


def cmd_compare(args: argparse.Namespace) -> None:
    """PipeMorph, CrossPipe and torch's built-ins side by side for one profile, each torch schedule (and
    ZB-H1) also beside our plans at its own peak per-rank memory (docs/choosing.md)."""
    profile = _profile_from_args(args)
    from .plan.ir import torch_schedules

    torch_schedules()  # torch's import (seconds on a loaded host) is no candidate's share of the budget
    start = time.monotonic()
    rows = _budgeted(list(_compare_candidates(profile, args.hol)), args.time_limit)
    matched = dict(_budgeted(list(_matched_candidates(profile, rows, args.hol)),
                             max(0.0, args.time_limit - (time.monotonic() - start))))
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
        ours = one_stage = None
        if name in matched:
            got = matched[name]
            ours, one_stage = ("n/a", "n/a") if isinstance(got, str) else got
            row["memory_matched"] = {"memory_limit": rank_peak, "placement": _REPLACES[name] or "one stage per rank",
                                     "ours_ms": got if isinstance(got, str) else ours,
                                     "ours_one_stage_ms": got if isinstance(got, str) else one_stage}
        print(f"{name:<28} {t.makespan_ms:>12.1f} {t.bubble_rate:>8.1%} {peak:>10} {rank_peak:>9.3g} "
              f"{torch_best / t.makespan_ms:>13.2f}x {_ms(ours):>19} {_ms(one_stage):>18}")
        out.append(row)
    print("peak/stage: activations the busiest stage holds (2-chunk schedules: half-size chunks); peak/rank: "
          "the busiest rank's, in activations of its whole model part (a chunk counts 1/2); vs best torch: "
          "the best torch built-in's makespan / this one's; ours at its memory: our plan in the same placement "
          "(2 stages per rank for torch's 2-chunk schedules) limited to this row's peak/rank; ours 1 stage/rank: "
          "our one-stage-per-rank plan at that memory (rounded down to whole activations)")
    if args.json:
        _print_json({"hol": args.hol, "schedules": out}, args)


_GANTT_FORMATS = (".png", ".pdf", ".svg")


_OUTPUT_FLAGS = (("--out-csv", "out_csv"), ("--trace", "trace"), ("--gantt", "gantt"))
_INPUT_FLAGS = (("--profile", "profile"), ("--csv", "csv"))


def _outputs(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """(flag, path) of each output given (argparse keeps their text: see ``titan_ext.args.names_a_directory``)."""
    return [(flag, Path(getattr(args, dest))) for flag, dest in _OUTPUT_FLAGS if getattr(args, dest, None) is not None]


def check_outputs(args: argparse.Namespace) -> None:
    """Before any work: each output path is new or a writable regular file (not a symbolic link: the
    output would replace the link, not the file it names), in a writable directory, with a supported
    extension, and no two outputs -- nor an output and an input -- share a path."""
    seen: dict[str, str] = {}
    for flag, dest in _INPUT_FLAGS:
        path = getattr(args, dest, None)
        if path is not None:
            with contextlib.suppress(OSError, ValueError):
                seen[os.path.realpath(path)] = f"the input {flag} {path}"
    for flag, dest in _OUTPUT_FLAGS:
        text = getattr(args, dest, None)
        if text is None:
            continue
        if "\0" in text:
            raise UsageError(f"{flag} {text!r}: a path cannot contain a NUL character")
        if names_a_directory(text):
            raise UsageError(f"{flag} {text}: is a directory path; an output is a file (e.g. out/plan.csv)")
    for flag, path in _outputs(args):
        if flag == "--gantt" and path.suffix.lower() not in _GANTT_FORMATS:
            raise UsageError(f"--gantt {path}: unsupported extension {path.suffix!r} "
                             f"(use {', '.join(_GANTT_FORMATS)})")
        if os.path.islink(path):
            raise UsageError(f"{flag} {path}: is a symbolic link (to {os.readlink(path)!r}); give the file's own path")
        key = os.path.realpath(path)
        if key in seen:
            raise UsageError(f"{flag} {path}: the same file as {seen[key]} (give each output its own path)")
        seen[key] = f"{flag} {path}"
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            mode = None
        except OSError as e:
            raise UsageError(f"{flag} {path}: {e.strerror or e}") from None
        parent = path.parent if str(path.parent) else Path(".")
        if mode is not None and stat.S_ISDIR(mode):
            raise UsageError(f"{flag} {path}: is a directory")
        if mode is not None and not stat.S_ISREG(mode):
            raise UsageError(f"{flag} {path}: not a regular file (outputs are files)")
        if not parent.is_dir():
            raise UsageError(f"{flag} {path}: no such directory {str(parent)!r}")
        if mode is not None and not os.access(path, os.W_OK):
            raise UsageError(f"{flag} {path}: not writable")
        try:  # the temporary file _write_outputs will need (os.access is no proof: root, /proc, read-only mounts)
            with _signals_deferred():
                os.unlink(_temporary(path))
        except OSError as e:
            raise UsageError(f"{flag} {path}: cannot create a file in {str(parent)!r} ({e.strerror or e})") from None


def _temporary(path: Path) -> str:
    """A new empty file next to ``path`` with its extension (matplotlib picks the format from it)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent if str(path.parent) else ".")
    os.close(fd)
    return tmp


def _write_outputs(actions, timeline, args: argparse.Namespace) -> None:
    """--out-csv, --trace, --gantt: all or nothing. Each goes to a temporary file next to its target;
    only when all are written are they renamed into place, so a failure leaves every file as it was."""
    from .plan.export import write_chrome_trace, write_gantt_png, write_torch_csv

    _stop_clock()
    writers = {"--out-csv": lambda p: write_torch_csv(actions, p),
               "--trace": lambda p: write_chrome_trace(timeline, p),
               "--gantt": lambda p: write_gantt_png(timeline, p)}
    staged: list[tuple[str, Path]] = []  # (temporary file, target)
    try:
        for flag, path in _outputs(args):
            try:
                with _signals_deferred():  # created and recorded as one step (a signal between leaks it)
                    staged.append((_temporary(path), path))
                writers[flag](Path(staged[-1][0]))  # a signal here: the clean-up below removes it
            except OSError as e:
                raise UsageError(f"{flag} {path}: {e.strerror or e}") from None
            except ModuleNotFoundError as e:  # matplotlib (the plot extra) for --gantt
                raise UsageError(f"{flag} {path}: {e}") from None
        with _signals_deferred():  # all renamed, or none (a signal waits until the last one is in place)
            for tmp, path in staged:
                os.chmod(tmp, _file_mode(path))
                os.replace(tmp, path)
            staged.clear()
    except BaseException:  # an error, Ctrl-C (KeyboardInterrupt), SIGTERM (Terminated), --time-limit
        with _signals_deferred():
            for tmp, _ in staged:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        raise


def _file_mode(path: Path) -> int:
    """The mode the replaced file had, or a new file's (0o666 less the umask; mkstemp's is 0o600)."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


#: subcommands run by a module of titan_ext.titan (TorchTitan and W&B imported there): name -> (module,
#: function taking argv and returning an exit status, one-line help)
TOOLS = {
    "summary": ("titan_ext.titan.summary", "main",
                "side-by-side summary of training runs from their pipeline_metrics.jsonl"),
    "wandb-offline": ("titan_ext.titan.wandb_offline", "main",
                      "read a W&B offline run's history back from disk, one JSON object per line"),
    "falcon-s4": ("titan_ext.titan.falcon_s4", "main",
                  "torchrun a titan_ext.train job; after Falcon's S4 checkpoint-exit, relaunch it on the kept devices"),
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from . import __version__

    try:
        return version("titan-ext")
    except PackageNotFoundError:  # a source checkout on PYTHONPATH
        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="titan-ext", description="Plan and simulate straggler-resilient PP schedules, "
                                                   "and summarise training runs.")
    parser.add_argument("--version", action="version", version=f"titan-ext {_version()}")
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
    _add_time_limit(p)
    p.add_argument("--virtual-stages", type=_number(int, 2, MAX_OPS, "an integer"), default=None, metavar="V",
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
    p.add_argument("--stage-memory-limit", type=_COUNT, default=None, metavar="K",
                   help="at most K in-flight activations on any one stage (chunk)")
    p.add_argument("--strict", action="store_true",
                   help="also validate with torch's checker, lowering and dry run (slower; default: ours)")
    p.add_argument("--polish", type=_number(float, 0.1, MAX_TIME_LIMIT_S, "seconds"), default=None, metavar="S",
                   help="auto|crosspipe-ud|crosspipe-udsub: polish the CrossPipe plan with CP-SAT and a longer "
                        "search within S seconds (needs titan-ext[solver]; never slower; docs/optimality.md); "
                        "default: off")
    p.add_argument("--slack-floor", type=_COUNT, default=2, metavar="D",
                   help="Alg.2's lower bound on every slackness (paper: 2; 1 saves memory; at most the "
                        "number of microbatches)")
    p.add_argument("--backward", choices=("split", "full"), default="split",
                   help="split: I and W actions (W fills bubbles); full: one full backward B per microbatch "
                        "(1F1B-style) with the same warm-up planning")
    p.add_argument("--out-csv", type=str, help="write the plan as a torch compute-only CSV")
    p.add_argument("--trace", type=str, help="write a Chrome/Perfetto trace JSON of the simulated timeline")
    p.add_argument("--gantt", type=str, help="write a Gantt PNG of the simulated timeline")
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
    _add_time_limit(s)
    s.add_argument("--trace", type=str, help="write a Chrome/Perfetto trace JSON")
    s.add_argument("--gantt", type=str, help="write a Gantt PNG")
    s.set_defaults(func=cmd_simulate)

    c = sub.add_parser("compare", help="PipeMorph, CrossPipe and torch's built-ins side by side for one profile",
                       description="Plan PipeMorph (Alg.1/2) and CrossPipe for the given profile, take torch's "
                                   "built-in schedules as they are, simulate all under the same delays and "
                                   "print makespan, bubble rate and peak in-flight activations "
                                   "(docs/choosing.md says when to use which).")
    _add_common(c)
    c.add_argument("--hol", action="store_true", help="head-of-line blocking: sends block the compute behind them")
    _add_time_limit(c, "wall-clock budget of the whole comparison in s: each schedule gets the time left divided "
                       "by the number of schedules left; one that does not finish in its share is skipped "
                       "(and says so)")
    c.set_defaults(func=cmd_compare)
    for name, (_, _, help_text) in TOOLS.items():  # listed here; main() hands their arguments over whole
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _run_tool(name: str, argv: list[str]) -> int:
    """``titan-ext NAME ARGS``: the tool's own parser and exit status (``--help`` included)."""
    import importlib

    module, function, _ = TOOLS[name]
    status = getattr(importlib.import_module(module), function)(argv, prog=f"titan-ext {name}")
    return int(status or 0)


def _silence_stdout() -> None:
    """Nothing more reaches stdout (no second error at exit's flush)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _run(args: argparse.Namespace) -> None:
    """Check the outputs, then do the work within --time-limit (compare budgets its own candidates)."""
    check_outputs(args)
    if getattr(args, "json", False):  # stdout carries the JSON document only
        args.json_stream = sys.stdout
        with contextlib.redirect_stdout(sys.stderr):
            return _run_limited(args)
    return _run_limited(args)


def _run_limited(args: argparse.Namespace) -> None:
    limit = getattr(args, "time_limit", None)
    if args.func is cmd_compare or limit is None:
        return args.func(args)
    size = _work_size(args)
    progress = (f"{args.command} still running; it stops at --time-limit {limit:g} s"
                if size is None or size >= PROGRESS_OPS else None)  # small work: slow imports are no news
    try:
        with time_limit(_grace(limit), progress):
            args.func(args)
    except TimeLimitReached:
        raise UsageError(f"{args.command}: not finished within --time-limit {limit:g} s (raise it, or plan "
                         f"fewer stages or microbatches)") from None


def _work_size(args: argparse.Namespace) -> int | None:
    """Actions to plan (stages x microbatches x virtual stages), None when a --profile gives them."""
    if args.stages is None or args.microbatches is None:
        return None
    return args.stages * args.microbatches * (getattr(args, "virtual_stages", None) or 1)


def _grace(limit: float) -> float:
    """The alarm of a --time-limit: the limit plus a little for simulating and reporting the plan that the
    optimal solver returns at the limit."""
    return limit * 1.05 + 1.0


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: its exit status (0, 2 for bad input, 130 after Ctrl-C, 143 after SIGTERM; one
    line on stderr for each failure, never a traceback). The caller's signal handlers are put back."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        with _sigterm_raises():
            return _main(argv)
    except KeyboardInterrupt:
        print("titan-ext: interrupted (Ctrl-C)", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated:
        print("titan-ext: terminated (SIGTERM)", file=sys.stderr)
        return EXIT_TERMINATED


def _main(argv: list[str]) -> int:
    if argv and argv[0] in TOOLS:
        return _run_tool(argv[0], argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        _run(args)
        sys.stdout.flush()
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, like other Unix tools
        _silence_stdout()
        return 0
    except OSError as e:  # stdout itself cannot be written (`> /dev/full`)
        _silence_stdout()
        print(f"error: cannot write the output: {e.strerror or e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
