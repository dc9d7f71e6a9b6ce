"""scripts/frontier_spread.py: the per-cell distances and their spread over invocations, against hand
arithmetic on two made-up invocations, and its exit status."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import frontier_spread  # noqa: E402


def _report(date: str, ms: float, predicted: float, optimal: float | None, speedup: float) -> dict:
    return {"date": date, "rows": [{"delay_ms": 60.0, "schedule": "GPipe", "pipemorph_ms_at_same_memory": ms,
                                    "predicted_ms": predicted, "optimal_ms": optimal, "speedup": speedup}]}


def test_distances_and_spread_by_hand():
    rows = frontier_spread.spread([_report("a", 105.0, 100.0, 100.0, 1.2), _report("b", 102.0, 100.0, 96.0, 1.3),
                                   _report("c", 110.0, 110.0, None, 1.1)])
    (row,) = rows
    assert row["vs_predicted_pct"] == pytest.approx([5.0, 2.0, 0.0])
    assert row["vs_predicted_pct_min_median_max"] == pytest.approx([0.0, 2.0, 5.0])
    assert row["vs_optimal_pct"][:2] == pytest.approx([5.0, 6.25])  # 102 / 96 − 1
    assert row["vs_optimal_pct"][2] != row["vs_optimal_pct"][2]  # no optimum: NaN
    assert row["speedup_min_median_max"] == pytest.approx([1.1, 1.2, 1.3])


@pytest.mark.multiprocess
@pytest.mark.parametrize("within, rc", [(7.0, 0), (6.0, 1)])
def test_exit_status_names_a_cell_beyond_the_bound(tmp_path, within, rc):
    paths = []
    for k, rep in enumerate((_report("a", 105.0, 100.0, 100.0, 1.2), _report("b", 102.0, 100.0, 96.0, 1.3))):
        paths.append(tmp_path / f"r{k}.json")
        paths[-1].write_text(json.dumps(rep))
    out = tmp_path / "spread.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "frontier_spread.py"), *map(str, paths),
                           "--within", str(within), "--json", str(out)], capture_output=True, text=True)
    assert proc.returncode == rc, proc.stdout + proc.stderr
    assert json.loads(out.read_text())["largest_pct"] == pytest.approx(6.25)
