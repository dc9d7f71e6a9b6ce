"""Measured-timeline statistics and the summary table, on hand-built timelines (no processes)."""

import math

import pytest

from titan_ext.testing import run_ranks
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


def test_link_delay_is_the_mean_of_each_directions_smallest_gap():
    """Forward gaps 5 ms, backward gaps 7 ms (stage 0's backwards start 2 ms later): each direction's
    minimum, then their mean, as the runtime's c_i."""
    tl = _gpipe_like(5.0)
    acts = [a if not (a.stage == 0 and a.kind == "B")
            else Action(0, "B", a.microbatch, a.start_ns + 2 * MS, a.end_ns + 2 * MS) for a in tl.actions]
    stats = timeline_stats(IterationTimeline(1, 2, acts, 2))
    assert stats["link_delay_ms"][0] == pytest.approx((5.0 + 7.0) / 2)


def test_one_late_message_does_not_move_the_link_delay():
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


# -- cross-host clock alignment, 2 gloo ranks on loopback ------------------------------------------

class _FakeStage:
    def __init__(self, index, num_stages):
        self.stage_index, self.num_stages = index, num_stages

    def forward_one_chunk(self, mb, *args, **kwargs):
        import time
        time.sleep(0.02)

    def backward_one_chunk(self, mb, loss=None, full_backward=True, last_backward=False):
        pass

    def backward_weight_one_chunk(self, mb, last_backward=False):
        pass


class _FakeSchedule:
    def __init__(self, stage):
        self._stages = [stage]

    def step(self):
        for stage in self._stages:
            stage.forward_one_chunk(0)


def _clock_worker(rank, world, skew_ns):
    import time

    import torch.distributed as dist

    from titan_ext.titan import monitor

    # pretend every rank is on its own host, with a clock ``skew_ns * rank`` ahead
    monitor.socket.gethostname = lambda: f"host{rank}"
    clock = lambda: time.monotonic_ns() + skew_ns * rank  # noqa: E731
    mon = monitor.PipelineMonitor(_FakeSchedule(_FakeStage(rank, world)), dist.group.WORLD, clock=clock)
    dist.barrier()
    mon.schedule.step()
    tl = mon.gather(step=1)
    return mon.clock_offset_ns, ({a.stage: a.start_ns for a in tl.actions} if rank == 0 else None)


@pytest.mark.multiprocess
def test_clock_offsets_across_hosts_are_estimated_and_removed():
    # run_ranks: gloo on loopback, and each rank leaves without interpreter finalisation (a gloo
    # worker thread still releasing the last all_gather_object's tensors when the interpreter
    # finalises is ended inside a C++ destructor: SIGABRT after a clean run, seen under load)
    skew = 5_000_000_000  # rank 1's clock is 5 s ahead
    results = run_ranks(_clock_worker, 2, skew, backend="gloo", timeout_s=120)
    offsets = sorted(r[0] for r in results)
    assert offsets[0] == 0
    assert abs(offsets[1] - skew) < 50_000_000  # barrier exit skew on loopback: well below 50 ms
    starts = next(r[1] for r in results if r[1] is not None)
    # both ranks started their F right after the same barrier: aligned, not 5 s apart
    assert abs(starts[1] - starts[0]) < 100_000_000


def test_the_monitor_keeps_nothing_per_step():
    """1000 steps leave the monitor's containers as large as 10 did (a run-long job must not grow a
    list a step)."""
    from titan_ext.titan import monitor

    class _QuickStage(_FakeStage):
        def forward_one_chunk(self, mb, *args, **kwargs):
            pass

    mon = monitor.PipelineMonitor(_FakeSchedule(_QuickStage(0, 1)), None)

    def sizes():
        return {k: len(v) for k, v in vars(mon).items() if isinstance(v, (list, dict, set, tuple))}

    for _ in range(10):
        mon.schedule.step()
    after_10 = sizes()
    for _ in range(990):
        mon.schedule.step()
    assert sizes() == after_10
