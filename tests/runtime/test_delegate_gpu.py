"""GPU tests of the delegate data plane (marker ``gpu``; skipped without CUDA).

Not run on CPU-only machines.  On a GPU machine run:
    .venv/bin/python -m pytest -m gpu tests/runtime/test_delegate_gpu.py
    compute-sanitizer --tool memcheck .venv/bin/python -m pytest -m gpu tests/runtime/test_delegate_gpu.py -k signal
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _need_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from titan_ext.runtime.comm.delegate._ext import load_ext

    if not load_ext().cuda_compiled():
        pytest.skip("titan_ext._delegate_C was built without CUDA (no nvcc or CPU torch at build time)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
@pytest.mark.parametrize("numel", [1, 4097, 1 << 22])
def test_d2h_then_h2d_with_signals_on_fresh_data_poisoned_destinations(dtype, numel):
    _need_cuda()
    from titan_ext.runtime.comm.delegate import ring as R
    from titan_ext.runtime.comm.delegate._ext import load_ext

    ext = load_ext()
    esize = torch.empty((), dtype=dtype).element_size()
    ring = R.SlotRing.create(2, numel * esize)
    ring.region.cuda_register()
    off = ring.geometry.slot_offset(0) + R.SLOT_PAYLOAD
    for trial in range(3):
        src = torch.randint(0, 255, (numel * esize,), dtype=torch.uint8, device="cuda").view(dtype)
        ring.payload(0, numel * esize).fill_(0xA5)          # poisoned host slot
        ring.set_state(0, R.WRITING, wake=False)
        ring.region.d2h_signal(src, off, ring.state_offset(0), R.READY)
        # the host waits on the flag only (no stream/device sync): the data must be there once it flips
        assert ring.wait_state(0, R.READY, 10.0) == 0
        host = ring.payload(0, numel * esize).clone()
        assert torch.equal(host, src.view(torch.uint8).cpu())
        dst = torch.full((numel * esize,), 0x5A, dtype=torch.uint8, device="cuda").view(dtype)  # poisoned
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        ring.set_state(0, R.BUSY, wake=False)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            ring.region.h2d_signal(off, dst, ring.state_offset(0), R.FREE, flag, trial + 1)
        ext.stream_wait_flag(flag, trial + 1)              # compute stream waits on the device signal
        check = dst.view(torch.uint8).clone()              # runs on the compute stream after the wait
        assert ring.wait_state(0, R.FREE, 10.0) == 0        # slot released by the GPU
        torch.cuda.synchronize()
        assert torch.equal(check, src.view(torch.uint8))


def _gpu_pipeline_worker(rank, world):
    import torch.distributed as dist

    from titan_ext.runtime.comm.delegate import DelegatePool, pipeline_channels
    from titan_ext.runtime.comm.delegate.transport import P2PRouter

    torch.cuda.set_device(0)  # all ranks share one GPU
    pool = DelegatePool(rank, pipeline_channels(rank, list(range(world))), num_slots=4, slot_bytes=8 << 20)
    router = P2PRouter(rank, pool, delegating=True)
    ok = True
    for mb in range(6):
        g = torch.Generator(device="cuda").manual_seed(100 * mb)
        expect = torch.randn(512, 1024, device="cuda", generator=g)
        if rank == 0:
            router.isend(expect, 1, "F")
        else:
            got = torch.full((512, 1024), float("nan"), device="cuda")
            router.irecv(got, rank - 1, "F").wait()
            ok &= bool(torch.equal(got, expect))
            if rank + 1 < world:
                router.isend(got, rank + 1, "F")
    torch.cuda.synchronize()
    dist.barrier()
    pool.close()
    return ok


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_sharing_one_gpu_exchange_activations_only_through_delegates(world):
    _need_cuda()
    from titan_ext.testing import run_ranks

    assert all(run_ranks(_gpu_pipeline_worker, world))
