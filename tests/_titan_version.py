"""The TorchTitan the titan tests run under (issue 22): one marker for tests of TorchTitan 0.2-only APIs
and one parser for "the bundled CPU debug job" under either version.

Every titan test file either runs under both TorchTitan 0.2.x and 0.3.x (through :func:`debug_cpu`,
whose config comes from ``train_configs/debug_cpu.toml`` on 0.2 and from its 0.3 twin
``--module titan_ext.titan --config pipemorph_debugmodel`` on 0.3), or is marked :func:`tt02_only`
with the 0.2-only API it exercises -- so ``scripts/ci_versions.sh torchtitan-0.3`` runs the whole set
and a skip says why.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from titan_ext.titan import adapters

ROOT = Path(__file__).resolve().parent.parent
ADAPTER = adapters.current()
TT_VERSION = adapters.torchtitan_version()
IS_TT02 = ADAPTER.VERSION == "0.2"
IS_TT03 = ADAPTER.VERSION == "0.3"

#: the 0.2-only APIs, named once (the skip reason of every test that needs one)
TOML_CONFIG = ("TOML job configs (ConfigManager --job.config_file, job.custom_config_module, "
               "[titan_ext] parsed from TOML)")
TITAN_EXT_TRAIN = "titan_ext.train, the TOML entry point over torchtitan.train.main"
TRAIN_SPEC = "torchtitan.protocols.train_spec (model args per flavor; gone in 0.3: model_spec)"
POSITIONAL_BUILDER = "the positional build_pipeline_schedule(job_config, stages, loss_fn)"


def tt02_only(api: str):
    """Skip unless TorchTitan 0.2.x is installed, naming the 0.2-only ``api`` the test exercises."""
    return pytest.mark.skipif(
        not IS_TT02, reason=f"TorchTitan 0.2-only API: {api}; TorchTitan {TT_VERSION} installed "
                            f"(0.3's path: tests/test_titan_tt03.py)")


def debug_cpu(*extra: str):
    """The bundled CPU debug job's config (llama3 debug model, PP = 4, one stage per rank, PipeMorph)
    with ``--section.key value`` overrides ``extra``, parsed by the installed TorchTitan's ConfigManager."""
    from torchtitan.config import ConfigManager

    if IS_TT03:
        args = ["--module", "titan_ext.titan", "--config", "pipemorph_debugmodel"]
    else:
        args = ["--job.config_file", str(ROOT / "train_configs" / "debug_cpu.toml")]
    return ConfigManager().parse_args([*args, *extra])
