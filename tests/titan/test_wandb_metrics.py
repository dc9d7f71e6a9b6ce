"""The pipeline metrics on W&B without a training run: a real offline W&B run read back from its files
(summaries, x-axis, tag prefix, the decisions table's step column), the decision rows' trainer step in
either order TorchTitan names it, the server-version gate of incremental tables, and a job without
matplotlib."""

import json
import logging
import sys
from types import SimpleNamespace

import pytest

from titan_ext.titan import metrics


class _Schedule:
    """A one-stage schedule whose ``step`` runs one F and one B on its stage and deploys plan version
    ``versions[i]`` in its i-th iteration (0-based), as a titan_ext runtime reports it."""

    def __init__(self, versions: dict[int, int]):
        self.versions = versions
        self.last_metrics = {"plan_version": 0, "iteration": -1}
        self._stage = SimpleNamespace(num_stages=1, stage_index=0, device="cpu",
                                      forward_one_chunk=lambda mb, *a, **k: None,
                                      backward_one_chunk=lambda mb, **k: None,
                                      backward_weight_one_chunk=lambda mb, *a, **k: None)

    def step(self):
        self._stage.forward_one_chunk(0)
        self._stage.backward_one_chunk(0, full_backward=True)
        it = self.last_metrics["iteration"] + 1
        version = self.versions.get(it, self.last_metrics["plan_version"])
        self.last_metrics = {"iteration": it, "plan_version": version, "decision": "adapt",
                             "decision_reason": f"iteration {it}", "warmup_counts": [1], "backward": "split"}


def _attach(monkeypatch, tmp_path, versions, gantt_every=10):
    from titan_ext.titan.config import TitanExt

    monkeypatch.setattr(metrics, "_current", None)  # restored after the test
    job_config = SimpleNamespace(parallelism=SimpleNamespace(pipeline_parallel_schedule="PipeMorph"),
                                 job=SimpleNamespace(dump_folder=str(tmp_path)), dump_folder=str(tmp_path),
                                 titan_ext=TitanExt(gantt_every=gantt_every))
    schedule = _Schedule(versions)
    pm = metrics.attach(schedule, job_config, [SimpleNamespace(group=None)])
    return schedule, pm


class _Processor:
    """What the trainer sees of TorchTitan's MetricsProcessor: ``should_log`` every step, ``log`` handing
    its extra metrics to the logger (TorchTitan's ``WandBLogger`` adds its tag)."""

    parallel_dims = SimpleNamespace(pp_enabled=True)

    def __init__(self, logger=None):
        self.logger = logger

    def should_log(self, step):
        return True

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        if self.logger is not None:
            self.logger.log({"loss_metrics/global_avg_loss": global_avg_loss, **extra_metrics}, step)


def _train(schedule, processor, steps, accumulation, named_before, log=False):
    """The trainer's loop: ``accumulation`` schedule iterations per step; TorchTitan 0.3 asks
    ``should_log(step)`` before them (``named_before``), 0.2 after the optimizer."""
    for step in steps:
        if named_before:
            processor.should_log(step)
        for _ in range(accumulation):
            schedule.step()
        if not named_before:
            processor.should_log(step)
        if log:
            processor.log(step, 1.0 / step, 1.0 / step, 0.5)


@pytest.mark.parametrize("named_before", [True, False], ids=["tt03-before", "tt02-after"])
def test_decision_rows_carry_the_trainer_step(monkeypatch, tmp_path, named_before):
    """A plan deployed in trainer step k has step k in the decisions table (not the schedule's 0-based
    iteration): a run resumed at step 5, two schedule iterations per step, plans deployed in iterations
    2 and 6 (steps 6 and 8)."""
    schedule, pm = _attach(monkeypatch, tmp_path, {2: 1, 6: 2})
    processor = metrics.instrument(_Processor())
    _train(schedule, processor, range(5, 9), accumulation=2, named_before=named_before)
    assert [row[:3] for row in pm.decisions] == [[6, 1, "adapt"], [8, 2, "adapt"]]
    assert [row[3] for row in pm.decisions] == ["iteration 2", "iteration 6"]


@pytest.fixture
def offline_wandb(monkeypatch, tmp_path):
    """A W&B offline run under tmp_path (nothing written elsewhere); yields the ``wandb`` module."""
    wandb = pytest.importorskip("wandb")
    for var, sub in (("WANDB_DIR", "run"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data"),
                     ("WANDB_CONFIG_DIR", "config"), ("WANDB_ARTIFACT_DIR", "artifacts")):
        (tmp_path / sub).mkdir()
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield wandb
    wandb.teardown()  # finishes a run a failed test left, and forgets these settings


@pytest.mark.multiprocess
def test_offline_run_has_min_mean_summaries_tagged_keys_and_step_keyed_decisions(
        monkeypatch, tmp_path, offline_wandb, caplog):
    """A real offline run, read back from its files: the summarized keys' run summary is their min and
    mean over the logged steps, against the trainer step (``tg/pipeline/step``, equal to ``_step``); every
    key of ours is under the logger's tag; the decisions table is incremental (offline) and each logged
    increment holds the rows deployed at that trainer step, keyed by it."""
    from torchtitan.components.metrics import LoggerContainer, WandBLogger

    from titan_ext.titan.wandb_offline import find_offline_runs, read_history, read_records, read_summary

    wandb = offline_wandb
    schedule, pm = _attach(monkeypatch, tmp_path / "dump", {0: 1, 2: 2})
    monkeypatch.setattr(metrics.adapters, "current", lambda: SimpleNamespace(metrics_rank=lambda *a: 0))
    monkeypatch.setattr("torch.distributed.get_rank", lambda *a: 0)  # one process, no process group
    wandb.init(project="titan-ext-test", dir=str(tmp_path / "run"))
    wb = object.__new__(WandBLogger)  # TorchTitan's logger, its own log(); wandb.init above
    wb.wandb, wb.tag = wandb, "tg"
    container = LoggerContainer()
    container.add_logger(wb)
    processor = metrics.instrument(_Processor(container))
    caplog.set_level(logging.INFO)
    _train(schedule, processor, range(1, 5), accumulation=1, named_before=False, log=True)
    wandb.finish()
    wandb.teardown()  # finish() may return before wandb-core has written the run's last records

    [run] = find_offline_runs(tmp_path / "run")
    history = read_history(run)
    assert [row["_step"] for row in history] == [1, 2, 3, 4]
    ours = {k for row in history for k in row if not k.startswith("_")}
    assert ours and all(k.startswith("tg/") for k in ours), sorted(ours)
    assert [row["tg/pipeline/step"] for row in history] == [1, 2, 3, 4]

    defined = {r.metric.name: r.metric for r in read_records(run) if r.WhichOneof("record_type") == "metric"}
    summary = read_summary(run)
    for key in ("tg/pipeline/iteration_ms", "tg/pipeline/bubble_rate", "tg/pipeline/train_step_ms"):
        assert defined[key].step_metric == "tg/pipeline/step", key
        values = [row[key] for row in history]
        assert summary[key] == pytest.approx({"min": min(values), "mean": sum(values) / len(values)}), key
    assert summary["tg/pipeline/plan_version"] == 2  # not summarized: the last value

    # plans deployed in iterations 0 and 2: trainer steps 1 and 3, each logged as an increment of its own
    tables = {row["_step"]: row for row in history if "tg/pipeline/decisions/_type" in row}
    assert sorted(tables) == [1, 3]
    for step, row in tables.items():
        assert row["tg/pipeline/decisions/_type"] == "incremental-table-file"
        table = json.loads((run.parent / "files" / row["tg/pipeline/decisions/path"]).read_text())
        assert table["columns"][0] == "step" and [r[0] for r in table["data"]] == [step]
    modes = [r.getMessage() for r in caplog.records if "tg/pipeline/decisions" in r.getMessage()]
    assert modes == ["[titan_ext] W&B tg/pipeline/decisions: one incremental table (offline run)"]


def _online_run(version):
    asked = []

    def server_version(base_url):
        asked.append(base_url)
        return version

    run = SimpleNamespace(settings=SimpleNamespace(mode="online", base_url="https://wandb.example.org"))
    return run, server_version, asked


@pytest.mark.parametrize("version, incremental", [
    ("0.70.0", True), ("0.71.3", True), ("1.2.0", True), ("cloud", True),
    ("0.69.2", False), ("0.9.1", False), (None, False), ("development", False)])
def test_incremental_tables_need_server_0_70_or_a_known_cloud(version, incremental):
    run, server_version, asked = _online_run(version)
    ok, why = metrics.incremental_tables(run, server_version)
    assert ok is incremental, why
    assert asked == ["https://wandb.example.org"]
    offline = SimpleNamespace(settings=SimpleNamespace(mode="offline", base_url="unused"))
    assert metrics.incremental_tables(offline, server_version) == (True, "offline run") and len(asked) == 1


def test_old_server_gets_a_plain_table_of_the_new_rows_each_time(monkeypatch, caplog):
    wandb = pytest.importorskip("wandb")
    from torchtitan.components.metrics import WandBLogger

    run, server_version, asked = _online_run("0.69.2")
    monkeypatch.setattr(metrics, "wandb_server_version", server_version)
    wb = object.__new__(WandBLogger)
    wb.tag = None
    wb.wandb = SimpleNamespace(Table=wandb.Table, run=run, define_metric=lambda *a, **k: None)
    caplog.set_level(logging.INFO)
    wandb_run = metrics._WandbRun(wb)
    first = wandb_run.decisions([[1, 1, "adapt", "Eq.1", "[1]", "split"]])
    second = wandb_run.decisions([[4, 2, "adapt", "Eq.1", "[1]", "split"]])
    assert first is not second and first.log_mode == second.log_mode == "IMMUTABLE"
    assert [r[0] for r in first.data] == [1] and [r[0] for r in second.data] == [4]  # the new rows only
    assert len(asked) == 1  # asked once per run
    modes = [r.getMessage() for r in caplog.records if "pipeline/decisions" in r.getMessage()]
    assert modes == ["[titan_ext] W&B pipeline/decisions: a table of the new rows per plan change "
                     "(W&B server 0.69.2 < 0.70)"]


def test_server_version_is_read_from_the_servers_graphql(monkeypatch):
    """Both of wandb's ways to ask ``serverInfo``; a cloud (no local version) and a failure."""
    wandb = pytest.importorskip("wandb")
    queries = []

    def api(answer, old):
        class Api:
            def __init__(self, overrides=None, timeout=None):
                assert overrides == {"base_url": "https://wandb.example.org"} and timeout
                if isinstance(answer, Exception):
                    raise answer
                if old:
                    self.client = SimpleNamespace(server_info=answer)
                else:
                    self._service_api = SimpleNamespace(
                        execute_graphql=lambda q: queries.append(q) or {"serverInfo": answer})
        return Api

    local = {"latestLocalVersionInfo": {"versionOnThisInstanceString": "0.69.2"}}
    for answer, expected in ((local, "0.69.2"), ({"latestLocalVersionInfo": None}, "cloud"),
                             (ConnectionError("no route"), None)):
        for old in (True, False):
            monkeypatch.setattr(wandb, "Api", api(answer, old))
            assert metrics.wandb_server_version("https://wandb.example.org") == expected, (answer, old)
    assert queries and all("versionOnThisInstanceString" in q for q in queries)


def test_timeline_images_without_matplotlib_warn_once_and_training_goes_on(monkeypatch, tmp_path, caplog):
    schedule, pm = _attach(monkeypatch, tmp_path, {}, gantt_every=1)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    caplog.set_level(logging.WARNING)
    for step in (1, 2, 3):
        schedule.step()
        pm.step_metrics(step, 1.0, is_metrics_rank=True)
        assert pm.image is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "pip install 'titan-ext[plot]'" in warnings[0], warnings
    assert sorted(p.name for p in (tmp_path / "timelines").iterdir()) == [
        f"step_0000{s}.trace.json" for s in (1, 2, 3)]  # the traces need no matplotlib
