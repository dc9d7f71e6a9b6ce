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
* on W&B, ``pipeline/decisions``: a table of the plan changes (the trainer step that deployed it, version,
  decision, reason, warm-up counts, backward), logged incrementally: each plan change sends its new rows
  only (:func:`incremental_tables`: a plain table of the new rows where the server may not take those);
* on W&B, the run summary of ``pipeline/iteration_ms``, ``pipeline/bubble_rate`` and
  ``pipeline/train_step_ms`` is their min and mean over the run, not the last step's value, against
  ``pipeline/step``, the trainer's step (the ``step=`` TorchTitan logs every key with);
* one console line next to TorchTitan's step line (iteration time, bubble rate, plan version);
* one JSON line per logged step in ``<dump_folder>/<[titan_ext] metrics_file>`` (strict JSON: a
  missing number is ``null``, never NaN);
* a timeline image (``<dump_folder>/timelines/step_N.png`` and ``pipeline/timeline`` on W&B) on the
  first logged step of every ``[titan_ext] gantt_every`` steps;
* every measured (logged) step's timeline as a Chrome/Perfetto trace,
  ``<dump_folder>/timelines/step_N.trace.json`` (open it in ui.perfetto.dev or chrome://tracing).

W&B: unless ``WANDB_MODE`` is set, a run goes offline only when no W&B credentials exist (no
``WANDB_API_KEY`` / ``WANDB_IDENTITY_TOKEN_FILE`` and no ``wandb login`` entry in the netrc file):
someone logged in with ``wandb login`` gets an online run (:func:`wandb_logged_in`). Our W&B keys go
under the logger's tag as TorchTitan's own do (``{tag}/pipeline/...`` when its ``WandBLogger`` has one).

wandb and matplotlib are optional (the ``wandb`` and ``plot`` extras), imported only when used:
:func:`titan_ext.titan.jobcheck.check_wandb_available` refuses ``[metrics] enable_wandb`` without wandb before any process group
exists, and a job without matplotlib warns once and draws no timeline image.

Every plan change logs one INFO line (version, the decision and reason that led to it, warm-up counts)
right after the iteration that deployed it, whatever ``log_freq`` is.
"""

import json
import math
import netrc
import os
import re
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

__all__ = ["PipelineMetrics", "attach", "current", "incremental_tables", "install",
           "instrument", "metrics_processor_builder", "pipeline_metrics_config", "pipeline_metrics_processor",
           "runtime_metrics", "strict_json", "wandb_logged_in", "wandb_server_version"]

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
    from titan_ext.runtime.emulate.delay_injection import current_injector

    injector = current_injector()
    if injector is None or injector.schedule.is_empty():
        return {}
    return {i: injector.link_delay(i).latency_ms for i in range(num_links)}


def _made_by(deployed: Any) -> tuple[str, str]:
    """(decision, reason) of a deployed plan, from its own record: the runtime writes a policy's plan's
    reason as "<decision>: <why>" (``control/regime.py``); another plan (the initial, an external one) is
    named by its kind."""
    reason = str(deployed.reason)
    head, sep, rest = reason.partition(": ")
    if sep and head and " " not in head:
        return head, rest
    return str(getattr(deployed, "kind", "deployed")), reason


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
        self._iterations = 0  # schedule iterations so far
        self._named_before: bool | None = None  # the trainer names its step before its iterations
        self._trainer_step: int | None = None  # the trainer step the schedule is running, when known
        self._unstamped: list[list[Any]] = []  # decision rows waiting for their trainer step
        self.image: Path | None = None  # the image written on the current logged step, if any
        self._no_matplotlib = False  # warned once: no timeline images
        self.metrics_log = LineLog(self.dump / self.section.metrics_file, "the pipeline metrics file")
        self.wandb_runs: dict[int, _WandbRun] = {}  # id(W&B logger) -> titan_ext's part of its run
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

    def trainer_step(self, step: int) -> None:
        """The trainer names the step it runs (``MetricsProcessor.should_log``, once per train step): the
        decisions table's step column. TorchTitan 0.3 names it before the step's schedule iterations, 0.2
        after them (its train step asks after the optimizer); the first call tells which (no iteration
        yet: before), so a row waits for its step only in the second case."""
        if self._named_before is None:
            self._named_before = self._iterations == 0
        if self._named_before:
            self._trainer_step = step
        for row in self._unstamped:
            row[0] = step
        self._unstamped = []

    def _note_plan_change(self, rt: dict[str, Any]) -> None:
        self._iterations += 1
        decision = rt.get("decision")
        if decision and decision not in _PASSIVE_DECISIONS:
            self._pending_reason = (decision, rt.get("decision_reason", ""))
        version = rt.get("plan_version")
        if version is None or version == self._plan_version:
            return
        self._plan_version = version
        action, reason = self._pending_reason
        deployed = getattr(self.schedule, "deployed", None)
        if getattr(deployed, "version", None) == version:  # the plan's own record says what made it
            action, reason = _made_by(deployed)  # e.g. a refine that made a probe: by how much it missed
        row = [self._trainer_step, version, action, reason, str(rt.get("warmup_counts")),
               str(rt.get("backward"))]
        self.decisions.append(row)
        if self._trainer_step is None:
            self._unstamped.append(row)
        logger.info(f"[titan_ext] plan v{version} deployed (iteration {rt.get('iteration')}): {action}: "
                    f"{reason}; warm-up counts {row[4]}, backward {row[5]}")

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
        if self._no_matplotlib:
            return
        path = self.dump / "timelines" / f"step_{timeline.step:05d}.png"
        try:
            write_timeline_png(timeline, path, title=f"{self.schedule_name}, step {timeline.step}")
            with open(path.with_suffix(".json"), "w") as f:
                json.dump(strict_json({"step": timeline.step, "num_stages": timeline.num_stages,
                                       "actions": timeline.to_rows()}), f, allow_nan=False)
        except Exception as e:  # an image must never stop training
            if isinstance(e, ModuleNotFoundError) and e.name == "matplotlib":  # optional: said once
                self._no_matplotlib = True
                logger.warning(f"[titan_ext] no timeline images ([titan_ext] gantt_every = "
                               f"{self.section.gantt_every}): {e}; training goes on")
            else:
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


_STEP_KEY = "pipeline/step"  # the trainer's step, the x-axis of the summarized keys
#: per-step keys whose run summary is their min and mean (the last step's value says little of a run)
_SUMMARIZED = ("pipeline/iteration_ms", "pipeline/bubble_rate", "pipeline/train_step_ms")
_DECISION_COLUMNS = ["step", "plan_version", "decision", "reason", "warmup_counts", "backward"]
#: the first W&B Server that takes ``log_mode="INCREMENTAL"`` tables (W&B's docs, "Log tables")
INCREMENTAL_SERVER = (0, 70)
# the field of W&B's GraphQL API with the server's version (older wandb releases ask it in
# ``Api.client.server_info``); W&B's multi-tenant cloud, always on the newest release, answers null
_SERVER_VERSION_QUERY = "query ServerInfo { serverInfo { latestLocalVersionInfo { versionOnThisInstanceString } } }"


def _tagged(wb: Any, key: str) -> str:
    """``key`` as TorchTitan's ``WandBLogger.log`` names its own keys: under the logger's tag, if any."""
    tag = getattr(wb, "tag", None)
    return key if tag is None else f"{tag}/{key}"


def log_tagged(wb: Any, values: dict, step: int) -> None:
    """``values`` to TorchTitan's W&B logger ``wb`` at ``step``, each key under its tag (:func:`_tagged`)."""
    wb.wandb.log({_tagged(wb, k): v for k, v in values.items()}, step=step)


def wandb_server_version(base_url: str) -> str | None:
    """The version of the W&B server at ``base_url`` (``"0.69.2"``); ``"cloud"`` for W&B's multi-tenant
    cloud, which reports none; None when it cannot be read. wandb has no public call for it: the query goes
    through ``wandb.Api``'s GraphQL channel: ``Api.client.server_info`` in older wandb releases,
    ``ServiceApi.execute_graphql`` in newer ones (what ``wandb verify`` reads ``serverInfo`` through)."""
    import wandb

    try:
        api = wandb.Api(overrides={"base_url": base_url}, timeout=10)
        client = getattr(api, "client", None)
        if client is not None and hasattr(client, "server_info"):
            info = client.server_info
        else:
            info = api._service_api.execute_graphql(_SERVER_VERSION_QUERY)["serverInfo"]
        local = (info or {}).get("latestLocalVersionInfo")
        return "cloud" if local is None else local["versionOnThisInstanceString"]
    except Exception as e:  # no answer: the caller takes the safe way
        logger.debug(f"[titan_ext] W&B server version at {base_url}: {e!r}")
        return None


def incremental_tables(run: Any, server_version: Callable[[str], str | None] | None = None) -> tuple[bool, str]:
    """Whether W&B ``run`` may log ``log_mode="INCREMENTAL"`` tables (W&B Server >= 0.70), and why: an
    offline run has no server to ask (fine); an online run asks its server, and an older server or an
    unknown version gets plain tables."""
    if run.settings.mode in ("offline", "dryrun", "disabled"):
        return True, f"{run.settings.mode} run"
    version = (server_version or wandb_server_version)(run.settings.base_url)
    if version == "cloud":
        return True, "W&B's cloud"
    found = re.match(r"(\d+)\.(\d+)", version or "")
    if found is None:
        return False, f"W&B server version unknown: {version or 'not readable'}"
    ok = tuple(map(int, found.groups())) >= INCREMENTAL_SERVER
    return ok, f"W&B server {version} {'>=' if ok else '<'} {'.'.join(map(str, INCREMENTAL_SERVER))}"


class _WandbRun:
    """titan_ext's part of one W&B run (one TorchTitan ``WandBLogger``): the summarized keys defined once,
    before TorchTitan first logs them, and the decisions table."""

    def __init__(self, wb: Any):
        self.wb = wb
        self.table: Any = None  # the run's incremental decisions table
        self.incremental: bool | None = None  # decided on the first plan change
        step = _tagged(wb, _STEP_KEY)
        wb.wandb.define_metric(step)
        for key in _SUMMARIZED:
            wb.wandb.define_metric(_tagged(wb, key), step_metric=step, summary="min,mean")

    def decisions(self, rows: list[list[Any]]) -> Any:
        """``rows`` as a W&B table: appended to the run's incremental table, which logs only its new rows,
        or, where the server may not take one (or wandb has none), a table of ``rows`` alone."""
        wandb = self.wb.wandb
        if self.incremental is None:
            self.incremental, why = incremental_tables(wandb.run)
            if self.incremental:
                try:
                    self.table = wandb.Table(columns=_DECISION_COLUMNS, log_mode="INCREMENTAL")
                except TypeError:  # a wandb without log_mode
                    self.incremental, why = False, f"wandb {wandb.__version__} has no incremental tables"
            how = "one incremental table" if self.incremental else "a table of the new rows per plan change"
            logger.info(f"[titan_ext] W&B {_tagged(self.wb, 'pipeline/decisions')}: {how} ({why})")
        if not self.incremental:
            return wandb.Table(columns=_DECISION_COLUMNS, data=[list(r) for r in rows])
        for row in rows:
            self.table.add_data(*row)
        return self.table


def _wandb_runs(processor: Any, pm: PipelineMetrics) -> list[_WandbRun]:
    """The W&B runs of ``processor`` (on the rank that logs to W&B; none elsewhere), set up on first use."""
    runs = []
    for wb in _wandb_loggers(processor):
        if id(wb) not in pm.wandb_runs:
            pm.wandb_runs[id(wb)] = _WandbRun(wb)
        runs.append(pm.wandb_runs[id(wb)])
    return runs


def _log_to_wandb(runs: list[_WandbRun], pm: PipelineMetrics, step: int) -> None:
    new_rows, pm.decisions = pm.decisions, []  # logged once, then dropped (no run-long list)
    for run in runs:
        wb = run.wb
        extra: dict[str, Any] = {_tagged(wb, _STEP_KEY): step}
        if pm.image is not None:
            extra[_tagged(wb, "pipeline/timeline")] = wb.wandb.Image(str(pm.image))
        if new_rows:
            extra[_tagged(wb, "pipeline/decisions")] = run.decisions(new_rows)
        wb.wandb.log(extra, step=step)


#: where ``wandb login`` logs in without ``WANDB_BASE_URL``: wandb < 0.31, and 0.31's
#: (``wandb.sdk.lib.urls.DEFAULT_BASE_URL``, read here without importing wandb)
WANDB_DEFAULT_HOSTS = ("api.wandb.ai", "api.forge.coreweave.com")


def wandb_logged_in(environ=os.environ) -> bool:
    """W&B credentials exist: env vars, or the netrc entry ``wandb login`` writes for the W&B host
    (``WANDB_BASE_URL``'s, else the default host of either wandb generation: :data:`WANDB_DEFAULT_HOSTS`)."""
    if environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    base = environ.get("WANDB_BASE_URL")
    hosts = (urlparse(base).hostname,) if base else WANDB_DEFAULT_HOSTS
    path = environ.get("NETRC") or os.path.join(environ.get("HOME", os.path.expanduser("~")), ".netrc")
    try:
        entries = netrc.netrc(path)
    except (OSError, netrc.NetrcParseError):
        return False
    return any(entries.authenticators(host) is not None for host in hosts)


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
        wandb_runs = _wandb_runs(self, pm)  # their keys defined before TorchTitan first logs them
        original(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)
        logger.info(pm.console_line(step, extra))
        _log_to_wandb(wandb_runs, pm, step)

    log._titan_ext_wrapped = True  # type: ignore[attr-defined]
    log.__wrapped__ = original  # type: ignore[attr-defined]
    return log


def _step_naming_should_log(original):
    """``MetricsProcessor.should_log`` (``original``, unbound), which the trainer calls once per train step
    with its step, also names that step to the schedule's metrics (:meth:`PipelineMetrics.trainer_step`)."""

    def should_log(self, step):
        if _current is not None:
            _current.trainer_step(step)
        return original(self, step)

    should_log._titan_ext_wrapped = True  # type: ignore[attr-defined]
    should_log.__wrapped__ = original  # type: ignore[attr-defined]
    return should_log


def instrument(processor: Any) -> Any:
    """``processor`` (one TorchTitan ``MetricsProcessor``) reports the pipeline metrics: its own ``log``
    and ``should_log`` are wrapped on the instance, never on the class."""
    import types

    if not getattr(processor.log, "_titan_ext_wrapped", False):
        processor.log = types.MethodType(_pipeline_log(type(processor).log), processor)
    should_log = getattr(processor, "should_log", None)
    if should_log is not None and not getattr(should_log, "_titan_ext_wrapped", False):
        processor.should_log = types.MethodType(_step_naming_should_log(type(processor).should_log), processor)
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
        should_log = _step_naming_should_log(MetricsProcessor.should_log)

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
