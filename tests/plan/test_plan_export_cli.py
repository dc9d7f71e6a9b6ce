"""Exporters (torch CSV loadable by torch's runtime, Perfetto JSON, Gantt PNG) and the CLI's contract."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from titan_ext.plan import PipelineProfile, plan_pipemorph, simulate
from titan_ext.plan.export import read_torch_csv, write_chrome_trace, write_gantt_png, write_torch_csv


def test_csv_loads_in_torch_runtime(tmp_path):
    """torch's own ``_PipelineScheduleRuntime._load_csv`` (what TorchTitan's pipeline_parallel_schedule_csv
    uses) reads our CSV and lowers it with SEND/RECV; its compute order equals our plan."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    S, N = 4, 8
    plan = plan_pipemorph(PipelineProfile.uniform(S, N, 10, 10, 10, delays_ms={2: 30}))
    path = tmp_path / "plan.csv"
    write_torch_csv(plan.actions, path)
    for rank in range(S):
        stage = SimpleNamespace(stage_index=rank, num_stages=S, group_size=S, group_rank=rank,
                                is_first=rank == 0, is_last=rank == S - 1, submod=None)
        runtime = _PipelineScheduleRuntime([stage], N)
        runtime._load_csv(str(path))
        compute = [a for a in runtime.pipeline_order_with_comms[rank] if a.is_compute_op]
        assert [str(a) for a in compute] == [str(a) for a in plan.actions[rank]]
        kinds = {a.computation_type.value for a in runtime.pipeline_order_with_comms[rank]}
        assert ("SEND_F" in kinds) == (rank < S - 1) and ("RECV_F" in kinds) == (rank > 0)
    assert read_torch_csv(path) == plan.actions


def test_csv_rejects_garbage(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0X1\n")
    with pytest.raises(ValueError, match="row 1"):
        read_torch_csv(path)
    path.write_text("0F0,0SEND_F0\n")
    with pytest.raises(ValueError, match="not a compute action"):
        read_torch_csv(path)


def test_trace_and_gantt(tmp_path):
    prof = PipelineProfile.uniform(4, 8, 10, 10, 10)
    tl = simulate(plan_pipemorph(prof).actions, prof)
    write_chrome_trace(tl, tmp_path / "t.json")
    trace = json.loads((tmp_path / "t.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 3 * 4 * 8
    assert max(e["ts"] + e["dur"] for e in spans) == pytest.approx(tl.makespan_ms * 1e3)
    write_gantt_png(tl, tmp_path / "g.png")
    import matplotlib.image

    img = matplotlib.image.imread(tmp_path / "g.png")
    assert img.shape[0] > 100 and img.shape[1] > 400


def run(*args):
    """``python -m titan_ext.cli ARGS`` in a new process: the entry point's own contract (exit status, one
    line on stderr) is checked through it once for help and once for a usage error; the other tests call
    the same ``main`` in this process (conftest's ``cli_main``), a new interpreter costing seconds each."""
    return subprocess.run([sys.executable, "-m", "titan_ext.cli", *args], capture_output=True, text=True)


@pytest.mark.multiprocess
@pytest.mark.parametrize("cmd", [[], ["plan"], ["simulate"]])
def test_help_everywhere(cmd, cli_main):
    out = (run if cmd == [] else cli_main)(*cmd, "--help")
    assert out.returncode == 0 and "usage:" in out.stdout


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "args, needle",
    [
        (["plan", "--stages", "4", "--microbatches", "0", "--times", "10,10,10"], "--microbatches"),
        (["plan", "--stages", "4", "--microbatches", "8", "--times", "10,10"], "--times"),
        (["plan", "--stages", "4", "--microbatches", "8", "--times", "10,10,10", "--delay", "7:30"], "link 7"),
        (["plan", "--stages", "4", "--microbatches", "8", "--times", "10,10,10", "--delay", "1-30"], "LINK:VALUE"),
        (["plan", "--stages", "4", "--microbatches", "8", "--times", "10,-1,10"], "b_ms[0]"),
        (["plan", "--stages", "4", "--microbatches", "8", "--times", "10,10,10", "--bandwidth", "0:10"], "--message-mb"),
        (["plan", "--stages", "4", "--microbatches", "8", "--times", "10,10,10", "--schedule", "nope"], "--schedule"),
        (["simulate", "--builtin", "Nope", "--stages", "4", "--microbatches", "8", "--times", "1,1,1"], "unknown built-in"),
        (["simulate", "--csv", "/does/not/exist.csv", "--stages", "4", "--microbatches", "8", "--times", "1,1,1"], "exist"),
        (["plan", "--stages", "4", "--microbatches", "8", "--times", "1,1,1", "--schedule", "crosspipe-ud",
          "--backward", "full"], "split backwards only"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_arguments_one_line_exit_2(args, needle, cli_main):
    out = (run if args == ["frobnicate"] else cli_main)(*args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], out.stderr
    assert "Traceback" not in out.stderr


def test_json_last_line_fields(tmp_path, cli_main):
    out = cli_main("plan", "--stages", "4", "--microbatches", "12", "--times", "10,10,10", "--delay", "2:30",
              "--bandwidth", "1:25", "--message-mb", "50", "--trace", str(tmp_path / "t.json"),
              "--gantt", str(tmp_path / "g.png"), "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("makespan_ms", "bubble_rate", "warmup_counts", "slackness", "plan_ms", "peak_inflight"):
        assert key in doc
    # link 1 carries 50 MB at 25 GB/s = 2 ms per message; link 2 has 30 ms: Alg.2 gives link 2 the most slack
    assert doc["slackness"][2] == max(doc["slackness"]) == 4
    assert (tmp_path / "t.json").exists() and (tmp_path / "g.png").exists()


def test_profile_file(tmp_path, cli_main):
    profile = {"num_stages": 3, "num_microbatches": 9, "f_ms": [5, 6, 7], "b_ms": [5, 6, 7], "w_ms": [1, 1, 1],
               "links": [{"latency_ms": 0}, {"latency_ms": 40}]}
    (tmp_path / "p.json").write_text(json.dumps(profile))
    out = cli_main("plan", "--profile", str(tmp_path / "p.json"), "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    # Eq.1 on link 1: ceil((6 + 6 + 80) / 14) = 7, clipped at max(N − 2S, 2) = 3 (Alg.2 as published)
    from titan_ext.plan import PipelineProfile, plan_pipemorph

    alg2 = plan_pipemorph(PipelineProfile.from_json(profile), candidates=False)
    assert alg2.slackness == [2, 3]
    # the CLI's plan (Alg.2 and its candidates): as fast, and on a tie the one holding fewer activations
    assert doc["makespan_ms"] <= alg2.predicted_makespan_ms + 1e-9
    assert doc["makespan_ms"] < alg2.predicted_makespan_ms - 1e-9 or sum(doc["warmup_counts"]) <= sum(alg2.warmup_counts)
    (tmp_path / "bad.json").write_text(json.dumps({**profile, "f_ms": [5, 6]}))
    bad = cli_main("plan", "--profile", str(tmp_path / "bad.json"))
    assert bad.returncode == 2 and "f_ms" in bad.stderr


def test_full_backward_plan_has_the_1f1b_makespan(cli_main):
    """zb-h1 (x_i = S − i) with --backward full is 1F1B: (N + S − 1)(F + B + W) = 11 · 20 ms."""
    out = cli_main("plan", "--stages", "4", "--microbatches", "8", "--times", "10,6,4", "--schedule", "zb-h1",
              "--backward", "full", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["makespan_ms"] == pytest.approx(220.0) and doc["backward"] == "full"
