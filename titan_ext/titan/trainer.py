"""TorchTitan's Trainer with titan_ext's checks before the process group and delegate cleanup.

The pipeline metrics, timeline images and W&B extras do not need this class: they follow the
schedule (:mod:`titan_ext.titan.metrics`), so stock ``torchtitan.train`` reports them too.
"""

import torch
from torchtitan.train import Trainer

__all__ = ["TitanExtTrainer"]


class TitanExtTrainer(Trainer):
    """``Trainer`` + :func:`titan_ext.train.check_job_config` before any process group exists (it
    fills the one-stage-per-rank split our schedules need) + closing delegate processes."""

    def __init__(self, job_config):
        from titan_ext.train import _world_size, check_job_config

        check_job_config(job_config, world_size=_world_size())
        super().__init__(job_config)

    def train(self):
        super().train()
        self._trained = True

    def close(self) -> None:
        close_delegation = getattr(getattr(self, "pp_schedule", None), "close_delegation", None)
        if callable(close_delegation):
            close_delegation()
        super().close()
        if getattr(self, "_trained", False) and torch.distributed.is_initialized():
            # leave together after a successful run: a rank that exits while others still tear
            # down their process group has been seen to abort in a C++ destructor ("terminate
            # called without an active exception") on a loaded machine
            torch.distributed.barrier()
