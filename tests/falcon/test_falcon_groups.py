"""Falcon's host data never travels on a data group, and its emulation and probes act on the device
(defects 5 and 8).

Defect 5: on a GPU job the world and TorchTitan's mesh groups are NCCL groups, which take device
tensors only; Falcon's timings, data-loader chunks, coordinates and validation results are host data
and must use gloo control groups. The check here runs :class:`FalconJob` in a 4-rank DP 2 × PP 2
gloo world (the same mesh TorchTitan builds) under a recorder of every torch.distributed call: a call
on a *data group* (the world or a mesh group, the groups that are NCCL on a GPU job) must carry only
tensors Falcon made for the device (:func:`device_clock.to_device` / ``device_buffer``), and no
pickled objects or barriers. On a01ec7e the job's first call (``all_gather_object`` on the world)
already broke the rule.

Tiers: the nccl_rules job run and the CUDA-stretch check are default tier; the gloo + recorder run
(the one that fails on a01ec7e independently of nccl_rules) and the probe run are slow-marked
(each a 4- or 2-process spawn).

Defect 8 on CPU: what the device-side paths compute, with a recording stand-in for the CUDA timer
and sleep (the CUDA calls themselves are not run here: no GPU in CI).
"""

import os

import pytest
import torch
import torch.distributed as dist

from titan_ext.testing import run_ranks

from _falcon_trainer import chunks, fake_trainer, mesh_of_groups, step_runner, wrap_dist

_CHECKED = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list",
            "send", "recv", "barrier", "reduce_scatter", "gather_object", "batch_isend_irecv")


def _install_rule_recorder(data_groups: list, violations: list, calls: list) -> None:
    """Wrap the torch.distributed calls: on a data group, only device-made tensors."""
    from titan_ext.runtime.falcon.device_clock import made_for_device

    def is_data(group) -> bool:
        return group is None or group is dist.group.WORLD or any(group is g for g in data_groups)

    def tensors_of(args, kwargs):
        out = []
        for a in list(args) + list(kwargs.values()):
            if torch.is_tensor(a):
                out.append(a)
            elif isinstance(a, (list, tuple)) and a and all(torch.is_tensor(x) for x in a):
                out.extend(a)
            elif isinstance(a, (list, tuple)) and a and all(isinstance(x, dist.P2POp) for x in a):
                out.extend(op.tensor for op in a)
        return out

    def check(name, group, args, kwargs):
        data = is_data(group)
        calls.append((name, "data" if data else "control"))
        if data:
            if name.endswith("_object") or name.endswith("_object_list") or name == "barrier":
                violations.append(f"{name} (host objects / barrier) on a data group")
            for t in tensors_of(args, kwargs):
                if not made_for_device(t):
                    violations.append(f"{name}: host tensor {tuple(t.shape)} {t.dtype} on a data group")

    wrap_dist(_CHECKED, check)


def _job_worker(rank, world, outdir, backend):
    from torch.distributed.device_mesh import init_device_mesh

    from titan_ext.titan.falcon_job import FalconJob
    from titan_ext.runtime.falcon.measure import validate

    if backend == "nccl_rules":  # its groups carry no names, which DeviceMesh needs: the same
        mesh = mesh_of_groups(rank)  # layout from plain new_group calls
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_replicate"))
    data_groups = [mesh["pp"].get_group(), mesh["dp_replicate"].get_group()]
    violations, calls = [], []
    _install_rule_recorder(data_groups, violations, calls)
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1)
    trainer = fake_trainer(mesh, model, outdir)
    from titan_ext.titan.config import TitanExt

    section = TitanExt(emulate_slow_link="0-1:5", falcon=True, falcon_apply=True)
    job = FalconJob(trainer, section)
    run_step = step_runner(model, job)

    for step, split in ((1, None), (2, [4, 2])):  # the even split, then S2's exchange of chunks
        trainer.step = step
        if split:
            job.split = split
        model.zero_grad()
        job.train_step(run_step, iter(chunks(job.dp_index, step, 3)))
    validate(job.monitor, grid=job.grid, emulation=job.emulation, control=job.control, device=job.device,
             ring_groups=job.ring_groups())
    torch.save({"violations": violations, "calls": calls, "dp_sync_s": job.dp.sync_s,
                "grid": job.grid}, os.path.join(outdir, f"rank{rank}.pt"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", [pytest.param("gloo", marks=pytest.mark.slow), "nccl_rules"])
def test_falcon_job_keeps_host_data_off_the_data_groups(backend, tmp_path):
    """gloo + the recorder: the rule checked by this test alone; nccl_rules: the project's CPU
    backend with NCCL's rules (titan_ext/testing/nccl_rules.py) refuses host tensors itself."""
    run_ranks(_job_worker, 4, str(tmp_path), backend, backend=backend)
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    for r in res:
        assert r["violations"] == [], r["violations"][:5]
        kinds = {c for c in r["calls"]}
        # the job did use both kinds: gradients on the DP data group, host data on control groups
        assert ("all_reduce", "data") in kinds and ("all_reduce", "control") in kinds
        assert ("all_gather", "control") in kinds  # S2's chunks
        assert ("batch_isend_irecv", "data") in kinds  # ring validation buffers (batched, on the rings' groups)
    assert res[0]["grid"] == [[0, 2], [1, 3]]  # replica d = pipeline (d, d + 2)
    # device 0-1 is stage 0's DP link (+5 ms per message, 2 ring steps): its DP sync pays >= 10 ms
    assert res[0]["dp_sync_s"] >= 0.010 and res[1]["dp_sync_s"] >= 0.010


# --------------------------------------------------------------------------- defect 8 (device paths)


class _FakeEvent:
    """A CUDA event stand-in: completes when the test says so, with a given device time."""

    def __init__(self, clock):
        self.t, self.done = clock["t"], False

    def query(self):
        return self.done

    def synchronize(self):
        raise AssertionError("the stretch must not wait for the device on the critical path")


def test_cuda_stretch_sleeps_on_the_device_by_the_last_measured_region_without_host_sync(monkeypatch):
    from titan_ext.runtime.falcon.emulation import FailSlowEmulation, parse_slow_device
    from titan_ext.titan import falcon_emulate as falcon_emulate

    clock, sleeps, events = {"t": 0.0}, [], []

    class Timer:
        cuda = True

        def __init__(self, device):
            pass

        def mark(self):
            events.append(_FakeEvent(clock))
            return events[-1]

        def elapsed_s(self, start, end, wait=True):
            assert not wait
            return (end.t - start.t) if end.query() else None

    monkeypatch.setattr(falcon_emulate, "DeviceTimer", Timer)
    monkeypatch.setattr(falcon_emulate, "device_sleep", lambda s, device=None: sleeps.append((s, device)))
    emulation = FailSlowEmulation(0, [0], slow_device=parse_slow_device("0:4"))
    stretch = falcon_emulate.DeviceStretch(emulation, "cuda:0")
    start = stretch.timer.mark()
    clock["t"] = 0.010
    stretch.end("f", start)  # first forward: no completed measurement yet, no stretch
    assert sleeps == []
    start = stretch.timer.mark()
    clock["t"] = 0.025
    stretch.end("f", start)  # the first forward's events have not completed: still none
    assert sleeps == []
    for ev in events:
        ev.done = True
    start = stretch.timer.mark()
    clock["t"] = 0.040
    stretch.end("f", start)  # the second forward (15 ms) has completed: (4 - 1) x 15 ms on the device
    assert sleeps == [(pytest.approx(0.045), "cuda:0")]


def _probe_worker(rank, world, outdir):
    from titan_ext.runtime.falcon.device_clock import control_group
    from titan_ext.runtime.falcon.validation import gemm_probe

    control = control_group()
    factor = 4.0 if rank == 1 else 1.0
    times = gemm_probe(n=128, repeats=9, group=control, slowdown=lambda: factor, device="cpu")
    torch.save(times, os.path.join(outdir, f"rank{rank}.pt"))


@pytest.mark.slow
def test_gemm_probe_reads_the_emulated_slow_device_inside_its_timed_region(tmp_path):
    run_ranks(_probe_worker, 2, str(tmp_path), backend="gloo")
    times = torch.load(tmp_path / "rank0.pt")
    # fastest of 9: a 4x device reads >= 2x its healthy peer (half the effect, robust to load)
    assert set(times) == {0, 1} and times[1] >= 2.0 * times[0], times
