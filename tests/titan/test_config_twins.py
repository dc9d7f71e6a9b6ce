"""The shipped configs under both TorchTitan versions: each TorchTitan 0.3 Python config
(titan_ext/titan/config_registry.py) sets every value its TOML twin (train_configs/*.toml) sets, read where
0.3 keeps it (RENAMED), except the few fields the two cannot share (ALLOWED, each with why); and the
``[titan_ext]`` knobs that take one of a fixed set of strings list their choices in TorchTitan's --help.

The 0.3 configs are built by TorchTitan 0.3 itself, in a subprocess: this interpreter when it has 0.3,
else ``.venvs/torchtitan-0.3`` (scripts/ci_versions.sh torchtitan-0.3, which CI makes before its slow
tier); without either the twin test skips."""

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from _titan_version import IS_TT03

ROOT = Path(__file__).resolve().parents[2]
TT03_PYTHON = Path(sys.executable) if IS_TT03 else ROOT / ".venvs" / "torchtitan-0.3" / "bin" / "python"

TWINS = {  # TOML file -> its config_registry function
    "debug_cpu.toml": "pipemorph_debugmodel",
    "debug_cpu_dp2_pp2.toml": "falcon_dp2_pp2_debugmodel",
    "llama3_8b_pipemorph.toml": "llama3_8b_pipemorph",
    "llama3_70b_pipemorph.toml": "llama3_70b_pipemorph",
}
WITHOUT_TWIN = {"debug_cpu_dp2_pp4.toml": "the DP 2 x PP 4 benchmark of scripts/bench_falcon.py --fig19 (0.2 only)"}


def _from_root(path: str) -> str:  # the TOML files are run from the repository root; 0.3 names the path whole
    return os.path.normpath(ROOT / path)


def _head_renamed(parts: list[list[str]]) -> list[list[str]]:  # llama3's head is `output` in 0.2, `lm_head` in 0.3
    return [["lm_head" if m == "output" else m for m in part] for part in parts]


#: TOML key -> (where 0.3 keeps it, how the TOML value reads there); any other key is at the same path
RENAMED = {
    "job.dump_folder": ("dump_folder", None),
    "model.name": ("model_spec.name", None),
    "model.flavor": ("model_spec.flavor", None),
    "model.hf_assets_path": ("hf_assets_path", _from_root),
    "training.dataset": ("dataloader.dataset", None),
    "optimizer.name": ("optimizer.param_groups.0.optimizer_name", None),
    "optimizer.lr": ("optimizer.param_groups.0.optimizer_kwargs.lr", None),
    "optimizer.eps": ("optimizer.param_groups.0.optimizer_kwargs.eps", None),
    # 0.3 names the mode by the config's class; its selective AC is the per-op one (0.2's "op")
    "activation_checkpoint.mode": ("activation_checkpoint.__type__",
                                   {"none": None, "selective": "SelectiveAC.Config", "full": "FullAC.Config"}.get),
    "activation_checkpoint.selective_ac_option": ("activation_checkpoint.__type__", {"op": "SelectiveAC.Config"}.get),
    "parallelism.module_fqns_per_model_part": ("parallelism.module_fqns_per_model_part", _head_renamed),
}
#: TOML keys (every file's, or "FILE:key" for one file's) whose value 0.3 cannot or must not share, and why
ALLOWED = {
    "job.custom_config_module": "0.3 merges no config module: the [titan_ext] section is a field of "
                                "TitanExtTrainer.Config",
    "experimental.custom_import": "0.3 has no custom_import: `--module titan_ext.titan` imports titan_ext",
    "job.description": "0.3's Trainer.Config has no description",
    "debug_cpu.toml:job.dump_folder": "the 0.3 debug runs write under <folder>_tt03, so a 0.2 and a 0.3 run "
                                      "of the demo in one checkout keep their appended metrics apart",
    "debug_cpu_dp2_pp2.toml:job.dump_folder": "as debug_cpu.toml's",
}

# every dataclass as a dict with its class (``__type__``); the model's own config tree left out
_DUMP = """
import dataclasses, json, sys
from titan_ext.titan import config_registry

def plain(o):
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        fields = {f.name: plain(getattr(o, f.name)) for f in dataclasses.fields(o) if f.name != "model"}
        return {"__type__": type(o).__qualname__, **fields}
    if isinstance(o, (list, tuple)):
        return [plain(x) for x in o]
    if isinstance(o, dict):
        return {str(k): plain(v) for k, v in o.items()}
    return o if o is None or isinstance(o, (bool, int, float, str)) else repr(o)

with open(sys.argv[1], "w") as f:
    json.dump({name: plain(getattr(config_registry, name)()) for name in sys.argv[2:]}, f)
"""


@pytest.fixture(scope="module")
def tt03_configs(tmp_path_factory) -> dict[str, dict]:
    """Every twin's 0.3 config as plain data, built by TorchTitan 0.3 (about 20 s: its import)."""
    if not TT03_PYTHON.is_file():
        pytest.skip(f"no TorchTitan 0.3 environment at {TT03_PYTHON.parent.parent} "
                    "(bash scripts/ci_versions.sh torchtitan-0.3 makes it)")
    out = tmp_path_factory.mktemp("tt03") / "configs.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    p = subprocess.run([str(TT03_PYTHON), "-c", _DUMP, str(out), *TWINS.values()], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text())


def _toml_fields(path: Path) -> dict[str, object]:
    return {f"{section}.{key}": value for section, table in tomllib.loads(path.read_text()).items()
            for key, value in table.items()}


def _at(tree, path: str):
    for part in path.split("."):
        if tree is None and part == "__type__":  # no config at all: 0.3's activation_checkpoint "none"
            return None
        tree = tree[int(part)] if isinstance(tree, list) else tree[part]
    return tree


def test_every_config_has_its_twin_named():
    """Every TOML file and every config function of the registry (its ``__all__``, read from the source:
    importing it needs 0.3) is in TWINS, or the TOML in WITHOUT_TWIN."""
    import ast

    tomls = {p.name for p in (ROOT / "train_configs").glob("*.toml")}
    assert tomls == set(TWINS) | set(WITHOUT_TWIN)
    tree = ast.parse((ROOT / "titan_ext" / "titan" / "config_registry.py").read_text())
    (names,) = [ast.literal_eval(n.value) for n in tree.body
                if isinstance(n, ast.Assign) and [t.id for t in n.targets if isinstance(t, ast.Name)] == ["__all__"]]
    assert set(TWINS.values()) == set(names) - {"one_stage_per_rank"}


@pytest.mark.slow  # TorchTitan 0.3's import in a subprocess (about 20 s); CI's slow tier runs after its 0.3 environment exists
@pytest.mark.parametrize("toml", sorted(TWINS))
def test_tt03_config_sets_what_its_toml_twin_sets(toml, tt03_configs):
    config = tt03_configs[TWINS[toml]]
    differ = []
    for key, value in _toml_fields(ROOT / "train_configs" / toml).items():
        if key in ALLOWED or f"{toml}:{key}" in ALLOWED:
            continue
        path, reads = RENAMED.get(key, (key, None))
        try:
            got = _at(config, path)
        except (KeyError, IndexError):
            differ.append(f"{key}: 0.3 has no {path} (map it in RENAMED or name it in ALLOWED)")
            continue
        want = reads(value) if reads else value
        if got != want:
            differ.append(f"{key} = {value!r}: {TWINS[toml]}() has {path} = {got!r}")
    assert not differ, f"{toml} vs config_registry.{TWINS[toml]}:\n" + "\n".join(differ)


def test_allowed_differences_are_keys_of_the_tomls():
    keys = {k for name in TWINS for k in _toml_fields(ROOT / "train_configs" / name)}
    for entry in ALLOWED:
        name, _, key = entry.rpartition(":")
        assert key in (_toml_fields(ROOT / "train_configs" / name) if name else keys), entry


def test_help_lists_the_choices_of_a_literal_knob(capsys):
    """``delegation`` and ``backward`` are ``Literal`` (titan/config.py), as TorchTitan types its own enum
    fields: tyro lists their choices in ``--help`` (and refuses another on the command line; a TOML value
    is checked by validate_titan_ext: tests/titan/test_titan_config.py)."""
    from torchtitan.config import ConfigManager

    base = (["--module", "titan_ext.titan", "--config", "pipemorph_debugmodel"] if IS_TT03
            else ["--job.config_file", str(ROOT / "train_configs" / "debug_cpu.toml")])
    with pytest.raises(SystemExit) as exc:
        ConfigManager().parse_args([*base, "--help"])
    assert exc.value.code in (0, None)
    out = "".join(capsys.readouterr())
    assert re.search(r"--titan[-_]ext\.delegation\s+\{off,auto,always\}", out), out[-3000:]
    assert re.search(r"--titan[-_]ext\.backward\s+\{,auto,measure,split,full\}", out), out[-3000:]
