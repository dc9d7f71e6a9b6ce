"""The PP groups of one job agree their plans (``runtime/comm/peers.py``).

The peers of a rank are derived from its PP group's ranks alone; checked here against device meshes
built by brute force (every layout of up to three dimensions with PP at each position).  Then DP 2 × PP 2
on four gloo ranks, only the second replica's link delayed: with a policy that chooses by the link's
delay, deciding alone the replicas deploy different plans (the test can fail) and agreeing they deploy the
delayed replica's; with PipeMorph's own policy every rank deploys the same plans at the same iterations,
and the replicas train as the data-parallel reference does.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as Fn

from titan_ext.runtime.comm.peers import peer_ranks, resolve_peers
from titan_ext.testing import mlp_stages, run_ranks, seeded_batch, step_rank

pytestmark = pytest.mark.timeout(300)


def _mesh_groups(shape: tuple[int, ...], pp_dim: int) -> tuple[list[list[int]], dict[int, int]]:
    """PP groups (lines of the row-major mesh along ``pp_dim``) and each rank's PP coordinate, by enumeration."""
    coords = list(itertools.product(*(range(n) for n in shape)))
    rank_of = {c: i for i, c in enumerate(coords)}
    groups = {}
    for c in coords:
        key = c[:pp_dim] + c[pp_dim + 1:]
        groups.setdefault(key, []).append(rank_of[c])
    return list(groups.values()), {rank_of[c]: c[pp_dim] for c in coords}


@pytest.mark.parametrize("shape", [(2, 2), (4, 2), (2, 3, 2), (3, 2, 4), (1, 4), (4, 1, 2)])
def test_peers_are_the_ranks_at_the_same_pp_position_of_every_mesh_layout(shape):
    world = 1
    for n in shape:
        world *= n
    for pp_dim in range(len(shape)):
        groups, coord = _mesh_groups(shape, pp_dim)
        for group in groups:
            for rank in group:
                want = sorted(r for r in range(world) if coord[r] == coord[rank])
                got = peer_ranks(group, world, rank)
                assert got == (None if len(group) == 1 else want), (shape, pp_dim, group, rank)


def test_no_peers_where_the_pp_group_is_not_a_mesh_line_and_explicit_peers_are_checked():
    assert peer_ranks([0, 1, 3], 8, 1) is None  # not evenly spaced
    assert peer_ranks([1, 2], 4, 1) is None  # PP rank 0 at coordinate 1 of a stride-1 line
    assert peer_ranks([0, 3], 9, 0) is None  # 3 · 2 does not divide 9
    assert resolve_peers("auto", [0, 1, 2, 3], 4, 2) is None  # the world is one PP group
    assert resolve_peers("off", [0, 1], 4, 0) is None
    assert resolve_peers([5, 1], [1, 2], 8, 1) == [1, 5]
    with pytest.raises(ValueError, match="including this rank"):
        resolve_peers([0, 4], [1, 2], 8, 1)
    with pytest.raises(ValueError, match="another position of this PP group"):
        resolve_peers([1, 2], [1, 2], 8, 1)
    from titan_ext.runtime import PipeMorph
    from titan_ext.runtime.control.config import AdaptiveConfig

    with pytest.raises(TypeError, match="peers must be"):
        AdaptiveConfig(peers="sometimes")
    assert PipeMorph.spec.config_class(peers=(0, 2)).peers == (0, 2)


PP, DP, DIM, BATCH, N, STEPS = 2, 2, 8, 8, 4, 6


class CountsByDelay:
    """Re-plans at every check to warm-up counts chosen by the link's delay estimate: GPipe's where it is
    above 10 ms (the delayed replica's 25 ms), 1F1B's below (the other's: a few ms at most, even on a busy
    host) — deciding alone, the replicas choose differently at every check, whatever the timing."""

    window = 1
    forces = True

    def decide(self, estimate, deployed_counts, initial_counts, since, slack_floor=2):
        from titan_ext.runtime.decide.policy import Decision

        counts = [N, N - 1] if estimate.delays_ms[0] > 10.0 else [2, 1]
        return Decision("force", f"counts {counts} for a {estimate.delays_ms[0]:.1f} ms link", warmup_counts=counts)


SCENARIOS = (("off", "by delay"), ("auto", "by delay"), ("auto", "default"))  # (peers, policy)


def _worker(rank: int, world: int) -> list[dict]:
    """Every scenario in one process group (one spawn), the second replica's link delayed throughout."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage

    from titan_ext.runtime import PipeMorph, inject_link_delays

    mesh = init_device_mesh("cpu", (DP, PP), mesh_dim_names=("dp", "pp"))
    dp, pp, group = rank // PP, rank % PP, mesh["pp"].get_group()
    injector = inject_link_delays("0:25" if dp == 1 else "")  # the second replica's link only
    out = []
    try:
        for peers, policy in SCENARIOS:
            mods = mlp_stages(PP, DIM)
            stage = PipelineStage(mods[pp], pp, PP, torch.device("cpu"), group=group)
            kw = {"policy": CountsByDelay()} if policy == "by delay" else {}
            sched = PipeMorph(stage, N, loss_fn=Fn.mse_loss, peers=peers, **kw)
            opt = torch.optim.SGD(mods[pp].parameters(), lr=0.05)
            losses = []
            for k in range(STEPS):
                x, y = seeded_batch(1000 + 10 * k + dp, BATCH, DIM)
                got: list = []
                opt.zero_grad()
                step_rank(sched, pp, PP, x, y, got)
                for p in mods[pp].parameters():  # the replicas' gradient mean
                    dist.all_reduce(p.grad, group=mesh["dp"].get_group())
                    p.grad /= DP
                opt.step()
                losses.append([float(v) for v in got])
            log = sched.decision_log
            out.append({"deploys": [(e["iteration"], e["plan_hash"]) for e in log if e["decision"] == "deploy"],
                        # the policy's first re-plan (later deploys: backward probes too)
                        "forced": [list(e["warmup_counts"]) for e in log
                                   if e["decision"] == "deploy" and e["kind"] == "forced"][:1],
                        "checks": [m["iteration"] for m in sched.metrics_history if m["check"] in ("exchange", "decided")],
                        "losses": losses})
        return out
    finally:
        injector.remove()


def _reference_losses() -> list[list[list[float]]]:
    """Per step, per replica, the last stage's microbatch losses of the same data-parallel training."""
    mods = mlp_stages(PP, DIM)
    opt = torch.optim.SGD([p for m in mods for p in m.parameters()], lr=0.05)
    out = []
    for k in range(STEPS):
        opt.zero_grad()
        per_replica = []
        for dp in range(DP):
            x, y = seeded_batch(1000 + 10 * k + dp, BATCH, DIM)
            losses = []
            for xm, ym in zip(x.chunk(N), y.chunk(N)):
                h = xm
                for m in mods:
                    h = m(h)
                loss = Fn.mse_loss(h, ym)
                (loss / (DP * N)).backward()  # the schedule's mean over microbatches (scale_grads)
                losses.append(float(loss.detach()))
            per_replica.append(losses)
        opt.step()
        out.append(per_replica)
    return out


@pytest.mark.multiprocess
def test_replicas_decide_apart_alone_as_one_with_peers_and_train_as_the_reference():
    results = run_ranks(_worker, DP * PP)
    alone, agreed, own = ([r[i] for r in results] for i in range(len(SCENARIOS)))
    # alone: the delayed replica re-plans to GPipe's counts, the other to 1F1B's (the test can fail)
    assert [r["forced"] for r in alone] == [[[2, 1]]] * PP + [[[N, N - 1]]] * PP
    assert alone[0]["deploys"] != alone[PP]["deploys"]
    # agreed: every rank decides on the slowest (the delayed) replica's profiles: its choice, the same
    # plans at the same iterations everywhere
    for r in agreed:
        assert r["forced"] == [[N, N - 1]]
        assert r["deploys"] == agreed[0]["deploys"] and r["checks"] == agreed[0]["checks"]
    # PipeMorph's own policy: the same plans (at least the calibrated one after the initial) at the same
    # iterations, and the replicas train as the data-parallel reference
    for r in own:
        assert r["deploys"] == own[0]["deploys"] and len(r["deploys"]) >= 2 and r["checks"] == own[0]["checks"]
    reference = _reference_losses()
    for dp in range(DP):
        got = own[dp * PP + PP - 1]["losses"]
        for k in range(STEPS):
            assert got[k] == pytest.approx(reference[k][dp], rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("pp,replicas,shard,cp,tp", [(2, 2, 1, 1, 1), (2, 2, 1, 1, 2), (4, 2, 1, 2, 2), (2, 3, 1, 1, 1),
                                                     (2, 2, 2, 1, 1), (2, 2, -1, 1, 1), (2, 1, 1, 1, 2)])
def test_trainer_replicated_jobs_agree_within_a_replica_only(pp, replicas, shard, cp, tp):
    """TorchTitan's DP x PP jobs whose replicas the trainer synchronises (Falcon's S2 runs a different
    number of schedule steps per replica): the peers are the ranks at this PP position in this replica,
    checked against TorchTitan's mesh (pp, dp_replicate, dp_shard, cp, tp) enumerated here; with FSDP
    (shard > 1, or -1 leaving more than one rank) or no replicas: None, the schedule's own "auto"."""
    from types import SimpleNamespace

    from titan_ext.titan.options import replica_peers

    real_shard = shard if shard > 0 else 1
    shape = (pp, replicas, real_shard, cp, tp)
    world = pp * replicas * real_shard * cp * tp
    job = SimpleNamespace(parallelism=SimpleNamespace(
        pipeline_parallel_degree=pp, data_parallel_replicate_degree=replicas, data_parallel_shard_degree=shard,
        context_parallel_degree=cp, tensor_parallel_degree=tp))
    coords = list(itertools.product(*(range(n) for n in shape)))
    for rank, c in enumerate(coords):
        got = replica_peers(job, world, rank)
        if replicas == 1 or real_shard > 1:
            assert got is None
        else:
            assert got == [r for r, d in enumerate(coords) if d[:2] == c[:2]], (shape, rank)
