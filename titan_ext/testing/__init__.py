"""Test backends and harness of titan_ext's tests and scripts; no part of a job.

| module | what |
|---|---|
| ``nccl_rules`` | the ``nccl_rules`` CPU process-group backend: NCCL's rules enforced over gloo |
| ``simdevice`` | the asynchronous-device simulation behind the runtime's device layer |
| ``ranks`` | ``run_ranks`` (spawned ranks on loopback, one process group each), ``free_port``, ``chosen_backend`` |
| ``launch`` | ``torchrun`` / ``torchrun_command``: the one torchrun launcher |
| ``models`` | deterministic MLP stages, seeded batches, ``step_rank``, ``sgd_step``, ``counted_sgd_step``, ``train_steps``, ``gpipe_reference``, sleep stages |

Layering: this package sits on ``titan_ext.runtime`` (it may import it and plan/); nothing in plan/
or runtime/ imports it (tests/plan/test_plan_imports.py), and it imports nothing of titan/ or the entry
points.  Nor does the product name it: test code registers itself into hooks the product owns
(``nccl_rules.install`` → the delegate ring's host marker, ``lagdevice.install`` → the device layer and
the delegate's stream wait, ``cpu_setup`` → TorchTitan's CPU shim).
"""

from .launch import torchrun, torchrun_command
from .models import (
    SleepComputeStage,
    TinyTransformerStage,
    counted_sgd_step,
    gpipe_reference,
    mlp_stages,
    seeded_batch,
    sgd_step,
    static_stage_shapes,
    step_rank,
    timed_step,
    train_steps,
)
from .ranks import DEFAULT_BACKEND, chosen_backend, free_port, run_ranks

__all__ = ["DEFAULT_BACKEND", "SleepComputeStage", "TinyTransformerStage", "chosen_backend", "counted_sgd_step",
           "free_port", "gpipe_reference", "mlp_stages", "run_ranks", "seeded_batch", "sgd_step",
           "static_stage_shapes", "step_rank", "timed_step", "torchrun", "torchrun_command", "train_steps"]
