"""What ``FalconJob.apply`` does to a job's layout, on the host model of the Falcon tests: the split and
grid in force after a decision's changes (S2's split; S3's grid, set on the monitor, and the split
re-planned for the new replicas), with the strategies applied."""

from __future__ import annotations

from typing import Any


def apply_on_model(changes: Any, split: list[int], grid: list[list[int]], even: list[int],
                   monitor: Any) -> tuple[list[int], list[list[int]], list[str]]:
    """(split, grid, the names of ``changes.applied`` in order) after ``changes``."""
    from titan_ext.runtime.falcon.apply import replanned_split

    for name in changes.applied:
        if name == "microbatch_redistribution":
            split = list(changes.split)
        elif name == "topology_adjustment":
            grid = [list(r) for r in changes.grid]
            monitor.set_grid(grid)
            if split != even:
                split = replanned_split(monitor, even)
    return split, grid, list(changes.applied)
