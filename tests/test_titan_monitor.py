"""Measured-timeline statistics and the summary table, on hand-built timelines (no processes)."""

import math

import pytest

from titan_ext.titan.monitor import Action, IterationTimeline, timeline_stats

MS = 1_000_000  # ns


def _gpipe_like(delay_ms: float) -> IterationTimeline:
    """2 stages, 2 microbatches, F = B = 10 ms; link 0 delivers after ``delay_ms``."""
    d = int(delay_ms * MS)
    t = 10 * MS
    acts = [
        Action(0, "F", 0, 0, t), Action(0, "F", 1, t, 2 * t),
        Action(1, "F", 0, t + d, 2 * t + d), Action(1, "F", 1, 2 * t + d, 3 * t + d),
        Action(1, "B", 0, 3 * t + d, 4 * t + d), Action(1, "B", 1, 4 * t + d, 5 * t + d),
        Action(0, "B", 0, 4 * t + 2 * d, 5 * t + 2 * d), Action(0, "B", 1, 5 * t + 2 * d, 6 * t + 2 * d),
    ]
    return IterationTimeline(step=1, num_stages=2, actions=acts, num_ranks=2)


@pytest.mark.parametrize("delay", [0.0, 7.0, 30.0])
def test_iteration_time_bubble_rate_and_link_delay(delay):
    stats = timeline_stats(_gpipe_like(delay))
    T = 60.0 + 2 * delay
    assert stats["iteration_ms"] == pytest.approx(T)
    busy = 8 * 10.0
    assert stats["bubble_rate"] == pytest.approx(1 - busy / (2 * T))
    assert stats["link_delay_ms"][0] == pytest.approx(delay)
    assert stats["busy_ms"] == {0: pytest.approx(40.0), 1: pytest.approx(40.0)}


def test_link_delay_is_the_smallest_gap_over_both_directions():
    tl = _gpipe_like(5.0)
    # make the backward message of mb 1 arrive later than needed: the minimum still says 5 ms
    acts = [a if not (a.stage == 0 and a.kind == "B" and a.microbatch == 1)
            else Action(0, "B", 1, a.start_ns + 20 * MS, a.end_ns + 20 * MS) for a in tl.actions]
    stats = timeline_stats(IterationTimeline(1, 2, acts, 2))
    assert stats["link_delay_ms"][0] == pytest.approx(5.0)


def test_empty_timeline_is_nan_not_an_error():
    stats = timeline_stats(IterationTimeline(1, 4, [], 4))
    assert math.isnan(stats["iteration_ms"]) and math.isnan(stats["bubble_rate"])


def test_plan_timeline_conversion_and_png(tmp_path):
    from titan_ext.titan.gantt import to_plan_timeline, write_timeline_png

    tl = _gpipe_like(10.0)
    pt = to_plan_timeline(tl)
    assert pt.makespan_ms == pytest.approx(80.0)
    assert pt.peak_inflight == {0: 2, 1: 2}
    assert pt.bubble_rate == pytest.approx(timeline_stats(tl)["bubble_rate"])
    path = write_timeline_png(tl, tmp_path / "t.png")
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_summary_table(tmp_path):
    import json

    from titan_ext.titan.summary import format_table, load_run, summarize

    for name, it in (("a", 100.0), ("b", 150.0)):
        d = tmp_path / name
        d.mkdir()
        with open(d / "pipeline_metrics.jsonl", "w") as f:
            for step in range(1, 9):
                f.write(json.dumps({"step": step, "loss": 9.0 - step, "schedule": name,
                                    "iteration_ms": it + (1000 if step == 1 else 0), "bubble_rate": 0.25,
                                    "train_step_ms": it + 5, "link_delay_ms": {"0": 1.0},
                                    "plan_version": 1 if name == "a" else 0}) + "\n")
    sa, sb = (summarize(load_run(tmp_path / n), skip=3) for n in ("a", "b"))
    assert sa["iteration_ms"] == 100.0 and sb["iteration_ms"] == 150.0  # step 1 outlier skipped
    assert sa["loss_first"] == 8.0 and sa["loss_last"] == 1.0
    table = format_table([sa, sb])
    assert "a is 1.50x as fast as b" in table
