"""The cluster-scale projection's stage times (scripts/project_scale.py) against TorchTitan's own FLOP
count for the same Llama 3 model (``get_nparams_and_flops`` on a meta-device model)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import project_scale  # noqa: E402


@pytest.mark.parametrize("flavor", ["8B", "70B"])
def test_stage_times_add_up_to_torchtitans_flops(flavor):
    pytest.importorskip("torchtitan.models.llama3")
    from titan_ext.titan import adapters

    if adapters.current().PYTHON_CONFIGS:
        pytest.skip("reads TorchTitan 0.2's llama3 model arguments")
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.models.llama3.model.model import Transformer

    args = llama3_args[flavor]
    assert (args.n_layers, args.dim, args.vocab_size) == tuple(project_scale.MODELS[flavor][i] for i in (0, 1, 3))
    with torch.device("meta"):
        model = Transformer(args)
    _, flops_per_token = args.get_nparams_and_flops(model, project_scale.SEQ)
    tflops = 400.0
    total_ms = sum(project_scale.stage_forward_ms(flavor, 8, tflops))
    expected_ms = flops_per_token / 3 * project_scale.SEQ * project_scale.MICROBATCH / (tflops * 1e12) * 1e3
    assert total_ms == pytest.approx(expected_ms, rel=0.01)


def test_control_cost_fit_is_exact_on_a_log2_law():
    a, b, how = project_scale.fit_log2({4: 1.0 + 2.0 * 2, 8: 1.0 + 2.0 * 3, 16: 1.0 + 2.0 * 4})
    assert (a, b, how) == (pytest.approx(1.0), pytest.approx(2.0), "least squares")
    assert project_scale.fit_log2({4: 6.0})[:2] == (0.0, 3.0)


def test_a_check_that_ran_behind_costs_its_two_boundaries():
    # hand-made history: boundaries of 1 ms without a check; a check decided where it exchanged costs
    # 9 - 1 = 8 ms; one that ran behind costs (3 - 1) + (2 - 1) = 3 ms (posted, then decided)
    # (CPU: every boundary half its wall time, so a check half its cost)
    row = lambda ms, check: {"boundary_ms": ms, "boundary_cpu_ms": ms / 2, "check": check,  # noqa: E731
                             "exchange_ms": 0.5 if check else 0.0}
    history = [row(1, ""), row(9, "exchange"), row(1, ""), row(3, "posted"), row(2, "decided"), row(1, ""),
               row(3, "posted"), row(2, "decided")]
    assert project_scale.check_cost_ms(history) == {"check_cost_ms": 3.0, "check_cpu_ms": 1.5, "checks": 3,
                                                    "iterations": 8}
    # metrics from before checks could run behind (no "check"): a check is an exchange > 0
    old = [{"boundary_ms": b, "exchange_ms": e} for b, e in ((1, 0), (6, 2), (1, 0), (8, 3))]
    assert project_scale.check_cost_ms(old)["check_cost_ms"] == 6.0
    assert project_scale.check_cost_ms(old)["check_cpu_ms"] is None  # not measured then
