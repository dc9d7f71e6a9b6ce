"""[titan_ext] config section, schedule registration, shipped configs and assets (no process group)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from _titan_version import (ADAPTER, TITAN_EXT_TRAIN, TOML_CONFIG, debug_cpu, parse_titan_args, titan_toml,
                            tt02_only)

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
CONFIGS = sorted((ROOT / "train_configs").glob("*.toml"))


@pytest.mark.multiprocess
def test_import_titan_ext_is_light():
    out = subprocess.run(
        [PY, "-c", "import sys, titan_ext, titan_ext.titan.config; "
                   "print(sorted(m for m in ('torch', 'torchtitan', 'wandb') if m in sys.modules))"],
        capture_output=True, text=True, check=True, cwd=ROOT,
    )
    assert out.stdout.strip() == "[]"


@tt02_only(TOML_CONFIG)
def test_section_defaults_and_values_from_toml(tmp_path):
    cfg = parse_titan_args(["--job.config_file", titan_toml(tmp_path, '[titan_ext]\nreplan_interval = 7\n'
                                                       'delegation = "auto"\ninject_delays = "2:30"\n')])
    assert cfg.titan_ext.replan_interval == 7
    assert cfg.titan_ext.delegation == "auto"
    assert cfg.titan_ext.inject_delays == "2:30"
    assert cfg.titan_ext.slack_floor == 2  # default


@tt02_only(TOML_CONFIG)
def test_cli_overrides_toml(tmp_path):
    cfg = parse_titan_args(["--job.config_file", titan_toml(tmp_path, "[titan_ext]\nreplan_interval = 7\n"),
                  "--titan_ext.replan_interval", "4"])
    assert cfg.titan_ext.replan_interval == 4


@tt02_only(TOML_CONFIG)
@pytest.mark.parametrize("key,value,needle", [
    ("delegation", '"sometimes"', "must be one of 'off', 'auto', 'always'"),
    ("replan_interval", "0", "must be >= 1"),
    ("tolerance_margin", "11.0", "must be in [0, 10]"),
    ("memory_budget_gib", "-1.0", ">= 0"),
    ("max_inflight", "-2", "must be >= 0"),
    ("adaptive", '"yes"', "must be of type bool"),
    ("inject_delays", '"2:fast"', "latency 'fast' is not a number"),
    ("inject_trace", '"/no/such/trace.csv"', "No such file or directory"),
    ("replan_interval", '"five"', "must be of type int"),
    ("backward", '"fused"', "must be one of '', 'auto', 'measure', 'split', 'full'"),
])
def test_bad_value_error_names_the_key(tmp_path, key, value, needle):
    from titan_ext.titan.config import TitanExtConfigError

    with pytest.raises(TitanExtConfigError) as e:
        parse_titan_args(["--job.config_file", titan_toml(tmp_path, f"[titan_ext]\n{key} = {value}\n")])
    assert f"[titan_ext] {key} = " in str(e.value)
    assert needle in str(e.value)


@tt02_only(TOML_CONFIG)
def test_bad_trace_content_names_key_and_line(tmp_path):
    from titan_ext.titan.config import TitanExtConfigError

    trace = tmp_path / "t.csv"
    trace.write_text("time_s,link2\n0,10\n5,abc\n")
    with pytest.raises(TitanExtConfigError, match=r"\[titan_ext\] inject_trace = .*line 3"):
        parse_titan_args(["--job.config_file", titan_toml(tmp_path, f'[titan_ext]\ninject_trace = "{trace}"\n')])


def test_injected_link_must_exist_for_the_pp_degree():
    from titan_ext.titan.config import TitanExtConfigError
    from titan_ext.titan.jobcheck import check_job_config

    cfg = debug_cpu("--titan_ext.inject_delays", "3:30")  # PP = 4: links 0..2
    with pytest.raises(TitanExtConfigError, match=r"inject_delays = '3:30': link 3 does not exist"):
        check_job_config(cfg, world_size=4)


@pytest.mark.multiprocess
@tt02_only(TITAN_EXT_TRAIN)
def test_train_entry_fails_fast_before_any_process_group(tmp_path):
    """No torchrun env at all: creating a process group would fail differently (env:// rendezvous)."""
    cfg = tmp_path / "c.toml"
    cfg.write_text((ROOT / "train_configs" / "debug_cpu.toml").read_text() + 'delegation = "sometimes"\n')
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    p = subprocess.run([PY, "-m", "titan_ext.train", "--job.config_file", str(cfg)],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "titan_ext: configuration error: [titan_ext] delegation = 'sometimes': must be one of "
        "'off', 'auto', 'always'"], p.stderr  # one line, before anything (a process group) starts


def test_unknown_schedule_fails_before_process_group():
    from titan_ext.titan.jobcheck import JobConfigError, check_job_config

    cfg = debug_cpu("--parallelism.pipeline_parallel_schedule", "Nope")
    with pytest.raises(JobConfigError, match=r"pipeline_parallel_schedule = 'Nope'.*PipeMorph"):
        check_job_config(cfg, world_size=4)
    with pytest.raises(JobConfigError, match="does not divide the world size 6"):
        cfg.parallelism.pipeline_parallel_schedule = "1F1B"
        check_job_config(cfg, world_size=6)


_IMPORT_ORDERS = {
    # `custom_import = "titan_ext"`: torchtitan's trainer is imported first
    "torchtitan_first": "import torchtitan.train\nimportlib.import_module('titan_ext')\n",
    # a user script that imports titan_ext before anything of torchtitan's
    "titan_ext_first": "importlib.import_module('titan_ext')\nimport torchtitan.train\n",
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("order", sorted(_IMPORT_ORDERS))
def test_registration_in_stock_torchtitan_builder(order):
    """Both import orders register the schedules, the dataset and the CPU shim (fresh process)."""
    code = (
        "import importlib, sys\n"
        + _IMPORT_ORDERS[order] +
        "import torchtitan.distributed.pipeline_parallel as pp\n"
        "from torch.distributed.pipelining.schedules import Schedule1F1B, PipelineScheduleMulti\n"
        "from titan_ext.runtime import PipeMorph, CrossPipe\n"
        "cls = pp.get_schedule_class('PipeMorph')\n"
        "assert issubclass(cls, PipeMorph) and issubclass(cls, PipelineScheduleMulti), cls.__mro__\n"
        "assert pp.get_schedule_class('pipemorph') is cls\n"
        "assert issubclass(pp.get_schedule_class('CrossPipe'), CrossPipe)\n"
        "assert pp.get_schedule_class('1F1B') is Schedule1F1B\n"
        f"assert all(getattr(pp, name)._titan_ext_wrapped for name in {sorted(ADAPTER.WRAPPERS)})\n"
        "from torchtitan.hf_datasets.text_datasets import DATASETS\n"
        "assert 'titan_ext_tiny' in DATASETS\n"
        "import torchtitan.tools.utils as u, torchtitan.components.metrics as m\n"
        "print(u.device_type, m.device_type)\n"
    )
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    import torch

    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert out.stdout.strip().splitlines()[-1] == f"{expected} {expected}"


def test_schedule_kwargs_follow_constructor_signature():
    from titan_ext.titan.config import JobConfig, TitanExt
    from titan_ext.titan.options import schedule_kwargs

    from titan_ext.runtime import PipeMorph
    from titan_ext.runtime import PipeMorphConfig
    from titan_ext.runtime.control.config import DelegationConfig, PolicySettings

    jc = JobConfig(titan_ext=TitanExt(memory_budget_gib=2.0, replan_interval=9, adaptive=False,
                                      profile_window=4, tolerance_margin=0.2, recover_patience=5))
    kw = schedule_kwargs(PipeMorph, jc)
    # the runtime's adaptive schedules get one config (delegation is a transport choice of all of them)
    assert list(kw) == ["config"]
    expected = PipeMorphConfig(memory_budget_bytes=2.0 * 1024**3, profile_every=9, adaptive=False, slack_floor=2,
                               falcon=True, delegation=DelegationConfig(mode="off", slow_link_ms=5.0, failover=False),
                               policy_settings=PolicySettings(window=4, rel_margin=0.2, recover_patience=5))
    assert kw["config"] == expected
    cfg = schedule_kwargs(PipeMorph, JobConfig(titan_ext=TitanExt()))["config"]
    assert cfg.memory_budget_bytes is None and cfg.max_inflight is None  # 0 = automatic
    assert cfg.backward == "auto"  # "" = the schedule's own default
    assert schedule_kwargs(PipeMorph, JobConfig(titan_ext=TitanExt(backward="full")))["config"].backward == "full"

    class Sched:
        def __init__(self, stages, n_microbatches, loss_fn=None, scale_grads=True, *,
                     max_inflight=None, delegation="off"):
            pass

    kw = schedule_kwargs(Sched, JobConfig(titan_ext=TitanExt(max_inflight=6, delegation="auto")))
    assert kw == {"max_inflight": 6, "delegation": "auto"}

    class NoDelegation:
        def __init__(self, stages, n_microbatches, *, max_inflight=None):
            pass

    with pytest.raises(ValueError, match=r"delegation = 'always': schedule NoDelegation"):
        schedule_kwargs(NoDelegation, JobConfig(titan_ext=TitanExt(delegation="always")))


@tt02_only(TOML_CONFIG)
@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_parse_with_torchtitan_config_manager(path):
    cfg = parse_titan_args(["--job.config_file", str(path)])
    par = cfg.parallelism
    assert par.pipeline_parallel_degree >= 2  # 4 ranks at least: PP=4, or DP 2 x PP 2
    assert par.pipeline_parallel_degree * par.data_parallel_replicate_degree >= 4
    assert cfg.experimental.custom_import == "titan_ext"
    assert cfg.titan_ext is not None
    if "70b" in path.name or "8b" in path.name:
        assert cfg.parallelism.pipeline_parallel_degree == 8
        assert cfg.parallelism.pipeline_parallel_schedule == "PipeMorph"
        parts = cfg.parallelism.module_fqns_per_model_part
        assert parts is not None and len(parts) == 8  # one stage per PP rank
        flat = [m for part in parts for m in part]
        n_layers = 80 if "70b" in path.name else 32
        assert flat == ["tok_embeddings", *[f"layers.{i}" for i in range(n_layers)], "norm", "output"]
    from titan_ext.train import JobConfigError, check_job_config

    par = cfg.parallelism
    world = par.pipeline_parallel_degree * par.tensor_parallel_degree * 2
    if "70b" in path.name or "8b" in path.name:  # a real tokenizer path to set: the placeholder is refused
        assert cfg.training.dataset == "c4"
        with pytest.raises(JobConfigError, match=r"hf_assets_path = '/path/to/Llama-3\.1-\d+B' is a placeholder"):
            check_job_config(cfg, world_size=world)
        cfg.model.hf_assets_path = "titan_ext/titan/assets/tokenizer"
    check_job_config(cfg, world_size=world)


def test_expected_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"debug_cpu.toml", "llama3_8b_pipemorph.toml", "llama3_70b_pipemorph.toml"} <= names


def test_shipped_assets_are_regenerated_identically(tmp_path):
    from titan_ext.titan.assets_gen import ASSETS_DIR, write_assets

    write_assets(tmp_path)
    for rel in ("corpus.jsonl", "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"):
        assert (tmp_path / rel).read_bytes() == (ASSETS_DIR / rel).read_bytes(), rel


def _debug_model_vocab_size() -> int:
    if ADAPTER.VERSION == "0.2":
        from torchtitan.models.llama3 import llama3_args

        return llama3_args["debugmodel"].vocab_size
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    return llama3_debugmodel().model_spec.model.vocab_size


def test_tokenizer_fits_debug_model_and_round_trips():
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from titan_ext.titan.data import TOKENIZER_DIR, load_corpus

    tok = HuggingFaceTokenizer(tokenizer_path=str(TOKENIZER_DIR))
    assert tok.get_vocab_size() <= _debug_model_vocab_size()
    text = load_corpus()[5]["text"]
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids[1:-1]) == text
    assert len(ids) < len(text) / 2  # BPE actually compresses


@pytest.mark.multiprocess
@tt02_only(TOML_CONFIG)
def test_stock_torchtitan_train_rejects_bad_value_before_process_group(tmp_path):
    """Stock `python -m torchtitan.train`: the [titan_ext] error comes from config parsing."""
    cfg = tmp_path / "bad.toml"
    cfg.write_text((ROOT / "train_configs" / "debug_cpu.toml").read_text()
                   .replace("replan_interval = 1", "replan_interval = -3"))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env["LOCAL_RANK"] = "0"
    p = subprocess.run([PY, "-m", "torchtitan.train", "--job.config_file", str(cfg)],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert p.returncode != 0
    assert "[titan_ext] replan_interval = -3: must be >= 1" in p.stderr
    assert "init_process_group" not in p.stderr


def test_delegation_is_the_schedules_transport_before_any_process_group(tmp_path):
    """delegation is a transport every adaptive schedule has -- the same class with and without
    it (no delegating subclass), the mode in its config."""
    pytest.importorskip("titan_ext.runtime.comm.delegate.schedule")
    from titan_ext.runtime import CrossPipe, PipeMorph
    from titan_ext.titan.options import schedule_kwargs
    from titan_ext.titan.registry import schedule_class_for
    from titan_ext.titan.jobcheck import JobConfigError, check_job_config

    cfg = debug_cpu  # train_configs/debug_cpu.toml, or its TorchTitan 0.3 twin

    auto = cfg("--titan_ext.delegation", "auto", "--titan_ext.delegation_slow_link_ms", "7.5")
    cls = schedule_class_for("PipeMorph", auto)
    assert issubclass(cls, PipeMorph) and cls.__mro__[1] is PipeMorph  # [titan_ext]-configured PipeMorph
    config = schedule_kwargs(cls, auto)["config"]
    assert (config.delegation.mode, config.delegation.slow_link_ms, config.delegation.failover) == ("auto", 7.5, False)
    assert config.profile_every == 1  # PipeMorph's own knobs: the same config
    check_job_config(auto, world_size=4)

    off = cfg()
    assert schedule_class_for("PipeMorph", off) is cls  # one class: delegation is its config's
    assert schedule_kwargs(cls, off)["config"].delegation.mode == "off"
    crosspipe = cfg("--titan_ext.delegation", "auto", "--parallelism.pipeline_parallel_schedule", "CrossPipe")
    config = schedule_kwargs(schedule_class_for("CrossPipe", crosspipe), crosspipe)["config"]
    assert issubclass(schedule_class_for("CrossPipe", crosspipe), CrossPipe) and config.delegation.mode == "auto"
    check_job_config(crosspipe, world_size=4)  # was: "schedule 'CrossPipe' has no delegation variant"

    baseline = cfg("--titan_ext.delegation", "always", "--parallelism.pipeline_parallel_schedule", "1F1B")
    with pytest.raises(JobConfigError, match=r"\[titan_ext\] delegation = 'always': schedule '1F1B' is not"):
        check_job_config(baseline, world_size=4)


def test_pipemorph_takes_torchtitans_stage_split():
    """PipeMorph runs several stages per rank: TorchTitan's own split is kept (two stages per
    rank by default); delegation (one stage per rank) and placement "v" (two) are checked up front."""
    from titan_ext.titan.jobcheck import JobConfigError, check_job_config

    def default_split(*extra):  # the debug job without its one-stage-per-rank module split
        cfg = debug_cpu(*extra)
        cfg.parallelism.module_fqns_per_model_part = None
        return cfg

    cfg = default_split()
    check_job_config(cfg, world_size=4)
    assert cfg.parallelism.module_fqns_per_model_part is None  # TorchTitan's default: 2 stages per rank
    check_job_config(default_split("--titan_ext.placement", "v"), world_size=4)
    # 6 layers + embeddings + output at 1 per stage = 8 stages = 2 per rank
    check_job_config(default_split("--parallelism.pipeline_parallel_layers_per_stage", "1"), world_size=4)
    with pytest.raises(JobConfigError, match="delegation runs one stage per PP rank, but PipeMorph gets 2"):
        check_job_config(default_split("--titan_ext.delegation", "always"), world_size=4)
    with pytest.raises(JobConfigError, match="placement = 'v' needs two stages per PP rank, got 1"):
        check_job_config(debug_cpu("--titan_ext.placement", "v"), world_size=4)


def test_backward_option_is_checked_against_the_schedule_before_any_process_group():
    from titan_ext.titan.jobcheck import JobConfigError, check_job_config

    cfg = debug_cpu  # train_configs/debug_cpu.toml, or its TorchTitan 0.3 twin

    check_job_config(cfg("--titan_ext.backward", "full"), world_size=4)  # PipeMorph takes it
    with pytest.raises(JobConfigError, match=r"\[titan_ext\] backward = 'full': schedule 'CrossPipe' takes 'split'"):
        check_job_config(cfg("--titan_ext.backward", "full", "--parallelism.pipeline_parallel_schedule",
                             "CrossPipe"), world_size=4)
    with pytest.raises(JobConfigError, match=r"schedule '1F1B' takes no backward option"):
        check_job_config(cfg("--titan_ext.backward", "auto", "--parallelism.pipeline_parallel_schedule",
                             "1F1B"), world_size=4)


_BAD_TRAINER_INPUTS = {
    # name: (extra TOML, extra CLI args, env, the error line must contain)
    "malformed_toml": ("[titan_ext\nslack_floor = 2\n", [], {}, "titan_ext: malformed TOML: "),
    "unknown_titan_ext_key": ("slack_flor = 2\n", [], {}, "slack_flor"),  # appended to [titan_ext]
    "malformed_env_delays": ("", [], {"TITAN_EXT_INJECT_DELAYS": "2:abc"}, "TITAN_EXT_INJECT_DELAYS"),
    "fewer_microbatches_than_stages": ("", ["--training.local_batch_size", "2"], {},
                                       "gives 2 microbatches, fewer than the 4 pipeline stages"),
    "max_inflight_below_stages": ("", ["--titan_ext.max_inflight", "3"], {},
                                  "[titan_ext] max_inflight = 3"),
}


@tt02_only(TITAN_EXT_TRAIN)
@pytest.mark.parametrize("case", sorted(_BAD_TRAINER_INPUTS))
def test_trainer_bad_input_is_one_line_exit_2_before_any_process_group(case, tmp_path, capsys,
                                                                      monkeypatch):
    """`python -m titan_ext.train` (what every torchrun rank runs): one stderr line, exit 2, before
    TorchTitan's main (which creates the process group) is reached."""
    import torchtitan.train

    from titan_ext import train

    toml, args, env, needle = _BAD_TRAINER_INPUTS[case]
    cfg = tmp_path / "c.toml"
    cfg.write_text((ROOT / "train_configs" / "debug_cpu.toml").read_text() + "\n" + toml)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torchtitan.train, "main", lambda *a: pytest.fail("reached TorchTitan's main"))
    with pytest.raises(SystemExit) as exc:
        train.main(["--job.config_file", str(cfg), *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("titan_ext: ") and needle in err[0], err


def _greedy_planner(config):
    from titan_ext.runtime.decide.planning import PipeMorphPlanner

    return PipeMorphPlanner(schedule="zb")


def _zb_spec():
    from titan_ext.runtime.control.parts import ScheduleSpec
    from titan_ext.runtime.schedules.pipemorph import PIPEMORPH

    return ScheduleSpec("ZBAdaptive", one_stage_planner=_greedy_planner,
                        multi_stage_planner=PIPEMORPH.multi_stage_planner, backward_choices=("split",))


def test_a_new_adaptive_schedule_is_a_registry_entry_torchtitan_finds():
    """A schedule = a ScheduleSpec naming its planner, registered by
    ``register_schedule``; TorchTitan's lookup finds it by name and its [titan_ext] settings arrive as its
    config — no subclass code, no signature patch, no second table."""
    from titan_ext.runtime import AdaptiveConfig, AdaptiveSchedule, PipeMorph
    from titan_ext.runtime.control.registry import unregister_schedule
    from titan_ext.titan import registry
    from titan_ext.titan.config import JobConfig, TitanExt
    from titan_ext.titan.options import schedule_kwargs

    zb_adaptive = registry.register_schedule(_zb_spec(), module=__name__)
    try:
        assert "ZBAdaptive" in registry.registered_schedules()
        job = JobConfig(titan_ext=TitanExt(replan_interval=3, backward="split"))
        cls = registry.schedule_class_for("zbadaptive", job)
        assert issubclass(cls, zb_adaptive) and issubclass(cls, AdaptiveSchedule) and cls.__name__ == "ZBAdaptive"
        assert not issubclass(cls, PipeMorph)  # an entry beside PipeMorph, not a PipeMorph
        assert cls.spec.one_stage_planner(AdaptiveConfig()).schedule == "zb" and cls.backward_choices == ("split",)
        config = schedule_kwargs(cls, job)["config"]
        assert type(config) is AdaptiveConfig and config.profile_every == 3 and config.backward == "split"
        with pytest.raises(TypeError, match="ZBAdaptive: unknown option"):
            config.updated("ZBAdaptive", variant="ud")  # CrossPipe's keyword is not this schedule's
    finally:
        unregister_schedule("ZBAdaptive")
    assert not registry.is_titan_ext_schedule("ZBAdaptive")
