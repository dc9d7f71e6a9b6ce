"""[titan_ext] placement and link_alpha_beta: parsed by TorchTitan's ConfigManager and
validated before any process group, errors naming the key."""

import math

import pytest

from _titan_version import TOML_CONFIG, tt02_only
from titan_ext.titan.config import TitanExt, TitanExtConfigError, validate_titan_ext


def _parse(tmp_path, body: str):
    from torchtitan.config import ConfigManager

    p = tmp_path / "c.toml"
    p.write_text('[job]\ncustom_config_module = "titan_ext.titan.config"\n[titan_ext]\n' + body)
    return ConfigManager().parse_args(["--job.config_file", str(p)]).titan_ext


@tt02_only(TOML_CONFIG)
def test_values_from_toml(tmp_path):
    cfg = _parse(tmp_path, 'placement = "v"\nlink_alpha_beta = "2:5:50MB/s,0:1"\n')
    assert cfg.placement == "v" and cfg.link_alpha_beta == "2:5:50MB/s,0:1"
    from titan_ext.titan.config import config_delay_schedule

    link2 = config_delay_schedule(cfg.link_alpha_beta).at(0, 2)
    assert link2.latency_ms == 5 and link2.bandwidth_bytes_per_s == 50e6
    assert math.isinf(config_delay_schedule(cfg.link_alpha_beta).at(0, 0).bandwidth_bytes_per_s)
    assert TitanExt().placement == "" and TitanExt().link_alpha_beta == ""


@tt02_only(TOML_CONFIG)
@pytest.mark.parametrize("body, needle", [
    ('placement = "zigzag"', "[titan_ext] placement = 'zigzag': must be one of '', 'loop', 'v'"),
    ('link_alpha_beta = "2:fast"', "[titan_ext] link_alpha_beta = '2:fast'"),
    ('link_alpha_beta = "2:5:5furlongs"', "bandwidth '5furlongs'"),
    ('link_alpha_beta = "trace:x.csv"', "not a trace"),
])
def test_bad_values_name_the_key(tmp_path, body, needle):
    with pytest.raises(TitanExtConfigError) as e:
        _parse(tmp_path, body + "\n")
    assert needle in str(e.value)


def test_link_must_exist_for_the_pp_degree():
    cfg = TitanExt(link_alpha_beta="3:5:1GB/s")
    validate_titan_ext(cfg, num_pp_links=4)
    with pytest.raises(TitanExtConfigError, match=r"link_alpha_beta = '3:5:1GB/s': link 3 does not exist"):
        validate_titan_ext(cfg, num_pp_links=3)


@pytest.mark.parametrize("placement, stages_of_rank0", [("v", [0, 3]), ("loop", [0, 2])])
def test_torchtitan_settings_run_the_multi_stage_policy(placement, stages_of_rank0):
    """under TorchTitan the [titan_ext] thresholds reach the schedule as its config's
    PolicySettings, and with several stages per rank the factory builds the multi-stage
    VirtualReplanPolicy from them (one stage per rank: ReplanPolicy) — options no longer hands over a
    one-stage ReplanPolicy object."""
    from titan_ext.runtime.control.parts import build_parts
    from titan_ext.runtime.decide.placement import VirtualReplanPolicy, read_layout
    from titan_ext.runtime.decide.policy import ReplanPolicy
    from titan_ext.titan.config import JobConfig
    from titan_ext.titan.options import schedule_kwargs
    from titan_ext.titan.registry import schedule_class_for

    job = JobConfig(titan_ext=TitanExt(placement=placement, profile_window=4, tolerance_margin=0.2))
    cls = schedule_class_for("PipeMorph", job)
    config = schedule_kwargs(cls, job)["config"]
    multi = build_parts("PipeMorph", read_layout(stages_of_rank0, 0, 2, 4), 8, config, cls.spec, None, lambda: None)
    assert type(multi.policy) is VirtualReplanPolicy
    assert (multi.policy.window, multi.policy.rel_margin, multi.policy.layout.placement) == (4, 0.2, placement)
    assert multi.estimator.window.size == 4 and multi.local_stages == 2
    one = build_parts("PipeMorph", read_layout([0], 0, 2, 2), 8, config, cls.spec, None, lambda: None)
    assert type(one.policy) is ReplanPolicy and (one.policy.window, one.policy.rel_margin) == (4, 0.2)
