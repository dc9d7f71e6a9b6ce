"""TorchTitan's Trainer with titan_ext's checks before the process group, Falcon's job-level driver
for DP × PP jobs, and delegate cleanup.

The pipeline metrics, timeline images and W&B extras do not need this class: they follow the
schedule (:mod:`titan_ext.titan.metrics`), so stock ``torchtitan.train`` reports them too. What does
need it is DP × PP with Falcon (:mod:`titan_ext.titan.falcon_job`): the trainer syncs the DP replicas
itself and applies Falcon's mitigations to the next steps.
"""

import torch
from torchtitan.train import Trainer

from titan_ext.titan.falcon_job import FalconJob, install_replication_by_trainer, replicated_by_trainer
from titan_ext.titan.options import titan_ext_section

__all__ = ["TitanExtTrainer"]


class TitanExtTrainer(Trainer):
    """``Trainer`` + :func:`titan_ext.train.check_job_config` before any process group exists (it
    fills the one-stage-per-rank split our schedules need) + Falcon in DP × PP jobs + closing
    delegate processes."""

    def __init__(self, job_config):
        from titan_ext.train import _world_size, check_job_config

        check_job_config(job_config, world_size=_world_size())
        install_replication_by_trainer()
        from titan_ext.titan.registry import active_job_config

        with active_job_config(job_config):  # the model split reads [titan_ext] placement
            super().__init__(job_config)
        # DP x PP: the trainer syncs the DP replicas, and Falcon runs at job level (falcon_job.py)
        self.falcon_job = (FalconJob(self, titan_ext_section(job_config))
                           if replicated_by_trainer(self.parallel_dims) else None)

    def train(self):
        super().train()
        self._trained = True

    def train_step(self, data_iterator):
        if self.falcon_job is not None:
            self.falcon_job.train_step(super().train_step, data_iterator)
        else:
            super().train_step(data_iterator)
        if self.step == 1:  # TorchTitan's rule: the train timeout once the first step is done
            from titan_ext.runtime import timeouts

            timeouts.set_timeout(self.job_config.comm.train_timeout_seconds)

    def forward_backward_step(self, **kwargs):
        loss = super().forward_backward_step(**kwargs)
        if self.falcon_job is not None:
            self.falcon_job.after_backward()
        return loss

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
