"""End-to-end CPU training: llama3 debug model, PP=4 over gloo on loopback (torchrun, 4 processes).

One 20-step PipeMorph run of *stock* ``torchtitan.train`` (the TOML's ``custom_import`` does the
rest) under an injected straggler, with W&B enabled and no login (so offline by titan_ext's default),
is shared by several tests (module fixture): our metrics must come out of TorchTitan's own metrics
processor, console and W&B logger. Short runs of ``titan_ext.train`` (README's command) with 1F1B and
with delegation complete it.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from _titan_version import TITAN_EXT_TRAIN, TOML_CONFIG, tt02_only

from titan_ext.testing import chosen_backend, torchrun
from titan_ext.testing.nccl_rules import ENV_VAR as TEST_BACKEND_VAR

pytestmark = [pytest.mark.slow, tt02_only(TITAN_EXT_TRAIN + " and " + TOML_CONFIG)]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "train_configs/debug_cpu.toml"
STEPS = 20


def _torchrun(module: str, args: list[str], log: Path, env_extra: dict | None = None,
              timeout: int = 420, log_rank: int = 3) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", "NETRC": str(log.parent / "no-netrc"),
                "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"})
    for var in ("TITAN_EXT_INJECT_DELAYS", "WANDB_MODE", "WANDB_API_KEY"):
        env.pop(var, None)  # W&B: no login here, so titan_ext makes the run offline
    # the test backend (default nccl_rules: NCCL's rules on the PP and DP groups; the CPU shim reads it)
    env[TEST_BACKEND_VAR] = chosen_backend()
    env.update(env_extra or {})
    return torchrun(4, ["-m", module, "--job.config_file", CONFIG, *args], log=log, cwd=ROOT, env=env,
                    timeout=timeout, local_ranks_filter=log_rank)


def _no_nan(token):
    raise ValueError(f"not strict JSON: {token}")


def _metrics(dump: Path) -> list[dict]:
    """The JSONL, read by a strict parser (NaN / Infinity rejected)."""
    with open(dump / "pipeline_metrics.jsonl") as f:
        return [json.loads(line, parse_constant=_no_nan) for line in f if line.strip()]


@pytest.fixture(scope="module")
def pipemorph_run(tmp_path_factory):
    dump = tmp_path_factory.mktemp("pipemorph")
    log = dump / "train.log"
    p = _torchrun("torchtitan.train", [
        "--training.steps", str(STEPS), "--job.dump_folder", str(dump),
        "--metrics.enable_wandb", "--titan_ext.gantt_every", "10",
        "--titan_ext.inject_delays", "2:30",
    ], log)
    assert p.returncode == 0, log.read_text()[-4000:]
    return dump


def test_pipemorph_cpu_run_loss_falls(pipemorph_run):
    rows = _metrics(pipemorph_run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["schedule"] == "PipeMorph" for r in rows)
    losses = [r["loss"] for r in rows]
    assert losses[0] > 7.0  # ~ln(vocab) at init
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
    assert losses[-1] < 0.4 * losses[0]


def test_injected_straggler_is_measured_on_the_right_link(pipemorph_run):
    rows = _metrics(pipemorph_run)[3:]
    med = {link: sorted(float(r["link_delay_ms"][link]) for r in rows)[len(rows) // 2]
           for link in ("0", "1", "2")}
    assert 30.0 <= med["2"] < 45.0, med
    assert med["0"] < 10.0 and med["1"] < 10.0, med
    assert max(r["plan_version"] for r in rows) >= 1
    assert all(0.0 < r["bubble_rate"] < 1.0 for r in rows)


def test_wandb_offline_run_holds_pipeline_metrics_and_timeline_images(pipemorph_run):
    from titan_ext.titan.wandb_offline import find_offline_runs, read_history

    runs = find_offline_runs(pipemorph_run)
    assert len(runs) == 1, runs
    history = read_history(runs[0])
    by_step = {}
    for row in history:
        by_step.setdefault(row["_step"], {}).update(row)
    assert set(range(1, STEPS + 1)) <= set(by_step)
    headline = ["pipeline/iteration_ms", "pipeline/bubble_rate", "pipeline/plan_version",
                "pipeline/slowest_link", "pipeline/slowest_link_ms", "pipeline/train_step_ms",
                "pipeline/injected_delay_ms/2"]
    detail = ["pipeline_detail/delegation", "pipeline_detail/link_delay_ms/0",
              "pipeline_detail/link_delay_ms/1", "pipeline_detail/link_delay_ms/2",
              "pipeline_detail/runtime/replan_ms", "pipeline_detail/runtime/warmup_counts/0"]
    for step in range(1, STEPS + 1):
        row = by_step[step]
        missing = [k for k in ["loss_metrics/global_avg_loss", *headline, *detail] if k not in row]
        assert not missing, (step, missing)
        assert 0.0 < row["pipeline/bubble_rate"] < 1.0
        assert row["pipeline/iteration_ms"] > 0
        assert row["pipeline/injected_delay_ms/2"] == 30.0
        # one link-delay series: the runtime's own estimates are not plotted beside it
        assert not [k for k in row if k.startswith("pipeline_detail/runtime/link_delay")], step
    late = [by_step[s] for s in range(4, STEPS + 1)]
    assert sorted(r["pipeline/slowest_link"] for r in late)[len(late) // 2] == 2.0
    # the plan changes as a table (text columns kept), logged when a version is deployed
    table_steps = [s for s, row in by_step.items()
                   if row.get("pipeline/decisions/_type") in ("incremental-table-file", "table-file")]
    assert table_steps and min(table_steps) == 1, table_steps
    # W&B and the JSONL agree on the loss
    rows = _metrics(pipemorph_run)
    assert by_step[STEPS]["loss_metrics/global_avg_loss"] == pytest.approx(rows[-1]["loss"], rel=1e-9)
    # a timeline image every 10 steps, stored in the run's media folder
    image_steps = sorted(s for s, row in by_step.items() if row.get("pipeline/timeline/_type") == "image-file")
    assert image_steps == [10, 20]
    for s in image_steps:
        png = runs[0].parent / "files" / by_step[s]["pipeline/timeline/path"]
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (pipemorph_run / "timelines" / "step_00020.png").is_file()
    # every logged step's measured timeline as a Perfetto trace
    assert all((pipemorph_run / "timelines" / f"step_{s:05d}.trace.json").is_file() for s in range(1, STEPS + 1))


def test_same_seed_step1_loss_equal_under_1f1b(pipemorph_run, tmp_path):
    """Also: a torch built-in schedule faces the straggler given by TITAN_EXT_INJECT_DELAYS."""
    log = tmp_path / "train.log"
    p = _torchrun("titan_ext.train", [
        "--training.steps", "3", "--job.dump_folder", str(tmp_path),
        "--parallelism.pipeline_parallel_schedule", "1F1B",
    ], log, env_extra={"TITAN_EXT_INJECT_DELAYS": "1:40"})
    assert p.returncode == 0, log.read_text()[-4000:]
    base = _metrics(tmp_path)
    assert base[0]["schedule"] == "1F1B" and base[0]["plan_version"] == 0
    ours = _metrics(pipemorph_run)
    # delays change timing only, never the numbers
    assert base[0]["loss"] == pytest.approx(ours[0]["loss"], rel=1e-6, abs=0)
    link1 = sorted(r["link_delay_ms"]["1"] for r in base)[1]
    others = [r["link_delay_ms"][k] for r in base for k in ("0", "2")]
    assert 40.0 <= link1 < 55.0, link1
    assert sorted(others)[len(others) // 2] < 10.0, others


@pytest.mark.soak  # 43 s; CI: tests/runtime/test_runtime_multistage.py runs the V placement against torch's schedule
def test_pipemorph_runs_two_stages_per_rank_v_shaped(tmp_path):
    """TorchTitan's default split for a PipelineScheduleMulti (two stages per rank) with
    ``[titan_ext] placement = "v"``: rank 0 holds the first and the last stage."""
    import re

    log = tmp_path / "train.log"
    p = _torchrun("titan_ext.train", ["--training.steps", "4", "--job.dump_folder", str(tmp_path),
                                      "--parallelism.module_fqns_per_model_part", "None",
                                      "--titan_ext.placement", "v"], log, log_rank=0)
    text = log.read_text()
    assert p.returncode == 0, text[-4000:]
    assert "Using pipeline schedule PipeMorph with 16 microbatches and 8 stages" in text
    assert "PP rank 0 is building stage_idx 0 " in text and "PP rank 0 is building stage_idx 7 " in text
    losses = [float(x) for x in re.findall(r"step:\s+\d+\s+loss:\s+([-\d.]+)", text)]
    assert len(losses) == 4 and losses[0] > 7.0 and losses[-1] < 0.8 * losses[0], losses


def test_stock_torchtitan_console_shows_pipeline_line_plan_changes_and_straggler(pipemorph_run):
    """TorchTitan's logger output (rank 3, the metrics rank) carries our lines."""
    text = (pipemorph_run / "train.log").read_text()
    assert "Using pipeline schedule PipeMorph" in text
    assert "CPU capacity" in text  # TorchTitan's own device report, through the CPU shim
    assert "W&B: no login found" in text
    lines = text.splitlines()
    for step in (1, STEPS):
        i = next(i for i, ln in enumerate(lines) if f"step: {step:2}  loss:" in ln)
        ours = lines[i + 1]  # right after TorchTitan's step line
        assert f"step: {step:2}  pipeline: iteration" in ours and "bubble" in ours and " plan v" in ours
    plan_lines = [ln for ln in lines if "[titan_ext] plan v" in ln]
    rows = _metrics(pipemorph_run)
    assert len(plan_lines) == rows[-1]["plan_version"], plan_lines  # one per plan change
    assert all("warm-up counts [" in ln for ln in plan_lines)
    assert any("INJECTED STRAGGLER" in ln and "[titan_ext] inject_delays" in ln for ln in lines)


def test_delegation_auto_switches_on_under_a_straggler_and_keeps_the_numbers(pipemorph_run, tmp_path):
    """[titan_ext] delegation = "auto": PipeMorph's delegation (its transport) moves PP traffic to its
    delegate processes once link 2's estimate exceeds the threshold; losses stay bit-for-bit."""
    log = tmp_path / "train.log"
    p = _torchrun("titan_ext.train", [
        "--training.steps", "4", "--job.dump_folder", str(tmp_path),
        "--titan_ext.inject_delays", "2:30", "--titan_ext.delegation", "auto",
        "--titan_ext.delegation_slow_link_ms", "10",
    ], log)
    assert p.returncode == 0, log.read_text()[-4000:]
    rows = _metrics(tmp_path)
    assert [r["delegation"] for r in rows][-1] == "active"
    assert all(r["runtime"].get("delegating") == (r["delegation"] == "active") for r in rows)
    ours = _metrics(pipemorph_run)
    for a, b in zip(rows, ours):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=0), (a["step"], a["loss"], b["loss"])
