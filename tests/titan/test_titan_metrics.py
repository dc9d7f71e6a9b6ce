"""Pieces of titan_ext.titan.metrics that need no training run (the stock-trainer run is in
test_titan_train.py, a real offline W&B run in test_wandb_metrics.py): W&B login detection, strict JSON,
the decisions table, wandb and matplotlib missing."""

import json
import math
from urllib.parse import urlparse

import pytest

from titan_ext.titan.metrics import strict_json, wandb_logged_in


def test_wandb_login_is_detected_from_netrc_or_env(tmp_path):
    netrc = tmp_path / "netrc"
    env = {"HOME": str(tmp_path), "NETRC": str(netrc)}
    assert not wandb_logged_in(env)  # no file
    netrc.write_text("machine example.org login u password p\n")
    netrc.chmod(0o600)
    assert not wandb_logged_in(env)  # another host only
    netrc.write_text("machine api.wandb.ai login user password 0123456789abcdef\n")
    assert wandb_logged_in(env)  # what `wandb login` writes
    assert not wandb_logged_in({**env, "WANDB_BASE_URL": "https://wandb.example.org"})  # other server
    assert wandb_logged_in({"HOME": str(tmp_path / "nowhere"), "WANDB_API_KEY": "k"})
    netrc.write_text("machine api.forge.coreweave.com login user password 0123456789abcdef\n")
    assert wandb_logged_in(env)  # wandb 0.31's default host


def test_wandb_default_hosts_include_the_installed_wandbs():
    urls = pytest.importorskip("wandb.sdk.lib.urls")
    from titan_ext.titan.metrics import WANDB_DEFAULT_HOSTS

    assert urlparse(urls.DEFAULT_BASE_URL).hostname in WANDB_DEFAULT_HOSTS


def test_strict_json_has_null_not_nan():
    record = {"a": math.nan, "b": [1.0, math.inf, {"c": -math.inf}], 2: (3, math.nan)}
    text = json.dumps(strict_json(record), allow_nan=False)
    assert json.loads(text) == {"a": None, "b": [1.0, None, {"c": None}], "2": [3, None]}


def test_wandb_decisions_table_logs_only_new_rows():
    """One incremental table per W&B run: each plan change sends its new rows, nothing between; every
    logged step carries the trainer's step, the x-axis of the summarized keys."""
    from types import SimpleNamespace

    import wandb
    from torchtitan.components.metrics import WandBLogger

    from titan_ext.titan import metrics

    logged, defined = [], []
    wb = object.__new__(WandBLogger)
    wb.tag = None
    wb.wandb = SimpleNamespace(Table=wandb.Table, Image=None, log=lambda data, step: logged.append((step, data)),
                               define_metric=lambda name, **kw: defined.append((name, kw)),
                               run=SimpleNamespace(settings=SimpleNamespace(mode="offline")))
    processor = SimpleNamespace(logger=SimpleNamespace(_loggers=[wb]))
    pm = SimpleNamespace(decisions=[[1, 1, "adapt", "Eq.1", "[3, 1]", "split"]], image=None, wandb_runs={})
    for step in (1, 2, 6):
        if step == 6:
            pm.decisions.append([6, 2, "shrink", "memory", "[2, 1]", "split"])
        metrics._log_to_wandb(metrics._wandb_runs(processor, pm), pm, step=step)
    assert [(step, data["pipeline/step"]) for step, data in logged] == [(1, 1), (2, 2), (6, 6)]
    assert "pipeline/decisions" not in logged[1][1]  # no plan change: no table
    first, second = (logged[i][1]["pipeline/decisions"] for i in (0, 2))
    assert first is second and first.log_mode == "INCREMENTAL"  # the same table, appended to
    assert [row[:2] for row in first.data] == [[1, 1], [6, 2]] and pm.decisions == []  # logged rows are not kept
    assert defined == [("pipeline/step", {}), *(
        (key, {"step_metric": "pipeline/step", "summary": "min,mean"})
        for key in ("pipeline/iteration_ms", "pipeline/bubble_rate", "pipeline/train_step_ms"))]  # once


def test_enable_wandb_without_wandb_is_refused_at_config_time(monkeypatch):
    import sys
    from types import SimpleNamespace

    import pytest

    from titan_ext.titan.jobcheck import JobConfigError
    from titan_ext.titan.jobcheck import check_wandb_available

    on, off = (SimpleNamespace(metrics=SimpleNamespace(enable_wandb=v)) for v in (True, False))
    check_wandb_available(on)  # installed here
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not
    with pytest.raises(JobConfigError) as e:
        check_wandb_available(on)
    assert "[metrics] enable_wandb" in str(e.value) and "pip install 'titan-ext[wandb]'" in str(e.value)
    check_wandb_available(off)  # no W&B asked for: no wandb needed


def test_wandb_offline_reader_without_wandb_names_the_extra(monkeypatch, tmp_path, capsys):
    import sys

    from titan_ext.titan import wandb_offline

    monkeypatch.setitem(sys.modules, "wandb.proto", None)
    assert wandb_offline.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: reading W&B runs needs wandb") and "pip install 'titan-ext[wandb]'" in err
    assert "Traceback" not in err


def test_plots_without_matplotlib_name_the_extra(monkeypatch, tmp_path):
    """The measured Gantt (titan/gantt.py, through plan/export.py) and scripts/bench_frontier.py's plot say
    which extra to install, and write nothing."""
    import importlib.util
    import sys
    from pathlib import Path

    import pytest

    from titan_ext.titan.gantt import write_timeline_png
    from titan_ext.titan.monitor import Action, IterationTimeline

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    timeline = IterationTimeline(step=1, num_stages=1, actions=[Action(0, "F", 0, 0, 10_000_000)])
    with pytest.raises(ModuleNotFoundError, match=r"needs matplotlib.*pip install 'titan-ext\[plot\]'") as e:
        write_timeline_png(timeline, tmp_path / "timelines" / "step_00001.png")
    assert e.value.name == "matplotlib"  # what the training loop tells apart from other failures
    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_frontier.py"
    spec = importlib.util.spec_from_file_location("bench_frontier", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'titan-ext\[plot\]'"):
        bench.plot([{"delay_ms": 0.0}], str(tmp_path / "frontier.png"), "t")
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == []


def test_measured_timeline_as_perfetto_trace(tmp_path):
    from titan_ext.titan.gantt import write_timeline_trace
    from titan_ext.titan.monitor import Action, IterationTimeline

    ms = 1_000_000
    actions = [Action(0, "F", 0, 0, 10 * ms), Action(1, "F", 0, 12 * ms, 22 * ms),
               Action(1, "B", 0, 22 * ms, 42 * ms), Action(0, "B", 0, 44 * ms, 64 * ms)]
    path = write_timeline_trace(IterationTimeline(step=3, num_stages=2, actions=actions),
                                tmp_path / "timelines" / "step_00003.trace.json", title="PipeMorph, step 3")
    trace = json.loads(path.read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted((e["tid"], e["name"], e["ts"], e["dur"]) for e in slices) == [
        (0, "B0", 44000.0, 20000.0), (0, "F0", 0.0, 10000.0), (1, "B0", 22000.0, 20000.0), (1, "F0", 12000.0, 10000.0)]
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert {"PipeMorph, step 3", "rank 0", "rank 1"} <= names


def test_metrics_through_the_train_spec_not_the_class():
    """TorchTitan 0.2: the pipeline metrics come in through the TrainSpec's build_metrics_processor_fn
    (TorchTitan's extension point), and MetricsProcessor's class is left as it is."""
    import pytest

    from titan_ext.titan import adapters, metrics, register

    if adapters.current().PYTHON_CONFIGS:
        pytest.skip("TorchTitan 0.3: no TrainSpec (its configurable metrics processor: the next test)")
    import torchtitan.protocols.train_spec as train_spec
    from torchtitan.components.metrics import MetricsProcessor

    register(cpu_shim=False)
    spec = train_spec.get_train_spec("llama3")
    assert getattr(spec.build_metrics_processor_fn, "_titan_ext_wrapped", False)
    assert not getattr(MetricsProcessor.log, "_titan_ext_wrapped", False)

    class Processor:  # what a builder returns: its log is wrapped on the instance only
        def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
            return "logged"

    built = metrics.metrics_processor_builder(lambda job_config, parallel_dims, model_args=None: Processor())
    processor = built(object(), object())
    assert getattr(processor.log, "_titan_ext_wrapped", False)
    assert not getattr(Processor.log, "_titan_ext_wrapped", False) and not getattr(Processor().log, "_titan_ext_wrapped", False)


def test_metrics_through_the_trainer_config_not_the_class_tt03():
    """TorchTitan 0.3: the pipeline metrics come in through the configurable ``Trainer.Config.metrics``
    (a MetricsProcessor subclass that titan_ext's trainer config builds). MetricsProcessor and
    WandBLogger are TorchTitan's own after registration, and a MetricsProcessor other code builds in
    the same process is not altered."""
    import dataclasses
    import pickle

    import pytest

    from titan_ext.titan import adapters, register

    if not adapters.current().PYTHON_CONFIGS:
        pytest.skip("TorchTitan 0.2: metrics through the TrainSpec (the test above)")
    from torchtitan.components.metrics import MetricsProcessor, WandBLogger
    from torchtitan.distributed import ParallelDims

    from titan_ext.titan import metrics
    from titan_ext.titan.config_registry import llama3_8b_pipemorph, pipemorph_debugmodel
    from titan_ext.titan.trainer import TitanExtTrainer

    register(cpu_shim=False)
    for hook in (MetricsProcessor.log, MetricsProcessor.__init__, WandBLogger.__init__):
        assert hook.__module__ == "torchtitan.components.metrics", hook
        assert not getattr(hook, "_titan_ext_wrapped", False) and not hasattr(hook, "__wrapped__"), hook
    Pipeline = metrics.pipeline_metrics_processor()
    assert Pipeline.Config._owner is Pipeline and MetricsProcessor.Config._owner is MetricsProcessor
    assert Pipeline.log is not MetricsProcessor.log and Pipeline.log.__wrapped__ is MetricsProcessor.log

    # our configs build our processor (the cluster ones keep TorchTitan's metrics values)
    cfg = pipemorph_debugmodel()
    assert type(cfg.metrics) is Pipeline.Config and cfg.metrics.log_freq == 1
    assert type(llama3_8b_pipemorph().metrics) is Pipeline.Config
    assert pickle.loads(pickle.dumps(cfg.metrics)) == cfg.metrics
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    mine = cfg.metrics.build(parallel_dims=dims)
    assert type(mine) is Pipeline

    # a processor other code builds afterwards, in the same process, is TorchTitan's own
    other = MetricsProcessor.Config(log_freq=3).build(parallel_dims=dims)
    assert type(other) is MetricsProcessor and other.log.__func__ is MetricsProcessor.log
    assert "log" not in vars(other) and not getattr(other.log, "_titan_ext_wrapped", False)

    # TitanExtTrainer turns this config's plain metrics config into ours (same values), nothing else;
    # a user's own processor subclass is kept
    plain = dataclasses.replace(cfg, metrics=MetricsProcessor.Config(log_freq=7, enable_tensorboard=True))
    shared = MetricsProcessor.Config(log_freq=5)
    adapters.current().use_pipeline_metrics(plain)
    assert type(plain.metrics) is Pipeline.Config
    assert (plain.metrics.log_freq, plain.metrics.enable_tensorboard) == (7, True)
    assert type(shared) is MetricsProcessor.Config and type(TitanExtTrainer.Config().metrics) is MetricsProcessor.Config

    class UserProcessor(MetricsProcessor):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(MetricsProcessor.Config):
            pass

    users = dataclasses.replace(cfg, metrics=UserProcessor.Config())
    adapters.current().use_pipeline_metrics(users)
    assert type(users.metrics) is UserProcessor.Config


def test_a_plan_change_is_logged_with_the_swapped_plans_own_reason():
    """The console / decisions table names each plan version by the plan's own record, not by the decision
    the check that first ran it took (the first step's check decides on the *next* plan): the initial plan
    by its kind, a policy's plan by the "<decision>: <why>" the runtime wrote into it — a refine that found
    its plan not realised and made a probe says by how much it missed; a schedule without that record
    falls back to the pending decision."""
    from types import SimpleNamespace

    from titan_ext.titan.metrics import PipelineMetrics

    pm = PipelineMetrics.__new__(PipelineMetrics)
    pm._iterations, pm._plan_version, pm._trainer_step, pm.decisions, pm._unstamped = 0, 0, 7, [], []
    pm._pending_reason = ("initial", "the schedule's first plan")
    pm.schedule = SimpleNamespace(deployed=SimpleNamespace(version=1, kind="initial", reason="initial plan (Alg.1)"))
    pm._note_plan_change({"decision": "adapt", "decision_reason": "Eq.1 violated", "plan_version": 1})
    probe = "refine: planned again (measured 430.8 ms, predicted 400.5: beyond 5 %)"
    pm.schedule.deployed = SimpleNamespace(version=2, kind="initial", reason=probe)
    pm._note_plan_change({"decision": "keep", "plan_version": 2, "warmup_counts": [7, 1], "backward": "full"})
    pm.schedule.deployed = SimpleNamespace(version=3, kind="external", reason="a user's plan: by hand")
    pm._note_plan_change({"decision": "select", "decision_reason": "median span", "plan_version": 3})
    pm.schedule = SimpleNamespace()  # no record of its own
    pm._note_plan_change({"decision": "shrink", "decision_reason": "less slackness suffices", "plan_version": 4})
    assert [row[1:4] for row in pm.decisions] == [
        [1, "initial", "initial plan (Alg.1)"],  # not the first check's "adapt", which made v2
        [2, "refine", "planned again (measured 430.8 ms, predicted 400.5: beyond 5 %)"],
        [3, "external", "a user's plan: by hand"],  # not "select": the plan is not that decision's
        [4, "shrink", "less slackness suffices"]]
