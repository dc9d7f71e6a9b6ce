"""Pieces of titan_ext.titan.metrics that need no training run (the stock-trainer run is in
test_titan_train.py): W&B login detection, strict JSON."""

import json
import math

from titan_ext.titan.metrics import strict_json, wandb_logged_in


def test_wandb_login_is_detected_from_netrc_or_env(tmp_path):
    netrc = tmp_path / "netrc"
    env = {"HOME": str(tmp_path), "NETRC": str(netrc)}
    assert not wandb_logged_in(env)  # no file
    netrc.write_text("machine example.org login u password p\n")
    netrc.chmod(0o600)
    assert not wandb_logged_in(env)  # another host only
    netrc.write_text("machine api.wandb.ai login user password 0123456789abcdef\n")
    assert wandb_logged_in(env)  # what `wandb login` writes
    assert not wandb_logged_in({**env, "WANDB_BASE_URL": "https://wandb.example.org"})  # other server
    assert wandb_logged_in({"HOME": str(tmp_path / "nowhere"), "WANDB_API_KEY": "k"})


def test_strict_json_has_null_not_nan():
    record = {"a": math.nan, "b": [1.0, math.inf, {"c": -math.inf}], 2: (3, math.nan)}
    text = json.dumps(strict_json(record), allow_nan=False)
    assert json.loads(text) == {"a": None, "b": [1.0, None, {"c": None}], "2": [3, None]}
