"""A table of hostile trainer inputs (config file, TOML
shapes, command-line values, paths, environment variables). Each one is refused before any process group
exists with one line from rank 0 (``titan_ext: ...``), nothing from the others, exit 2 everywhere, no
traceback -- or, for the last rows, accepted as valid.

Cases run ``titan_ext.train.main`` in this process with TorchTitan's ``main`` replaced by a failure (so a
case that reaches it fails), which is what torchrun's ranks run up to their process group. None repeats
tests/titan/test_titan_robust.py (missing file, syntax error, duplicate key, not UTF-8, env garbage alone,
env link beyond the pipeline, _T0) or tests/titan/test_titan_config.py.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from _titan_version import TITAN_EXT_TRAIN, tt02_only

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "train_configs" / "debug_cpu.toml"
BASE = CONFIG.read_text()
# the DP 2 x PP 2 Falcon job's parallelism (emulated faults need DP replicas)
DPPP = BASE.replace("pipeline_parallel_degree = 4", "pipeline_parallel_degree = 2\ndata_parallel_replicate_degree = 2") \
    .replace('''module_fqns_per_model_part = [
    ["tok_embeddings", "layers.0"],
    ["layers.1", "layers.2"],
    ["layers.3", "layers.4"],
    ["layers.5", "norm", "output"],
]''', '''module_fqns_per_model_part = [["tok_embeddings", "layers.0", "layers.1", "layers.2"],
    ["layers.3", "layers.4", "layers.5", "norm", "output"]]''')


def _fifo(tmp: Path) -> str:
    path = tmp / "fifo.toml"
    os.mkfifo(path)
    return str(path)


def _link(tmp: Path, name: str, target: str) -> str:
    path = tmp / name
    os.symlink(target, path)
    return str(path)


def _file(tmp: Path, name: str = "afile", text: str = "x") -> str:
    path = tmp / name
    path.write_text(text)
    return str(path)


def _dir(tmp: Path, name: str) -> str:
    path = tmp / name
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def _trace(tmp: Path, text: str, name: str = "t.csv") -> str:
    return _file(tmp, name, text)


def _big_trace(tmp: Path) -> str:
    path = tmp / "big.csv"
    with open(path, "w") as f:
        f.write("time_s,link1\n")
        row = "".join(f"{i},5\n" for i in range(1, 200_001))
        while f.tell() < (17 << 20):
            f.write(row)
            row = row.replace(",5\n", ",6\n")
    # strictly increasing time_s is not what we test: the size cap refuses it before parsing
    return str(path)


# name: (config text or a callable(tmp) -> path of the config, extra argv (callables get tmp),
#        env, the one line must contain)
BAD = {
    # -- the config file itself: regular file, size cap, TOML shape --------------------------------------
    "config_is_fifo": (_fifo, [], {}, "not a regular file (a FIFO"),
    "config_is_dev_zero": (lambda t: "/dev/zero", [], {}, "/dev/zero: not a regular file"),
    "config_is_directory": (lambda t: _dir(t, "conf.d"), [], {}, "a directory; it must be a TOML file"),
    "config_too_large": (lambda t: _file(t, "big.toml", BASE + "#" * (5 << 20) + "\n"), [], {},
                         "more than the limit of 4 MiB"),
    "array_of_tables": (BASE.replace("[titan_ext]", "[[titan_ext]]"), [], {},
                        "[[titan_ext]] is an array of tables"),
    "scalar_section": ("titan_ext = 5\n" + BASE.split("[titan_ext]")[0], [], {}, "top-level titan_ext = 5"),
    "scalar_job_section": ("job = \"x\"\n" + BASE.replace("[job]\n", "[jobx]\n"), [], {}, "top-level job = 'x'"),
    # -- paths the job writes -------------------------------------------------------------------------------
    "dump_folder_is_a_file": (BASE, ["--job.dump_folder", lambda t: _file(t)], {}, "is a file, not a directory"),
    "dump_folder_under_a_file": (BASE, ["--job.dump_folder", lambda t: _file(t) + "/out"], {},
                                 "cannot be created"),
    "metrics_file_dotdot": (BASE, ["--titan_ext.metrics_file", ".."], {}, "metrics_file = '..'"),
    "metrics_file_dot": (BASE, ["--titan_ext.metrics_file", "."], {}, "metrics_file = '.'"),
    "metrics_file_is_a_dir": (BASE, ["--job.dump_folder", lambda t: str(t / "out"), "--titan_ext.metrics_file", "m.jsonl"],
                              {}, "is a directory, not a file"),
    "timelines_is_a_file": (BASE, ["--job.dump_folder", lambda t: str(t / "out2")], {}, "timelines"),
    # -- paths the job reads ------------------------------------------------------------------------------
    "assets_missing": (BASE, ["--model.hf_assets_path", lambda t: str(t / "nope")], {}, "no such directory"),
    "assets_is_a_file": (BASE, ["--model.hf_assets_path", lambda t: _file(t)], {}, "not a directory"),
    "assets_without_tokenizer": (BASE, ["--model.hf_assets_path", lambda t: _dir(t, "empty")], {},
                                 "holds none of tokenizer.json"),
    "assets_empty": (BASE, ["--model.hf_assets_path", ""], {}, "hf_assets_path is empty"),
    "trace_is_fifo": (BASE, ["--titan_ext.inject_trace", _fifo], {}, "not a regular file"),
    "trace_is_a_dir": (BASE, ["--titan_ext.inject_trace", lambda t: _dir(t, "tr")], {}, "a directory"),
    "trace_too_large": (BASE, ["--titan_ext.inject_trace", _big_trace], {}, "more than the limit of 16 MiB"),
    "trace_not_utf8": (BASE, ["--titan_ext.inject_trace", lambda t: _trace(t, "time_s,link1\n0,\xff\n".encode(
        "latin-1").decode("latin-1"), "l1.csv")], {}, "inject_trace"),
    "trace_latency_overflow": (BASE, ["--titan_ext.inject_trace", lambda t: _trace(t, "time_s,link1\n0,1e15\n")], {},
                               "at most 1e+09"),
    "trace_arabic_digit": (BASE, ["--titan_ext.inject_trace", lambda t: _trace(t, "time_s,link1\n0,\u0663\n")], {},
                           "ASCII digits"),
    "trace_tiny_bandwidth": (BASE, ["--titan_ext.inject_trace", lambda t: _trace(t, "time_s,link1,link1_bw\n0,5,1e-300\n")],
                             {}, "bandwidth"),
    # -- values that overflowed later ----------------------------------------------------------------------
    "delay_1e15": (BASE, ["--titan_ext.inject_delays", "2:1e15"], {}, "latency '1e15'"),
    "delay_longer_than_timeout": (BASE, ["--titan_ext.inject_delays", "1:400000", "--comm.train_timeout_seconds", "300"],
                                  {}, "not shorter than [comm] train_timeout_seconds = 300"),
    "bandwidth_subnormal": (BASE, ["--titan_ext.inject_delays", "1:5:0.000001B/s"], {}, "bandwidth"),
    "link_5000_digits": (BASE, ["--titan_ext.inject_delays", "9" * 5000 + ":5"], {}, "is not '*' or an integer"),
    "device_factor_huge": (DPPP, ["--titan_ext.emulate_slow_device", "3:1000000000000"], {}, "FACTOR <= 1000"),
    "link_factor_huge": (DPPP, ["--titan_ext.emulate_slow_link", "0-1:x1e9"], {}, "emulate_slow_link"),
    "device_factor_two_dots": (DPPP, ["--titan_ext.emulate_slow_device", "3:1.2.3"], {}, "DEVICE:FACTOR"),
    "slack_floor_above_microbatches": (BASE, ["--titan_ext.slack_floor", "100"], {},
                                       "slack_floor = 100: that slackness"),
    "slack_floor_just_too_large": (BASE, ["--titan_ext.slack_floor", "6"], {}, "use <= 5"),
    "device_pass_ms_huge": (BASE, ["--titan_ext.emulate_device_pass_ms", "1e300"], {}, "emulate_device_pass_ms"),
    "device_pass_beyond_timeout": (BASE, ["--titan_ext.emulate_device_pass_ms", "200000",
                                          "--comm.train_timeout_seconds", "300"], {}, "not shorter than"),
    # -- ASCII digits only ----------------------------------------------------------------------------------
    "cli_arabic_int": (BASE, ["--titan_ext.slack_floor", "\u0663"], {}, "ASCII digits"),
    "cli_fullwidth_int": (BASE, ["--training.steps", "\uff11\uff12"], {}, "--training.steps"),
    "cli_fullwidth_equals": (BASE, ["--titan_ext.replan_interval=\uff12"], {}, "ASCII digits"),
    "delay_arabic_link": (BASE, ["--titan_ext.inject_delays", "\u0663:30"], {}, "ASCII digits"),
    "delay_fullwidth_ms": (BASE, ["--titan_ext.inject_delays", "1:\uff13\uff10"], {}, "ASCII digits"),
    "device_arabic_factor": (DPPP, ["--titan_ext.emulate_slow_device", "3:\u0664"], {}, "ASCII digits"),
    "toml_string_arabic": (BASE + 'inject_delays = "\u0661:5"\n', [], {}, "ASCII digits"),
    # -- more of each kind ------------------------------------------------------------------------------------
    "config_symlink_to_dev_zero": (lambda t: _link(t, "z.toml", "/dev/zero"), [], {}, "not a regular file"),
    "nested_titan_ext_table": (BASE + "\n[titan_ext.sub]\nx = 1\n", [], {}, "Invalid field names"),
    "toml_wrong_type": (BASE.replace("replan_interval = 1", 'replan_interval = "one"'), [], {},
                        "replan_interval = 'one': must be of type int"),
    "cli_wrong_type_one_line": (BASE, ["--titan_ext.slack_floor", "two"], {}, "command line: Error parsing"),
    "cli_unrecognized_value": (BASE, ["--titan_ext.adaptive", "maybe"], {}, "Unrecognized options: maybe"),
    "bandwidth_overflows_to_inf": (BASE, ["--titan_ext.inject_delays", "1:5:1e400MB/s"], {}, "bandwidth '1e400MB/s'"),
    "delay_nan": (BASE, ["--titan_ext.inject_delays", "1:nan"], {}, "latency 'nan'"),
    "trace_time_overflow": (BASE, ["--titan_ext.inject_trace", lambda t: _trace(t, "time_s,link1\n1e15,5\n")], {},
                            "time_s"),
    "slow_link_ms_huge": (DPPP, ["--titan_ext.emulate_slow_link", "0-1:700000"], {}, "MS <= 600000"),
    "slow_device_step_huge": (DPPP, ["--titan_ext.emulate_slow_device", "3:4@99999999999"], {}, "DEVICE:FACTOR"),
    "dump_folder_dangling_symlink": (BASE, ["--job.dump_folder", lambda t: _link(t, "dangle", str(t / "nowhere"))],
                                     {}, "broken (dangling or looping) symbolic link"),
    "dump_folder_symlink_loop": (BASE, ["--job.dump_folder", lambda t: _link(t, "loop", str(t / "loop"))], {},
                                 "symbolic link"),
    "assets_is_fifo": (BASE, ["--model.hf_assets_path", _fifo], {}, "not a directory"),
    "empty_config_default_assets": (lambda t: _file(t, "empty.toml", ""), [], {}, "hf_assets_path"),
    # -- environment variables: garbage is an error whichever source wins ------------------------------------
    "env_delays_garbage_config_wins": (BASE, ["--titan_ext.inject_delays", "1:5"],
                                       {"TITAN_EXT_INJECT_DELAYS": "garbage!!"}, "TITAN_EXT_INJECT_DELAYS = 'garbage!!'"),
    "env_delays_garbage_trace_wins": (BASE, ["--titan_ext.inject_trace", lambda t: _trace(t, "time_s,link1\n0,5\n")],
                                      {"TITAN_EXT_INJECT_DELAYS": "1:"}, "TITAN_EXT_INJECT_DELAYS = '1:'"),
    "env_delays_arabic": (BASE, [], {"TITAN_EXT_INJECT_DELAYS": "\u0661:5"}, "ASCII digits"),
    "env_delays_overflow": (BASE, [], {"TITAN_EXT_INJECT_DELAYS": "1:1e15"}, "TITAN_EXT_INJECT_DELAYS = '1:1e15'"),
    "env_t0_arabic": (BASE, [], {"TITAN_EXT_INJECT_DELAYS": "1:5", "TITAN_EXT_INJECT_DELAYS_T0": "\u0661\u0662"},
                      "TITAN_EXT_INJECT_DELAYS_T0"),
    "env_slow_device_garbage_config_wins": (DPPP, ["--titan_ext.emulate_slow_device", "3:2"],
                                            {"TITAN_EXT_SLOW_DEVICE": "garbage"}, "TITAN_EXT_SLOW_DEVICE = 'garbage'"),
    "env_slow_link_garbage": (BASE, [], {"TITAN_EXT_SLOW_LINK": "0-0:5"}, "TITAN_EXT_SLOW_LINK = '0-0:5'"),
    "env_slow_device_overflow": (BASE, [], {"TITAN_EXT_SLOW_DEVICE": "1:1e12"}, "TITAN_EXT_SLOW_DEVICE"),
    # the S4 plan a relaunched job is given, checked before the model is built
    "s4_plan_missing": (BASE, [], {"TITAN_EXT_S4_PLAN": "/nonexistent/falcon_s4_plan.json"},
                        "TITAN_EXT_S4_PLAN = '/nonexistent/falcon_s4_plan.json'"),
    "s4_plan_empty_object": (BASE, [], {"TITAN_EXT_S4_PLAN": lambda t: _file(t, "p.json", "{}")},
                             "not an S4 plan of this version: begin_time, step"),
    "s4_plan_a_list": (BASE, [], {"TITAN_EXT_S4_PLAN": lambda t: _file(t, "p.json", "[]")}, "not an S4 plan"),
    "s4_plan_not_json": (BASE, [], {"TITAN_EXT_S4_PLAN": lambda t: _file(t, "p.json", "{")}, "not JSON"),
    "s4_plan_a_dir": (BASE, [], {"TITAN_EXT_S4_PLAN": lambda t: _dir(t, "plan")}, "TITAN_EXT_S4_PLAN"),
    "s4_plan_nan_step": (BASE, [], {"TITAN_EXT_S4_PLAN": lambda t: _s4_plan(t, step=float("nan"))}, "step"),
    # the environment's delays are held to the config's rules when they are the ones used
    "env_delay_longer_than_timeout": (BASE, ["--comm.train_timeout_seconds", "300"],
                                      {"TITAN_EXT_INJECT_DELAYS": "1:400000"},
                                      "TITAN_EXT_INJECT_DELAYS = '1:400000': a delay of 400000 ms is not shorter"),
    # a delegate slot that cannot hold one activation (1 x 64 tokens x dim 256 x 2 bytes = 32 KiB)
    "slot_below_one_activation": (BASE, ["--titan_ext.delegation", "always", "--titan_ext.delegation_slot_mib",
                                         "0.001"], {}, "at least 0.0312 MiB here (microbatch 1 x seq_len 64 x dim 256"),
    "no_torchrun": (BASE, [], {}, "LOCAL_RANK, RANK, WORLD_SIZE not set: start the trainer with torchrun"),
    # -- an output named like one the job writes itself ------------------------------------------------------
    "metrics_file_timelines": (BASE, ["--titan_ext.metrics_file", "timelines"], {}, "its timeline traces"),
    "metrics_file_falcon_log": (BASE, ["--titan_ext.metrics_file", "falcon.jsonl"], {}, "Falcon's decisions"),
    "metrics_file_tb": (BASE, ["--titan_ext.metrics_file", "tb"], {}, "TensorBoard's logs"),
    "metrics_file_checkpoint": (BASE, ["--titan_ext.metrics_file", "ckpt", "--checkpoint.folder", "ckpt"], {},
                                "its checkpoints"),
}


def _s4_plan(tmp: Path, **fields) -> str:
    """An S4 plan as a job's S4 exit writes it (``write_s4_plan``), ``fields`` replaced."""
    from titan_ext.runtime.falcon.restart import ShrinkPlan, write_s4_plan

    plan = ShrinkPlan(step=7, grid=[[0, 1], [2, 3]], excluded=[3], kept_replicas=[0], num_pp=2, chunks_per_replica=4)
    extra = dict(begin_time=1e9, save_s=0.5, estimated_cost_s=3.0, iteration_time_before_s=None)
    path = write_s4_plan(tmp / "s4dump", plan, **extra)
    if fields:
        import json

        path.write_text(json.dumps(json.loads(path.read_text()) | fields))
    return str(path)


def _prepare(case: str, tmp: Path) -> list[str]:
    """The command line of a case (and the files it needs)."""
    text, extra, _env, _needle = BAD[case] if case in BAD else GOOD[case]
    if callable(text):
        config = text(tmp)
    else:
        (tmp / "c.toml").write_text(text)
        config = str(tmp / "c.toml")
    argv = ["--job.config_file", config] + [a(tmp) if callable(a) else a for a in extra]
    if case == "metrics_file_is_a_dir":
        (tmp / "out" / "m.jsonl").mkdir(parents=True)
    if case == "timelines_is_a_file":
        (tmp / "out2").mkdir()
        (tmp / "out2" / "timelines").write_text("x")
    return argv


def _run(case, rank, tmp_path, capsys, monkeypatch):
    import torchtitan.train

    from titan_ext import train

    for var in ("TITAN_EXT_INJECT_DELAYS", "TITAN_EXT_INJECT_DELAYS_T0", "TITAN_EXT_SLOW_DEVICE", "TITAN_EXT_SLOW_LINK",
                "TITAN_EXT_S4_PLAN"):
        monkeypatch.delenv(var, raising=False)
    table = BAD if case in BAD else GOOD
    for k, v in table[case][2].items():
        monkeypatch.setenv(k, v(tmp_path) if callable(v) else v)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("LOCAL_RANK", rank)
    if case == "no_torchrun":
        for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
            monkeypatch.delenv(var)
    monkeypatch.chdir(ROOT)  # the shipped config's relative tokenizer path
    argv = _prepare(case, tmp_path)
    reached = []
    monkeypatch.setattr(torchtitan.train, "main", lambda *a: reached.append(a))
    try:
        train.main(argv)
    except SystemExit as exc:
        return exc.code, capsys.readouterr(), reached
    return None, capsys.readouterr(), reached


@tt02_only(TITAN_EXT_TRAIN)
@pytest.mark.parametrize("case", sorted(BAD))
def test_hostile_input_is_one_line_from_rank_0_and_exit_2(case, tmp_path, capsys, monkeypatch):
    code, (out, err), reached = _run(case, "0", tmp_path, capsys, monkeypatch)
    assert not reached, f"{case}: reached TorchTitan's main (would fail after the process group exists)"
    assert code == 2, (code, err)
    lines = err.strip().splitlines()
    needle = BAD[case][3]
    assert len(lines) == 1 and lines[0].startswith("titan_ext: ") and needle in lines[0], err
    assert "Traceback" not in out + err


@tt02_only(TITAN_EXT_TRAIN)
@pytest.mark.parametrize("case", ["config_is_fifo", "array_of_tables", "dump_folder_is_a_file", "delay_1e15",
                                  "env_delays_garbage_config_wins", "cli_arabic_int"])
def test_other_ranks_exit_2_quietly(case, tmp_path, capsys, monkeypatch):
    code, (out, err), reached = _run(case, "3", tmp_path, capsys, monkeypatch)
    assert not reached and code == 2 and err.strip() == "" and "Traceback" not in out, (code, err)


# valid inputs next to the refused ones: accepted (they reach TorchTitan's main)
GOOD = {
    "ascii_numbers": (BASE, ["--titan_ext.slack_floor", "5", "--titan_ext.inject_delays", "1:30"], {}, ""),
    "non_ascii_path_not_a_number": (BASE, ["--job.dump_folder", lambda t: str(t / "r\u00e9sultat_\u0663")], {}, ""),
    "env_delays_when_config_wins_well_formed": (BASE, ["--titan_ext.inject_delays", "1:5"],
                                                {"TITAN_EXT_INJECT_DELAYS": "2:5"}, ""),
    "trace_small": (BASE, ["--titan_ext.inject_trace", lambda t: _trace(t, "time_s,link1\n0,5\n10,0\n")], {}, ""),
    "device_factor_1000_dp_pp": (DPPP, ["--titan_ext.emulate_slow_device", "3:1000@3"], {}, ""),
    "s4_plan_as_written": (BASE, [], {"TITAN_EXT_S4_PLAN": lambda t: _s4_plan(t)}, ""),
    "slot_one_mib": (BASE, ["--titan_ext.delegation", "always", "--titan_ext.delegation_slot_mib",
                            "1"], {}, ""),
}


@tt02_only(TITAN_EXT_TRAIN)
@pytest.mark.parametrize("case", sorted(GOOD))
def test_valid_neighbours_are_accepted(case, tmp_path, capsys, monkeypatch):
    code, (out, err), reached = _run(case, "0", tmp_path, capsys, monkeypatch)
    assert code is None and len(reached) == 1, (code, err)
    assert "titan_ext:" not in err


def test_a_trace_is_parsed_once_per_process(tmp_path, monkeypatch):
    """The config's own check, the job check and the installation share one parse (a 33 MB trace was read
    several times before the job started); an edited file is read again."""
    from titan_ext.runtime.emulate import delay_injection as di

    path = tmp_path / "t.csv"
    path.write_text("time_s,link1\n0,5\n")
    calls = []
    real = di._parse_trace
    monkeypatch.setattr(di, "_parse_trace", lambda p: calls.append(p) or real(p))
    first = di.parse_delay_spec(f"trace:{path}")
    for _ in range(3):
        again = di.parse_delay_spec(f"trace:{path}")
    assert len(calls) == 1 and again.at(0.0, 1).latency_ms == first.at(0.0, 1).latency_ms == 5.0
    path.write_text("time_s,link1\n0,7\n")
    os.utime(path, ns=(1, 1))  # another mtime even on a coarse clock
    assert di.parse_delay_spec(f"trace:{path}").at(0.0, 1).latency_ms == 7.0 and len(calls) == 2


def test_config_file_checks_never_open_a_fifo(tmp_path):
    """The check refuses a FIFO from its stat, without opening it (an open would block forever)."""
    from titan_ext.titan.jobcheck import JobConfigError, check_config_file

    fifo = _fifo(tmp_path)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    with pytest.raises(JobConfigError, match="not a regular file"):
        check_config_file(fifo)


def test_unwritable_dump_folder_is_refused(tmp_path, monkeypatch):
    """(Tests run as root, where every directory is writable: the permission probe is replaced.)"""
    from titan_ext.titan import jobcheck
    from titan_ext.titan.config import TitanExt

    real = os.access
    monkeypatch.setattr(jobcheck.os, "access", lambda p, m: False if str(p) == str(tmp_path) else real(p, m))
    config = type("C", (), {})()
    config.job = type("J", (), {"dump_folder": str(tmp_path / "out")})()
    with pytest.raises(jobcheck.JobConfigError, match="cannot be created: .* is not writable"):
        jobcheck.check_paths(config, TitanExt())


def test_the_one_number_reader_takes_ascii_only():
    from titan_ext.args import parse_float, parse_int

    assert parse_int(" 12 ", "n") == 12 and parse_float("1e3", "x") == 1000.0
    for bad in ("\u0663", "\uff11\uff12", "", "1 2", "9" * 100, None):
        with pytest.raises(ValueError, match="n"):
            parse_int(bad, "n")
