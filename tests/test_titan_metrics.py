"""Pieces of titan_ext.titan.metrics that need no training run (the stock-trainer run is in
test_titan_train.py): W&B login detection, strict JSON."""

import json
import math

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


def test_strict_json_has_null_not_nan():
    record = {"a": math.nan, "b": [1.0, math.inf, {"c": -math.inf}], 2: (3, math.nan)}
    text = json.dumps(strict_json(record), allow_nan=False)
    assert json.loads(text) == {"a": None, "b": [1.0, None, {"c": None}], "2": [3, None]}


def test_wandb_decisions_table_logs_only_new_rows():
    """One incremental table per W&B logger: each plan change sends its new rows, nothing between."""
    from types import SimpleNamespace

    import wandb
    from torchtitan.components.metrics import WandBLogger

    from titan_ext.titan import metrics

    logged = []
    wb = object.__new__(WandBLogger)
    wb.wandb = SimpleNamespace(Table=wandb.Table, Image=None, log=lambda data, step: logged.append((step, data)))
    processor = SimpleNamespace(logger=SimpleNamespace(_loggers=[wb]))
    pm = SimpleNamespace(decisions=[[0, 1, "adapt", "Eq.1", "[3, 1]", "split"]], image=None, wandb_tables={})
    metrics._log_to_wandb(processor, pm, step=1)
    metrics._log_to_wandb(processor, pm, step=2)  # no plan change: nothing logged
    pm.decisions.append([5, 2, "shrink", "memory", "[2, 1]", "split"])
    metrics._log_to_wandb(processor, pm, step=6)
    assert [step for step, _ in logged] == [1, 6]
    first, second = (data["pipeline/decisions"] for _, data in logged)
    assert first is second and first.log_mode == "INCREMENTAL"  # the same table, appended to
    assert [row[1] for row in first.data] == [1, 2] and pm.decisions == []  # logged rows are not kept


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
