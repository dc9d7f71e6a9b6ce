"""The dry run (titan_ext/titan/dryrun.py): M^F measured on fake tensors against closed forms, groups on
torch's fake backend, and the whole build of a config through scripts/launch.sh's DRY_RUN=1."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from titan_ext.titan.dryrun import measure_forward_bytes, pp_group_ranks

ROOT = Path(__file__).resolve().parents[2]
B, D_IN, D_H, D_OUT = 8, 16, 32, 8  # fp32: 4 bytes an element


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(D_IN, D_H), torch.nn.Linear(D_H, D_OUT)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _measure(module):
    return measure_forward_bytes(module.to("meta"), lambda: (torch.zeros(B, D_IN, requires_grad=True), {}))


def test_no_checkpointing_counts_what_autograd_keeps():
    """Autograd keeps the input (for up's weight gradient) and relu's output (relu's backward and down's
    weight gradient: one storage); up's output is freed. Alive after the forward: those and the output, which
    torch's stage keeps until the backward (``fwd_cache``) and the runtime's rule counts too."""
    live, rule, (shape, dtype) = _measure(Block())
    assert rule == 4 * B * (D_IN + D_H + D_OUT)
    assert live == 4 * B * (D_IN + D_H + D_OUT)
    assert shape == [B, D_OUT] and dtype == "float32"


def test_full_checkpointing_keeps_the_input_only():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    live, rule, _ = _measure(checkpoint_wrapper(Block(), preserve_rng_state=False))
    assert rule == live == 4 * B * (D_IN + D_OUT)


def test_selective_checkpointing_is_seen_alive_and_by_the_runtime():
    """Selective checkpointing saving every matmul keeps up's and down's outputs in its own cache, where no
    saved tensor of autograd's shows them: alive, and counted by the runtime, which sees the wrapper."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    live, rule, _ = _measure(checkpoint_wrapper(Block(), preserve_rng_state=False, context_fn=_sac_policy()))
    assert live >= 4 * B * (D_IN + D_H + D_OUT)  # the input, up's and down's matmuls, the output
    assert rule >= 4 * B * (D_H + D_OUT)


def _sac_policy():
    from functools import partial

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        mm = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return CheckpointPolicy.MUST_SAVE if mm else CheckpointPolicy.PREFER_RECOMPUTE

    return partial(create_selective_checkpoint_contexts, policy)


@pytest.mark.parametrize("selective", [False, True])
def test_runtime_rule_sees_selective_checkpointing(selective):
    """The runtime's first-forward M^F (``executor.measured_forward``) on real tensors: with full
    checkpointing autograd's saved tensors say it all (the input); with selective checkpointing, which the
    wrapper's ``context_fn`` reveals, the bytes left alive count too (the input, both matmuls, the output);
    the output always (torch's stage keeps it until the backward)."""
    from types import SimpleNamespace

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from titan_ext.runtime.execute.executor import measured_forward

    kwargs = {"context_fn": _sac_policy()} if selective else {}
    module = checkpoint_wrapper(Block(), preserve_rng_state=False, **kwargs)
    x = torch.randn(B, D_IN, requires_grad=True)
    _, nbytes = measured_forward(SimpleNamespace(submod=module), lambda: module(x))
    if selective:
        assert nbytes >= 4 * B * (D_H + D_OUT)  # up's and down's matmuls (x was made before: not seen alive)
    else:
        assert nbytes == 4 * B * (D_IN + D_OUT)


def test_last_stage_keeps_its_logits():
    """On the last stage torch's stage keeps the output (the logits) until the backward, beside what the
    loss saves (its log-softmax) and the scalar loss: both counts see the block's, the logits and the loss's."""
    live, rule, (shape, _) = measure_forward_bytes(
        Block().to("meta"), lambda: (torch.zeros(B, D_IN, requires_grad=True), {}),
        lambda out: torch.nn.functional.cross_entropy(out, torch.zeros(B, dtype=torch.long)))
    assert shape == [B, D_OUT]
    assert rule >= 4 * B * (D_IN + D_H + 2 * D_OUT)  # the block's, the logits, the loss's log-softmax
    assert abs(live - rule) <= 64  # the scalar loss and the target


def test_fake_backend_groups_are_fake():
    """On the fake backend (TorchTitan's dry-run mode) our gloo control groups are fake too: a gloo group
    would wait for peers that do not exist."""
    from titan_ext.runtime.comm import timeouts
    from titan_ext.runtime.comm.control_plane import new_control_group

    dist.init_process_group("fake", rank=3, world_size=8)
    try:
        assert timeouts.fake_backend()
        group = new_control_group([1, 3, 5, 7], timeout_s=5)
        assert dist.get_backend(group) == "fake"
        timeouts.publish_identity()  # the fake store stores nothing: skipped, no error
    finally:
        dist.destroy_process_group()
    assert not timeouts.fake_backend()


def test_pp_group_ranks_match_torchtitans_mesh():
    """PP is the outermost dimension of TorchTitan's mesh: the rank each PP coordinate starts at."""
    from torchtitan.distributed import ParallelDims

    dist.init_process_group("fake", rank=0, world_size=16)
    try:
        try:
            dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=4, ep=1, etp=1, world_size=16)
        except TypeError:  # 0.3's fields
            from torchtitan.config import ParallelismConfig

            dims = ParallelDims.from_config(ParallelismConfig(pipeline_parallel_degree=4, tensor_parallel_degree=2,
                                                              data_parallel_shard_degree=2), 16)
        mesh = dims.get_mesh("pp") if hasattr(dims, "get_mesh") else dims.world_mesh["pp"]
        assert [int(r) for r in mesh.mesh.tolist()] == pp_group_ranks(16, 4)
    finally:
        dist.destroy_process_group()


def _launch(env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CONFIG", "MODULE", "DRY_RUN", "NGPU"))}
    return subprocess.run(["bash", "scripts/launch.sh"], cwd=ROOT, env={**base, "PYTHON": sys.executable, **env},
                          capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.slow
def test_dry_run_builds_the_debug_job():
    """DRY_RUN=1 prints the command, then builds the 4-rank debug job on fake process groups."""
    run = _launch({"DRY_RUN": "1", "CONFIG_FILE": "train_configs/debug_cpu.toml"}, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    assert "torch.distributed.run" in run.stdout and "--nproc_per_node 4" in run.stdout
    assert "4 ranks (PP 4 x 1)" in run.stdout
    assert lines[-1].startswith("titan_ext dry run: fits")
    rows = [ln.split() for ln in lines if ln.split()[:1] and ln.split()[0].isdigit()]
    assert [int(r[1]) for r in rows] == [0, 1, 2, 3]
    # the debug model's microbatch saves well under a MiB; the default budget (80 GiB GPU less the model
    # state) holds all 16 microbatches on every stage
    assert all(int(r[-2]) == 16 for r in rows)


@pytest.mark.slow
def test_dry_run_refuses_a_budget_below_1f1b():
    """An activation budget below 1F1B's in-flight microbatches of stage 0: said in the last line, exit 1."""
    env = dict(os.environ, NGPU="4")
    run = subprocess.run([sys.executable, "-m", "titan_ext.titan.dryrun", "--job.config_file",
                          "train_configs/debug_cpu.toml", "--titan_ext.memory_budget_gib", "0.0002"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    last = run.stdout.strip().splitlines()[-1]
    assert last.startswith("titan_ext dry run: does not fit") and "stage 0 holds" in last
    assert "memory_budget_gib = 0.0002" in last


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.parametrize("config", ["llama3_8b_pipemorph", "llama3_70b_pipemorph"])
def test_cluster_configs_fit(config):
    """The 8B and 70B configs give every stage at least 1F1B's in-flight count (their world sizes: the
    fewest ranks each runs on)."""
    run = _launch({"DRY_RUN": "1", "MODULE": "titan_ext.titan", "CONFIG": config}, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1].startswith("titan_ext dry run: fits")



def test_runtime_rule_drops_what_the_forward_released():
    """A loss that runs its backward chunk by chunk inside the forward (TorchTitan 0.3's chunked loss)
    saves tensors and releases them before the forward returns: M^F counts what is still held (up's
    input, relu's output, the output), not tanh's output, saved and released on the way."""
    from types import SimpleNamespace

    from titan_ext.runtime.execute.executor import measured_forward

    module = Block()
    x = torch.randn(B, D_IN, requires_grad=True)

    def forward():
        h = module.up(x)
        piece = torch.tanh(h.detach().requires_grad_())  # tanh saves its output: B x D_H
        piece.sum().backward()  # ... released here
        return module.down(torch.relu(h))

    _, nbytes = measured_forward(SimpleNamespace(submod=module), forward)
    assert nbytes == 4 * B * (D_IN + D_H + D_OUT)


def test_flex_attention_stage_is_measured_with_the_trainers_masks():
    """TorchTitan 0.3's llama3 debug model uses FlexAttention, whose forward needs the batch's masks and
    whose CPU kernel refuses to record a backward: the dry run hands the stage the positions and masks the
    trainer builds, runs FlexAttention eagerly, and measures it. Full model, 2 layers, fp32: M^F is at
    least the logits kept for the backward and both counts agree within the scalar loss."""
    from titan_ext.titan import adapters

    if not adapters.current().PYTHON_CONFIGS:
        pytest.skip("TorchTitan 0.3's FlexAttention models")
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from titan_ext.titan.adapters.tt03 import attention_kwargs
    from titan_ext.titan.dryrun import eager_cpu_attention

    model_config = llama3_debugmodel().model_spec.model
    assert any(True for _ in model_config.traverse(FlexAttention.Config))
    with torch.device("meta"):
        model = model_config.build()
    batch, seq = 2, 64

    def make_input():
        tokens = torch.zeros(batch, seq, dtype=torch.long)
        kwargs = attention_kwargs(model_config, model, tokens)
        assert set(kwargs) == {"positions", "attention_masks"}
        return tokens, kwargs

    with eager_cpu_attention():
        live, rule, (shape, dtype) = measure_forward_bytes(model, make_input)
    vocab = shape[-1]
    assert shape == [batch, seq, vocab] and dtype == "float32"
    assert min(live, rule) >= 4 * batch * seq * vocab  # the logits torch's stage keeps
    assert abs(live - rule) <= 0.05 * live
