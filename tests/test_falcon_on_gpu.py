"""Falcon in the DP x PP job on a GPU, checked on CPU (issue 34, Deliver 2):

* the detector is fed the step's *device* time (the fake CUDA of ``tests/_fake_cuda.py``: a device
  that runs behind the host), not the host's enqueueing time;
* Falcon's start-up allocates a bounded amount, whatever the stage's size (docs/falcon.md's table).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from _fake_cuda import FakeGPU, install
from titan_ext.titan.falcon_job import FalconJob
from titan_ext.titan.falcon_measure import StepClock

KERNEL_MS, HOST_MS = 40.0, 0.5


def test_the_detector_is_fed_the_device_time_of_a_step(monkeypatch):
    """A step whose kernels take 3 x 40 ms on the device while the host enqueues them in 1.5 ms, after
    a 200 ms backlog left by the previous step: the detector gets the device's 120 ms."""
    gpu = FakeGPU(index=0)
    install(monkeypatch, gpu)
    fed: list[float] = []
    job = SimpleNamespace(
        enabled=True, step_clock=StepClock(torch.device("cuda", 0)), emulation=SimpleNamespace(step=0),
        trainer=SimpleNamespace(step=7, gradient_accumulation_steps=0), data_iterator=None,
        pp_delays=SimpleNamespace(maybe_install=lambda pipeline: None), grid=[[0]], dp_index=0,
        _my_chunks=lambda it: [next(it), next(it), next(it)], dp=SimpleNamespace(step_started=lambda: None),
        _falcon=fed.append)

    def run_step(chunks):
        for _ in chunks:
            gpu.kernel(KERNEL_MS)
            gpu.host_work(HOST_MS)

    for backlog_ms in (0.0, 200.0):
        gpu.kernel(backlog_ms)
        with torch.cuda.device(torch.device("cuda", 0)):
            FalconJob.train_step(job, run_step, iter(range(3)))
    assert fed == [pytest.approx(3 * KERNEL_MS / 1e3, abs=1e-6)] * 2
    assert gpu.device_syncs == 0 and gpu.violations == []
