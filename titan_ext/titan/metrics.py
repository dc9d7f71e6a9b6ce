"""Pipeline metrics that follow the schedule, not the trainer (stock ``torchtitan.train`` included).

The wrapped ``build_pipeline_schedule`` (:mod:`titan_ext.titan.registry`) calls :func:`attach` once
the PP schedule exists, for every schedule -- ours and torch's built-ins. The metrics processor the
trainer builds through TorchTitan's own extension point (:func:`install`: 0.2's TrainSpec
``build_metrics_processor_fn``, 0.3's ``Trainer.Config.metrics`` of titan_ext's trainer) adds, on every
logged step (TorchTitan's ``MetricsProcessor`` class itself is never patched):

* headline keys ``pipeline/iteration_ms``, ``pipeline/bubble_rate`` (fraction), ``pipeline/plan_version``,
  ``pipeline/slowest_link`` and ``pipeline/slowest_link_ms``, ``pipeline/train_step_ms``, and
  ``pipeline/injected_delay_ms/<i>`` while a straggler is injected;
* the full set under ``pipeline_detail/`` (``link_delay_ms/<i>`` measured on the timeline -- the one
  link-delay series --, ``step_wall_ms``, ``delegation``, the runtime's numbers); every time is in ms;
* on W&B, ``pipeline/decisions``: a table of the plan changes (step, version, decision, reason,
  warm-up counts, backward), logged incrementally: each plan change sends its new rows only;
* one console line next to TorchTitan's step line (iteration time, bubble rate, plan version);
* one JSON line per logged step in ``<dump_folder>/<[titan_ext] metrics_file>`` (strict JSON: a
  missing number is ``null``, never NaN);
* a timeline image (``<dump_folder>/timelines/step_N.png`` and ``pipeline/timeline`` on W&B) on the
  first logged step of every ``[titan_ext] gantt_every`` steps;
* every measured (logged) step's timeline as a Chrome/Perfetto trace,
  ``<dump_folder>/timelines/step_N.trace.json`` (open it in ui.perfetto.dev or chrome://tracing).

W&B: unless ``WANDB_MODE`` is set, a run goes offline only when no W&B credentials exist (no
``WANDB_API_KEY`` / ``WANDB_IDENTITY_TOKEN_FILE`` and no ``wandb login`` entry in the netrc file):
someone logged in with ``wandb login`` gets an online run (:func:`wandb_logged_in`).

Every plan change logs one INFO line (version, the decision and reason that led to it, warm-up counts)
right after the iteration that deployed it, whatever ``log_freq`` is.
"""

import json
import math
import netrc
import os
from urllib.parse import urlparse
from pathlib import Path
from collections.abc import Callable
from typing import Any

from torchtitan.tools.logging import logger

from titan_ext.titan import adapters

from titan_ext.titan.appendlog import LineLog
from titan_ext.titan.gantt import write_timeline_png, write_timeline_trace
from titan_ext.titan.monitor import IterationTimeline, PipelineMonitor, timeline_stats
from titan_ext.titan.options import titan_ext_section

__all__ = ["PipelineMetrics", "attach", "current", "install", "instrument", "metrics_processor_builder",
           "pipeline_metrics_config", "pipeline_metrics_processor", "runtime_metrics", "strict_json",
           "wandb_logged_in"]

# pipeline_detail/delegation: 0 = direct P2P, 1 = auto mode, not delegating (yet), 2 = delegating
_DELEGATION_CODES = {"off": 0, "auto": 1, "active": 2}
# runtime keys left out of W&B: the runtime's own link-delay estimates (the measured series is the
# one W&B shows; the JSONL keeps them) and text/ids (decisions go to the table)
_RUNTIME_KEYS_NOT_PLOTTED = ("link_delay_ms", "link_delay_fwd_ms", "link_delay_bwd_ms",
                             "link_delay_estimate_ms", "plan_hash")
# decisions that ask for a new plan (the reason shown when its version is deployed)
_PASSIVE_DECISIONS = ("keep", "none", "hold")

_current: "PipelineMetrics | None" = None


def runtime_metrics(schedule: Any) -> dict[str, Any]:
    """The per-iteration metrics dict of a titan_ext runtime schedule ({} for torch's built-ins)."""
    value = getattr(schedule, "last_metrics", None)
    return dict(value) if isinstance(value, dict) else {}


def strict_json(value: Any) -> Any:
    """``value`` with NaN/inf replaced by None (recursively) and keys as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def _flat_numbers(prefix: str, metrics: dict[str, Any]) -> dict[str, float]:
    """Numbers (and dicts/lists of numbers) of ``metrics`` under ``prefix``, W&B-style keys."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, (bool, int, float)):
            out[f"{prefix}{key}"] = float(value)
        elif isinstance(value, dict):
            out.update(_flat_numbers(f"{prefix}{key}/", {str(k): v for k, v in value.items()}))
        elif isinstance(value, (list, tuple)):
            out.update(_flat_numbers(f"{prefix}{key}/", dict(enumerate(value))))
    return out


def _injected_delays_ms(num_links: int) -> dict[int, float]:
    """The injected straggler's current latency per link ({} when none is installed)."""
    from titan_ext.runtime.delay_injection import current_injector

    injector = current_injector()
    if injector is None or injector.schedule.is_empty():
        return {}
    return {i: injector.link_delay(i).latency_ms for i in range(num_links)}


class PipelineMetrics:
    """Per-step pipeline metrics of one PP schedule (see the module docstring)."""

    def __init__(self, schedule: Any, job_config: Any, pp_group: Any):
        self.schedule = schedule
        self.schedule_name = job_config.parallelism.pipeline_parallel_schedule
        self.section = titan_ext_section(job_config)
        self.job_config = job_config
        self.dump = Path(adapters.current().dump_folder(job_config))
        self.monitor = PipelineMonitor(schedule, pp_group)
        self.decisions: list[list[Any]] = []  # rows of the W&B decisions table not logged yet
        self._plan_version = runtime_metrics(schedule).get("plan_version", 0)
        self._pending_reason = ("initial", "the schedule's first plan")
        self._last_logged_step = 0
        self.image: Path | None = None  # the image written on the current logged step, if any
        self.metrics_log = LineLog(self.dump / self.section.metrics_file, "the pipeline metrics file")
        self.wandb_tables: dict[int, Any] = {}  # W&B logger -> its incremental decisions table
        self._wrap_step()

    # -- every iteration: plan changes ---------------------------------------------------------
    def _wrap_step(self) -> None:
        step = self.schedule.step

        def step_and_note_plan_change(*args, **kwargs):
            try:
                return step(*args, **kwargs)
            finally:
                self._note_plan_change(runtime_metrics(self.schedule))

        self.schedule.step = step_and_note_plan_change

    def _note_plan_change(self, rt: dict[str, Any]) -> None:
        decision = rt.get("decision")
        if decision and decision not in _PASSIVE_DECISIONS:
            self._pending_reason = (decision, rt.get("decision_reason", ""))
        version = rt.get("plan_version")
        if version is None or version == self._plan_version:
            return
        self._plan_version = version
        action, reason = self._pending_reason
        row = [rt.get("iteration"), version, action, reason, str(rt.get("warmup_counts")),
               str(rt.get("backward"))]
        self.decisions.append(row)
        logger.info(f"[titan_ext] plan v{version} deployed (iteration {row[0]}): {action}: {reason}; "
                    f"warm-up counts {row[4]}, backward {row[5]}")

    # -- logged steps ----------------------------------------------------------------------------
    def step_metrics(self, step: int, loss: float, is_metrics_rank: bool) -> dict[str, float]:
        """W&B/TensorBoard keys of this logged step; collective over the PP group (all ranks call)."""
        timeline = self.monitor.gather(step)
        stats = timeline_stats(timeline)
        rt = runtime_metrics(self.schedule)
        delegation = "active" if rt.get("delegating") else (
            "auto" if self.section.delegation == "auto" else "off")
        links = stats["link_delay_ms"]
        slowest = max(links, key=links.get) if links else -1
        injected = _injected_delays_ms(self.monitor.num_stages - 1)
        metrics = {
            "pipeline/iteration_ms": stats["iteration_ms"],
            "pipeline/bubble_rate": stats["bubble_rate"],
            "pipeline/plan_version": float(rt.get("plan_version", 0)),
            "pipeline/slowest_link": float(slowest),
            "pipeline/slowest_link_ms": links.get(slowest, math.nan),
            "pipeline/train_step_ms": self.monitor.since_step_start_ms(),
            **{f"pipeline/injected_delay_ms/{i}": ms for i, ms in injected.items()},
            "pipeline_detail/step_wall_ms": max(timeline.step_wall_ms.values()),
            "pipeline_detail/delegation": float(_DELEGATION_CODES[delegation]),
            **{f"pipeline_detail/link_delay_ms/{i}": ms for i, ms in links.items()},
            **_flat_numbers("pipeline_detail/runtime/", {k: v for k, v in rt.items()
                                                         if k not in _RUNTIME_KEYS_NOT_PLOTTED}),
        }
        image_due = self._image_due(step)
        self._last_logged_step = step
        if is_metrics_rank:
            self._write_trace(timeline)
            if image_due:
                self._write_image(timeline)
            if self.section.metrics_file:
                self._append_jsonl(step, loss, stats, metrics, rt, delegation, injected)
        return metrics

    def console_line(self, step: int, metrics: dict[str, float]) -> str:
        line = (f"step: {step:2}  pipeline: iteration {metrics['pipeline/iteration_ms']:7.1f} ms  "
                f"bubble {100 * metrics['pipeline/bubble_rate']:4.1f} %  "
                f"plan v{int(metrics['pipeline/plan_version'])}")
        if metrics["pipeline/slowest_link"] >= 0:
            line += (f"  slowest link {int(metrics['pipeline/slowest_link'])} "
                     f"({metrics['pipeline/slowest_link_ms']:.1f} ms)")
        return line

    def _image_due(self, step: int) -> bool:
        """First logged step of each block of ``gantt_every`` steps (step k·gantt_every when logged)."""
        k = self.section.gantt_every
        return k > 0 and step // k > self._last_logged_step // k

    def _append_jsonl(self, step, loss, stats, metrics, rt, delegation, injected) -> None:
        record = {
            "step": step,
            "loss": float(loss),
            "schedule": self.schedule_name,
            "iteration_ms": stats["iteration_ms"],
            "bubble_rate": stats["bubble_rate"],
            "plan_version": rt.get("plan_version", 0),
            "slowest_link": int(metrics["pipeline/slowest_link"]),
            "step_wall_ms": metrics["pipeline_detail/step_wall_ms"],
            "train_step_ms": metrics["pipeline/train_step_ms"],
            "link_delay_ms": stats["link_delay_ms"],
            "injected_delay_ms": injected,
            "delegation": delegation,
            "runtime": rt,
        }
        self.metrics_log.append([json.dumps(strict_json(record), allow_nan=False, default=str)])

    def _write_trace(self, timeline: IterationTimeline) -> None:
        path = self.dump / "timelines" / f"step_{timeline.step:05d}.trace.json"
        try:
            write_timeline_trace(timeline, path, title=f"{self.schedule_name}, step {timeline.step}")
        except Exception as e:  # a trace must never stop training
            logger.warning(f"[titan_ext] timeline trace for step {timeline.step} failed: {e}")

    def _write_image(self, timeline: IterationTimeline) -> None:
        path = self.dump / "timelines" / f"step_{timeline.step:05d}.png"
        try:
            write_timeline_png(timeline, path, title=f"{self.schedule_name}, step {timeline.step}")
            with open(path.with_suffix(".json"), "w") as f:
                json.dump(strict_json({"step": timeline.step, "num_stages": timeline.num_stages,
                                       "actions": timeline.to_rows()}), f, allow_nan=False)
        except Exception as e:  # an image must never stop training
            logger.warning(f"[titan_ext] timeline image for step {timeline.step} failed: {e}")
            return
        self.image = path


def attach(schedule: Any, job_config: Any, stages: list) -> PipelineMetrics:
    """Measure ``schedule`` (built for ``job_config``); titan_ext's metrics processor reports it."""
    global _current
    _current = PipelineMetrics(schedule, job_config, getattr(stages[0], "group", None))
    return _current


def current() -> PipelineMetrics | None:
    return _current


def _wandb_loggers(processor: Any) -> list:
    from torchtitan.components.metrics import WandBLogger

    container = processor.logger
    return [lg for lg in getattr(container, "_loggers", [container]) if isinstance(lg, WandBLogger)]


_DECISION_COLUMNS = ["iteration", "plan_version", "decision", "reason", "warmup_counts", "backward"]


def _decisions_table(wandb: Any) -> Any:
    """A W&B table that logs only its new rows each time (``log_mode="INCREMENTAL"``); a wandb without
    incremental tables gets a table of the new rows per plan change instead."""
    try:
        return wandb.Table(columns=_DECISION_COLUMNS, log_mode="INCREMENTAL")
    except TypeError:
        return None


def _log_to_wandb(processor: Any, pm: PipelineMetrics, step: int) -> None:
    new_rows, pm.decisions = pm.decisions, []  # logged once, then dropped (no run-long list)
    for wb in _wandb_loggers(processor):
        extra: dict[str, Any] = {}
        if pm.image is not None:
            extra["pipeline/timeline"] = wb.wandb.Image(str(pm.image))
        if new_rows:
            table = pm.wandb_tables.get(id(wb), False)
            if table is False:
                table = pm.wandb_tables[id(wb)] = _decisions_table(wb.wandb)
            if table is None:
                table = wb.wandb.Table(columns=_DECISION_COLUMNS, data=[list(r) for r in new_rows])
            else:
                for row in new_rows:
                    table.add_data(*row)
            extra["pipeline/decisions"] = table
        if extra:
            wb.wandb.log(extra, step=step)


def wandb_logged_in(environ=os.environ) -> bool:
    """W&B credentials exist: env vars, or the netrc entry ``wandb login`` writes for the W&B host."""
    if environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    path = environ.get("NETRC") or os.path.join(environ.get("HOME", os.path.expanduser("~")), ".netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _offline_without_login() -> None:
    if "WANDB_MODE" not in os.environ and not wandb_logged_in():
        logger.info("[titan_ext] W&B: no login found (wandb login / WANDB_API_KEY): offline run")
        os.environ["WANDB_MODE"] = "offline"


def _pipeline_log(original):
    """``MetricsProcessor.log`` (``original``, unbound) plus the pipeline metrics of the schedule being
    measured; everything else is TorchTitan's own."""

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        pm = _current
        if pm is None or not self.parallel_dims.pp_enabled:
            return original(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)
        import torch.distributed as dist

        is_metrics_rank = dist.get_rank() == adapters.current().metrics_rank(self, pm.job_config)
        pm.image = None
        extra = dict(extra_metrics or {})
        extra.update(pm.step_metrics(step, global_avg_loss, is_metrics_rank))
        original(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)
        logger.info(pm.console_line(step, extra))
        _log_to_wandb(self, pm, step)

    log._titan_ext_wrapped = True  # type: ignore[attr-defined]
    log.__wrapped__ = original  # type: ignore[attr-defined]
    return log


def instrument(processor: Any) -> Any:
    """``processor`` (one TorchTitan ``MetricsProcessor``) reports the pipeline metrics: its own ``log``
    is wrapped on the instance, never on the class."""
    import types

    if not getattr(processor.log, "_titan_ext_wrapped", False):
        processor.log = types.MethodType(_pipeline_log(type(processor).log), processor)
    return processor


def metrics_processor_builder(build: Callable) -> Callable:
    """A TrainSpec ``build_metrics_processor_fn`` around ``build`` (the spec's own, else TorchTitan's
    ``build_metrics_processor``): W&B goes offline without a login, and the built processor is
    :func:`instrument`-ed."""
    if getattr(build, "_titan_ext_wrapped", False):
        return build

    def build_metrics_processor(job_config, parallel_dims, model_args=None, *args, **kwargs):
        if getattr(getattr(job_config, "metrics", None), "enable_wandb", False):
            _offline_without_login()
        return instrument(build(job_config, parallel_dims, model_args, *args, **kwargs))

    build_metrics_processor._titan_ext_wrapped = True  # type: ignore[attr-defined]
    build_metrics_processor.__wrapped__ = build  # type: ignore[attr-defined]
    return build_metrics_processor


def install() -> None:
    """Make TorchTitan's metrics processor report the pipeline metrics (idempotent); nothing is patched
    class-wide, so a ``MetricsProcessor`` other code builds is TorchTitan's own.

    Each TorchTitan version's own extension point is used: 0.2's TrainSpec ``build_metrics_processor_fn``
    (the adapter plugs :func:`metrics_processor_builder` in there, which :func:`instrument`-s the built
    processor), 0.3's configurable ``Trainer.Config.metrics`` (titan_ext's trainer config builds
    :func:`pipeline_metrics_processor`'s subclass: ``adapter.use_pipeline_metrics``)."""
    if not adapters.current().install_metrics_processor(metrics_processor_builder):
        raise adapters.TitanIntegrationError(
            f"TorchTitan {adapters.torchtitan_version()}: no extension point for the metrics processor")


_processor_class: type | None = None


def pipeline_metrics_processor() -> type:
    """TorchTitan 0.3's ``MetricsProcessor`` subclass that reports the pipeline metrics (a
    ``Configurable``: its ``Config`` -- TorchTitan's fields, no new ones -- builds it, so a trainer config
    whose ``metrics`` is a ``PipelineMetricsProcessor.Config`` gets it and no other processor changes).
    W&B goes offline without a login when the config enables it. Made once, on first use (0.3 only)."""
    global _processor_class
    if _processor_class is not None:
        return _processor_class
    from dataclasses import dataclass

    from torchtitan.components.metrics import MetricsProcessor

    class PipelineMetricsProcessor(MetricsProcessor):
        """TorchTitan's metrics processor plus titan_ext's pipeline metrics (titan_ext.titan.metrics)."""

        @dataclass(kw_only=True, slots=True)
        class Config(MetricsProcessor.Config):
            """TorchTitan's metrics config; builds titan_ext's ``PipelineMetricsProcessor``."""

        def __init__(self, config, **kwargs):
            if config.enable_wandb:
                _offline_without_login()
            MetricsProcessor.__init__(self, config, **kwargs)

        log = _pipeline_log(MetricsProcessor.log)

    PipelineMetricsProcessor.__module__ = PipelineMetricsProcessor.Config.__module__ = __name__
    PipelineMetricsProcessor.__qualname__ = "PipelineMetricsProcessor"
    PipelineMetricsProcessor.Config.__qualname__ = "PipelineMetricsProcessor.Config"
    globals()["PipelineMetricsProcessor"] = _processor_class = PipelineMetricsProcessor  # pickle finds it
    return _processor_class


def pipeline_metrics_config(config: Any) -> Any:
    """``config`` (a 0.3 ``MetricsProcessor.Config``) as a ``PipelineMetricsProcessor.Config`` with the
    same values (itself when it already is one, or is another subclass's config: a user's own
    processor is left alone)."""
    from dataclasses import fields

    from torchtitan.components.metrics import MetricsProcessor

    cls = pipeline_metrics_processor().Config
    if type(config) is not MetricsProcessor.Config:
        return config
    return cls(**{f.name: getattr(config, f.name) for f in fields(config) if f.init})
