"""The schedule's config: typed settings checked at construction, the keywords of
earlier releases mapped onto it by one helper, and the narrow seams (no private reads)."""

import ast
import dataclasses
from pathlib import Path

import pytest

from titan_ext.runtime import PipeMorphConfig
from titan_ext.runtime.control.config import DelegationConfig, PolicySettings
from titan_ext.runtime.schedules.crosspipe import CrossPipeConfig
from titan_ext.runtime.decide.policy import ReplanPolicy

RUNTIME = Path(__file__).resolve().parents[2] / "titan_ext" / "runtime"


@pytest.mark.parametrize("kwargs, needle", [
    ({"profile_every": 0}, "profile_every must be >= 1"),
    ({"max_inflight": 0}, "max_inflight must be >= 1"),
    ({"memory_budget_bytes": -1.0}, "memory_budget_bytes must be > 0"),
    ({"backward_margin": 1.0}, "backward_margin must be within [0, 1)"),
    ({"initial_times_ms": (1.0, 2.0)}, "initial_times_ms must be (F, I, W)"),
    ({"delegation": "sometimes"}, "delegation must be a DelegationConfig"),
])
def test_bad_settings_fail_at_construction_with_one_line(kwargs, needle):
    with pytest.raises((ValueError, TypeError)) as e:
        PipeMorphConfig(**kwargs)
    assert needle in str(e.value)


@pytest.mark.parametrize("make, needle", [
    (lambda: DelegationConfig(mode="sometimes"), "delegation must be one of ('off', 'auto', 'always')"),
    (lambda: DelegationConfig(slot_bytes=0), "delegate_slot_bytes must be >= 1"),
    (lambda: PolicySettings(window=0), "policy window must be >= 1"),
    (lambda: PolicySettings(rel_margin=-0.1), "policy rel_margin must be >= 0"),
    (lambda: CrossPipeConfig(variant="zigzag"), "CrossPipe run-time variant must be 'ud' or 'udsub'"),
    (lambda: PipeMorphConfig().updated("CrossPipe", varient="ud"), "CrossPipe: unknown option(s) ['varient']"),
    (lambda: PipeMorphConfig().updated(delegation="sometimes"), "delegation must be one of"),
])
def test_bad_values_and_unknown_keywords_name_what_is_wrong(make, needle):
    with pytest.raises((ValueError, TypeError)) as e:
        make()
    assert needle in str(e.value)


def test_old_keywords_land_on_the_config_fields_they_always_meant():
    detector = lambda metrics: False  # noqa: E731
    cfg = PipeMorphConfig().updated(adaptive=False, profile_every=3, delegation="auto", failover=True,
                                    slow_link_ms=7.5, detector=detector, delegate_lanes=2, delegate_slots=8,
                                    delegate_slot_bytes=8192, recv_timeout_s=4.0, delegate_timeout_s=9.0)
    assert (cfg.adaptive, cfg.profile_every) == (False, 3)
    assert cfg.delegation == DelegationConfig(mode="auto", failover=True, slow_link_ms=7.5, detector=detector,
                                              lanes=2, slots=8, slot_bytes=8192, recv_timeout_s=4.0, timeout_s=9.0)
    # every field is reachable as a keyword: the config's own names, delegation's former ones
    own = {f.name for f in dataclasses.fields(PipeMorphConfig)} - {"delegation", "policy", "policy_settings",
                                                                   "planner", "observers", "falcon"}
    assert all(getattr(PipeMorphConfig().updated(**{n: getattr(cfg, n)}), n) == getattr(cfg, n) for n in own)
    base = PipeMorphConfig(max_inflight=5)
    assert base.updated() is base and base.updated(adaptive=False).max_inflight == 5  # keywords on top


def test_a_plain_replan_policy_becomes_settings_and_any_other_policy_is_kept():
    cfg = PipeMorphConfig().updated(policy=ReplanPolicy(window=5, rel_margin=0.3))
    assert cfg.policy is None and (cfg.policy_settings.window, cfg.policy_settings.rel_margin) == (5, 0.3)

    class Mine(ReplanPolicy):
        pass

    mine = Mine(window=2)
    assert PipeMorphConfig().updated(policy=mine).policy is mine


def test_policy_built_from_settings_has_their_thresholds_and_headroom():
    s = PolicySettings(window=4, rel_margin=0.2, abs_margin_ms=0.5, recover_patience=6, min_dwell=1)
    pol = ReplanPolicy.from_settings(s)
    assert (pol.window, pol.rel_margin, pol.abs_margin_ms, pol.recover_patience, pol.min_dwell) == (4, 0.2, 0.5, 6, 1)
    assert pol.forces is False
    assert s.headroom_delay(10.0) == pytest.approx(10.0 * 1.2 + 0.5) == pol.headroom_delay(10.0)
    assert s.headroom_delay(0.0) == 0.0


def _private_reads(path: Path, names: set[str]) -> list[str]:
    tree = ast.parse(path.read_text())
    return [f"{path.name}:{n.lineno} .{n.attr}" for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr in names]


def test_observers_and_delegation_read_no_private_state_of_the_schedule():
    """They get a ScheduleContext; the schedule's private attributes never appear in their code."""
    private = {"_group", "_num_stages", "_in_iteration", "_log", "_stages", "_stage", "_n_microbatches",
               "executor", "schedule"}
    files = [RUNTIME / "control" / "observers.py", RUNTIME / "control" / "extensions.py",
             *sorted((RUNTIME / "comm" / "delegate").glob("*.py")),
             *sorted((RUNTIME / "falcon").glob("*.py"))]
    assert [hit for f in files for hit in _private_reads(f, private)] == []
