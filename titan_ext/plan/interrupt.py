"""Native solver calls that leave the process's signal handling as they found it.

OR-Tools' CP-SAT installs its own C-level SIGINT handler during ``CpSolver.Solve`` (parameter
``catch_sigint_signal``, on by default) and, when the solve ends, sets the kernel's SIGINT action to
SIG_DFL -- while Python's ``signal.getsignal`` still reports Python's handler. After one optimal solve
a Ctrl-C killed the process at once: no ``KeyboardInterrupt``, no cleanup of temporary files, and a
library user's interpreter died.

:func:`solve` is the one way plan/ runs a CP-SAT model:

- the solver never touches the signal handlers (``catch_sigint_signal = False``);
- while it runs, a SIGINT, SIGTERM or SIGALRM that would reach a Python handler is held back: SIGINT and
  SIGTERM stop the search at once (``StopSearch`` from a watcher thread woken by
  ``signal.set_wakeup_fd``; a wake-up fd the caller had, e.g. asyncio's, still receives every byte);
- afterwards the handlers are installed again as they were (:func:`signal_handlers_kept`, which also
  sets the kernel's action back should anything native have changed it), and only then is each
  held-back signal handed to its own handler, as after any blocking call: Python's default SIGINT
  handler raises ``KeyboardInterrupt`` there -- never in the middle of the clean-up.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
from typing import Any, Iterator

#: the signals whose handlers a native call must leave as it found them
KEPT_SIGNALS = tuple(s for s in (getattr(signal, "SIGINT", None), getattr(signal, "SIGTERM", None)) if s is not None)
#: the signals whose Python handlers wait until a native call has returned and cleaned up (SIGALRM: the
#: CLI's --time-limit alarm)
HELD_SIGNALS = KEPT_SIGNALS + tuple(s for s in (getattr(signal, "SIGALRM", None),) if s is not None)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def signals_deferred(signals: tuple[int, ...] = KEPT_SIGNALS) -> Iterator[None]:
    """SIGINT and SIGTERM wait (blocked, still pending) until the body is done: for the few steps that must
    not be cut in half -- a temporary file created and recorded, outputs renamed into place, temporary
    files removed. (A signal that arrived just before still runs its handler at the body's first step.)"""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, set(signals))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def signal_handlers_kept(signals: tuple[int, ...] = KEPT_SIGNALS) -> Iterator[None]:
    """Run the body, then install the Python-level handlers of ``signals`` again as they were before
    (``signal.signal(sig, saved)`` re-sets the kernel's action too, which native code may have reset
    behind Python's back). Outside the main thread Python cannot install handlers: nothing to do."""
    if not _in_main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:  # None: installed by native code before Python looked; leave it
                signal.signal(sig, handler)


@contextlib.contextmanager
def _held_back(signals: tuple[int, ...], stopping: set[int], stop: Any) -> Iterator[None]:
    """While the body runs, the Python handlers of ``signals`` (those that have one) only record their
    signal (``stop()`` for one in ``stopping``, called at once from a watcher thread since the main thread
    is blocked in native code); afterwards the handlers are put back and the recorded signals handed to
    them in order. Main thread only; elsewhere the body runs as is."""
    if not _in_main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in signals}
    caught: list[int] = []
    r, w = os.pipe()  # the wake-up fd: one byte per signal
    quit_r, quit_w = os.pipe()  # ends the watcher at once (no polling)
    os.set_blocking(w, False)
    previous = None  # the caller's wake-up fd once ours is installed
    watcher = None

    def hold(signum, frame) -> None:
        caught.append(signum)

    def watch() -> None:
        while True:
            ready, _, _ = select.select([r, quit_r], [], [])
            if r in ready:
                data = os.read(r, 512)
                if previous not in (None, -1):  # the caller's wake-up fd (asyncio ...) still hears every signal
                    with contextlib.suppress(OSError):
                        os.write(previous, data)
                if stopping & set(data):
                    stop()
            if quit_r in ready:
                return

    try:
        for sig, handler in saved.items():
            if callable(handler):  # a Python handler; SIG_DFL / SIG_IGN / native ones stay as they are
                signal.signal(sig, hold)
        with contextlib.suppress(ValueError, OSError):  # no wake-up fd here: no early stop, still held back
            previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        if previous is not None:
            watcher = threading.Thread(target=watch, name="titan-ext-solver-signals", daemon=True)
            watcher.start()
        yield
    finally:
        if previous is not None:
            signal.set_wakeup_fd(previous)
        os.write(quit_w, b"q")
        if watcher is not None:
            watcher.join()
        for fd in (r, w, quit_r, quit_w):
            os.close(fd)
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)
    frame = sys._getframe()
    for signum in caught:  # as after any blocking call (a KeyboardInterrupt is raised here)
        handler = saved[signum]
        if callable(handler):
            handler(signum, frame)


def solve(solver: Any, model: Any) -> int:
    """``solver.Solve(model)`` (OR-Tools CP-SAT) without touching the process's signal handling: see the
    module docstring. Returns the solver's status."""
    solver.parameters.catch_sigint_signal = False
    stopping = {int(s) for s in KEPT_SIGNALS}
    with signal_handlers_kept(), _held_back(HELD_SIGNALS, stopping, solver.StopSearch):
        return solver.Solve(model)
