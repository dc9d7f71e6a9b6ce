"""TorchTitan's Trainer with titan_ext's checks before the process group, Falcon's job-level driver
for DP × PP jobs, and delegate cleanup -- one class for every supported TorchTitan version.

The base class comes from the TorchTitan adapter (:mod:`titan_ext.titan.adapters`): 0.2's
``torchtitan.train.Trainer`` (constructed with a TOML-parsed ``JobConfig``) or 0.3's
``torchtitan.trainer.Trainer``, for which the class also carries ``TitanExtTrainer.Config``: 0.3's
``Trainer.Config`` plus a ``titan_ext`` section (``slots=True``, as 0.3's ``Configurable`` requires), whose
``build()`` makes this trainer.

The pipeline metrics, timeline images and W&B extras do not need this class: they follow the
schedule (:mod:`titan_ext.titan.metrics`), so stock ``torchtitan.train`` reports them too (0.2). What does
need it is DP × PP with Falcon (:mod:`titan_ext.titan.falcon_job`): the trainer syncs the DP replicas
itself and applies Falcon's mitigations to the next steps.
"""

import time

import torch

from titan_ext.titan import adapters
from titan_ext.titan.checkpoint_guard import guard_checkpointer
from titan_ext.titan.falcon_dp import replicated_by_trainer
from titan_ext.titan.falcon_emulate import install_device_passes
from titan_ext.titan.falcon_job import FalconJob
from titan_ext.titan.falcon_s4 import S4Resume
from titan_ext.titan.jobcheck import check_job_config, world_size
from titan_ext.titan.options import titan_ext_section

__all__ = ["TitanExtTrainer"]


def _lock_dump_folder(config):
    """Rank 0 takes the dump folder's lock (:mod:`titan_ext.titan.dumplock`); a live job holding it
    ends this one in one line, exit 2 (torchrun then ends the other ranks)."""
    import os

    from titan_ext.titan.dumplock import DumpFolderBusy, DumpFolderLock
    from titan_ext.titan.entry import config_error_exit

    if os.environ.get("RANK", "0") != "0":
        return None
    try:
        return DumpFolderLock.acquire(_ADAPTER.dump_folder(config))
    except DumpFolderBusy as e:
        config_error_exit(e)

_ADAPTER = adapters.current()
_Base = _ADAPTER.trainer_base()


class TitanExtTrainer(_Base):
    """``Trainer`` + :func:`titan_ext.titan.jobcheck.check_job_config` before any process group exists (it
    fills the one-stage-per-rank split our schedules need) + checkpoints checked before they are loaded
    (:func:`~titan_ext.titan.checkpoint_guard.guard_checkpointer`) + Falcon in DP × PP jobs + closing
    delegate processes."""

    if _ADAPTER.PYTHON_CONFIGS:
        Config = _ADAPTER.trainer_config(_Base)

    def __init__(self, config):
        check_job_config(config, world_size=world_size())
        self._dump_lock = _lock_dump_folder(config)  # rank 0: one job per dump folder
        _ADAPTER.install_replication_by_trainer(config)
        _ADAPTER.use_pipeline_metrics(config)  # 0.3: this config's metrics processor, not the class
        from titan_ext.titan.registry import active_job_config

        # the model split and (0.3) the schedule builder read the titan_ext section
        with active_job_config(config):
            super().__init__(config)
        section = titan_ext_section(config)
        # a manifest beside every checkpoint saved, checked before any is loaded (checkpoint_guard.py)
        guard_checkpointer(self.checkpointer, trust=section.trust_checkpoint)
        # DP x PP: the trainer syncs the DP replicas, and Falcon runs at job level (falcon_job.py)
        self.falcon_job = FalconJob(self, section) if replicated_by_trainer(self.parallel_dims) else None
        if self.falcon_job is None and section.emulate_device_pass_ms > 0:
            install_device_passes(self, section.emulate_device_pass_ms)
        # a job the launcher restarted after Falcon's S4: its cost and outcome (falcon_s4.py)
        self.s4_resume = S4Resume.from_env(self, section.falcon_check_every)

    def train(self):
        super().train()
        self._trained = True

    def train_step(self, data_iterator):
        if self.s4_resume is not None:
            self.s4_resume.before_step(self.step)
        t0 = time.perf_counter()
        if self.falcon_job is not None:
            _ADAPTER.falcon_train_step(self.falcon_job, super().train_step, data_iterator)
        else:
            super().train_step(data_iterator)
        if self.s4_resume is not None:
            self.s4_resume.after_step(self.step, time.perf_counter() - t0)

    def forward_backward_step(self, **kwargs):
        loss = super().forward_backward_step(**kwargs)
        if self.falcon_job is not None:
            self.falcon_job.after_backward()
        return loss

    def close(self) -> None:
        delegation = getattr(getattr(self, "pp_schedule", None), "delegation", None)
        if delegation is not None:  # every adaptive schedule's transport (None: direct P2P)
            delegation.close()
        super().close()
        if getattr(self, "_dump_lock", None) is not None:
            self._dump_lock.release()
        if getattr(self, "_trained", False) and torch.distributed.is_initialized():
            # leave together after a successful run: a rank that exits while others still tear
            # down their process group has been seen to abort in a C++ destructor ("terminate
            # called without an active exception") on a loaded machine
            torch.distributed.barrier()
