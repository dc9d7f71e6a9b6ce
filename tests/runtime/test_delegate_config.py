"""[titan_ext] delegation_slot_mib and the delegate links' timeout."""

import math

import pytest

from titan_ext.titan.config import JobConfig, TitanExt, TitanExtConfigError, validate_titan_ext


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan, 65537.0])
def test_bad_slot_size_is_refused_naming_the_key(bad):
    with pytest.raises(TitanExtConfigError, match=r"\[titan_ext\] delegation_slot_mib"):
        validate_titan_ext(TitanExt(delegation_slot_mib=bad))


def test_slot_size_and_job_timeout_reach_the_schedule():
    from torchtitan.config import ConfigManager

    from titan_ext.runtime import PipeMorph
    from titan_ext.titan.options import schedule_kwargs

    config = schedule_kwargs(PipeMorph, JobConfig(titan_ext=TitanExt(delegation_slot_mib=64.5)))["config"]
    assert config.delegation.slot_bytes == int(64.5 * 2**20)
    assert schedule_kwargs(PipeMorph, JobConfig(titan_ext=TitanExt()))["config"].delegation.slot_bytes is None  # derived
    cfg = ConfigManager().parse_args(["--job.custom_config_module", "titan_ext.titan.config",
                                      "--comm.train_timeout_seconds", "77"])
    assert schedule_kwargs(PipeMorph, cfg)["config"].delegation.timeout_s == 77.0
