"""runtime/metrics.py: the published keys of ``last_metrics`` (moved from test_runtime_parts.py)."""

from __future__ import annotations

import math

from titan_ext.runtime.metrics import IterationMetrics


def test_metrics_dict_keeps_the_published_keys():
    m = IterationMetrics(3, 12.5, decision="keep", extra={"falcon/event": "none"})
    d = m.as_dict()
    for key in ("iteration", "iteration_time_ms", "bubble_rate", "timeline_span_ms", "link_delay_ms",
                "link_delay_estimate_ms", "compute_ms", "backward", "plan_version", "plan_hash", "warmup_counts",
                "slackness", "eq1_tolerance_ms", "replan_ms", "deployed", "plan_ms", "plan_cpu_ms", "swap_ms",
                "exchange_ms", "boundary_ms", "decision", "decision_reason", "recv_wait_ms", "inflight_cap"):
        assert key in d, key
    assert d["iteration"] == 3 and d["falcon/event"] == "none" and "extra" not in d
