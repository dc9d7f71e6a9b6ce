"""Single-process tests of the compiled data plane and the sizing rule (fast, no delegates)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from titan_ext.runtime.comm.delegate import delegates_needed, our_shm_names, sweep_stale_segments
from titan_ext.runtime.comm.delegate import ring as R


def test_segment_is_0600_and_nameless_while_mapped():
    ring = R.SlotRing.create(4, 1 << 16)
    name = ring.region.name
    assert name.startswith(f"/titanx_{os.getpid()}_")
    assert our_shm_names([os.getpid()]) == []                     # unlinked at once
    assert not os.path.exists("/dev/shm" + name)
    st = os.fstat(ring.region.fd)
    assert st.st_mode & 0o777 == 0o600
    assert st.st_size == ring.geometry.total_bytes


def test_header_roundtrip_and_payload_views_share_memory():
    ring = R.SlotRing.create(2, 4096)
    t = torch.arange(24, dtype=torch.bfloat16).reshape(2, 3, 4)
    n = ring.write_header(1, 77, t)
    ring.copy_in(1, t, n)
    assert ring.read_header(1) == (77, 48, torch.bfloat16, (2, 3, 4))
    assert torch.equal(ring.typed_view(1, torch.bfloat16, (2, 3, 4)), t)
    with pytest.raises(ValueError, match="exceeds the delegate slot size"):
        ring.write_header(0, 1, torch.zeros(2048, dtype=torch.float32))


def test_flag_wait_release_acquire_across_threads():
    ring = R.SlotRing.create(1, 1 << 20)
    payload = torch.randn(1 << 18)

    def producer():
        time.sleep(0.05)
        ring.copy_in(0, payload, payload.numel() * 4)
        ring.set_state(0, R.READY)          # release store + futex wake

    th = threading.Thread(target=producer)
    t0 = time.perf_counter()
    th.start()
    assert ring.wait_state(0, R.READY, 5.0) == 0          # acquire
    waited = time.perf_counter() - t0
    assert torch.equal(ring.typed_view(0, torch.float32, (1 << 18,)), payload)
    th.join()
    assert 0.04 < waited < 2.0
    assert ring.wait_state(0, R.FREE, 0.05) == 1          # timeout
    ring.set_error("boom")
    assert ring.wait_state(0, R.FREE, 5.0, R.CTRL_ERROR) == 2
    assert ring.error_text() == "boom"


def test_sweep_removes_only_names_of_dead_creators():
    dead = 2 ** 22 + 12345
    while os.path.exists(f"/proc/{dead}"):
        dead += 1
    path = f"/dev/shm/titanx_{dead}_deadbeef"
    with open(path, "wb") as f:
        f.write(b"x")
    live = R.load_ext().Region.create(4096, "titanx", True)   # keep_name: ours, creator alive
    try:
        removed = sweep_stale_segments()
        assert f"titanx_{dead}_deadbeef" in removed and not os.path.exists(path)
        assert os.path.exists("/dev/shm" + live.name)
    finally:
        os.unlink("/dev/shm" + live.name)


@pytest.mark.parametrize("prod, per, want", [(8, 2, 4), (1, 2, 1), (9, 2, 5), (100, 1, 8), (0, 1, 1)])
def test_delegates_needed_follows_production_over_per_delegate_rate(prod, per, want):
    assert delegates_needed(prod, per, max_delegates=8) == want
