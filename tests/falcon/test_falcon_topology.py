"""S3 applied in memory (Falcon §5.3 "Adjust topology"): a 2 DP × 2 PP GPipe job
(torch.distributed.pipelining, float64, gloo) whose DP link 0-2 is slow re-maps its mesh so that
0-2 becomes a PP hop — new groups, parameters and SGD-momentum state moved by point-to-point
messages, no checkpoint, no restart — and keeps training. Reference: the *new* layout started in
fresh processes from the same state written with the checkpoint path (:mod:`restart`); the losses
and final parameters of every role must agree to float64 round-off."""

import os
import pickle

import pytest
import torch
import torch.distributed as dist

from titan_ext.runtime.falcon import plan_topology
from titan_ext.runtime.falcon.restart import identity_grid
from titan_ext.runtime.falcon.topology import moving_ranks
from titan_ext.testing import run_ranks

SWITCH, STEPS = 3, 6


def _build_stage(stage: int):
    torch.manual_seed(1234 + stage)
    layers = [torch.nn.Linear(8, 16), torch.nn.Tanh()] if stage == 0 else [torch.nn.Linear(16, 1)]
    model = torch.nn.Sequential(*layers).double()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _step(model, opt, mesh, step: int):
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from titan_ext.runtime.falcon.restart import stage_index_to_group_rank

    example = torch.zeros(2, 8 if mesh.pp_index == 0 else 16, dtype=torch.float64)
    stage = PipelineStage(model, mesh.pp_index, 2, torch.device("cpu"), input_args=example,
                          group=mesh.pp_group)
    stage.stage_index_to_group_rank = stage_index_to_group_rank(mesh.pp_ranks)
    sched = ScheduleGPipe(stage, 4, loss_fn=torch.nn.functional.mse_loss)
    g = torch.Generator().manual_seed(10_000 * step + mesh.dp_index)
    x = torch.randn(8, 8, generator=g, dtype=torch.float64)
    y = torch.randn(8, 1, generator=g, dtype=torch.float64)
    opt.zero_grad()
    losses = []
    if mesh.pp_index == 0:
        sched.step(x)
    else:
        sched.step(target=y, losses=losses)
    for p in model.parameters():
        dist.all_reduce(p.grad, group=mesh.dp_group)
        p.grad /= 2
    opt.step()
    return [float(v) for v in losses]


def _worker(rank, world, ckdir, outdir, phase, new_grid):
    from titan_ext.runtime.falcon.device_clock import control_group
    from titan_ext.runtime.falcon.restart import (
        build_mesh_groups,
        load_stage_checkpoint,
        role_of,
        save_stage_checkpoint,
    )
    from titan_ext.runtime.falcon.topology import apply_topology_in_memory

    control = control_group()
    out = {"losses": {}}
    if phase == "inmem":
        grid = identity_grid(2, 2)
        mesh = build_mesh_groups(grid)
        model, opt = _build_stage(mesh.pp_index)
        for s in range(SWITCH):
            out["losses"][s] = _step(model, opt, mesh, s)
        if mesh.dp_index == 0:  # the reference's starting state (files), not used by this run
            save_stage_checkpoint(ckdir, mesh.pp_index, model, opt, step=SWITCH)
        dist.barrier(group=control)
        st = apply_topology_in_memory(grid, new_grid, model, opt, _build_stage, control_group=control)
        model, opt, mesh = st.module, st.optimizer, st.mesh
        out["received_from"] = st.received_from
    else:  # reference: the new layout in fresh processes, from the checkpointed state
        mesh = build_mesh_groups(new_grid)
        model, opt = _build_stage(mesh.pp_index)
        load_stage_checkpoint(ckdir, mesh.pp_index, model, opt)
    for s in range(SWITCH, STEPS):
        out["losses"][s] = _step(model, opt, mesh, s)
    out["role"] = (mesh.dp_index, mesh.pp_index)
    assert out["role"] == role_of(new_grid, rank)
    out["final"] = {k: v.clone() for k, v in model.state_dict().items()}
    out["momentum"] = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    with open(os.path.join(outdir, f"{phase}_rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)


@pytest.mark.slow  # two 4-process spawns
def test_s3_in_memory_equals_the_new_layout_started_from_the_same_state_float64(tmp_path):
    old = identity_grid(2, 2)  # pipelines {0,1}, {2,3}; DP groups {0,2}, {1,3}
    plan = plan_topology(old, [(0, 2)])  # DP link 0-2 is slow
    new = [list(map(int, row)) for row in plan.grid]
    pos = {r: (d, s) for d, row in enumerate(new) for s, r in enumerate(row)}
    assert pos[0][0] == pos[2][0] and abs(pos[0][1] - pos[2][1]) == 1  # 0-2 is now a PP hop
    moves = moving_ranks(old, new)
    assert len(moves) == plan.moved == 2
    ck, out = tmp_path / "ck", tmp_path / "out"
    ck.mkdir()
    out.mkdir()
    for phase in ("inmem", "ref"):
        run_ranks(_worker, 4, str(ck), str(out), phase, new, backend="gloo")
    res = {(p, r): pickle.load(open(out / f"{p}_rank{r}.pkl", "rb"))
           for p in ("inmem", "ref") for r in range(4)}
    for r in range(4):
        a, b = res[("inmem", r)], res[("ref", r)]
        assert a["received_from"] == moves.get(r)
        assert a["role"] == b["role"] == pos[r]
        for s in range(SWITCH, STEPS):
            torch.testing.assert_close(a["losses"][s], b["losses"][s], rtol=1e-13, atol=0)
        for k in b["final"]:
            torch.testing.assert_close(a["final"][k], b["final"][k], rtol=1e-13, atol=1e-16)
        for x, y in zip(a["momentum"], b["momentum"]):
            torch.testing.assert_close(x, y, rtol=1e-13, atol=1e-16)
    # the last stage's holders reported losses after the switch (training continued)
    assert sum(bool(res[("inmem", r)]["losses"][STEPS - 1]) for r in range(4)) == 2
