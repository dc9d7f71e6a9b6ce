"""Falcon in the DP x PP job on a GPU, checked on CPU (Deliver 2):

* the detector is fed the step's *device* time (the fake CUDA of ``tests/_fake_cuda.py``: a device
  that runs behind the host), not the host's enqueueing time;
* Falcon's start-up allocates a bounded amount, whatever the stage's size (docs/falcon.md's table).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from _allocations import NewStorageBytes
from _fake_cuda import FakeGPU, install
from titan_ext.titan.falcon_job import FalconJob
from titan_ext.runtime.falcon.measure import StepClock

KERNEL_MS, HOST_MS = 40.0, 0.5


def test_the_detector_is_fed_the_device_time_of_a_step(monkeypatch):
    """A step whose kernels take 3 x 40 ms on the device while the host enqueues them in 1.5 ms, after
    a 200 ms backlog left by the previous step: the step's record (what the exchange sends and the
    detector gets) holds the device's 120 ms, read once the device ran it — without a host sync."""
    gpu = FakeGPU(index=0)
    install(monkeypatch, gpu)
    ended: list = []
    job = SimpleNamespace(
        enabled=True, step_clock=StepClock(torch.device("cuda", 0)), emulation=SimpleNamespace(step=0),
        trainer=SimpleNamespace(step=7, gradient_accumulation_steps=0), data_iterator=None,
        pp_delays=SimpleNamespace(maybe_install=lambda pipeline: None), grid=[[0]], dp_index=0, _steps=0,
        _my_chunks=lambda it: [next(it), next(it), next(it)], dp=SimpleNamespace(step_started=lambda: None))
    job._after_step = lambda: ended.append(job.step_clock.stop())
    syncs_before = gpu.event_syncs

    def run_step(chunks):
        for _ in chunks:
            gpu.kernel(KERNEL_MS)
            gpu.host_work(HOST_MS)

    for backlog_ms in (0.0, 200.0):
        gpu.kernel(backlog_ms)
        with torch.cuda.device(torch.device("cuda", 0)):
            FalconJob.train_step(job, run_step, iter(range(3)))
    gpu.host_work(1e3)  # the device catches up
    with torch.cuda.device(torch.device("cuda", 0)):
        read = job.step_clock.read()
    assert [s.index for s in read] == [0, 1] and read == ended
    assert [s.seconds for s in read] == [pytest.approx(3 * KERNEL_MS / 1e3, abs=1e-6)] * 2
    assert gpu.device_syncs == 0 and gpu.event_syncs == syncs_before and gpu.violations == []


def _startup_bytes(rank: int, world: int, numel: int, probe_bytes: int, dump: str) -> int:
    """Falcon's start-up measurements on a DP 2 x PP 1 stage of ``numel`` fp32 parameters (the
    calls :class:`FalconJob` makes: DP sync base, S3's cost, S4's cost); the bytes they allocate."""
    import torch.distributed as dist

    from titan_ext.runtime.falcon import FalconConfig, FalconMonitor, device_clock
    from titan_ext.titan.falcon_costs import JobCosts
    from titan_ext.titan.falcon_dp import DPSync
    from titan_ext.titan.falcon_s4 import estimate_s4_cost

    device_clock.PROBE_BYTES = probe_bytes
    torch.manual_seed(rank)
    part = torch.nn.Linear(numel // 64, 64, bias=False)
    opt = torch.optim.AdamW(part.parameters())
    trainer = SimpleNamespace(model_parts=[part], optimizers=SimpleNamespace(optimizers=[opt]))
    control = device_clock.control_group()
    monitor = FalconMonitor(FalconConfig(num_microbatches=2), grid=[[0], [1]])
    with NewStorageBytes(list(part.parameters())) as counted:
        dp = DPSync(trainer, SimpleNamespace(link_bytes_per_s=0.0), control, torch.device("cpu"))
        dp.regroup(dist.group.WORLD, control, [0, 1], 0, 1)
        JobCosts(monitor, control).measure_s3(trainer, [[0], [1]], 0, torch.device("cpu"))
        estimate_s4_cost(SimpleNamespace(trainer=trainer, control=control), dump)
    assert dp.base_s > 0 and 0 < monitor.config.costs.topology_adjustment < 60
    return counted.bytes


#: docs/falcon.md "Start-up memory": Falcon's start-up allocates at most 6 probes of PROBE_BYTES
#: (the DP all-reduce's, S3's send and receive and load copy, S4's sample and its reload), whatever
#: the stage's size — it once held ~10 bytes per parameter and more (two 3x-state
#: buffers, a copy of the stage and a full fp32 gradient buffer)
STARTUP_PROBES = 6


@pytest.mark.multiprocess
def test_falcon_startup_memory_is_bounded_whatever_the_stage_size(tmp_path):
    from titan_ext.testing import run_ranks

    numel, probe = 1 << 18, 64 << 10  # a 1 MiB stage, 64 KiB probes (64 MiB in a real job)
    got = run_ranks(_startup_bytes, 2, numel, probe, str(tmp_path), backend="gloo", timeout_s=180)
    for nbytes in got:
        assert nbytes <= STARTUP_PROBES * probe + (16 << 10), nbytes  # + a few small host vectors
