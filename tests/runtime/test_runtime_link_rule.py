"""One link model and one rank-pair → link rule for the planner, the simulator and the delay injector.

* The injector's arrival times are ``plan.timing.LinkQueues``'s: against ``LinkQueues.send`` on random
  sends of fixed-size messages, and against the injector's closed form (start = max(t, link free),
  arrival = start + size/bw + latency, delivered in order per direction) written out here, on random
  sends with changing sizes, a trace that changes the delays, and hand-over times out of order.
* For every placement (loop and v, R = 2..6 ranks, V = 1..3 stages per rank) every cross-rank message
  of the plan carries, under the injector, the delay the planner and ``simulate`` give its stage
  boundary (the loop wrap-around R−1 → 0 included).
"""

from __future__ import annotations

import math
import random
import statistics
from types import SimpleNamespace

import pytest

from titan_ext.plan import LinkProfile, PipelineProfile, simulate
from titan_ext.plan.deps import producers
from titan_ext.plan.placement import boundary_link, rank_link, stage_profile, stage_to_rank
from titan_ext.plan.timing import LinkQueues, to_ns
from titan_ext.runtime.emulate import delay_injection
from titan_ext.runtime.emulate.delay_injection import (
    DelaySchedule,
    DelaySpecError,
    LinkDelay,
    LinkDelayInjector,
    parse_delay_spec,
)


def _closed_form(sends, delay_at):
    """The injector's model as documented, in float seconds: per (link, direction) the transmission
    starts at max(hand-over, link free), lasts size/bandwidth, arrives latency later and never before
    the previous message of that direction."""
    free, last, out = {}, {}, []
    for link, direction, nbytes, t in sends:
        d = delay_at(t, link)
        key = (link, direction)
        start = max(t, free.get(key, -math.inf))
        tx = 0.0 if math.isinf(d.bandwidth_bytes_per_s) else nbytes / d.bandwidth_bytes_per_s
        free[key] = start + tx
        arrival = max(start + tx + d.latency_ms / 1e3, last.get(key, -math.inf))
        last[key] = arrival
        out.append(arrival)
    return out


@pytest.mark.parametrize("seed", range(20))
def test_the_injectors_arrivals_are_link_queues_sends(seed):
    """Fixed message size per link, hand-over times that never decrease per direction (what a rank's
    program order gives): every arrival equals ``LinkQueues.send`` under the same links (ns)."""
    rng = random.Random(seed)
    L = rng.randint(1, 4)
    links = [LinkProfile(latency_ms=rng.choice([0.0, rng.uniform(0, 30)]),
                         bandwidth_bytes_per_s=rng.choice([math.inf, rng.uniform(1e6, 1e9)]),
                         message_bytes=rng.randint(1, 10_000_000)) for _ in range(L)]
    spec = DelaySchedule(steps=[(0.0, {i: LinkDelay(lk.latency_ms, lk.bandwidth_bytes_per_s)
                                       for i, lk in enumerate(links)})], wildcard=[None])
    inj = LinkDelayInjector(spec)
    origin = inj._origin_mono
    queues = LinkQueues(links)
    clock = {}
    for _ in range(300):
        link, direction = rng.randrange(L), rng.randrange(2)
        t = clock[(link, direction)] = clock.get((link, direction), 0.0) + rng.choice([0.0, rng.uniform(0, 0.05)])
        got = inj.arrival_time(link, direction, links[link].message_bytes, origin + t)
        want = queues.send(link, (link, direction), to_ns(1e3 * (origin + t)))
        assert abs(got * 1e9 - want) <= 3, (got * 1e9, want)


@pytest.mark.parametrize("seed", range(20))
def test_the_injectors_arrivals_keep_the_closed_form(seed):
    """Changing sizes, a trace changing latency and bandwidth (faster links after slower ones), and
    hand-over times out of order: the arrivals are the documented model's (to the rounding of each
    transfer time to the nanosecond)."""
    rng = random.Random(seed)
    steps = []
    for k in range(4):
        steps.append((0.5 * k, {link: LinkDelay(rng.uniform(0, 40), rng.choice([math.inf, rng.uniform(1e5, 1e8)]))
                                for link in range(3) if rng.random() < 0.8}))
    spec = DelaySchedule(steps=steps, wildcard=[None] * len(steps))
    inj = LinkDelayInjector(spec)
    origin = inj._origin_mono
    sends = [(rng.randrange(3), rng.randrange(2), rng.randint(0, 5_000_000), origin + rng.uniform(0, 2.2))
             for _ in range(400)]
    if seed % 2:
        sends.sort(key=lambda s: s[3])
    want = _closed_form(sends, lambda t, link: spec.at(t - origin, link))
    got = [inj.arrival_time(*s) for s in sends]
    # integer ns: each transfer time is rounded to the ns, so a queue of k messages may drift k/2 ns
    assert all(abs(g - w) <= (k + 3) * 1e-9 for k, (g, w) in enumerate(zip(got, want))), \
        max(abs(g - w) for g, w in zip(got, want))
    assert statistics.median(abs(g - w) for g, w in zip(got, want)) < 1e-7


def test_send_timed_is_send_for_fixed_links():
    """``LinkQueues.send_timed`` with a link's own latency and transfer time is ``send`` (ready times
    non-decreasing per channel, zero-transfer links included)."""
    rng = random.Random(7)
    links = [LinkProfile(3.0, 2e6, 100_000), LinkProfile(1.5), LinkProfile()]
    a, b = LinkQueues(links), LinkQueues(links)
    ready = {}
    for _ in range(500):
        link, ch = rng.randrange(3), rng.randrange(2)
        t = ready[(link, ch)] = ready.get((link, ch), 0) + rng.choice([0, rng.randrange(10 ** 7)])
        assert a.send(link, (link, ch), t) == b.send_timed((link, ch), t, a.latency_ns[link], a.transfer_ns[link])


def _injector_link(monkeypatch, spec: str, world: int, src: int, dst: int):
    """The injector's (link, direction) for a message ``src`` → ``dst`` of a PP group of ``world``."""
    inj = LinkDelayInjector(parse_delay_spec(spec))
    monkeypatch.setattr(delay_injection.dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(delay_injection.dist, "get_rank", lambda group=None: src)
    return inj._stamped_link(SimpleNamespace(group=None, group_peer=dst))


PLACEMENTS = [(p, R, V) for p in ("loop", "v") for R in range(2, 7) for V in range(1, 4)]


@pytest.mark.parametrize("placement, R, V", PLACEMENTS)
def test_the_injector_and_the_planner_agree_on_every_message(monkeypatch, placement, R, V):
    """Rank link i gets latency i + 1 ms in both the rank-level profile and the injector's spec ("*" for
    every link the injector knows): each cross-rank message of the plan (deps.producers on the placement)
    is delayed by the injector exactly as the stage-level profile the planner and ``simulate`` time
    delays its boundary — the loop wrap-around by neither."""
    s2r = stage_to_rank(R, V, placement)
    S, N = len(s2r), 2
    ranks = PipelineProfile.uniform(R, N, 1.0, 1.0, 1.0, delays_ms={i: i + 1.0 for i in range(R - 1)})
    staged = stage_profile(ranks, s2r)
    spec = ",".join(f"{i}:{i + 1}" for i in range(R - 1))
    messages = 0
    for s in range(S):
        for kind in ("F", "I", "W", "B"):
            for stage, _, _ in producers((s, kind, 0), S):
                src, dst = s2r[stage], s2r[s]
                if src == dst:
                    continue
                messages += 1
                b = min(stage, s)
                assert rank_link(src, dst) == boundary_link(s2r, b)
                stamped = _injector_link(monkeypatch, spec, R, src, dst)
                injected = 0.0 if stamped is None else parse_delay_spec(spec).at(0, stamped[0]).latency_ms
                assert injected == staged.links[b].latency_ms, (src, dst, b, stamped)
                wild = _injector_link(monkeypatch, "*:5", R, src, dst)
                assert (wild is None) == (boundary_link(s2r, b) is None)
                if wild is not None:
                    assert wild[0] == boundary_link(s2r, b) and wild[1] == (0 if dst > src else 1)
    assert messages > 0
    wrap = placement == "loop" and V > 1 and R > 2
    if wrap:  # the wrap-around: neither the planner nor the injector has a link there
        assert staged.links[R - 1].delay_ms == 0.0 and boundary_link(s2r, R - 1) is None
        assert _injector_link(monkeypatch, "*:5", R, R - 1, 0) is None


def test_the_simulator_times_the_injected_links_only():
    """Loop placement, 3 ranks × 2 stages: a plan simulated with every rank link at 10 ms equals the
    same plan with the wrap-around boundary also at 0 in a hand-built stage-level profile (the
    planner's), and a delay on the wrap-around boundary would show (the simulator does time it when a
    stage-level profile names one)."""
    from titan_ext.plan.builtin import builtin_plan

    plan, s2r = builtin_plan("Interleaved1F1B", 3, 6)
    ranks = PipelineProfile.uniform(3, 6, 1.0, 2.0, 0.0, delays_ms={0: 10.0, 1: 10.0})
    by_rank = simulate(plan, ranks, stage_to_rank=s2r)
    links = tuple(LinkProfile(latency_ms=10.0 if abs(s2r[s] - s2r[s + 1]) == 1 else 0.0) for s in range(5))
    staged = PipelineProfile(6, 6, 0.5, 1.0, 0.0, links)
    assert simulate(plan, staged).makespan_ms == by_rank.makespan_ms
    wrap = PipelineProfile(6, 6, 0.5, 1.0, 0.0, links[:2] + (LinkProfile(latency_ms=10.0),) + links[3:])
    assert simulate(plan, wrap).makespan_ms > by_rank.makespan_ms


def test_a_spec_naming_the_wrap_around_is_refused(monkeypatch):
    """Links are 0..P−2 (link i joins ranks i and i+1): a spec naming link P−1 is a mistake, named."""
    with pytest.raises(DelaySpecError, match=r"names link 3 but the PP group has 4 ranks \(links 0..2"):
        _injector_link(monkeypatch, "3:10", 4, 3, 0)
    assert _injector_link(monkeypatch, "0:10", 2, 1, 0) == (0, 1)  # R = 2: the wrap-around pair is link 0
