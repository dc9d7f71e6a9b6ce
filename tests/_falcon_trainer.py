"""FalconJob on a stand-in TorchTitan trainer, as tests/falcon/test_falcon_groups.py and
tests/falcon/test_falcon_host_syncs.py run it on 4 ranks: TorchTitan's (pp, dp_replicate) mesh built
from plain ``new_group`` calls, the trainer, each step's data-loader chunks and the step that runs
them, and a wrapper of torch.distributed's entry points that reports every call with its group."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist


def chunks(dp: int, step: int, k: int) -> list:
    """Replica ``dp``'s ``k`` data-loader chunks of ``step``: ({"input": 3 x 6}, 3 x 1 labels)."""
    g = torch.Generator().manual_seed(100 * step + dp)
    return [({"input": torch.randn(3, 6, generator=g)}, torch.randn(3, 1, generator=g)) for _ in range(k)]


class _Dim:
    def __init__(self, ranks, rank):
        self.ranks, self.rank = ranks, rank
        self.group = None

    def get_group(self):
        return self.group

    def size(self):
        return len(self.ranks)

    def get_local_rank(self):
        return self.ranks.index(self.rank)


def mesh_of_groups(rank: int) -> dict:
    """TorchTitan's (pp, dp_replicate) mesh of 4 ranks: pp groups {0,2}, {1,3}; DP groups {0,1}, {2,3}."""
    mesh = {}
    for name, groups in (("pp", [[0, 2], [1, 3]]), ("dp_replicate", [[0, 1], [2, 3]])):
        for ranks in groups:
            group = dist.new_group(ranks)
            if rank in ranks:
                mesh[name] = _Dim(ranks, rank)
                mesh[name].group = group
    return mesh


def fake_trainer(mesh: dict, model: torch.nn.Module, outdir: str, steps: int | None = None) -> SimpleNamespace:
    """The trainer attributes FalconJob reads (TorchTitan 0.2's ``job_config`` and 0.3's ``config``), at
    step 1, 3 chunks a step, AdamW; ``steps``: the job's ``training.steps`` (None: not set)."""
    job_config = SimpleNamespace(job=SimpleNamespace(dump_folder=outdir))
    if steps is not None:
        job_config.training = SimpleNamespace(steps=steps)
    return SimpleNamespace(
        parallel_dims=SimpleNamespace(get_mesh=lambda name: mesh[name]), gradient_accumulation_steps=3,
        model_parts=[model], optimizers=SimpleNamespace(optimizers=[torch.optim.AdamW(model.parameters())]),
        pp_schedule=SimpleNamespace(falcon=None), device=torch.device("cpu"), job_config=job_config,
        config=SimpleNamespace(dump_folder=outdir), step=1)


def step_runner(model: torch.nn.Module, job: Any) -> Callable[[Any], None]:
    """What ``job.train_step`` runs: each chunk's forward and backward, then ``job.after_backward()``."""

    def run_step(step_chunks):
        for inputs, labels in step_chunks:
            torch.nn.functional.mse_loss(model(inputs["input"]), labels, reduction="sum").backward()
            job.after_backward()

    return run_step


def wrap_dist(names: Sequence[str], on_call: Callable[[str, Any, tuple, dict], None]) -> None:
    """Wrap torch.distributed's ``names``: each call first reports ``on_call(name, group, args, kwargs)``
    (``group``: the ``group=`` argument, a batch's first op's, or a bare ``send``/``recv``'s third)."""
    for name in names:
        original = getattr(dist, name)

        def wrapped(*args, _name=name, _original=original, **kwargs):
            group = kwargs.get("group")
            if _name == "batch_isend_irecv":
                group = args[0][0].group
            elif _name in ("send", "recv") and len(args) > 2:
                group = args[2]
            on_call(_name, group, args, kwargs)
            return _original(*args, **kwargs)

        setattr(dist, name, wrapped)
