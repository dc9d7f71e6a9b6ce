"""Exporters: torch CSV (compute-only), Chrome/Perfetto trace JSON, Gantt PNG.

matplotlib, for the PNG only, is optional (the ``plot`` extra): :func:`pyplot` imports it when a plot is
drawn, and says how to install it when it is missing.

Each writer is all or nothing: it writes a temporary file next to the target and renames it into
place only when complete, so an error, Ctrl-C or SIGTERM midway leaves the file that was there (and no
temporary file). A symbolic link is followed: the file it names is replaced, the link kept."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping

from ..args import ArgumentTypeError, output_path_arg
from .deps import KIND_INDEX
from .ir import COMPUTE_KINDS
from .interrupt import signals_deferred
from .ir import as_ops, to_torch_plan, torch_schedules
from .simulate import Timeline


@contextlib.contextmanager
def atomic_output(path: Any, name: str = "path") -> Iterator[str]:
    """Yield a temporary path next to ``path`` (same extension: matplotlib picks the format from it);
    on success it replaces ``path`` (keeping the mode of the file it replaces), otherwise it is removed."""
    target = os.path.realpath(output_path_arg(path, name))  # through a symlink: the file it names
    if os.path.isdir(target):
        raise IsADirectoryError(21, "Is a directory", str(path))
    folder, base = os.path.split(target)
    with signals_deferred():  # created and inside the try below as one step
        fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=os.path.splitext(base)[1], dir=folder)
        os.close(fd)
    try:
        yield tmp
        try:
            mode = stat.S_IMODE(os.stat(target).st_mode)
        except FileNotFoundError:
            mask = os.umask(0)
            os.umask(mask)
            mode = 0o666 & ~mask
        with signals_deferred():
            os.chmod(tmp, mode)
            os.replace(tmp, target)
    except BaseException:
        with signals_deferred(), contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _timeline_arg(timeline: Any) -> Timeline:
    if not isinstance(timeline, Timeline):
        raise ArgumentTypeError(f"timeline must be a Timeline (from simulate), got {type(timeline).__name__}")
    return timeline


def write_torch_csv(plan: Mapping[int, Any], path: str | Path) -> None:
    """One row per rank (rank order), one compute action per cell (``2F0``, ``1I3``, ``0W5``).

    This is the compute-only format of ``PipelineScheduleMulti._dump_csv`` that
    ``_PipelineScheduleRuntime._load_csv`` reads and lowers — so stock TorchTitan's
    ``pipeline_parallel_schedule_csv`` can run our plans.
    """
    output_path_arg(path)
    actions = to_torch_plan(as_ops(plan))
    ranks = sorted(actions)
    if ranks != list(range(len(ranks))):
        raise ValueError(f"ranks must be 0..R-1, got {ranks}")
    with atomic_output(path) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.writer(f)
        for rank in ranks:
            writer.writerow([str(a) for a in actions[rank]])


def read_torch_csv(path: str | Path) -> dict[int, list[Any]]:
    """Read a compute-only torch CSV back into rank → list[_Action] (as torch's ``_load_csv`` parses it)."""
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentTypeError(f"path must be a path (str or os.PathLike), got {type(path).__name__}")
    action = torch_schedules()._Action
    plan: dict[int, list[Any]] = {}
    with open(path, newline="") as f:
        for rank, row in enumerate(csv.reader(f)):
            try:
                plan[rank] = [a for a in (action.from_str(cell) for cell in row) if a is not None]
            except RuntimeError as e:
                raise ValueError(f"{path}: row {rank + 1}: {e}") from e
    if not plan:
        raise ValueError(f"{path}: empty schedule CSV")
    as_ops(plan)  # compute-only check, with a clear message
    return plan


def write_chrome_trace(timeline: Timeline, path: str | Path, title: str | None = None) -> None:
    """Chrome / Perfetto trace (open in ui.perfetto.dev or chrome://tracing): one track per rank;
    ``title`` names the process track (simulated plans and measured iterations alike)."""
    _timeline_arg(timeline)
    output_path_arg(path)
    events = [
        {
            "name": f"{e.kind}{e.microbatch}",
            "cat": e.kind,
            "ph": "X",
            "ts": e.start_ms * 1e3,
            "dur": (e.end_ms - e.start_ms) * 1e3,
            "pid": 0,
            "tid": e.rank,
            "args": {"stage": e.stage, "microbatch": e.microbatch},
        }
        for e in timeline.events
    ]
    meta = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}}
        for r in sorted(timeline.busy_ms)
    ]
    if title:
        meta.insert(0, {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": title}})
    text = json.dumps({"traceEvents": meta + events, "displayTimeUnit": "ms"})
    with atomic_output(path) as tmp:
        Path(tmp).write_text(text)


#: what a plot without matplotlib says to do
PLOT_INSTALL_HINT = "pip install 'titan-ext[plot]'"


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files only: no display on a cluster node); matplotlib is
    optional, so a missing one is a ``ModuleNotFoundError`` that names the extra to install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # matplotlib, or a package of its own
        raise ModuleNotFoundError(f"plotting needs matplotlib ({e}): {PLOT_INSTALL_HINT}",
                                  name="matplotlib") from None
    return plt


#: the legend's order of kinds: data-flow order, a full B where I stands (F, I, B, W)
LEGEND_ORDER = tuple(sorted(COMPUTE_KINDS, key=KIND_INDEX.__getitem__))
_COLORS = {"F": "#4C72B0", "I": "#DD8452", "B": "#C44E52", "W": "#55A868"}


def write_gantt_png(timeline: Timeline, path: str | Path, title: str | None = None) -> None:
    """Gantt chart of a timeline: one row per rank, F / I (B) / W coloured, microbatch ids inside."""
    _timeline_arg(timeline)
    output_path_arg(path)
    plt = pyplot()
    from matplotlib.patches import Patch

    ranks = sorted(timeline.busy_ms)
    fig, ax = plt.subplots(figsize=(max(8.0, min(40.0, len(timeline.events) / 12)), 0.6 * len(ranks) + 1.5))
    for e in timeline.events:
        width = e.end_ms - e.start_ms
        ax.barh(e.rank, width, left=e.start_ms, height=0.8, color=_COLORS[e.kind], edgecolor="white", linewidth=0.3)
        if width > timeline.makespan_ms / 150:
            ax.text(e.start_ms + width / 2, e.rank, str(e.microbatch), ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title or f"makespan {timeline.makespan_ms:.1f} ms, bubble rate {timeline.bubble_rate:.1%}")
    kinds = sorted({e.kind for e in timeline.events}, key=LEGEND_ORDER.index)
    ax.legend(handles=[Patch(color=_COLORS[k], label=k) for k in kinds], loc="upper right", fontsize=7)
    fig.tight_layout()
    try:
        with atomic_output(path) as tmp:
            fig.savefig(tmp, dpi=110)
    finally:
        plt.close(fig)
