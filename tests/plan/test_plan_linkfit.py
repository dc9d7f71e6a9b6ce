"""α-β fit of a PP link from timed messages of known sizes (titan_ext/plan/linkfit.py).

Synthetic messages are timed by the simulator's own FIFO link model (``timing.LinkQueues``, separate
code from the fit: one queue entry per message size, all on one channel) plus late-only noise; the
live test times real gloo messages through torch's ``_batch_p2p`` with a bandwidth cap injected by
``runtime/emulate/delay_injection.py``."""

import math
import random

import pytest

from titan_ext.plan.linkfit import fit_alpha_beta, fit_link
from titan_ext.plan.profile import LinkProfile
from titan_ext.plan.timing import LinkQueues, to_ns


def _timed(latency_ms, bandwidth, sizes, gaps_ms, *, offset_ms=0.0, noise_ms=0.0, seed=0):
    """(send_s, arrival_s, nbytes) of one direction's message train, timed by timing.LinkQueues."""
    kinds = sorted(set(sizes))
    queues = LinkQueues([LinkProfile(latency_ms, bandwidth, s) for s in kinds])
    rng = random.Random(seed)
    send, arrive, t = [], [], 0.0
    for size, gap in zip(sizes, gaps_ms):
        t += gap
        arrival_ms = queues.send(kinds.index(size), "one direction", to_ns(t)) / 1e6
        late = rng.expovariate(1 / noise_ms) if noise_ms else 0.0
        send.append(t / 1e3)
        arrive.append((arrival_ms + offset_ms + late) / 1e3)
    return send, arrive, list(sizes)


@pytest.mark.parametrize("seed", range(5))
def test_mixed_sizes_random_gaps_recover_alpha_and_beta(seed):
    rng = random.Random(seed)
    latency, bandwidth = rng.uniform(0, 40), rng.choice((20e6, 50e6, 400e6))
    sizes = [rng.choice((1e5, 4e5, 1e6)) for _ in range(40)]
    gaps = [rng.uniform(0, 30) for _ in sizes]
    fit = fit_alpha_beta(*_timed(latency, bandwidth, sizes, gaps, noise_ms=0.3, seed=seed))
    assert fit.identifiable
    assert fit.bandwidth_bytes_per_s == pytest.approx(bandwidth, rel=0.05)
    assert fit.latency_ms == pytest.approx(latency, abs=0.5)


def test_one_size_queued_messages_give_beta_by_dispersion():
    """All messages 1 MB at 50 MB/s (20 ms each), handed over every 5 ms: they queue, and their
    arrivals are 20 ms apart whatever the latency."""
    fit = fit_alpha_beta(*_timed(3.0, 50e6, [1e6] * 20, [5.0] * 20, noise_ms=0.2))
    assert fit.identifiable
    assert fit.bandwidth_bytes_per_s == pytest.approx(50e6, rel=0.02)
    assert fit.latency_ms == pytest.approx(3.0, abs=0.3)


def test_one_size_never_queued_is_not_identifiable():
    """Same size, sends farther apart than a transfer: latency and size·β cannot be told apart; the
    whole delay is latency (what the runtime assumes without a fit)."""
    fit = fit_alpha_beta(*_timed(7.0, 50e6, [1e6] * 20, [50.0] * 20))
    assert not fit.identifiable and math.isinf(fit.bandwidth_bytes_per_s)
    assert fit.latency_ms == pytest.approx(27.0, abs=1e-6)


def test_clock_offset_cancels_over_both_directions():
    sizes = [2e5, 8e5, 4e5] * 8
    fwd = _timed(12.0, 100e6, sizes, [3.0] * 24, offset_ms=+250.0)
    bwd = _timed(12.0, 100e6, sizes[::-1], [4.0] * 24, offset_ms=-250.0)
    assert fit_alpha_beta(*fwd).latency_ms == pytest.approx(262.0, abs=0.1)  # one direction: offset in α
    fit = fit_link(fwd, bwd)
    assert fit.latency_ms == pytest.approx(12.0, abs=0.1)
    assert fit.bandwidth_bytes_per_s == pytest.approx(100e6, rel=0.01)
    link = fit.link_profile(message_bytes=1e6)
    assert link.delay_ms == pytest.approx(12.0 + 10.0, abs=0.2)


@pytest.mark.parametrize("args, needle", [
    (([0.0], [0.1], [1.0]), ">= 2 messages"),
    (([0.0, 1.0], [0.1, 1.1], [1.0, -1.0]), ">= 0"),
    (([1.0, 0.0], [1.1, 0.1], [1.0, 1.0]), "send (FIFO) order"),
])
def test_bad_samples_raise(args, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        fit_alpha_beta(*args)


def test_plan_from_the_fit_accounts_for_occupancy():
    """2 MB messages on a 50 MB/s link (40 ms on the wire, more than a stage's 30 ms per microbatch):
    the CrossPipe plan made from the fitted α-β link is faster, under the true link, than the plan made
    when the same measured delay is all latency (today's run-time assumption), which ignores that the
    link carries one message at a time."""
    from titan_ext.plan import PipelineProfile, simulate
    from titan_ext.plan.crosspipe import plan_crosspipe

    fit = fit_alpha_beta(*_timed(0.0, 50e6, [5e5, 1e6, 2e6] * 6, [2.0] * 18, noise_ms=0.2))
    base = PipelineProfile.uniform(4, 16, 10, 10, 10)
    true = base.with_links([LinkProfile(), LinkProfile(), LinkProfile(0.0, 50e6, 2e6)])
    fitted = base.with_links([LinkProfile(), LinkProfile(), fit.link_profile(2e6)])
    latency_only = base.with_delays({2: true.links[2].delay_ms})
    ours = simulate(plan_crosspipe(fitted, "udsub").actions, true).makespan_ms
    naive = simulate(plan_crosspipe(latency_only, "udsub").actions, true).makespan_ms
    assert ours < 0.95 * naive
