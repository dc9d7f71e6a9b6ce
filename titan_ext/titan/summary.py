"""Side-by-side summary of training runs from their ``pipeline_metrics.jsonl`` files.

    python -m titan_ext.titan.summary outputs/run_local/PipeMorph outputs/run_local/1F1B [--skip 3]

For each run (a dump folder, or the JSONL file itself): schedule, steps, median iteration time
(measured timeline T), median whole train step, median bubble rate, loss at the first and the last
step, plan versions seen. Medians skip the first ``--skip`` steps (start-up, first plans). With
``--json PATH`` the numbers are also written as JSON; ``--json`` alone writes only the JSON to stdout.
"""

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

__all__ = ["load_run", "summarize", "format_table", "main"]


def load_run(path: str | Path, metrics_file: str = "pipeline_metrics.jsonl") -> list[dict[str, Any]]:
    path = Path(path)
    if path.is_dir():
        path = path / metrics_file
    if not path.is_file():
        raise FileNotFoundError(f"no pipeline metrics at {path}")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        raise ValueError(f"{path} holds no logged step")
    return sorted(rows, key=lambda r: r["step"])


def _median(values: list[float]) -> float:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(values) if values else math.nan


def summarize(rows: list[dict[str, Any]], skip: int = 3, name: str | None = None) -> dict[str, Any]:
    steady = [r for r in rows if r["step"] > skip] or rows
    delays = {}
    for r in steady:
        for link, ms in r.get("link_delay_ms", {}).items():
            delays.setdefault(link, []).append(ms)
    return {
        "name": name or rows[0].get("schedule", "?"),
        "schedule": rows[0].get("schedule", "?"),
        "steps": rows[-1]["step"],
        "median_steps_from": steady[0]["step"],
        "iteration_ms": _median([r["iteration_ms"] for r in steady]),
        "train_step_ms": _median([r.get("train_step_ms") for r in steady]),
        "bubble_rate": _median([r["bubble_rate"] for r in steady]),
        "loss_first": rows[0]["loss"],
        "loss_last": rows[-1]["loss"],
        "plan_versions": sorted({int(r.get("plan_version", 0)) for r in rows}),
        "link_delay_ms": {k: _median(v) for k, v in sorted(delays.items())},
    }


def format_table(summaries: list[dict[str, Any]]) -> str:
    def fmt(v, spec):
        return "n/a" if isinstance(v, float) and math.isnan(v) else format(v, spec)

    rows = [
        ("schedule", lambda s: s["schedule"]),
        ("steps", lambda s: str(s["steps"])),
        ("iteration time, median (ms)", lambda s: fmt(s["iteration_ms"], ".1f")),
        ("train step incl. optimizer (ms)", lambda s: fmt(s["train_step_ms"], ".1f")),
        ("bubble rate, median", lambda s: fmt(100 * s["bubble_rate"], ".1f") + " %"),
        ("loss, first step", lambda s: fmt(s["loss_first"], ".4f")),
        ("loss, last step", lambda s: fmt(s["loss_last"], ".4f")),
        ("plan versions", lambda s: ",".join(map(str, s["plan_versions"]))),
        ("measured link delays (ms)", lambda s: " ".join(f"{k}:{fmt(v, '.1f')}"
                                                         for k, v in s["link_delay_ms"].items())),
    ]
    width0 = max(len(r[0]) for r in rows)
    cols = [[get(s) for _, get in rows] for s in summaries]
    widths = [max(len(s["name"]), *(len(c) for c in col)) for s, col in zip(summaries, cols)]
    lines = [" " * width0 + "  " + "  ".join(s["name"].rjust(w) for s, w in zip(summaries, widths))]
    for i, (label, _) in enumerate(rows):
        lines.append(label.ljust(width0) + "  " + "  ".join(col[i].rjust(w) for col, w in zip(cols, widths)))
    if len(summaries) >= 2 and all(not math.isnan(s["iteration_ms"]) for s in summaries[:2]):
        a, b = summaries[0], summaries[1]
        lines.append(f"{a['name']} is {b['iteration_ms'] / a['iteration_ms']:.2f}x as fast as {b['name']} (iteration time, "
                     f"medians of steps >= {a['median_steps_from']})")
    return "\n".join(lines)


def _strict(value: Any) -> Any:
    """JSON as the standard has it: a missing median (NaN) is null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strict(v) for v in value]
    return value


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="dump folders (or pipeline_metrics.jsonl files)")
    p.add_argument("--skip", type=int, default=3, help="steps excluded from the medians")
    p.add_argument("--names", default="", help="comma-separated column names")
    p.add_argument("--json", nargs="?", const="-", default="", metavar="PATH",
                   help="the summary as JSON: alone on stdout (the table goes to stderr), or written to PATH")
    a = p.parse_args(argv)
    names = a.names.split(",") if a.names else [None] * len(a.runs)
    summaries = [summarize(load_run(r), a.skip, n) for r, n in zip(a.runs, names)]
    document = json.dumps(_strict(summaries), indent=2, allow_nan=False) + "\n"
    if a.json == "-":
        print(format_table(summaries), file=sys.stderr)
        sys.stdout.write(document)
        return 0
    print(format_table(summaries))
    if a.json:
        Path(a.json).write_text(document)
    return 0


if __name__ == "__main__":
    sys.exit(main())
