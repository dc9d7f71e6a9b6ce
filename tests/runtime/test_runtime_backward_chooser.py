"""The split/full backward chooser's decisions (pure logic, no processes): when it probes, what it
keeps, how it aborts, and when it reuses a verdict.  Expected outcomes follow from the spans fed in."""

from __future__ import annotations

from titan_ext.runtime.decide.backward import BackwardChooser
from titan_ext.runtime.decide.policy import Decision

KEEP = Decision("keep", "fine")
COUNTS = [7, 5, 3, 1]


def run(chooser: BackwardChooser, spans: list[tuple[str, float]], start: int = 0, delays=(0.3, 0.2, 30.0)):
    """Feed (variant that ran, span) per iteration with a 'keep' policy; returns the decisions, and
    plays the deployment: a probe/select with another variant runs from the next iteration on."""
    out = []
    for k, (variant, span) in enumerate(spans):
        chooser.record(variant, span)
        out.append(chooser.step(KEEP, variant, COUNTS, "adaptive", delays, start + k))
    return out


def test_probes_after_a_window_then_keeps_the_faster_full():
    c = BackwardChooser(window=3)
    d = run(c, [("split", 600), ("split", 610), ("split", 590)])
    assert [x.action for x in d] == ["keep", "keep", "probe"]
    assert d[-1].backward == "full" and d[-1].warmup_counts == COUNTS  # same memory as the regime's plan
    d = run(c, [("full", 520), ("full", 530), ("full", 515)])
    assert [x.action for x in d] == ["keep", "keep", "keep"]  # full runs and wins: nothing to deploy
    assert c.decided and c.verdict[0] == "full"


def test_full_wins_ties_so_a_tied_probe_of_full_stays_without_a_swap():
    c = BackwardChooser(window=2, margin=0.02)
    run(c, [("split", 600), ("split", 600)])
    d = run(c, [("full", 608), ("full", 606)])  # split 1.1 % faster: inside the margin
    assert [x.action for x in d] == ["keep", "keep"] and c.decided and c.verdict[0] == "full"


def test_split_that_wins_by_the_margin_is_redeployed_with_the_regime_counts():
    c = BackwardChooser(window=2, margin=0.02)
    run(c, [("split", 600), ("split", 600)])
    d = run(c, [("full", 615), ("full", 620)])  # split 2.8 % faster: beyond the margin
    assert d[-1].action == "select" and d[-1].backward == "split" and d[-1].warmup_counts == COUNTS
    assert c.verdict[0] == "split"


def test_a_tied_probe_of_split_hands_back_to_full():
    c = BackwardChooser(window=2, margin=0.02)
    run(c, [("full", 600), ("full", 600)])
    d = run(c, [("split", 592), ("split", 590)])  # split 1.5 % faster: inside the margin
    assert d[-1].action == "select" and d[-1].backward == "full" and d[-1].warmup_counts == COUNTS


def test_adapt_during_a_probe_aborts_it_and_a_shrink_waits():
    c = BackwardChooser(window=3)
    run(c, [("split", 600)] * 3)
    c.record("full", 700)
    shrink = Decision("shrink", "less slackness suffices", mode="initial")
    assert c.step(shrink, "full", COUNTS, "adaptive", (0, 0, 30), 4).action == "keep"
    adapt = Decision("adapt", "Eq.1 violated", mode="adaptive")
    d = c.step(adapt, "full", COUNTS, "adaptive", (0, 0, 30), 5)
    assert (d.action, d.backward, d.warmup_counts) == ("select", "split", COUNTS)
    assert c.decided and c.verdict[0] == "split"


def test_refused_probe_ends_the_comparison():
    c = BackwardChooser(window=2)
    run(c, [("split", 600), ("split", 600)])
    c.record("split", 600)  # the probe plan never ran: split is still deployed
    assert c.step(KEEP, "split", COUNTS, "adaptive", (0, 0, 30), 3) is KEEP and c.decided


def test_verdict_reused_while_delays_stay_put_and_not_after_they_change():
    c = BackwardChooser(window=2)
    run(c, [("split", 600), ("split", 600)])
    run(c, [("full", 500), ("full", 500)], start=2)
    c.new_regime()  # e.g. a shrink, same delays
    d = run(c, [("full", 500), ("full", 500)], start=10, delays=(0.3, 0.2, 31.0))
    assert [x.action for x in d] == ["keep", "keep"] and c.decided  # no new probe
    c.new_regime()  # the slow link got much slower: compare again
    d = run(c, [("full", 500), ("full", 500)], start=20, delays=(0.3, 0.2, 60.0))
    assert d[-1].action == "probe" and d[-1].backward == "split"
    c.new_regime()  # same delays but long after the verdict: compare again
    d = run(c, [("full", 500), ("full", 500)], start=200, delays=(0.3, 0.2, 60.0))
    assert d[-1].action == "probe"


def test_disabled_chooser_passes_the_policy_through():
    c = BackwardChooser(window=1, enabled=False)
    assert all(x is KEEP for x in run(c, [("split", 600)] * 5))
