"""A new adaptive schedule added in this one file, the way docs/ARCHITECTURE.md ("Adding an adaptive
schedule") tells a user to, and trained for 2 steps under TorchTitan with ``[titan_ext] delegation =
"auto"`` and the schedule's own knob set in ``[titan_ext]``.

The recipe, as followed here:

1. a config dataclass: an ``AdaptiveConfig`` subclass whose added fields are the schedule's settings,
   each documented by its docstring (``FixedWarmupConfig.warmup_rule``);
2. a planner choice per layout (``_one_stage``; several stages per rank: PipeMorph's);
3. the registry entry, ``ScheduleSpec``, registered by ``register_schedule`` (which returns the class);
4. for TorchTitan: the module is the job's ``job.custom_config_module`` and exports
   ``JobConfig = job_config_class()``, so its import registers the schedule before the config is parsed,
   ``pipeline_parallel_schedule = "FixedWarmup"`` finds it and ``[titan_ext] warmup_rule`` is a knob.

Nothing else: no table in titan/, no delegation subclass (delegation is every adaptive schedule's).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from _titan_version import TITAN_EXT_TRAIN, TOML_CONFIG, tt02_only

from titan_ext.runtime import AdaptiveConfig, ScheduleSpec, register_schedule
from titan_ext.runtime.schedules.pipemorph import PIPEMORPH
from titan_ext.runtime.decide.planning import PipeMorphPlanner
from titan_ext.titan.config import job_config_class

WARMUP_RULES = ("pipemorph", "zb", "zb-h1")


@dataclass(frozen=True)
class FixedWarmupConfig(AdaptiveConfig):
    """``AdaptiveConfig`` plus the warm-up rule of every plan."""

    backward: str = "split"
    warmup_rule: str = "pipemorph"
    """Warm-up counts of every plan: "pipemorph" (PipeMorph's Alg.1 / Alg.2), "zb" (x_i = 2(S-i)-1)
    or "zb-h1" (x_i = S-i, 1F1B's memory)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.warmup_rule not in WARMUP_RULES:
            raise ValueError(f"warmup_rule must be one of {WARMUP_RULES}, got {self.warmup_rule!r}")


def _one_stage(config: FixedWarmupConfig) -> PipeMorphPlanner:
    return PipeMorphPlanner(schedule=config.warmup_rule)


FIXED_WARMUP = ScheduleSpec("FixedWarmup", one_stage_planner=_one_stage,
                            multi_stage_planner=PIPEMORPH.multi_stage_planner, config_class=FixedWarmupConfig,
                            backward_choices=("split", "full"))
FixedWarmup = register_schedule(FIXED_WARMUP, module=__name__)

JobConfig = job_config_class()  # TorchTitan's [titan_ext] section, FixedWarmup's knob included

ROOT = Path(__file__).resolve().parents[2]


def test_the_configs_own_field_is_a_documented_titan_ext_knob():
    """Registered, the schedule's config field is a [titan_ext] knob (its docstring is the knob's help),
    validated while the config is parsed; the value reaches the schedule's config and its planner."""
    from titan_ext.titan.config import TitanExtConfigError, field_docs, registered_knobs, section_class
    from titan_ext.titan.options import schedule_kwargs
    from titan_ext.titan.registry import schedule_class_for

    knob = registered_knobs()["warmup_rule"]
    assert knob.schedules == ("FixedWarmup",) and knob.default == "pipemorph"
    assert knob.doc == field_docs(FixedWarmupConfig)["warmup_rule"] and knob.doc.startswith("Warm-up counts")
    section = section_class()
    job = JobConfig(titan_ext=section(warmup_rule="zb-h1", delegation="auto"))
    cls = schedule_class_for("fixedwarmup", job)
    assert issubclass(cls, FixedWarmup)
    config = schedule_kwargs(cls, job)["config"]
    assert type(config) is FixedWarmupConfig and config.warmup_rule == "zb-h1"
    assert config.delegation.mode == "auto"  # delegation: the same for every adaptive schedule
    assert cls.spec.one_stage_planner(config).schedule == "zb-h1"
    with pytest.raises(TitanExtConfigError, match=r"\[titan_ext\] warmup_rule = 'zb-h2': warmup_rule must be"):
        section(warmup_rule="zb-h2")


@pytest.mark.slow  # a 4-rank TorchTitan job (about 20 s)
@pytest.mark.timeout(600)
@tt02_only(TITAN_EXT_TRAIN + " and " + TOML_CONFIG)
def test_fixed_warmup_trains_two_steps_under_torchtitan_with_delegation_auto(tmp_path):
    """4 ranks (torchrun, the bundled CPU debug job, PP = 4), ``pipeline_parallel_schedule =
    "FixedWarmup"``, ``[titan_ext] delegation = "auto"`` and ``warmup_rule = "zb-h1"`` on the command
    line: the job trains 2 steps with this schedule, and its plans have zb-h1's warm-up counts
    (x_i = S - i), not PipeMorph's Alg.1 (x_i = 2(S-i)-1 here)."""
    from titan_ext.plan import zb_h1_warmup_counts
    from titan_ext.testing import chosen_backend, torchrun
    from titan_ext.testing.nccl_rules import ENV_VAR as TEST_BACKEND_VAR

    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent), str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for var in ("TITAN_EXT_INJECT_DELAYS", "TITAN_EXT_SLOW_DEVICE", "TITAN_EXT_SLOW_LINK"):
        env.pop(var, None)
    env[TEST_BACKEND_VAR] = chosen_backend()
    log = tmp_path / "train.log"
    p = torchrun(4, ["-m", "titan_ext.train", "--job.config_file", "train_configs/debug_cpu.toml",
                     "--job.custom_config_module", Path(__file__).stem, "--job.dump_folder", str(tmp_path),
                     "--training.steps", "2", "--parallelism.pipeline_parallel_schedule", "FixedWarmup",
                     "--titan_ext.delegation", "auto", "--titan_ext.warmup_rule", "zb-h1",
                     "--titan_ext.gantt_every", "0"],
                 log=log, cwd=ROOT, env=env, timeout=540, local_ranks_filter=3)
    assert p.returncode == 0, log.read_text()[-4000:]
    with open(tmp_path / "pipeline_metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert [r["step"] for r in rows] == [1, 2], rows
    assert all(r["schedule"] == "FixedWarmup" for r in rows), rows
    assert all(r["delegation"] in ("auto", "active") for r in rows), rows  # delegation = "auto" in force
    assert all(list(r["runtime"]["warmup_counts"]) == list(zb_h1_warmup_counts(4)) for r in rows), \
        [r["runtime"].get("warmup_counts") for r in rows]
