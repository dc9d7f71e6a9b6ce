"""``device.Latch``, the per-receive completion flag: the ``threading.Event`` semantics the receive path
relies on (set once by one thread, waited by any number, with and without a timeout)."""

from __future__ import annotations

import threading
import time

from titan_ext.runtime.execute.device import Latch


def test_unset_latch_times_out_and_set_latch_returns_at_once():
    latch = Latch()
    assert not latch.is_set()
    t0 = time.perf_counter()
    assert latch.wait(0.05) is False
    assert time.perf_counter() - t0 >= 0.04
    assert latch.wait(0) is False
    latch.set()
    latch.set()  # a second set is a no-op, as an Event's
    assert latch.is_set()
    assert latch.wait() is True and latch.wait(0) is True and latch.wait(1.0) is True


def test_every_waiter_is_released_by_one_set_from_another_thread():
    latch, released, started = Latch(), [], threading.Barrier(6)

    def waiter(k: int) -> None:
        started.wait()
        released.append((k, latch.wait(10.0), latch.is_set()))

    threads = [threading.Thread(target=waiter, args=(k,)) for k in range(5)]
    for t in threads:
        t.start()
    started.wait()
    time.sleep(0.05)
    assert released == []  # nobody passes an unset latch
    threading.Thread(target=latch.set).start()
    for t in threads:
        t.join(10.0)
    assert sorted(released) == [(k, True, True) for k in range(5)]
