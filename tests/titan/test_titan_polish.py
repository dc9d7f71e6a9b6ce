"""``[titan_ext] polish_s``: the anytime polish of TorchTitan jobs, from the TOML key or
``--titan_ext.polish_s`` to the adaptive schedules' ``PipeMorphConfig.polish_s`` (0 = off), checked while
the section is parsed (no process group)."""

import pytest

from _titan_version import TOML_CONFIG, parse_titan_args, titan_toml, tt02_only


def test_polish_s_reaches_the_adaptive_schedules_config():
    from titan_ext.runtime import CrossPipe, PipeMorph
    from titan_ext.titan.config import JobConfig, TitanExt
    from titan_ext.titan.options import schedule_kwargs

    assert TitanExt().polish_s == 0.0
    for cls in (PipeMorph, CrossPipe):
        assert schedule_kwargs(cls, JobConfig(titan_ext=TitanExt()))["config"].polish_s is None  # 0 = off
        assert schedule_kwargs(cls, JobConfig(titan_ext=TitanExt(polish_s=1.5)))["config"].polish_s == 1.5


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "2"])
def test_a_bad_polish_s_names_the_key(bad):
    from titan_ext.titan.config import TitanExt, TitanExtConfigError

    with pytest.raises(TitanExtConfigError, match=r"\[titan_ext\] polish_s = "):
        TitanExt(polish_s=bad)


@tt02_only(TOML_CONFIG)
def test_polish_s_from_toml_and_cli(tmp_path):
    from titan_ext.titan.config import TitanExtConfigError

    path = titan_toml(tmp_path, "[titan_ext]\npolish_s = 2.0\n")
    assert parse_titan_args(["--job.config_file", path]).titan_ext.polish_s == 2.0
    assert parse_titan_args(["--job.config_file", path, "--titan_ext.polish_s", "0.5"]).titan_ext.polish_s == 0.5
    with pytest.raises(TitanExtConfigError, match=r"polish_s = -1.0: must be a finite number of seconds >= 0"):
        parse_titan_args(["--job.config_file", titan_toml(tmp_path, "[titan_ext]\npolish_s = -1.0\n")])
