"""Fail fast, with a clear message, on a torch without the pipelining internals the runtime uses.

The runtime extends private parts of ``torch.distributed.pipelining`` (its action IR, lowering
passes and ``_PipelineScheduleRuntime``), which change between torch releases without notice. They
are tested with the torch range pinned in pyproject.toml (:data:`TESTED`); :func:`check_torch`
names every missing internal instead of letting the first ``from ... import _X`` fail somewhere deep.
"""

import importlib

TESTED = ">=2.13,<2.14"  # keep equal to pyproject.toml's torch requirement

# module -> private names the runtime (and plan/ir.py, plan/validate.py) use
REQUIRED = {
    "torch.distributed.pipelining.schedules": (
        "_Action", "_ComputationType", "_PipelineContext", "_PipelineScheduleRuntime",
        "_wait_batch_p2p", "_batch_p2p", "_validate_schedule", "_add_send_recv",
        "_add_reduce_grad", "_add_unshard_reshard", "_simulate_comms_compute",
        "_format_pipeline_order", "_PipelineScheduleRuntime._prepare_schedule_with_comms",
    ),
    "torch.distributed.pipelining.stage": ("_PipelineStageBase",),
}


def _has(obj, dotted: str) -> bool:
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def missing_internals() -> list[str]:
    """Fully qualified names of the required internals this torch lacks."""
    missing = []
    for module, names in REQUIRED.items():
        try:
            mod = importlib.import_module(module)
        except ImportError:
            missing.append(module)
            continue
        missing += [f"{module}.{name}" for name in names if not _has(mod, name)]
    return missing


def check_torch() -> None:
    """Raise ImportError naming the missing internals (and the tested torch range)."""
    missing = missing_internals()
    if missing:
        import torch

        raise ImportError(
            f"titan_ext.runtime needs torch{TESTED} (tested); torch {torch.__version__} lacks "
            f"{', '.join(missing)}")
