"""Numbers the docs quote from a benchmark JSON under docs/benchmarks/ are that JSON's numbers.

One explicit table, :data:`QUOTES`: (doc, JSON, the text the doc must contain) where the text is a
template whose ``{path:format}`` fields are read from the JSON — ``path`` is keys joined by ``/``
(``slowdown/1F1B/ours``), ``path÷path`` the ratio of two values — and formatted as the doc prints them. Whole table
rows the benchmark scripts print are rebuilt from their JSON by the functions below (:data:`ROWS`).
When a JSON is re-measured, the doc must be updated with it (or this table, when the doc words it
differently); a doc that drifts from its JSON fails here, naming both.
"""

from __future__ import annotations

import json
import string
from functools import reduce
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = "docs/benchmarks"
FIG15 = f"{BENCH}/fig15.json"
DETECT = f"{BENCH}/falcon_detection_2026-11-29.json"
FIG19 = f"{BENCH}/falcon_fig19_2026-11-27c_30ms.json"
FIG19_NOHOL = f"{BENCH}/falcon_fig19_2026-11-27c_30ms_nohol.json"
FIG19_B30 = f"{BENCH}/falcon_fig19_2026-11-27b_30ms.json"
FIG19_B90 = f"{BENCH}/falcon_fig19_2026-11-27b_90ms.json"
FIG19_RUNS = f"{BENCH}/fig19_2026-11-29b.json"
HOL_CAL = f"{BENCH}/fig19_hol_calibration.json"

QUOTES: list[tuple[str, str, str]] = [
    # PipeMorph Fig. 15 in simulation (scripts/bench_fig15.py)
    ("BENCHMARKS.md", FIG15, "1F1B **{slowdown/1F1B/ours:.2f}×** (paper {slowdown/1F1B/paper:.2f}×)"),
    ("BENCHMARKS.md", FIG15, "ZB **{slowdown/ZB/ours:.2f}×** (paper {slowdown/ZB/paper:.2f}×)"),
    ("BENCHMARKS.md", FIG15, "ZB + CPU delegation **{slowdown/ZB + CPU delegation/ours:.2f}×** "
                             "(paper {slowdown/ZB + CPU delegation/paper:.2f}×)"),
    ("BENCHMARKS.md", FIG15, "PipeMorph **{slowdown/PipeMorph/ours:.2f}×** (paper {slowdown/PipeMorph/paper:.2f}×)"),
    ("BENCHMARKS.md", FIG15, "makespans {makespan_ms/1F1B/0:.0f} → {makespan_ms/1F1B/60:.0f}, "
                             "{makespan_ms/ZB/0:.0f} → {makespan_ms/ZB/60:.0f}, "
                             "{makespan_ms/ZB + CPU delegation/0:.0f} → {makespan_ms/ZB + CPU delegation/60:.0f}, "
                             "{makespan_ms/PipeMorph/0:.0f} → {makespan_ms/PipeMorph/60:.0f} ms"),
    ("BENCHMARKS.md", FIG15, "{pipemorph_peak_inflight_at_last_delay} activations in flight on stage 0"),
    ("BENCHMARKS.md", FIG15, "{date}"),
    # Falcon detection (scripts/bench_falcon.py, default mode)
    (f"{BENCH}/falcon.md", DETECT, "{detection/traces} traces, seeds 50000..50999; overall accuracy "
                                   "{detection/accuracy:.4f}"),
    (f"{BENCH}/falcon.md", DETECT, "CallRecorder overhead: {hooks/overhead_us_per_call:.2f} µs per torch.distributed "
                                   "call ({hooks/plain_us_per_call:.1f} → {hooks/hooked_us_per_call:.1f} µs"),
    ("BENCHMARKS.md", DETECT, "a step confirmed {detection/per_category/step/latency_iters_max} iterations after its "
                              "onset (mean {detection/per_category/step/latency_iters_mean:.2f}, max "
                              "{detection/per_category/step/latency_iters_max} over "
                              "{detection/per_category/step/n} step traces"),
    ("BENCHMARKS.md", DETECT, "ramps {detection/per_category/ramp/latency_iters_mean:.2f} on average after the ramp "
                              "starts (max {detection/per_category/ramp/latency_iters_max})"),
    ("BENCHMARKS.md", DETECT, "accuracy {detection/accuracy:.3f}, "
                              "{detection/per_category/jitter/false_positives} false positives"),
    ("BENCHMARKS.md", DETECT, "detector {detection/detector_step_us/cpu_mean:.1f} µs CPU per iteration, the monitor "
                              "with group tracking of 4 groups {monitor/cpu_mean_us:.1f} µs "
                              "({monitor_without_group_tracking/cpu_mean_us:.1f} µs with `group_tracking=False`)"),
    # PipeMorph §7.3 / Fig. 19 bench (scripts/bench_falcon.py --fig19)
    ("docs/falcon.md", FIG19, "healthy — median step: {healthy_ms:.0f} ms; vs healthy: 1;"),
    ("docs/falcon.md", FIG19, "median step: {baseline_ms:.0f} ms; vs healthy: {ratios/baseline_over_healthy:.2f}×;"),
    ("docs/falcon.md", FIG19, "median step: {s3_ms:.0f} ms; vs healthy: {ratios/s3_over_healthy:.2f}×; ratio: "
                              "**{ratios/s3_over_baseline:.2f}× the baseline** (≤ 0.7: met), a "
                              "{baseline_ms÷s3_ms:.2f}× speed-up;"),
    ("docs/falcon.md", FIG19, "median step: {s3_pipemorph_ms:.0f} ms; vs healthy: {s3_pipemorph_ms÷healthy_ms:.2f}×; "
                              "ratio: **{ratios/s3_pipemorph_over_s3:.2f}× s3** (≤ 0.85: met), a "
                              "further {ratios/s3_over_s3_pipemorph:.2f}×;"),
    ("docs/falcon.md", FIG19, "s3 (Falcon's S3 at step {s3_step}, schedule frozen)"),
    ("docs/falcon.md", FIG19_NOHOL, "healthy {healthy_ms:.0f}, baseline {baseline_ms:.0f} "
                                    "({ratios/baseline_over_healthy:.2f}×), s3 {s3_ms:.0f} ms "
                                    "({ratios/s3_over_healthy:.2f}× healthy, {ratios/s3_over_baseline:.2f}× the "
                                    "baseline), s3_pipemorph {s3_pipemorph_ms:.0f} ms "
                                    "({ratios/s3_pipemorph_over_s3:.2f}× s3)"),
    # Fig. 19 at 10/20/30 ms, several invocations (scripts/bench_falcon.py --fig19 --fault-ms ...): one row
    # per fault size in docs/falcon.md's table and one in BENCHMARKS.md, each the median [min–max] of the runs
    *[(path, FIG19_RUNS, template.replace("{ms}", str(ms)))
      for ms in (10, 20, 30) for path, template in (
          ("docs/falcon.md", '| {ms} ms | {summary/{ms}/invocations} | {summary/{ms}/healthy_ms/median:.0f} ms [{summary/{ms}/healthy_ms/min:.0f}–{summary/{ms}/healthy_ms/max:.0f}] | {summary/{ms}/ratios/baseline_over_healthy/median:.2f}× [{summary/{ms}/ratios/baseline_over_healthy/min:.2f}–{summary/{ms}/ratios/baseline_over_healthy/max:.2f}] | {summary/{ms}/ratios/s3_over_baseline/median:.2f}× [{summary/{ms}/ratios/s3_over_baseline/min:.2f}–{summary/{ms}/ratios/s3_over_baseline/max:.2f}] ({summary/{ms}/ratios/s3_speedup_over_baseline/median:.2f}× [{summary/{ms}/ratios/s3_speedup_over_baseline/min:.2f}–{summary/{ms}/ratios/s3_speedup_over_baseline/max:.2f}]) | {summary/{ms}/ratios/s3_pipemorph_over_s3/median:.2f}× [{summary/{ms}/ratios/s3_pipemorph_over_s3/min:.2f}–{summary/{ms}/ratios/s3_pipemorph_over_s3/max:.2f}] ({summary/{ms}/ratios/s3_over_s3_pipemorph/median:.2f}× [{summary/{ms}/ratios/s3_over_s3_pipemorph/min:.2f}–{summary/{ms}/ratios/s3_over_s3_pipemorph/max:.2f}]) | {summary/{ms}/ratios/s3_pipemorph_over_healthy/median:.2f}× [{summary/{ms}/ratios/s3_pipemorph_over_healthy/min:.2f}–{summary/{ms}/ratios/s3_pipemorph_over_healthy/max:.2f}] |'),
          ("BENCHMARKS.md", '{ms} ms ({summary/{ms}/invocations}): baseline **{summary/{ms}/ratios/baseline_over_healthy/median:.2f}×** healthy [{summary/{ms}/ratios/baseline_over_healthy/min:.2f}–{summary/{ms}/ratios/baseline_over_healthy/max:.2f}], S3 **{summary/{ms}/ratios/s3_over_baseline/median:.2f}×** the baseline [{summary/{ms}/ratios/s3_over_baseline/min:.2f}–{summary/{ms}/ratios/s3_over_baseline/max:.2f}], S3 + PipeMorph **{summary/{ms}/ratios/s3_pipemorph_over_s3/median:.2f}×** S3 [{summary/{ms}/ratios/s3_pipemorph_over_s3/min:.2f}–{summary/{ms}/ratios/s3_pipemorph_over_s3/max:.2f}]'))],
    ("docs/falcon.md", HOL_CAL, "measured **{predicted_ratio:.2f}×**"),
    ("docs/falcon.md", HOL_CAL, "keeps hold {hold:g} (`saturated: true`)"),
    ("BENCHMARKS.md", HOL_CAL, "the maximal hold measured {predicted_ratio:.2f}×"),
    ("docs/status.md", FIG19, "fixed plan {ratios/baseline_over_healthy:.2f}× healthy (the paper's 8.04×), S3 "
                              "{ratios/s3_over_baseline:.2f}× of it"),
    ("docs/status.md", FIG19, "{ratios/s3_pipemorph_over_s3:.2f}× S3 (a further {ratios/s3_over_s3_pipemorph:.2f}×; "
                              "the paper's 1.96×;"),
]


def _fig19_b_row(path: str, fault_ms: int) -> str:
    d = _load(path)
    r = d["ratios"]
    met = lambda x, lim: "met" if x <= lim else "not met"  # noqa: E731
    return (f"| {fault_ms} (`{Path(path).name}`) | {d['healthy_ms']:.0f} ms | {d['baseline_ms']:.0f} ms "
            f"({r['baseline_over_healthy']:.2f}×) | {d['s3_ms']:.0f} ms ({r['s3_over_healthy']:.2f}×) | "
            f"{d['s3_pipemorph_ms']:.0f} ms | **{r['s3_over_baseline']:.2f}** {met(r['s3_over_baseline'], 0.7)} | "
            f"**{r['s3_pipemorph_over_s3']:.2f}** {met(r['s3_pipemorph_over_s3'], 0.85)} |")


def _fig15_rows() -> list[str]:
    """The table scripts/bench_fig15.py prints, row by row."""
    d = _load(FIG15)
    delays = [f"{x:g}" for x in d["setting"]["delays_ms"]]
    rows = []
    for arm, hol in d["setting"]["head_of_line_blocking"].items():
        ms = " | ".join(f"{d['makespan_ms'][arm][k]:.0f}" for k in delays)
        s = d["slowdown"][arm]
        rows.append(f"| {arm} | {'yes' if hol else 'no'} | {ms} | {s['ours']:.2f}× | {s['paper']:.2f}× |")
    warmup = d["warmup_counts"]["PipeMorph"][delays[-1]]
    rows.append(f"PipeMorph's plan at {delays[-1]} ms: warm-up {warmup}")
    return rows


def _detection_rows() -> list[str]:
    """The tables scripts/bench_falcon.py prints in its default mode (as docs/benchmarks/falcon.md shows them)."""
    d = _load(DETECT)
    rows = []
    for c, st in d["detection"]["per_category"].items():
        lat = ("-" if st["latency_iters_mean"] is None else
               f"{st['latency_iters_mean']:.2f} / {st['latency_iters_p50']:.0f} / "
               f"{st['latency_iters_p95']:.1f} / {st['latency_iters_max']}")
        rows.append(f"| {c} | {st['n']} | {st['accuracy']:.3f} | {st['false_positives']} | {lat} |")
    for r in d["latency_vs_step"]:
        lm = "-" if r["latency_mean"] is None else f"{r['latency_mean']:.2f}"
        rows.append(f"| {r['factor']} | {r['seeds']} | {r['missed']} | {lm} | {r['latency_max']} |")
    det = d["detection"]["detector_step_us"]
    rows.append(f"| SlowIterationDetector.observe | {det['mean']:.1f} | {det['p50']:.1f} | {det['p99']:.1f} | "
                f"{det['cpu_mean']:.1f} |")
    for name, key in (("FalconMonitor.observe (4 groups tracked)", "monitor"),
                      ("FalconMonitor.observe, `group_tracking=False`", "monitor_without_group_tracking")):
        m = d[key]
        rows.append(f"| {name} | {m['mean_us']:.1f} | {m['p50_us']:.1f} | {m['p99_us']:.1f} | {m['cpu_mean_us']:.1f} |")
    for k, v in d["cost_fraction"].items():
        rows.append(f"| {k[5:]} | {100 * v['detector']:.4f} % | {100 * v['monitor']:.4f} % | "
                    f"{100 * v['detector_cpu']:.4f} % | {100 * v['monitor_cpu']:.4f} % |")
    return rows


ROWS: list[tuple[str, str, callable]] = [
    ("BENCHMARKS.md", FIG15, _fig15_rows),
    (f"{BENCH}/falcon.md", DETECT, _detection_rows),
    ("docs/falcon.md", FIG19_B30, lambda: [_fig19_b_row(FIG19_B30, 30)]),
    ("docs/falcon.md", FIG19_B90, lambda: [_fig19_b_row(FIG19_B90, 90)]),
]


def _flat(text: str) -> str:
    """Runs of white space as one space: a quote may wrap anywhere in the doc."""
    return " ".join(text.split())


def _load(path: str) -> dict:
    return json.loads((ROOT / path).read_text())


def _get(doc: dict, path: str):
    return reduce(lambda node, key: node[key], path.split("/"), doc)


class _JsonFormatter(string.Formatter):
    """``{a/b/c:fmt}`` → the JSON's value at a → b → c; ``{x÷y:fmt}`` the ratio of two such values."""

    def __init__(self, data: dict):
        super().__init__()
        self.data = data

    def get_field(self, field_name, args, kwargs):
        if "÷" in field_name:
            num, den = field_name.split("÷")
            return _get(self.data, num) / _get(self.data, den), field_name
        return _get(self.data, field_name), field_name


@pytest.mark.parametrize("doc,path,template", QUOTES, ids=lambda x: x if isinstance(x, str) and len(x) < 40 else None)
def test_a_quoted_number_is_its_jsons(doc, path, template):
    data = _load(path)
    expected = _flat(_JsonFormatter(data).format(template))
    assert expected in _flat((ROOT / doc).read_text()), f"{doc} should quote {path} as:\n{expected}"


@pytest.mark.parametrize("doc,path,rows", ROWS, ids=[f"{d}<-{Path(p).name}" for d, p, _ in ROWS])
def test_a_table_printed_from_a_json_is_that_jsons(doc, path, rows):
    text = (ROOT / doc).read_text()
    missing = [r for r in rows() if r not in text]
    assert not missing, f"{doc}: rows not as in {path}:\n" + "\n".join(missing)


def test_every_json_the_table_names_is_in_the_repository_and_named_by_its_doc():
    for doc, path, _ in [*QUOTES, *ROWS]:
        assert (ROOT / path).is_file(), path
    for doc, path in {(d, p) for d, p, _ in [*QUOTES, *ROWS]}:
        text = (ROOT / doc).read_text()
        assert Path(path).name in text or path in text, f"{doc} quotes {path} without naming it"


@pytest.mark.slow  # the compare command plans and simulates ten schedules: ~13 s of CPU
def test_choosing_shows_what_its_compare_command_prints():
    """docs/choosing.md quotes `titan-ext compare` for S=8, N=32, +60 ms on link 6: its rows are what the
    command prints now (a planner change that moves a row must move the doc with it)."""
    import subprocess
    import sys

    doc = (ROOT / "docs" / "choosing.md").read_text()
    cmd = "compare --stages 8 --microbatches 32 --times 10,10,10 --delay 6:60"
    assert f".venv/bin/titan-ext {cmd}" in doc
    out = subprocess.run([sys.executable, "-m", "titan_ext", *cmd.split(), "--time-limit", "600"], cwd=ROOT,
                         capture_output=True, text=True, timeout=900, check=True).stdout
    rows = [line.rstrip() for line in out.splitlines() if line.startswith(("PipeMorph", "CrossPipe", "ZB-H1", "torch "))]
    assert len(rows) == 10, out
    doc_rows = {line.rstrip() for line in doc.splitlines()}
    assert [r for r in rows if r not in doc_rows] == [], "docs/choosing.md's compare block is not the command's output"
