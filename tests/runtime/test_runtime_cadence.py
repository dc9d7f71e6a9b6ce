"""runtime/control/cadence.py: when the ranks exchange profiles (adaptive k, PipeMorph §6 ②)."""

import pytest
import torch
import torch.nn.functional as Fn
from torch.distributed.pipelining import PipelineStage

from titan_ext.runtime import Decision, PipeMorph, PolicySettings
from titan_ext.runtime.control.cadence import CheckCadence
from titan_ext.testing import mlp_stages, run_ranks, seeded_batch, step_rank


def _checks(cadence: CheckCadence, iterations: int, settled=lambda it: True, delays=lambda it: [1.0]) -> list[int]:
    out = []
    for it in range(iterations):
        if cadence.due(it):
            out.append(it)
            cadence.after_check(it, settled(it), delays(it))
    return out


def test_period_doubles_after_a_quiet_window_up_to_the_max():
    # window 3: 3 quiet checks at each period (hand-counted; the first check has no previous delays to
    # compare with, so it is news): 0..3 at k=1, 5..9 at k=2, then k=4
    got = _checks(CheckCadence(1, 4, window=3, rel_margin=0.1, abs_margin_ms=1.0), 30)
    assert got == [0, 1, 2, 3, 5, 7, 9, 13, 17, 21, 25, 29]


def test_anything_but_quiet_resets_to_profile_every():
    unsettled_at = {7}
    got = _checks(CheckCadence(1, 4, 3, 0.1, 1.0), 20, settled=lambda it: it not in unsettled_at)
    assert got[:11] == [0, 1, 2, 3, 5, 7, 8, 9, 10, 12, 14]  # 7 not quiet: back to every iteration
    # a link delay that moves beyond 10 % + 1 ms is news: also not quiet
    moved = _checks(CheckCadence(1, 4, 3, 0.1, 1.0), 12, delays=lambda it: [1.0 if it < 7 else 30.0])
    assert moved[:9] == [0, 1, 2, 3, 5, 7, 8, 9, 10]
    # within the margins (1.0 → 1.5 ms < 10 % + 1 ms): still quiet
    assert _checks(CheckCadence(1, 4, 3, 0.1, 1.0), 12, delays=lambda it: [1.0 + 0.5 * (it % 2)])[3:6] == [3, 5, 7]


def test_fixed_cadence_never_grows():
    cadence = CheckCadence(2, 8, 1, 0.1, 1.0)
    cadence.fixed()
    assert _checks(cadence, 20) == list(range(0, 20, 2))


def test_a_check_runs_behind_only_once_backed_off_and_with_no_plan_to_agree_on():
    cadence = CheckCadence(1, 4, 1, 0.1, 1.0)
    assert cadence.post("x", 0, planning=False) == ("x", 0)  # period 1: decided where it exchanged
    for it in range(2):  # window 1: the check at 0 is news, the quiet one at 1 doubles the period
        cadence.after_check(it, True, [1.0])
    assert cadence.backed_off and cadence.period == 2
    assert cadence.post("y", 4, planning=True) == ("y", 4)  # a plan's hash to agree on: decided now
    assert cadence.post("z", 4, planning=False) is None  # runs behind: decided at 5, no check due there
    assert not cadence.due(5)
    assert cadence.take_posted() == ("z", 4) and cadence.take_posted() is None


def test_a_check_decided_behind_schedules_the_next_after_its_decision():
    cadence = CheckCadence(1, 4, 1, 0.1, 1.0)
    for it in range(2):
        cadence.after_check(it, True, [1.0])
    assert not cadence.due(2) and cadence.due(3)  # period 2 after the check at 1
    cadence.after_check(3, False, [1.0], decided_at=4)  # exchanged at 3, decided at 4: not quiet
    assert cadence.period == 1 and not cadence.due(4) and cadence.due(5)
    cadence.after_check(5, True, [1.0], decided_at=5)  # decided where it exchanged: quiet, the period doubles
    assert cadence.period == 2 and not cadence.due(6) and cadence.due(7)


class _SwapOnce:
    """Keeps, except one forced re-plan (one more warm-up forward on stage 0) at its second check; a window
    of one check."""

    window = 1
    forces = True

    def __init__(self):
        self.calls = 0

    def decide(self, estimate, deployed_counts, initial_counts, since, slack_floor=2):
        self.calls += 1
        if self.calls == 2:
            return Decision("force", "re-plan", warmup_counts=[initial_counts[0] + 1, *initial_counts[1:]])
        return Decision("keep", "quiet")


def _swap_once(rank: int, world: int) -> list[tuple[int, str | None, bool]]:
    mods = mlp_stages(world, 8)
    # margins no loopback reading crosses: a link delay that moves is news too (the test above), not wanted here
    sched = PipeMorph(PipelineStage(mods[rank], rank, world, torch.device("cpu")), 4, loss_fn=Fn.mse_loss,
                      adaptive=False, backward="full", policy=_SwapOnce(),
                      policy_settings=PolicySettings(abs_margin_ms=1e3))
    for k in range(12):
        step_rank(sched, rank, world, *seeded_batch(k, 8, 8))
    return [(m["iteration"], m["check"], bool(m["deployed"])) for m in sched.metrics_history]


@pytest.mark.multiprocess
def test_a_check_that_swaps_a_plan_in_is_not_quiet():
    """After a swap the window must first hold a check made under the new plan: the period (window 1)
    doubles after the check following the swap, not at the swap (exchanges at d + 1, then d + 3)."""
    for rows in run_ranks(_swap_once, 2, backend="gloo"):
        swaps = [it for it, _, deployed in rows if deployed]
        assert len(swaps) == 1, rows
        d = swaps[0]
        exchanged = [it for it, check, _ in rows if it > d and check in ("exchange", "posted")]
        assert exchanged[:2] == [d + 1, d + 3], rows
