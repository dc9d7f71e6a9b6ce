"""JSON-lines files the job appends to (the pipeline metrics, Falcon's decisions and events): a line is
written whole or not at all, and a full disk never stops training.

:func:`append_lines` writes a batch of lines with ``O_APPEND`` and, when a write fails part-way (``ENOSPC``,
``EDQUOT``, ``EIO``), truncates the file back to its length before the batch, so a reader never meets a
half-written line. :class:`LineLog` is what the job holds: it warns once when its file stops taking lines
(and once when it takes them again), counts the lines lost, and never raises ``OSError``.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from torchtitan.tools.logging import logger

__all__ = ["append_lines", "LineLog"]


def append_lines(path: Path, lines: list[str]) -> None:
    """Append ``lines`` (each without its newline) to ``path`` — all of them or none: on an ``OSError``
    the file is cut back to its length before the call, then the error is raised."""
    data = memoryview("".join(line + "\n" for line in lines).encode())
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.fstat(fd).st_size  # one writer per file: the batch starts here
        try:
            while data:
                data = data[os.write(fd, data):]
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            raise
    finally:
        os.close(fd)


class LineLog:
    """One appended JSON-lines file of the job (``what`` names it in the log)."""

    def __init__(self, path: Path, what: str):
        self.path, self.what = Path(path), what
        self.lost = 0
        """Lines not written (their batch met a full disk or another write error)."""
        self._failing = False

    def append(self, lines: list[str]) -> bool:
        """Write ``lines`` whole or not at all; False (and a WARNING the first time) when they were not."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            append_lines(self.path, lines)
        except OSError as e:
            self.lost += len(lines)
            if not self._failing:
                logger.warning(f"[titan_ext] cannot append to {self.what} {self.path}: {e.strerror or e}; training "
                               f"goes on, the file keeps whole lines only, and lines are lost until it can be written")
            self._failing = True
            return False
        if self._failing:
            logger.warning(f"[titan_ext] {self.what} {self.path} is written again ({self.lost} line(s) lost)")
            self._failing = False
        return True
