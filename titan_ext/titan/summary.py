"""Side-by-side summary of training runs from their ``pipeline_metrics.jsonl`` files.

    python -m titan_ext.titan.summary outputs/run_local/PipeMorph outputs/run_local/1F1B [--skip 3]

For each run (a dump folder, or the JSONL file itself): schedule, steps, median iteration time
(measured timeline T), median whole train step, median bubble rate, loss at the first and the last
step, plan versions seen, lines skipped. Medians skip the first ``--skip`` steps (start-up, first plans).

``--json PATH`` also writes the numbers as one JSON document to PATH (a temporary file next to it,
renamed into place when complete); ``--json -``, or ``--json`` as the last option, writes only the JSON
to stdout (the table goes to stderr). ``--json`` takes an optional value, so ``--json RUN_A RUN_B``
reads RUN_A as PATH: a PATH that is an existing folder, an existing ``.jsonl`` file, any other file that
is not a regular one, an input or an input's metrics file is refused, and the message says to write
``--json OUT.json`` or ``--json -``. An input is never written.

Runs that ended badly stay readable. Every line is read; a line that is not a JSON object with an
integer ``step`` and ``iteration_ms`` and ``bubble_rate`` that are numbers or null (the metrics writer
logs NaN as null) -- a half-written last line, binary garbage, nesting too deep to parse -- is skipped
and counted: row "lines skipped" of the table, field ``skipped_lines`` of the JSON, and one note per run
on stderr. Missing, null, NaN, infinite or overflowing values show as ``n/a`` in the table and ``null``
in the JSON, which is strict JSON.

A run that cannot be read (a missing path, an empty file, a file without one valid step, a folder
without the metrics file, a folder where the metrics file should be, a FIFO, device or socket -- refused
from its ``stat``, never opened --, an unreadable file), an unusable ``--json`` PATH and bad options are
each told in one line ``error: ...`` on stderr, exit code 2. Text from the runs (schedule and link
names) and paths are printed with their control characters escaped (:func:`printable`).
"""

import argparse
import json
import math
import os
import stat
import sys
from pathlib import Path
from typing import Any, Iterable, NamedTuple

__all__ = ["InputError", "ToolParser", "printable", "Run", "read_run", "load_run", "summarize", "format_table",
           "main"]

METRICS_FILE = "pipeline_metrics.jsonl"


class InputError(ValueError):
    """An input or option that cannot be used; its message is one line (``error: ...``, exit code 2)."""


class ToolParser(argparse.ArgumentParser):
    """argparse whose errors raise :class:`InputError` (one line) instead of printing its usage block."""

    def error(self, message: str) -> None:
        raise InputError(printable(f"{self.prog}: {message}"))


def printable(text: str) -> str:
    """``text`` with every character that is not printable (ESC, newline, BEL, bidi and zero-width
    controls, lone surrogates) written as Python's ``repr`` writes it: ``\\x1b``, ``\\n``, ``\\u202e``."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _shown(path: Any) -> str:
    return printable(os.fspath(path))


class Run(NamedTuple):
    rows: list[dict[str, Any]]  # the valid lines, sorted by step
    skipped_lines: int  # the lines that are not a valid step
    path: Path  # the metrics file read


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value: Any) -> float | None:
    """A number as a finite float; None for anything else (null, NaN, infinities, text, an int too big
    for a float)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def _valid(raw: bytes) -> dict[str, Any] | None:
    """The step a line holds, or None when it is not one."""
    try:
        row = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, an int beyond Python's digit limit, too deep
        return None
    if not isinstance(row, dict) or not _is_int(row.get("step")):
        return None
    for key in ("iteration_ms", "bubble_rate"):
        value = row.get(key, "missing")
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            return None
    return row


def _skipped(n: int) -> str:
    return f"{n} line{'s' if n != 1 else ''} skipped"


def _metrics_path(path: str, metrics_file: str) -> Path:
    """The regular file to read for ``path`` (a run folder or the metrics file), from ``stat`` alone (on
    the text given: ``Path`` would drop a trailing ``/``)."""
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISDIR(mode):
            path = Path(path) / metrics_file
            try:
                mode = os.stat(path).st_mode
            except FileNotFoundError:
                raise InputError(f"{_shown(path.parent)}: a folder without {_shown(metrics_file)}") from None
            if stat.S_ISDIR(mode):
                raise InputError(f"{_shown(path)}: a folder, not a metrics file")
    except OSError as e:
        raise InputError(f"{_shown(path)}: {e.strerror or e}") from None
    if not stat.S_ISREG(mode):
        raise InputError(f"{_shown(path)}: not a regular file (a FIFO, device or socket); not read")
    return Path(path)


def read_run(path: str | Path, metrics_file: str = METRICS_FILE) -> Run:
    """The valid steps of one run (a dump folder, or its metrics file) and how many lines were skipped;
    :class:`InputError` when the run cannot be read or holds no valid step."""
    path = _metrics_path(os.fspath(path), metrics_file)
    rows, skipped = [], 0
    try:  # O_NONBLOCK: should a FIFO replace the file after the stat, the read ends at once
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            for raw in f:
                if not raw.strip():
                    continue
                row = _valid(raw)
                if row is None:
                    skipped += 1
                else:
                    rows.append(row)
    except OSError as e:
        raise InputError(f"{_shown(path)}: {e.strerror or e}") from None
    if not rows:
        why = f"no valid step ({_skipped(skipped)})" if skipped else "an empty file: no logged step"
        raise InputError(f"{_shown(path)}: {why}")
    return Run(sorted(rows, key=lambda r: r["step"]), skipped, path)


def load_run(path: str | Path, metrics_file: str = METRICS_FILE) -> list[dict[str, Any]]:
    """The valid steps of one run, sorted by step (:func:`read_run` without the count)."""
    return read_run(path, metrics_file).rows


def _median(values: Iterable[Any]) -> float | None:
    """The median of the finite numbers among ``values``; None when there is none."""
    xs = sorted(x for x in map(_finite, values) if x is not None)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else xs[mid - 1] / 2 + xs[mid] / 2  # halves: no overflow near 1e308


def summarize(rows: list[dict[str, Any]], skip: int = 3, name: str | None = None,
              skipped_lines: int = 0) -> dict[str, Any]:
    steady = [r for r in rows if r["step"] > skip] or rows
    delays: dict[str, list[Any]] = {}
    for r in steady:
        links = r.get("link_delay_ms")
        for link, ms in (links.items() if isinstance(links, dict) else ()):
            delays.setdefault(link, []).append(ms)
    schedule = rows[0].get("schedule")
    schedule = schedule if isinstance(schedule, str) else "?"
    return {
        "name": name or schedule,
        "schedule": schedule,
        "steps": rows[-1]["step"],
        "median_steps_from": steady[0]["step"],
        "iteration_ms": _median(r["iteration_ms"] for r in steady),
        "train_step_ms": _median(r.get("train_step_ms") for r in steady),
        "bubble_rate": _median(r["bubble_rate"] for r in steady),
        "loss_first": _finite(rows[0].get("loss")),
        "loss_last": _finite(rows[-1].get("loss")),
        "plan_versions": sorted({v for r in rows if _is_int(v := r.get("plan_version", 0))}),
        "link_delay_ms": {k: _median(v) for k, v in sorted(delays.items())},
        "skipped_lines": skipped_lines,
    }


def format_table(summaries: list[dict[str, Any]]) -> str:
    def fmt(v, spec, scale=1):
        v = _finite(v if v is None else v * scale)
        return "n/a" if v is None else format(v, spec)

    rows = [
        ("schedule", lambda s: printable(s["schedule"])),
        ("steps", lambda s: str(s["steps"])),
        ("iteration time, median (ms)", lambda s: fmt(s["iteration_ms"], ".1f")),
        ("train step incl. optimizer (ms)", lambda s: fmt(s["train_step_ms"], ".1f")),
        ("bubble rate, median", lambda s: fmt(s["bubble_rate"], ".1f", 100) + " %"),
        ("loss, first step", lambda s: fmt(s["loss_first"], ".4f")),
        ("loss, last step", lambda s: fmt(s["loss_last"], ".4f")),
        ("plan versions", lambda s: ",".join(map(str, s["plan_versions"]))),
        ("measured link delays (ms)", lambda s: " ".join(f"{printable(k)}:{fmt(v, '.1f')}"
                                                         for k, v in s["link_delay_ms"].items())),
        ("lines skipped", lambda s: str(s.get("skipped_lines", 0))),
    ]
    names = [printable(s["name"]) for s in summaries]
    width0 = max(len(r[0]) for r in rows)
    cols = [[get(s) for _, get in rows] for s in summaries]
    widths = [max(len(n), *(len(c) for c in col)) for n, col in zip(names, cols)]
    lines = [" " * width0 + "  " + "  ".join(n.rjust(w) for n, w in zip(names, widths))]
    for i, (label, _) in enumerate(rows):
        lines.append(label.ljust(width0) + "  " + "  ".join(col[i].rjust(w) for col, w in zip(cols, widths)))
    if len(summaries) >= 2 and summaries[0]["iteration_ms"] and summaries[1]["iteration_ms"] is not None:
        a, b = summaries[0], summaries[1]
        lines.append(f"{names[0]} is {b['iteration_ms'] / a['iteration_ms']:.2f}x as fast as {names[1]} "
                     f"(iteration time, medians of steps >= {a['median_steps_from']})")
    return "\n".join(lines)


def _check_output(path: str, runs: list[Run]) -> None:
    """Refuse a ``--json`` PATH that would overwrite an input or that is no place for a JSON document."""
    use = "; --json takes the output file: write --json OUT.json, or --json - for stdout"
    try:
        mode = os.stat(path).st_mode
    except OSError:  # nothing there (yet): the write says what is wrong with it
        return
    if stat.S_ISDIR(mode):
        raise InputError(f"--json {_shown(path)}: a folder (a run?){use}")
    if not stat.S_ISREG(mode):
        raise InputError(f"--json {_shown(path)}: not a regular file{use}")
    if any(os.path.samefile(path, run.path) for run in runs):
        raise InputError(f"--json {_shown(path)}: an input of this summary{use}")
    if path.endswith(".jsonl"):
        raise InputError(f"--json {_shown(path)}: a metrics file (.jsonl), not an output{use}")


def _write(path: str, document: str) -> None:
    from titan_ext.plan.export import atomic_output

    try:
        with atomic_output(path, "--json") as tmp:
            Path(tmp).write_text(document)
    except OSError as e:
        raise InputError(f"--json {_shown(path)}: {e.strerror or e}") from None
    except ValueError as e:  # a path atomic_output refuses (a NUL, a trailing '/'); the message names it
        raise InputError(printable(str(e))) from None


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    p = ToolParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="dump folders (or pipeline_metrics.jsonl files)")
    p.add_argument("--skip", type=int, default=3, help="steps excluded from the medians")
    p.add_argument("--names", default="", help="comma-separated column names, one per run")
    p.add_argument("--json", nargs="?", const="-", default="", metavar="PATH",
                   help="the summary as JSON: alone on stdout with '--json -' or --json last (the table goes "
                        "to stderr), or written to PATH (never an input, a folder or a .jsonl file)")
    try:
        a = p.parse_args(argv)
        names = a.names.split(",") if a.names else [None] * len(a.runs)
        if len(names) != len(a.runs):
            raise InputError(f"--names gives {len(names)} names for {len(a.runs)} runs")
        runs = [read_run(r) for r in a.runs]
        if a.json not in ("", "-"):
            _check_output(a.json, runs)
        summaries = [summarize(run.rows, a.skip, n, run.skipped_lines) for run, n in zip(runs, names)]
        document = json.dumps(summaries, indent=2, allow_nan=False) + "\n"
        if a.json not in ("", "-"):
            _write(a.json, document)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for run in runs:
        if run.skipped_lines:
            print(f"note: {_shown(run.path)}: {_skipped(run.skipped_lines)} (not a JSON object with an integer "
                  "step, iteration_ms and bubble_rate)", file=sys.stderr)
    table = format_table(summaries)
    if a.json == "-":
        print(table, file=sys.stderr)
        sys.stdout.write(document)
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
