"""PNG image and Chrome/Perfetto trace of a measured pipeline iteration, by the planning layer's exporters.

The measured :class:`~titan_ext.titan.monitor.IterationTimeline` is converted into the planner's
``titan_ext.plan.simulate.Timeline`` (the same type the simulator produces), so measured and
simulated iterations are drawn identically by ``titan_ext.plan.export.write_gantt_png`` and traced
identically by ``titan_ext.plan.export.write_chrome_trace``.
"""

from pathlib import Path

from titan_ext.titan.monitor import IterationTimeline, timeline_stats

__all__ = ["to_plan_timeline", "write_timeline_png", "write_timeline_trace"]


def to_plan_timeline(timeline: IterationTimeline):
    """The measured iteration as a ``titan_ext.plan.simulate.Timeline`` (times in ms from t=0)."""
    from titan_ext.plan.simulate import ActionEvent, Timeline

    P = timeline.num_ranks or timeline.num_stages
    stats = timeline_stats(timeline)
    events = [
        ActionEvent(rank=r["stage"] % P, stage=r["stage"], kind=r["kind"], microbatch=r["microbatch"],
                    start_ms=r["start_ms"], end_ms=r["end_ms"])
        for r in timeline.to_rows()
    ]
    makespan = max((e.end_ms for e in events), default=0.0)
    busy = {rank: 0.0 for rank in range(P)}
    for e in events:
        busy[e.rank] += e.end_ms - e.start_ms
    inflight: dict[int, int] = {}
    peak: dict[int, int] = {}
    for e in sorted(events, key=lambda e: e.start_ms):
        if e.kind == "F":
            inflight[e.stage] = inflight.get(e.stage, 0) + 1
        elif e.kind in ("B", "I"):
            inflight[e.stage] = inflight.get(e.stage, 0) - 1
        peak[e.stage] = max(peak.get(e.stage, 0), inflight.get(e.stage, 0))
    return Timeline(
        events=events,
        makespan_ms=makespan,
        bubble_rate=stats["bubble_rate"],
        busy_ms=busy,
        idle_ms={rank: makespan - b for rank, b in busy.items()},
        peak_inflight=peak,
    )


def write_timeline_png(timeline: IterationTimeline, path: str | Path, title: str = "") -> Path:
    """Draw the measured ``timeline`` to ``path`` (one row per PP rank); returns the path. Needs matplotlib,
    which is optional: without it a ``ModuleNotFoundError`` names the extra to install (``titan-ext[plot]``),
    and no image is written (the trace below needs no matplotlib)."""
    from titan_ext.plan.export import write_gantt_png

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    stats = timeline_stats(timeline)
    head = title or f"step {timeline.step}"
    write_gantt_png(to_plan_timeline(timeline), path,
                    title=f"{head} (measured): iteration {stats['iteration_ms']:.1f} ms, "
                          f"bubble rate {stats['bubble_rate']:.1%}")
    return path


def write_timeline_trace(timeline: IterationTimeline, path: str | Path, title: str = "") -> Path:
    """The measured ``timeline`` as a Chrome/Perfetto trace JSON (one track per PP rank); returns the path."""
    from titan_ext.plan.export import write_chrome_trace

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_chrome_trace(to_plan_timeline(timeline), path, title=title or f"step {timeline.step} (measured)")
    return path
