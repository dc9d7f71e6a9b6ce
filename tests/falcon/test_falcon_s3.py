"""S3 applied in the running TorchTitan job (Falcon §5.3 "Adjust topology").

Fast tier: the mechanism on 4 gloo ranks without TorchTitan (the new mesh's groups, every rank
holding the model + AdamW state of the old holder of its new role, exactly), and the pieces without
processes — the bandwidth form of the slow-link emulation, the grid checks, the remapped TorchTitan
meshes, the topology plan's pipeline order, W&B rows. The runtime-level float64 reference on the new
layout started from the same state is tests/falcon/test_falcon_topology.py (slow).

Slow tier (torchrun, 4 gloo ranks, TorchTitan's llama3 debug model, DP 2 x PP 2): a DP link made
slow from step 5 is detected, localised and moved onto a PP hop in memory (and, with a slow device
on the link too, S2 then S3 with the split re-planned); the losses of every step
equal, bit for bit, those of the same job without the fault (S3 changes where each stage runs, not
what is computed: the same stages on the same data, and every reduction has two members). Both runs
keep PipeMorph's first plan (``no-adaptive``) so that no re-plan reorders float32 sums; TorchTitan
0.2.2 trains in float16 / bfloat16 / float32 only, and bit equality in float32 is stricter than a
float64 tolerance.
"""

import json
from types import SimpleNamespace

import numpy as np
import pytest

from titan_ext.runtime.falcon import plan_topology
from titan_ext.runtime.falcon.emulation import EmulationSpecError, FailSlowEmulation, parse_slow_link
from titan_ext.runtime.falcon.mitigation import topology_score

# --------------------------------------------------------------------------- fast tier


def test_slow_link_factor_is_a_bandwidth_fault():
    link = parse_slow_link("0-1:x6@5")
    assert (link.factor, link.delay_ms, link.from_step) == (6.0, 0.0, 5)
    for bad in ("0-1:x0.5", "0-0:x2", "0-1:x"):
        with pytest.raises(EmulationSpecError):
            parse_slow_link(bad)
    e = FailSlowEmulation(1, range(4), slow_link=link)
    e.link_bytes_per_s = 1e9
    e.step = 4
    assert e.collective_delay_s([0, 1], steps=2, base_s=0.01) == 0.0  # not before step 5
    e.step = 5
    # the DP all-reduce over the link takes 6x its healthy 10 ms: +50 ms; other groups pay nothing
    assert e.collective_delay_s([0, 1], steps=2, base_s=0.01) == pytest.approx(0.05)
    assert e.collective_delay_s([2, 3], steps=2, base_s=0.01) == 0.0
    # a 4 MB message over it: +5 x 4 MB / (1 GB/s)
    assert e.send_delay_s(0, 1, 4_000_000) == pytest.approx(0.02) and e.send_delay_s(0, 2, 4_000_000) == 0.0
    # as a PP hop (after S3): a bandwidth cap B / (F - 1) on that link, no latency
    assert e.pp_link_spec([0, 1]) == "0:0:2e+08B/s" and e.pp_link_spec([1, 3]) == ""
    from titan_ext.runtime.emulate.delay_injection import parse_delay_spec

    delay = parse_delay_spec(e.pp_link_spec([0, 1])).steps[0][1][0]
    assert delay.latency_ms == 0.0 and delay.bandwidth_bytes_per_s == pytest.approx(2e8)


def test_s3_plan_for_a_slow_dp_link_is_a_pp_hop_in_rank_order():
    grid = [[0, 2], [1, 3]]  # TorchTitan's DP 2 x PP 2: DP groups {0,1}, {2,3}
    for link in [(0, 1), (1, 0), (2, 3)]:
        plan = plan_topology(grid, [link])
        a, b = link
        pos = {r: (d, s) for d, row in enumerate(plan.grid) for s, r in enumerate(row)}
        assert pos[a][0] == pos[b][0] and abs(pos[a][1] - pos[b][1]) == 1  # now a PP hop
        assert all(list(row) == sorted(row) for row in plan.grid), plan.grid
        # brute force over all 24 grids: nothing scores better on the paper's criteria (1-6)
        import itertools

        best = min(topology_score(np.reshape(p, (2, 2)), [link], [], grid)[:6]
                   for p in itertools.permutations(range(4)))
        assert plan.score[:6] == best


class _Mesh(dict):
    def __getitem__(self, name):
        return dict.__getitem__(self, name)


def test_remapped_dims_answer_with_the_new_groups_and_delegate_the_rest():
    from titan_ext.titan.falcon_s3 import RemappedDims

    original = SimpleNamespace(pp=2, get_mesh=lambda n: f"old {n}", get_optional_mesh=lambda n: f"old? {n}")
    mesh = _Mesh(pp="new pp", dp_replicate="new dp")
    dims = RemappedDims(original, mesh)
    assert [dims.get_mesh(n) for n in ("pp", "batch", "loss", "dp_replicate")] == [
        "new pp", "new dp", "new dp", "new dp"]
    assert dims.get_optional_mesh("loss") == "new dp" and dims.get_optional_mesh(["pp"]) == "new pp"
    assert dims.get_mesh("tp") == "old tp" and dims.pp == 2
    assert RemappedDims(dims, mesh)._dims is original  # a second S3 wraps the original


def test_s3_refuses_grids_it_cannot_apply_before_anything_changes():
    from titan_ext.titan.falcon_s3 import check_grid

    trainer = SimpleNamespace(model_parts=[object()], parallel_dims=SimpleNamespace(tp=1, cp=1, dp_shard=1))
    old = [[0, 2], [1, 3]]
    check_grid(old, [[0, 1], [2, 3]], trainer)
    for bad, why in (([[0, 1], [2, 4]], "not a permutation"), ([[0, 1, 2, 3]], "shape"),
                     ([[1, 0], [2, 3]], "increasing rank order")):
        with pytest.raises(ValueError, match=why):
            check_grid(old, bad, trainer)
    with pytest.raises(ValueError, match="one model part"):
        check_grid(old, [[0, 1], [2, 3]], SimpleNamespace(model_parts=[1, 2], parallel_dims=trainer.parallel_dims))
    with pytest.raises(ValueError, match="DP x PP jobs only"):
        check_grid(old, [[0, 1], [2, 3]], SimpleNamespace(model_parts=[1], parallel_dims=SimpleNamespace(tp=2)))


def _distinct_stage(stage: int, rank: int):
    """A stage module + AdamW with one step taken, its values particular to ``rank`` (so that the
    test sees whose state a rank ends up with; in a job the DP replicas' states are equal)."""
    import torch

    torch.manual_seed(100 + rank)
    module = (torch.nn.Linear(4, 8) if stage == 0 else torch.nn.Linear(8, 2)).double()
    opt = torch.optim.AdamW(module.parameters(), lr=0.01)
    for p in module.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return module, opt


def _state_of(module, opt):
    return {"params": [p.detach().clone() for p in module.parameters()],
            "exp_avg": [opt.state[p]["exp_avg"].clone() for p in module.parameters()],
            "step": [float(opt.state[p]["step"]) for p in module.parameters()]}


def _mechanism_worker(rank, world, outdir):
    import os

    import torch
    import torch.distributed as dist

    from titan_ext.runtime.falcon.restart import role_of
    from titan_ext.runtime.falcon.topology import exchange_stage_state, load_stage_state, own_stage_state
    from titan_ext.titan.falcon_s3 import RemappedDims, grid_mesh

    old, new = [[0, 2], [1, 3]], [[0, 1], [2, 3]]
    module, opt = _distinct_stage(role_of(old, rank)[1], rank)
    before = _state_of(module, opt)
    mesh = grid_mesh(new, "cpu")
    dims = RemappedDims(SimpleNamespace(get_mesh=None, get_optional_mesh=None), mesh)
    moved = exchange_stage_state(old, new, module, opt, device=torch.device(f"cpu:{rank}"))
    new_stage = role_of(new, rank)[1]
    fresh, fresh_opt = _distinct_stage(new_stage, 99)  # a new stage with other values, loaded next
    if moved is None:
        load_stage_state(fresh, fresh_opt, *own_stage_state(module, opt))
    else:
        load_stage_state(fresh, fresh_opt, moved[1], moved[2])
    total = torch.tensor([float(rank)], dtype=torch.float64)
    dist.all_reduce(total, group=dims.get_mesh("loss").get_group())
    torch.save({"before": before, "after": _state_of(fresh, fresh_opt), "source": None if moved is None else moved[0],
                "pp": dist.get_process_group_ranks(dims.get_mesh("pp").get_group()),
                "dp": dist.get_process_group_ranks(dims.get_mesh("batch").get_group()),
                "loss_sum": float(total)}, os.path.join(outdir, f"rank{rank}.pt"))


@pytest.mark.multiprocess
def test_s3_mechanism_new_groups_and_every_rank_holds_its_new_roles_state(tmp_path):
    """4 gloo ranks, float64, no TorchTitan: the new mesh's groups are the new grid's rows and
    columns, and after the exchange every rank holds exactly the model + AdamW state of the old
    holder of its new role (rank-particular values, so a wrong source or order shows)."""
    import torch

    from titan_ext.testing import run_ranks

    run_ranks(_mechanism_worker, 4, str(tmp_path), backend="gloo")
    res = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    old, new = [[0, 2], [1, 3]], [[0, 1], [2, 3]]
    for rank, out in enumerate(res):
        d, s = next((d, s) for d, row in enumerate(new) for s, r in enumerate(row) if r == rank)
        holder = old[d][s]
        assert out["source"] == (None if holder == rank else holder)
        assert out["pp"] == new[d] and out["dp"] == [row[s] for row in new]
        assert out["loss_sum"] == sum(row[s] for row in new)
        for key in ("params", "exp_avg"):
            for got, want in zip(out["after"][key], res[holder]["before"][key]):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert out["after"]["step"] == res[holder]["before"]["step"]


# --------------------------------------------------------------------------- slow tier (torchrun)

STEPS = 32
"""The combined scenario's second fault (step 13) was confirmed 2-10 steps after it on a loaded host
by the iteration time alone, at step 31 under nccl_rules; with group tracking at step 15 (gloo and
nccl_rules, docs/falcon.md "Group tracking"). 32 keeps the margin for a loaded CI host."""
SLOW_FROM = 5
LINK_FACTOR = 21
"""Transfers over link 0-1 take 21x their time from step 5: the stage-0 DP all-reduce (~25-70 ms in
training on this loaded host) adds ~0.5-1.4 s to a ~1-1.3 s step (the debug job under nccl_rules and
the lagging device). At 11x (+0.2-0.7 s) a loaded run measured the slow steps at 1.46 s against
1.26 s after S3 (0.86, where the test asks < 0.8): the fault was no longer >= 3x the step-time noise
(the must-show's 6x is measured by scripts/bench_falcon.py: BENCHMARKS.md)."""


DEVICE_FACTOR = 24
SECOND_FROM = 13
SECOND_LINK_FACTOR = 201
"""The reversed compound scenario (Falcon §7.3's sequence backwards): device 1 (stage 0 of replica 1)
24x slower from step 5, then its DP link to device 0 201x slower from step 13 (+5-14 s a step). After
S2 a step takes 1-2.5 s with spikes to 15 s (the 24x device sleeps on a shared host), so the second
fault must add several seconds to be confirmed as a further slowdown: at 11x and 41x (+0.4 / +1.7 s
of DP time) no level event came within 11 steps (seen once each); replaying the 41x run's series
with +6 s from step 13 confirms it at step 16."""


def _s3_job(tmp_path_factory, name: str, extra: list[str]):
    from _titan_version import falcon_job

    dump = tmp_path_factory.mktemp(name)
    falcon_job(dump, STEPS, ["--titan_ext.no-adaptive", *extra])
    return dump


@pytest.fixture(scope="module")
def s3_runs(tmp_path_factory):
    return {"reference": _s3_job(tmp_path_factory, "reference", []),
            "slow_dp_link": _s3_job(tmp_path_factory, "slow_dp_link",
                                    ["--titan_ext.emulate_slow_link", f"0-1:x{LINK_FACTOR}@{SLOW_FROM}"])}


@pytest.fixture(scope="module")
def combined_run(tmp_path_factory):
    """Its own job (about 3 minutes, the soak tier's): the slow device, then the slow link."""
    return _s3_job(tmp_path_factory, "combined", [
        "--titan_ext.emulate_slow_device", f"1:{DEVICE_FACTOR}@{SLOW_FROM}",
        "--titan_ext.emulate_slow_link", f"0-1:x{SECOND_LINK_FACTOR}@{SECOND_FROM}"])


def _jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.slow
def test_slow_dp_link_moved_onto_a_pp_hop_in_memory_and_recorded(s3_runs):
    dump = s3_runs["slow_dp_link"]
    rows = _jsonl(dump / "falcon.jsonl")
    events = _jsonl(dump / "falcon_events.jsonl")
    s3 = [e for e in events if e["kind"] == "decision" and e["strategy"] == "S3"]
    assert s3 and s3[0]["applied"], events
    step = s3[0]["iteration"]
    assert step <= 12  # S3 in memory by step 12 (fault from step 5)
    assert s3[0]["suspected"]["root_cause"] == "dp_link"
    assert sorted(s3[0]["suspected"]["slow_links"][0]) == [0, 1]
    # the measured cost is the in-memory change's (seconds, not a process start), and it replaced
    # the start-up estimate for later decisions
    assert 0 < s3[0]["measured_cost_s"] < 30 and 0 < s3[0]["estimated_cost_s"] < 30
    # the grid in force once a step's row was handled: 0-1 is a PP hop of pipeline 0 from the step
    # whose numbers decided S3 on (``step`` is the check that applied it, at most
    # falcon_check_every - 1 steps later; the rows between are recorded but were not fed)
    decided = s3[0]["observed_step"]
    assert decided <= step
    grids = {r["step"]: json.loads(r["falcon/grid"]) for r in rows}
    assert all(grids[s] == [[0, 2], [1, 3]] for s in grids if s < decided)
    assert all(grids[s] == [[0, 1], [2, 3]] for s in grids if s >= decided)
    assert all(rows[s - 1].get("falcon/stale") == 1 for s in range(decided + 1, step + 1))
    # the run continued to its last step, and the change's outcome is a row (before / after)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    outcome = [e for e in events if e["kind"] == "outcome" and e["strategy"] == "S3"]
    assert outcome and outcome[0]["iteration_time_after_s"] > 0
    # the slow link now costs a PP hop its activations' share: the steps after the change are faster
    # than the slow steps before it (medians; the fault adds >= 3x the host's noise)
    before = [r["falcon/iteration_time_s"] for r in rows if SLOW_FROM <= r["step"] <= step]
    after = [r["falcon/iteration_time_s"] for r in rows if r["step"] > step + 1]
    assert np.median(after) < 0.8 * np.median(before), (before, after)


@pytest.mark.slow
def test_losses_after_s3_equal_the_run_without_the_change_bit_for_bit(s3_runs):
    def losses(dump):
        return [r["loss"] for r in _jsonl(dump / "pipeline_metrics.jsonl")]

    moved, reference = losses(s3_runs["slow_dp_link"]), losses(s3_runs["reference"])
    assert len(moved) == len(reference) == STEPS
    assert moved == reference  # exact: the state, the optimizer, the lr schedule and the data moved
    assert reference[-1] < 0.6 * reference[0]


def test_wandb_gets_the_events_table_and_an_applied_s3s_cost_and_after_time():
    from torchtitan.components.metrics import WandBLogger

    from titan_ext.titan.falcon_events import EventLog

    logged = []
    wb = WandBLogger.__new__(WandBLogger)
    wb.wandb = SimpleNamespace(log=lambda d, step: logged.append((step, d)),
                               Table=lambda columns, data: {"columns": columns, "data": data})
    log = EventLog(SimpleNamespace(step=9, metrics_processor=SimpleNamespace(logger=wb)), None, rank=0)
    decision = {"kind": "decision", "iteration": 9, "strategy": "S3", "name": "topology_adjustment",
                "applied": True, "estimated_cost_s": 0.2, "measured_cost_s": 0.35}
    log.record({}, [decision])
    log.trainer.step = 14
    log.record({}, [{"kind": "outcome", "iteration": 14, "strategy": "S3",
                                   "name": "topology_adjustment", "iteration_time_before_s": 0.9,
                                   "iteration_time_after_s": 0.45}])
    (s1, first), (s2, second) = logged
    assert (s1, s2) == (9, 14)
    assert first["falcon/applied/S3/measured_cost_s"] == 0.35 and first["falcon/applied/S3/estimated_cost_s"] == 0.2
    assert second["falcon/outcome/S3/after_s"] == 0.45 and second["falcon/outcome/S3/before_s"] == 0.9
    assert len(second["falcon/events"]["data"]) == 2  # the table holds every row so far


@pytest.mark.slow
@pytest.mark.soak
def test_combined_s2_is_not_enough_and_s3_follows_in_ladder_order(s3_runs, combined_run):
    """The reversed compound scenario from the events rows: the slow device is localised (``compute``, device 1, no
    slow link) and S2 applied; the iterations stay slow and, once device 1's DP link is slow too, a
    further slowdown is localised anew (slow link 0-1) and S3 is applied at a later step, moving 0-1
    onto a PP hop; the split is re-planned for the new replicas (device 1 ends in replica 0, which
    then gets the fewer chunks). Order: S1, then S2, then the re-localisation, then S3."""
    dump = combined_run
    rows = _jsonl(dump / "falcon.jsonl")
    events = _jsonl(dump / "falcon_events.jsonl")
    applied = [e for e in events if e["kind"] == "decision" and e["applied"]]
    first = {}
    for e in applied:
        first.setdefault(e["strategy"], e)
    assert {"S1", "S2", "S3"} <= set(first), applied
    s1, s2, s3 = first["S1"], first["S2"], first["S3"]
    assert s1["iteration"] <= s2["iteration"] < s3["iteration"], applied
    assert s2["suspected"]["root_cause"] == "compute" and 1 in s2["suspected"]["slow_devices"]
    assert [0, 1] not in [sorted(link) for link in s2["suspected"]["slow_links"]]  # not slow yet
    assert SLOW_FROM <= s2["iteration"] < SECOND_FROM
    assert not [e for e in events if e["iteration"] < SECOND_FROM and e.get("strategy") in ("S3", "S4")
                and e["kind"] == "decision" and e["applied"]]
    # between S2 and S3: the further slowdown was localised again, and it found the DP link
    relocalised = [e for e in events if e["kind"] == "localised" and s2["iteration"] < e["iteration"] <= s3["iteration"]]
    assert relocalised and sorted(relocalised[-1]["suspected"]["slow_links"][0]) == [0, 1], events
    assert SECOND_FROM <= relocalised[-1]["iteration"]
    after = [r for r in rows if r["step"] > s3["iteration"]]
    assert after and all(json.loads(r["falcon/grid"]) == [[0, 1], [2, 3]] for r in after)
    split = json.loads(after[0]["falcon/split"])
    assert sum(split) == 6 and split[0] < split[1], split  # replica 0 now holds device 1
    # S2 reorders float32 sums (which replica computes which chunk): equal within float tolerance
    moved = [r["loss"] for r in _jsonl(dump / "pipeline_metrics.jsonl")]
    reference = [r["loss"] for r in _jsonl(s3_runs["reference"] / "pipeline_metrics.jsonl")]
    assert moved == pytest.approx(reference, rel=2e-3)
