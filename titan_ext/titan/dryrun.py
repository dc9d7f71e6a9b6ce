"""The dry run: build the configured job on torch's fake process group, one PP rank at a time, on a CPU.

    python -m titan_ext.titan.dryrun --job.config_file train_configs/llama3_70b_pipemorph.toml   # 0.2 TOML
    python -m titan_ext.titan.dryrun --module titan_ext.titan --config llama3_70b_pipemorph      # 0.3
    DRY_RUN=1 CONFIG_FILE=... bash scripts/launch.sh      # prints the launch command, then runs this

Under TorchTitan 0.2 a 0.3 config of ``--module titan_ext.titan`` is built as its TOML twin (:data:`TOML_TWINS`).

"Will my 8B / 70B config run?" before a GPU allocation. The arguments are the trainer's; the world size
is ``NGPU`` (TorchTitan's name for its ``fake_backend`` mode; launch.sh passes NNODES x NPROC_PER_NODE),
else the fewest ranks the config runs on. Nothing here needs a GPU, a tokenizer or a dataset:

1. the checks every job runs before its process group (:func:`check_job_config`) for that world size;
2. for the first rank of every PP stage group (PP is the outermost mesh dimension): torch's ``fake``
   process group of the whole world with this rank, and TorchTitan's own build up to its pipeline
   (adapter ``build_pipeline``: parallel dims and mesh, the model on the meta device, the stage split,
   TP / FSDP / activation checkpointing by the model's ``parallelize_fn``, and the schedule, PipeMorph
   itself, with its control groups fake too: ``runtime.comm.timeouts.new_group``);
3. per stage, the bytes one microbatch's forward keeps alive until its backward (M^F), measured on that
   stage's real modules under ``FakeTensorMode`` (no memory is allocated): the storages alive after two
   forwards minus after one (what a second microbatch adds: activations, saved tensors, selective
   checkpointing's saved ops, the stage output kept for its backward; not FSDP's unsharded weights,
   which the first forward gathers once). What the runtime will count is measured beside it, by its own
   first-forward measurement (``executor.measured_forward``: autograd's saved tensors; under selective
   activation checkpointing, whose saved ops those do not show, also the bytes left alive);
4. the memory verdict: each stage's activation budget (``[titan_ext] memory_budget_gib``, else the GPU's
   memory, ``DRY_RUN_GPU_GIB`` (default 80), less the model state: 16 bytes per local parameter (fp32
   weight, gradient, AdamW's two states) and the stage's gathered bf16 weights, times
   1 - ``runtime.execute.memory.DEFAULT_HEADROOM``), the in-flight microbatches it holds, ⌊budget / M^F⌋ (PipeMorph
   Alg.1's memory rule, PipeMorph §4.2), against 1F1B's (stage s of S holds S - s); a stage that holds
   exactly 1F1B's count fits but is noted: PipeMorph has no room to widen its warm-up there;
5. PipeMorph's first plan: the warm-up counts the built schedule starts with, and the planner's plan
   for a model-size estimate of the stage times (the model's FLOPs per token, TorchTitan's
   ``get_nparams_and_flops``, split by parameters; ``DRY_RUN_TFLOPS`` (default 400) achieved per GPU;
   backward = 2 x forward, plus one forward recomputed under full checkpointing, half under selective),
   under the memory caps of 4, against 1F1B on the same estimate;
6. the delegate slots when ``delegation`` is on: the slot against the boundary activation.

One line at the end says whether the job fits and, if not, what to change; exit 0 / 1 (2: a config
error, one line, as the trainer's own check).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
import warnings
from typing import Any

import torch

__all__ = ["main", "measure_forward_bytes", "pp_group_ranks"]

GIB = float(2**30)
DEFAULT_GPU_GIB = 80.0
DEFAULT_TFLOPS = 400.0
#: bytes per local parameter of the model state: fp32 weight and gradient, AdamW's two fp32 states
STATE_BYTES_PER_PARAM = 16
#: extra backward work from recomputation, in forwards, by ``[activation_checkpoint] mode``
RECOMPUTE = {"full": 1.0, "selective": 0.5}


def pp_group_ranks(world_size: int, pp: int) -> list[int]:
    """The first global rank of each PP stage group: PP is the outermost dimension of TorchTitan's mesh
    (``pp, dp_replicate, dp_shard, cp, tp``), so PP rank p starts at p x world / pp."""
    return [p * (world_size // pp) for p in range(pp)]


def measure_forward_bytes(part: torch.nn.Module, make_input, loss=None) -> tuple[int, int, Any]:
    """(M^F as live storages, M^F as the runtime counts it, the output's shape and dtype) of one
    microbatch's forward through ``part``, under ``FakeTensorMode`` (FSDP2 refuses a forward on meta
    parameters; after ``to_empty`` they are fake CPU tensors, which it accepts): the storages alive after
    two forwards minus after one, and ``executor.measured_forward``'s count of the second, the runtime's
    own first-forward measurement (module docstring, item 3). ``make_input`` makes one microbatch's
    (input, keyword arguments: the trainer's attention masks) inside the fake mode; ``loss`` (the last
    stage): the output also goes through ``loss(output)``. Both are kept, as torch's stage keeps its
    output (``fwd_cache``, the logits on the last stage) until the microbatch's backward."""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from titan_ext.runtime.execute.executor import measured_forward
    from titan_ext.runtime.execute.memory import LiveStorages

    def forward() -> tuple[Any, Any]:
        args, kwargs = make_input()
        output = part(args, **kwargs)
        return (None if loss is None else loss(output)), output

    with FakeTensorMode(allow_non_fake_inputs=True):
        part.to_empty(device="cpu")
        live = LiveStorages()
        with live:
            first = forward()
            after_one = live.alive_bytes()
            second, counted = measured_forward(SimpleNamespace(submod=part), forward)
            spec = (list(second[1].shape), str(second[1].dtype).removeprefix("torch."))
            after_two = live.alive_bytes()
        del first, second
        return after_two - after_one, counted, spec


@contextlib.contextmanager
def eager_cpu_attention():
    """FlexAttention as the measurement needs it: eager (``torch.compiler.set_stance("force_eager")``:
    TorchTitan's compiled flex-attention and block-mask functions would compile CPU kernels for a
    forward whose only output is its fake tensors' sizes) and allowed to record its backward on the CPU (torch's
    ``_validate_device`` refuses that because its CPU kernel has no backward, which the measurement
    never runs). Autograd then saves what the GPU kernel's saves (query, key, value, output, log-sum-exp,
    the block mask), which is what M^F counts."""
    from torch.nn.attention import flex_attention

    validate = getattr(flex_attention, "_validate_device", None)
    if validate is not None:
        flex_attention._validate_device = lambda *args: None
    try:
        with torch.compiler.set_stance("force_eager"), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            yield
    finally:
        if validate is not None:
            flex_attention._validate_device = validate


def _local_numel(t: torch.Tensor) -> int:
    local = getattr(t, "to_local", None)
    return local().numel() if local is not None else t.numel()


def _gib(x: float) -> str:
    return f"{x / GIB:.2f}"


#: the 0.3 configs of ``--module titan_ext.titan`` -> their TOML twins (equal: tests/titan/test_config_twins.py),
#: which a TorchTitan 0.2 installation builds in their place
TOML_TWINS = {
    "pipemorph_debugmodel": "debug_cpu.toml",
    "falcon_dp2_pp2_debugmodel": "debug_cpu_dp2_pp2.toml",
    "llama3_8b_pipemorph": "llama3_8b_pipemorph.toml",
    "llama3_70b_pipemorph": "llama3_70b_pipemorph.toml",
}


def _twin_args(argv: list[str]) -> list[str]:
    """Under TorchTitan 0.2, ``--module titan_ext.titan --config NAME`` (a 0.3 config) -> its TOML twin."""
    from pathlib import Path

    from titan_ext.titan import adapters

    if adapters.current().PYTHON_CONFIGS or "--module" not in argv or "--config" not in argv:
        return argv
    i, j = argv.index("--module"), argv.index("--config")
    module, name = argv[i + 1:i + 2], argv[j + 1:j + 2]
    twin = TOML_TWINS.get(name[0] if name else "")
    if module != ["titan_ext.titan"] or twin is None:
        raise ValueError(f"--module {' '.join(module)} --config {' '.join(name)}: a TorchTitan 0.3 config, and this "
                         f"Python has TorchTitan {adapters.torchtitan_version()} (set PYTHON to a 0.3 environment)")
    path = Path(__file__).resolve().parents[2] / "train_configs" / twin
    print(f"titan_ext dry run: TorchTitan {adapters.torchtitan_version()} here: {name[0]} as its TOML twin {path.name}")
    return [a for k, a in enumerate(argv) if k not in (i, i + 1, j, j + 1)] + ["--job.config_file", str(path)]


def _parse(argv: list[str]) -> Any:
    from torchtitan.config import ConfigManager

    from titan_ext.titan.entry import parse_quietly
    from titan_ext.titan.jobcheck import check_ascii_numbers, check_config_file, config_file_arg

    check_ascii_numbers(argv)
    path = config_file_arg(argv)
    if path is not None:
        check_config_file(path)
    return parse_quietly(ConfigManager(), argv)


def _min_world(config: Any) -> int:
    p = config.parallelism
    degrees = (p.data_parallel_replicate_degree, max(p.data_parallel_shard_degree, 1), p.context_parallel_degree,
               p.tensor_parallel_degree, p.pipeline_parallel_degree)
    return math.prod(degrees)


def _build_rank(config: Any, world: int, rank: int, input_spec: Any) -> dict:
    """One PP rank: fake process group, TorchTitan's build, the measurement (a JSON-able record)."""
    import torch.distributed as dist

    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from titan_ext.titan import adapters
    from titan_ext.titan.registry import active_job_config

    dist.init_process_group("fake", rank=rank, world_size=world)
    try:
        with active_job_config(config):  # as TitanExtTrainer builds it (0.3 refuses a schedule built outside)
            built = adapters.current().build_pipeline(config, world, torch.device("cpu"))
        schedule, parts = built["schedule"], built["parts"]
        mb, seq = config.parallelism.pipeline_parallel_microbatch_size, config.training.seq_len
        tp = built["dims"].tp
        out: dict = {"rank": rank, "schedule": type(schedule).__name__, "n": schedule._n_microbatches,
                     "counts": list(getattr(schedule, "initial_counts", None) or []), "stages": [], "first": built["first"],
                     "last": built["last"], "flops_per_token": built["flops_per_token"], "tp": tp}
        spec, forward_kwargs = input_spec, built["forward_kwargs"]
        for part, stage in zip(parts, schedule._stages):
            modules = [name for name, _ in part.named_children()]
            total = sum(p.numel() for p in part.parameters())
            local = sum(_local_numel(p) for p in part.parameters())
            embed = sum(m.weight.numel() for m in part.modules() if isinstance(m, torch.nn.Embedding))
            if stage.is_first:
                def make_input():
                    tokens = torch.zeros(mb, seq, dtype=torch.long)
                    return tokens, forward_kwargs(tokens)
            else:
                shape, dtype = spec

                def make_input(shape=tuple(shape), dtype=getattr(torch, dtype)):
                    # every stage gets the batch's masks (the trainer's extra_kwargs), from the tokens' shape
                    return (torch.zeros(shape, dtype=dtype, requires_grad=True),
                            forward_kwargs(torch.zeros(mb, seq, dtype=torch.long)))
            def loss(output, fn=built["loss_fn"]):
                labels = torch.zeros(output.shape[:-1], dtype=torch.long)
                if not isinstance(output, DTensor):
                    return fn(output, labels)
                with loss_parallel():  # TP's vocabulary-sharded logits, as TorchTitan's train context
                    return fn(output, labels)
            with eager_cpu_attention():
                live, rule, spec = measure_forward_bytes(part, make_input, loss if stage.is_last else None)
            out["stages"].append({"stage": stage.stage_index, "modules": modules, "params": total,
                                  "local_params": local, "matmul_params": total - embed, "mf_bytes": live,
                                  "mf_rule_bytes": rule, "output": spec})
        out["next_input"] = spec
        return out
    finally:
        dist.destroy_process_group()


def _worker(argv: list[str], rank: int, spec: Any) -> dict:
    """One PP rank in a process of its own (TorchTitan's meshes and torch's group registry are per
    process: a second build after ``destroy_process_group`` finds stale group names)."""
    import json
    import subprocess

    env = dict(os.environ, TITAN_EXT_DRY_RUN_WORKER=json.dumps({"rank": rank, "spec": spec}))
    env.pop("TORCH_DIST_INIT_BARRIER", None)  # launch.sh's: a store barrier the fake backend's store cannot hold
    proc = subprocess.run([sys.executable, "-m", "titan_ext.titan.dryrun", *argv], env=env, capture_output=True,
                          text=True, check=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"the build of PP rank at global rank {rank} failed: {tail}")
    return json.loads(lines[-1])


def _budget_bytes(section: Any, stage: dict, tp: int) -> tuple[float, str]:
    """(activation budget, where it comes from) of a stage's rank (module docstring, item 4)."""
    from titan_ext.runtime.execute.memory import DEFAULT_HEADROOM

    configured = float(getattr(section, "memory_budget_gib", 0.0) or 0.0)
    if configured > 0:
        return configured * GIB, f"memory_budget_gib = {configured:g}"
    gpu = float(os.environ.get("DRY_RUN_GPU_GIB", DEFAULT_GPU_GIB)) * GIB
    state = STATE_BYTES_PER_PARAM * stage["local_params"] + 2 * stage["params"] / tp
    return max(gpu - state, 0.0) * (1 - DEFAULT_HEADROOM), f"{gpu / GIB:g} GiB GPU - {_gib(state)} GiB model state"


def _ac_mode(config: Any) -> str:
    """``[activation_checkpoint] mode`` (0.2), or what 0.3's config class (``FullAC`` / ``SelectiveAC``) says."""
    ac = getattr(config, "activation_checkpoint", None)
    if ac is None:
        return "none"
    if hasattr(ac, "mode"):
        return str(ac.mode)
    owner = type(ac).__qualname__.split(".")[0].lower()
    return next((m for m in ("full", "selective") if owner.startswith(m)), "none")


def _plan_lines(config: Any, ranks: list[dict], caps: list[int]) -> list[str]:
    """PipeMorph's plan for the model-size estimate under the caps, against 1F1B (item 5)."""
    from titan_ext.plan.profile import PipelineProfile
    from titan_ext.plan.schedules import plan_by_name

    stages = [s for r in ranks for s in r["stages"]]
    if len(stages) != len(ranks):
        return ["plan: several stages per rank: the planner's estimate is left to the first step's profile"]
    tokens = config.parallelism.pipeline_parallel_microbatch_size * config.training.seq_len
    tflops = float(os.environ.get("DRY_RUN_TFLOPS", DEFAULT_TFLOPS)) * 1e12
    whole = sum(s["matmul_params"] for s in stages)
    recompute = RECOMPUTE.get(_ac_mode(config), 0.0)
    f_ms = []
    for r, s in zip(ranks, stages):
        share = s["matmul_params"] / whole if whole else 1 / len(stages)
        f_ms.append(max(r["flops_per_token"] / 3 * share * tokens / r["tp"] / tflops * 1e3, 1e-3))
    n = config.training.local_batch_size // config.parallelism.pipeline_parallel_microbatch_size
    i_ms = tuple(f * (1 + recompute) for f in f_ms)
    budgets = tuple(float(c) for c in caps)
    profile = PipelineProfile(len(stages), n, tuple(f_ms), i_ms, tuple(f_ms), activation_bytes=(1.0,) * len(stages),
                              memory_budget_bytes=budgets, release="W")
    ours = plan_by_name(profile, "pipemorph", time_limit_s=20.0)
    plain = PipelineProfile(len(stages), n, tuple(f_ms), i_ms, tuple(f_ms), release="W")
    base = plan_by_name(plain, "1F1B")
    peaks = [ours.peak_inflight.get(s, 0) for s in range(len(stages))]
    return [f"plan (estimate, {tflops / 1e12:g} TFLOP/s per GPU): F per stage {', '.join(f'{f:.3g}' for f in f_ms)} ms; "
            f"PipeMorph {ours.predicted_makespan_ms:.4g} ms per step (in flight {peaks}), 1F1B "
            f"{base.predicted_makespan_ms:.4g} ms"]


def run(argv: list[str]) -> int:
    from titan_ext.titan.jobcheck import check_job_config

    started = time.perf_counter()
    config = _parse(argv)
    world = int(os.environ.get("NGPU") or _min_world(config))
    check_job_config(config, world_size=world, assets=False)
    pp = config.parallelism.pipeline_parallel_degree
    if pp < 2:
        print(f"titan_ext dry run: pipeline_parallel_degree = {pp}: no pipeline to check")
        return 0
    model = getattr(config, "model", None) or config.model_spec  # 0.2 / 0.3
    print(f"titan_ext dry run: {model.name} {model.flavor}, {world} ranks "
          f"(PP {pp} x {world // pp}), schedule {config.parallelism.pipeline_parallel_schedule}, "
          f"torch fake process group, TorchTitan's build on the meta device")
    from concurrent.futures import ThreadPoolExecutor

    first_rank, *others = pp_group_ranks(world, pp)
    ranks = [_worker(argv, first_rank, None)]  # its output is every later stage's input
    with ThreadPoolExecutor(max(1, min(len(others), (os.cpu_count() or 2)))) as pool:
        ranks += list(pool.map(lambda r: _worker(argv, r, ranks[0]["next_input"]), others))
    section = getattr(config, "titan_ext", None)
    S = sum(len(r["stages"]) for r in ranks)
    counts, n = ranks[0]["counts"], ranks[0]["n"]
    print(f"schedule {ranks[0]['schedule']}: {S} stages, {n} microbatches"
          + (f", first plan's warm-up forwards per stage {counts}" if counts else ""))
    print(f"{'PP rank':>7} {'stage':>5} {'modules':<28} {'params':>8} {'M^F MiB':>9} {'rule MiB':>9} "
          f"{'budget GiB':>10} {'holds':>5} {'1F1B':>4}")
    short: list[str] = []
    tight: list[str] = []
    caps = []
    for p, r in enumerate(ranks):
        for st in r["stages"]:
            budget, source = _budget_bytes(section, st, r["tp"])
            holds = min(int(budget // st["mf_bytes"]), n) if st["mf_bytes"] > 0 else n
            caps.append(max(holds, 1))
            need = min(S - st["stage"], n)
            mods = st["modules"][0] + (f" .. {st['modules'][-1]}" if len(st["modules"]) > 1 else "")
            print(f"{p:>7} {st['stage']:>5} {mods[:28]:<28} {st['params'] / 1e6:>7.0f}M {st['mf_bytes'] / 2**20:>9.2f} "
                  f"{st['mf_rule_bytes'] / 2**20:>9.2f} {_gib(budget):>10} {holds:>5} {need:>4}")
            if holds < need:
                more = need * st["mf_bytes"] / GIB
                short.append(f"stage {st['stage']} holds {holds} of 1F1B's {need} in-flight microbatches "
                             f"({source}): give it >= {more:.1f} GiB for activations")
            elif holds == need < n:
                tight.append(f"{st['stage']} (one more: {(need + 1) * st['mf_bytes'] / GIB:.1f} GiB)")
            runtime_cap = min(int(budget // max(st["mf_rule_bytes"], 1)), n)
            if st["mf_rule_bytes"] < 0.9 * st["mf_bytes"] and runtime_cap > holds:
                short.append(f"stage {st['stage']}: the runtime's M^F rule sees {_gib(st['mf_rule_bytes'])} of "
                             f"{_gib(st['mf_bytes'])} GiB, so it would let the stage hold {runtime_cap} where "
                             f"{holds} fit (set [titan_ext] max_inflight = {max(holds, 1)})")
    if tight:
        print(f"note: stage(s) {', '.join(tight)} hold exactly 1F1B's in-flight count: PipeMorph cannot give "
              f"them more warm-up under a slow link (memory_budget_gib)")
    print(*_plan_lines(config, ranks, caps), sep="\n")
    if section is not None and getattr(section, "delegation", "off") != "off":
        slot = float(getattr(section, "delegation_slot_mib", 0) or 0) * 2**20
        boundary = max(math.prod(r["next_input"][0]) * torch.empty((), dtype=getattr(torch, r["next_input"][1])).element_size()
                       for r in ranks)
        verdict = "fits" if slot <= 0 or boundary <= slot else "too small"
        print(f"delegate slots: the largest boundary activation is {boundary / 2**20:.1f} MiB; slot "
              f"{'sized to it' if slot <= 0 else f'{slot / 2**20:.0f} MiB'}: {verdict}")
        if verdict == "too small":
            short.append(f"raise [titan_ext] delegation_slot_mib to >= {math.ceil(boundary / 2**20)}")
    took = time.perf_counter() - started
    if short:
        print(f"titan_ext dry run: does not fit ({took:.0f} s): " + "; ".join(short))
        return 1
    print(f"titan_ext dry run: fits ({took:.0f} s): every stage holds at least 1F1B's in-flight microbatches")
    return 0


def main(argv: list[str] | None = None) -> int:
    from titan_ext.titan.entry import config_error_exit

    import importlib

    os.environ.setdefault("LOCAL_RANK", "0")
    importlib.import_module("titan_ext")  # registers the schedules

    argv = list(sys.argv[1:] if argv is None else argv)
    worker = os.environ.pop("TITAN_EXT_DRY_RUN_WORKER", None)
    try:
        argv = _twin_args(argv)
        if worker is not None:
            import json

            job = json.loads(worker)
            config = _parse(argv)
            record = _build_rank(config, int(os.environ.get("NGPU") or _min_world(config)), job["rank"], job["spec"])
            print(json.dumps(record))
            return 0
        return run(argv)
    except ValueError as e:  # TitanExtConfigError, JobConfigError, TorchTitan's unknown keys
        config_error_exit(e)
    return 2


if __name__ == "__main__":
    sys.exit(main())
