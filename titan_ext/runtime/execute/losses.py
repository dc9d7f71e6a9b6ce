"""Losses and outputs by micro-batch index, whatever order a plan runs the forwards in.

torch's runtime keeps the last stage's losses in a list in forward order and reads the loss of a
backward by position; a re-planned schedule may run micro-batches in any order, so an adaptive schedule
keys them by micro-batch index (:class:`MicrobatchLosses`: torch's ``_maybe_compute_loss`` /
``_maybe_get_loss`` hooks read and write it) and hands torch the list in micro-batch order at the end of
the iteration, with the last stage's outputs sorted the same way (:func:`sort_outputs`).
"""

from __future__ import annotations

from typing import Any, Callable

from .executor import forward_order

__all__ = ["MicrobatchLosses", "sort_outputs"]


class MicrobatchLosses:
    """One iteration's losses on this rank's last stage, by micro-batch index."""

    def __init__(self, name: str):
        self.name = name
        self.by_mb: dict[int, Any] = {}

    def compute(self, mb: int, loss: Callable[[], Any]) -> None:
        if mb in self.by_mb:
            raise AssertionError(f"{self.name}: microbatch {mb} forwarded twice on the last stage")
        self.by_mb[mb] = loss()

    def get(self, mb: int) -> Any:
        if mb not in self.by_mb:
            raise RuntimeError(f"{self.name}: backward of microbatch {mb} before its loss "
                               f"(losses so far: microbatches {sorted(self.by_mb)})")
        return self.by_mb[mb]

    def in_order(self, expected: int | None) -> list:
        """The losses in micro-batch order (cleared for the next iteration); ``expected``: how many there
        must be (None: no check, e.g. no last stage or no loss function)."""
        out = [self.by_mb[m] for m in sorted(self.by_mb)]
        self.by_mb.clear()
        if expected is not None and len(out) != expected:
            raise RuntimeError(f"{self.name}: {len(out)} losses for {expected} microbatches")
        return out


def sort_outputs(stages: list, actions: list) -> None:
    """Put the last stage's ``output_chunks`` in microbatch order (torch's ``step()`` merges them as
    appended, i.e. in the plan's forward order)."""
    for stage in stages:
        order = forward_order(actions, stage.stage_index)
        if stage.is_last and len(stage.output_chunks) == len(order) and order != sorted(order):
            by_mb = dict(zip(order, stage.output_chunks))
            stage.output_chunks[:] = [by_mb[m] for m in sorted(by_mb)]
