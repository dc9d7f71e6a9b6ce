"""Profiles reject bad input with a ValueError that names the field."""

import math

import pytest

from titan_ext.plan import LinkProfile, PipelineProfile


def make(**kw):
    args = dict(num_stages=4, num_microbatches=8, f_ms=10, b_ms=10, w_ms=10)
    args.update(kw)
    return PipelineProfile(**args)


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(num_stages=0), "num_stages"),
        (dict(num_microbatches=0), "num_microbatches"),
        (dict(num_stages=2.5), "num_stages"),
        (dict(f_ms=-1), "f_ms[0]"),
        (dict(f_ms=0), "f_ms[0]"),
        (dict(b_ms=[10, 10, math.nan, 10]), "b_ms[2]"),
        (dict(w_ms=[10, 10, 10, -0.5]), "w_ms[3]"),
        (dict(w_ms=[10, 10]), "w_ms"),
        (dict(f_ms=math.inf), "f_ms[0]"),
        (dict(links=(LinkProfile(),)), "links"),
        (dict(activation_bytes=1e6), "activation_bytes"),  # without a budget
        (dict(activation_bytes=1e6, memory_budget_bytes=[4e6, 4e6, 5e5, 4e6]), "memory_budget_bytes[2]"),
        (dict(activation_bytes=[1e6, 0, 1e6, 1e6], memory_budget_bytes=4e6), "activation_bytes[1]"),
    ],
)
def test_bad_profile_names_the_field(kw, field):
    with pytest.raises(ValueError) as err:
        make(**kw)
    assert field in str(err.value)


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(latency_ms=-1), "latency_ms"),
        (dict(latency_ms=math.nan), "latency_ms"),
        (dict(bandwidth_bytes_per_s=0), "bandwidth_bytes_per_s"),
        (dict(message_bytes=-5), "message_bytes"),
    ],
)
def test_bad_link_names_the_field(kw, field):
    with pytest.raises(ValueError) as err:
        LinkProfile(**kw)
    assert field in str(err.value)


def test_link_delay_is_latency_plus_size_over_bandwidth():
    link = LinkProfile(latency_ms=5, bandwidth_bytes_per_s=1e9, message_bytes=20e6)
    assert link.transfer_ms == pytest.approx(20.0)
    assert link.delay_ms == pytest.approx(25.0)
    assert LinkProfile(latency_ms=3).delay_ms == 3.0


def test_memory_capacity_per_stage():
    p = make(activation_bytes=[1e6, 2e6, 1e6, 1e6], memory_budget_bytes=[7.5e6, 7.5e6, 1e6, 3e6])
    assert p.max_inflight() == (7, 3, 1, 3)


def test_uniform_rejects_unknown_link():
    with pytest.raises(ValueError, match="link 3"):
        PipelineProfile.uniform(3, 6, 1, 1, 1, delays_ms={3: 10})


def test_fewer_microbatches_than_stages_plan_validly():
    """N < S is a valid profile (torch's GPipe, Interleaved1F1B and ZBV run it): every planner gives a plan
    that our validator accepts, with one stage per rank and with two."""
    from titan_ext.plan.schedules import plan_by_name
    from titan_ext.plan.validate import validate_plan
    from titan_ext.plan.virtual import plan_virtual

    for n in (1, 2, 3):
        prof = make(num_microbatches=n, links=tuple(LinkProfile(latency_ms=5.0) for _ in range(3)))
        for name in ("pipemorph", "zb", "zb-h1", "auto"):
            validate_plan(plan_by_name(prof, name).actions, 4, n)
        for placement in ("loop", "v"):
            plan = plan_virtual(prof, 2, placement)
            validate_plan(plan.actions, 8, n, torch_dry_run=True)


def test_per_stage_values_are_checked_as_each_value_alone():
    """A profile's per-stage tuples are validated in one pass where every value is a float (profiles derived
    from profiles, each check of the runtime); that pass must accept and refuse exactly what checking
    each value alone does (the same error, naming the same entry): every tuple of up to three edge
    values, for times (> 0 at least 1 ns, or >= 0; at most MAX_MS) and for byte counts (no upper bound)."""
    import itertools

    from titan_ext.plan import profile as P

    def alone(values, positive, ms):
        check = (lambda n, v: P._check_ms(n, v, positive=positive)) if ms else (
            lambda n, v: P._check_number(n, v, positive=positive))
        return tuple(check(f"x[{i}]", v) for i, v in enumerate(values))

    def outcome(fn):
        try:
            return ("ok", fn())
        except (ValueError, TypeError) as e:
            return (type(e).__name__, str(e))

    edges = [0.0, -0.0, 5e-324, 1e-7, P.MIN_POSITIVE_MS, 1.0, P.MAX_MS, P.MAX_MS * (1 + 1e-15), 1e300,
             math.inf, -math.inf, math.nan, -1.0, 3]  # 3: an int takes the per-value path
    for n in (1, 2, 3):
        for values in itertools.product(edges, repeat=n):
            for positive in (True, False):
                for ms in (True, False):
                    got = outcome(lambda: P._stage_tuple("x", list(values), n, positive=positive, ms=ms))
                    want = outcome(lambda: alone(values, positive, ms))
                    assert repr(got) == repr(want), (values, positive, ms)
