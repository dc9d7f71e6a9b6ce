"""PNG image of a measured pipeline iteration (one row per stage, one bar per action)."""

from pathlib import Path

from titan_ext.titan.monitor import IterationTimeline, timeline_stats

__all__ = ["write_timeline_png"]

_COLORS = {"F": "#4C72B0", "B": "#DD8452", "I": "#DD8452", "W": "#55A868"}


def write_timeline_png(timeline: IterationTimeline, path: str | Path, title: str = "") -> Path:
    """Draw ``timeline`` (measured) to ``path``; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = timeline.to_rows()
    stats = timeline_stats(timeline)
    S = timeline.num_stages
    fig, ax = plt.subplots(figsize=(12, 0.6 * S + 1.4), dpi=100)
    for r in rows:
        width = max(r["end_ms"] - r["start_ms"], 1e-3)
        ax.barh(r["stage"], width, left=r["start_ms"], height=0.8,
                color=_COLORS.get(r["kind"], "#8172B3"), edgecolor="black", linewidth=0.3)
        if width > 0.02 * max((x["end_ms"] for x in rows), default=1):
            ax.text(r["start_ms"] + width / 2, r["stage"], f'{r["kind"]}{r["microbatch"]}',
                    ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(S))
    ax.set_yticklabels([f"stage {s}" for s in range(S)])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms, measured)")
    head = title or f"step {timeline.step}"
    ax.set_title(f"{head}: iteration {stats['iteration_ms']:.1f} ms, "
                 f"bubble rate {stats['bubble_rate']:.1%}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
