"""TorchTitan's Trainer plus titan_ext's pipeline metrics, timeline images and W&B extras."""

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
from torchtitan.components.metrics import WandBLogger, _get_metrics_rank
from torchtitan.tools.logging import logger
from torchtitan.train import Trainer

from titan_ext.titan.gantt import write_timeline_png
from titan_ext.titan.monitor import IterationTimeline, PipelineMonitor, timeline_stats
from titan_ext.titan.options import titan_ext_section

__all__ = ["TitanExtTrainer", "runtime_metrics"]

# pipeline/delegation: 0 = direct P2P, 1 = auto mode, not delegating (yet), 2 = delegating
_DELEGATION_CODES = {"off": 0, "auto": 1, "active": 2}


def runtime_metrics(schedule: Any) -> dict[str, Any]:
    """The per-iteration metrics dict of a titan_ext runtime schedule ({} for torch's built-ins)."""
    for name in ("last_metrics", "metrics", "iteration_metrics", "last_iteration_metrics"):
        value = getattr(schedule, name, None)
        if callable(value):
            try:
                value = value()
            except TypeError:
                continue
        if isinstance(value, dict):
            return dict(value)
    return {}


def _flat_numbers(prefix: str, metrics: dict[str, Any]) -> dict[str, float]:
    """Numbers (and dicts of numbers) of ``metrics`` under ``prefix``, W&B-style keys."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, bool):
            out[f"{prefix}{key}"] = float(value)
        elif isinstance(value, (int, float)):
            out[f"{prefix}{key}"] = float(value)
        elif isinstance(value, dict):
            out.update(_flat_numbers(f"{prefix}{key}/", {str(k): v for k, v in value.items()}))
        elif isinstance(value, (list, tuple)) and value and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
        ):
            out.update({f"{prefix}{key}/{i}": float(v) for i, v in enumerate(value)})
    return out


class TitanExtTrainer(Trainer):
    """TorchTitan's trainer; with PP on, every logged step also carries pipeline metrics.

    Logged next to TorchTitan's own metrics (W&B / TensorBoard / console), under ``pipeline/``:
    ``iteration_ms`` and ``bubble_rate`` (measured timeline, see :mod:`titan_ext.titan.monitor`),
    ``step_wall_ms`` (slowest rank's ``schedule.step()``), ``train_step_ms`` (whole step incl.
    optimizer, this rank), ``link_delay_ms/<i>`` (measured), ``plan_version``, ``delegation``
    (0 direct / 1 auto, not delegating yet / 2 delegating) and, for titan_ext schedules, the runtime's own dict under
    ``pipeline/runtime/...`` (its link-delay estimates, re-plan time, decision). Every
    ``[titan_ext] gantt_every`` steps a timeline image goes to W&B (``pipeline/timeline``) and to
    ``<dump_folder>/timelines/``. The logging rank also appends one JSON line per logged step to
    ``<dump_folder>/<[titan_ext] metrics_file>``.
    """

    def __init__(self, job_config):
        from titan_ext.titan.registry import active_job_config

        with active_job_config(job_config):  # the model split reads [titan_ext] placement
            super().__init__(job_config)
        self.titan_ext = titan_ext_section(job_config)
        self.pipeline_monitor: PipelineMonitor | None = None
        self._train_step_t0 = math.nan
        self._logged_step = -1
        self._is_metrics_rank = (
            torch.distributed.get_rank() == _get_metrics_rank(self.parallel_dims, job_config)
        )
        self._dump = Path(job_config.job.dump_folder)
        if self.parallel_dims.pp_enabled:
            pp_group = self.parallel_dims.get_mesh("pp").get_group()
            self.pipeline_monitor = PipelineMonitor(self.pp_schedule, pp_group)
            original_log = self.metrics_processor.log

            def log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
                extra = dict(extra_metrics or {})
                extra.update(self._pipeline_step_metrics(step, global_avg_loss))
                original_log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)

            self.metrics_processor.log = log

    # -- hooks -----------------------------------------------------------------------------
    def train_step(self, data_iterator):
        self._train_step_t0 = time.perf_counter()
        super().train_step(data_iterator)
        # a timeline image is due on a step that was not logged: gather here (all PP ranks)
        if (self.pipeline_monitor is not None and self._gantt_due(self.step)
                and self._logged_step != self.step):
            timeline = self.pipeline_monitor.gather(self.step)
            self._maybe_write_gantt(timeline)

    # -- metrics ---------------------------------------------------------------------------
    def _gantt_due(self, step: int) -> bool:
        k = self.titan_ext.gantt_every
        return k > 0 and step % k == 0

    def _pipeline_step_metrics(self, step: int, loss: float) -> dict[str, float]:
        assert self.pipeline_monitor is not None
        self._logged_step = step
        # everything of this train_step but the logging itself (optimizer step included)
        train_step_ms = (time.perf_counter() - self._train_step_t0) * 1e3
        timeline = self.pipeline_monitor.gather(step)  # collective on the PP group
        stats = timeline_stats(timeline)
        rt = runtime_metrics(self.pp_schedule)
        delegation = self._delegation_state(rt)
        metrics: dict[str, float] = {
            "pipeline/iteration_ms": stats["iteration_ms"],
            "pipeline/bubble_rate": stats["bubble_rate"],
            "pipeline/step_wall_ms": max(timeline.step_wall_ms.values()),
            "pipeline/train_step_ms": train_step_ms,
            "pipeline/plan_version": float(rt.get("plan_version", 0)),
            "pipeline/delegation": float(_DELEGATION_CODES[delegation]),
        }
        for link, ms in stats["link_delay_ms"].items():
            metrics[f"pipeline/link_delay_ms/{link}"] = ms
        metrics.update(_flat_numbers("pipeline/runtime/", rt))
        if self._gantt_due(step):
            self._maybe_write_gantt(timeline)
        if self._is_metrics_rank and self.titan_ext.metrics_file:
            record = {
                "step": step,
                "loss": float(loss),
                "schedule": self.job_config.parallelism.pipeline_parallel_schedule,
                "iteration_ms": stats["iteration_ms"],
                "bubble_rate": stats["bubble_rate"],
                "step_wall_ms": metrics["pipeline/step_wall_ms"],
                "train_step_ms": train_step_ms,
                "link_delay_ms": {str(k): v for k, v in stats["link_delay_ms"].items()},
                "plan_version": rt.get("plan_version", 0),
                "delegation": delegation,
                "runtime": {k: v for k, v in rt.items() if _jsonable(v)},
            }
            self._dump.mkdir(parents=True, exist_ok=True)
            with open(self._dump / self.titan_ext.metrics_file, "a") as f:
                f.write(json.dumps(record) + "\n")
        return metrics

    def _delegation_state(self, rt: dict[str, Any]) -> str:
        if rt.get("delegating"):
            return "active"
        return "auto" if self.titan_ext.delegation == "auto" else "off"

    def close(self) -> None:
        close_delegation = getattr(getattr(self, "pp_schedule", None), "close_delegation", None)
        if callable(close_delegation):
            close_delegation()
        super().close()

    def _wandb_loggers(self) -> list[WandBLogger]:
        container = self.metrics_processor.logger
        loggers = getattr(container, "_loggers", [container])
        return [lg for lg in loggers if isinstance(lg, WandBLogger)]

    def _maybe_write_gantt(self, timeline: IterationTimeline) -> None:
        if not self._is_metrics_rank:
            return
        name = self.job_config.parallelism.pipeline_parallel_schedule
        path = self._dump / "timelines" / f"step_{timeline.step:05d}.png"
        try:
            write_timeline_png(timeline, path, title=f"{name}, step {timeline.step}")
        except Exception as e:  # an image must never stop training
            logger.warning(f"[titan_ext] timeline image for step {timeline.step} failed: {e}")
            return
        with open(path.with_suffix(".json"), "w") as f:
            json.dump({"step": timeline.step, "num_stages": timeline.num_stages,
                       "actions": timeline.to_rows()}, f)
        for wb in self._wandb_loggers():
            wb.wandb.log({"pipeline/timeline": wb.wandb.Image(str(path))}, step=timeline.step)


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def default_wandb_offline(job_config) -> None:
    """W&B without an account: offline mode unless the user configured W&B."""
    if job_config.metrics.enable_wandb and "WANDB_MODE" not in os.environ \
            and "WANDB_API_KEY" not in os.environ:
        os.environ["WANDB_MODE"] = "offline"
