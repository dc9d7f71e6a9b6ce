"""The planning core against the papers' published numbers and theorems."""

import json

import pytest

from titan_ext.plan import PipelineProfile, plan_pipemorph, simulate


def test_fig4_fig5_through_cli(tmp_path, cli_main):
    """PipeMorph Fig.4: ZB, S=4, N=12, t=10 ms → 390 ms; Fig.5: the same plan with 10 / 20 ms on link 0
    → 400 / 440 ms (the exported CSV is simulated, so the plan is fixed).  The CLI runs in this process
    (conftest's ``cli_main``); the process-level contract: tests/plan/test_plan_export_cli.py."""

    def cli(*args):
        out = cli_main(*args)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    csv = tmp_path / "zb.csv"
    planned = cli("plan", "--stages", "4", "--microbatches", "12", "--times", "10,10,10",
                  "--schedule", "zb", "--out-csv", str(csv), "--json")
    assert planned["makespan_ms"] == pytest.approx(390.0)
    for delay, expected in ((10, 400.0), (20, 440.0)):
        sim = cli("simulate", "--csv", str(csv), "--stages", "4", "--microbatches", "12",
                  "--times", "10,10,10", "--delay", f"0:{delay}", "--json")
        assert sim["makespan_ms"] == pytest.approx(expected)


def slack_plan(S, N, delta):
    """The plan of Theorem 1's proof (Fig.7), written out by hand: stage i runs x_i = 1 + Δ(S−1−i)
    warm-up forwards, then pairs B_a with F_{a+x_i} (so stage i's B_a / F_b pairs match stage i+1's
    with a slackness of Δ), then its remaining B's, then the W's."""
    plan = {}
    for i in range(S):
        x = min(1 + delta * (S - 1 - i), N)
        ops = [(i, "F", m) for m in range(x)]
        for a in range(N):
            ops.append((i, "I", a))
            if a + x < N:
                ops.append((i, "F", a + x))
        ops += [(i, "W", m) for m in range(N)]
        plan[i] = ops
    return plan


def added_delay(S, N, delta, link, c, t=10.0):
    base = PipelineProfile.uniform(S, N, t, t, t)
    plan = slack_plan(S, N, delta)
    return simulate(plan, base.with_delays({link: c})).makespan_ms - simulate(plan, base).makespan_ms


@pytest.mark.parametrize("delta", [2, 3, 4])
def test_theorem1_threshold(delta):
    """Theorem 1: a fixed plan with slackness Δ on the slow link absorbs c ≤ (Δ−1)t — the added delay
    is Θ(c): at most 2c (the F and the B of one microbatch cross the link once each) and the same for
    every N; once c > (Δ−1)t the added delay grows with N (Θ(Nc/(Δ−1)))."""
    S, t, link = 4, 10.0, 1
    threshold = (delta - 1) * t
    for c in (threshold / 2, threshold):
        added = [added_delay(S, N, delta, link, c) for N in (16, 32, 64)]
        assert all(a <= 2 * c + 1e-9 for a in added), added
        assert len(set(added)) == 1
    c = threshold + 5.0
    added = [added_delay(S, N, delta, link, c) for N in (16, 32, 64)]
    assert added[0] < added[1] < added[2] and added[2] > 2 * c, added


def test_slack_plan_is_valid():
    from titan_ext.plan import validate_plan

    for delta in (2, 3, 4):
        validate_plan(slack_plan(4, 16, delta), 4, 16)


@pytest.mark.parametrize("S", [4, 8])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("c", [15.0, 30.0, 60.0])
def test_adaptation_reaches_ideal_plus_2c(S, where, c):
    """Alg.2 + Alg.3/4: with one slow link the adapted plan's makespan is ≤ T_ideal + 2c.
    T_ideal = 3Nt + (S−1)t: the last stage cannot start before (S−1)t and then has 3Nt of work."""
    t, N = 10.0, 6 * S
    link = {"first": 0, "middle": S // 2 - 1, "last": S - 2}[where]
    prof = PipelineProfile.uniform(S, N, t, t, t, delays_ms={link: c})
    plan = plan_pipemorph(prof)
    ideal = 3 * N * t + (S - 1) * t
    makespan = simulate(plan.actions, prof).makespan_ms
    assert makespan <= ideal + 2 * c + 1e-9
    # and the fixed zb plan does worse whenever the delay exceeds its tolerance (Δ − 1)t = t
    zb = plan_pipemorph(prof, schedule="zb")
    assert simulate(zb.actions, prof).makespan_ms > makespan


def test_memory_extension_floor1():
    """Beyond the paper: slack floor 1 and in-flight cap x_i. S=8, N=32, t=10, +60 ms on the last link:
    still T_ideal + c, with stage 0 holding at most 14 activations."""
    S, N, t, c = 8, 32, 10.0, 60.0
    prof = PipelineProfile.uniform(S, N, t, t, t, delays_ms={S - 2: c})
    plan = plan_pipemorph(prof, slack_floor=1)
    tl = simulate(plan.actions, prof)
    assert tl.makespan_ms <= 3 * N * t + (S - 1) * t + c + 1e-9
    assert tl.makespan_ms == pytest.approx(1090.0)
    assert tl.peak_inflight[0] <= 14
    assert all(tl.peak_inflight[s] <= plan.warmup_counts[s] for s in range(S))
    # without the cap (the published behaviour) stage 0 holds more
    uncapped = plan_pipemorph(prof, slack_floor=1, cap_inflight=False, candidates=False)
    assert simulate(uncapped.actions, prof).peak_inflight[0] > 14


def test_peak_inflight_in_cli_json(cli_main):
    run = cli_main("plan", "--stages", "8", "--microbatches", "32", "--times", "10,10,10",
                   "--delay", "6:60", "--slack-floor", "1", "--json")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["peak_inflight"]["0"] <= 14
    assert out["warmup_counts"][0] == 14
    assert out["makespan_ms"] == pytest.approx(3 * 32 * 10 + 70 + 60)
