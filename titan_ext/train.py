"""Train with TorchTitan + titan_ext: ``torchrun ... -m titan_ext.train --job.config_file X.toml``.

Same command line as ``torchtitan.train`` (TOML file plus ``--section.key value`` overrides). On top:

* registration of titan_ext's schedules / dataset / CPU shim before anything else;
* the ``[titan_ext]`` section is always available (``job.custom_config_module`` defaults to
  ``titan_ext.titan.config``);
* checks that need more than one section run before any process group is created
  (:func:`check_job_config`), each error names its key;
* titan_ext schedules take TorchTitan's stage split as it is (a PipelineScheduleMulti: two stages per
  rank by default, or ``module_fqns_per_model_part`` / ``pipeline_parallel_layers_per_stage``);
  what needs one stage per rank (delegation) or two (``[titan_ext] placement = "v"``) is checked;
* then TorchTitan's own ``main`` with :class:`titan_ext.titan.trainer.TitanExtTrainer` (seed
  checkpoints and local_tensor mode work as in ``torchtitan.train``). Pipeline metrics, timeline
  images and W&B extras come from the schedule (:mod:`titan_ext.titan.metrics`), also under stock
  ``torchtitan.train``.
"""

import os
import sys

CUSTOM_CONFIG_MODULE = "titan_ext.titan.config"

# the checks live in titan/ (the trainer runs them too); re-exported here, where users call them
from titan_ext.titan.jobcheck import (  # noqa: E402
    JobConfigError,
    check_ascii_numbers,
    check_config_file,
    check_job_config,
    check_launcher_env,
    config_file_arg,
    world_size,
)
from titan_ext.titan.entry import config_error_exit, parse_quietly  # noqa: E402


def _with_custom_config_module(args: list[str]) -> list[str]:
    """Add ``--job.custom_config_module titan_ext.titan.config`` unless the CLI or TOML sets one."""
    from torchtitan.config import ConfigManager

    toml_values = ConfigManager()._maybe_load_toml(args) or {}
    on_cli = any(a.split("=")[0] in ("--job.custom_config_module", "--job.custom-config-module")
                 for a in args)
    in_toml = isinstance(toml_values.get("job"), dict) and toml_values["job"].get(
        "custom_config_module")
    if on_cli or in_toml:
        return args
    return [*args, "--job.custom_config_module", CUSTOM_CONFIG_MODULE]


def _config_error(e: Exception) -> None:
    """One line from rank 0 (the others exit quietly: no process group exists yet), exit 2 everywhere."""
    config_error_exit(e)


def _check_toml_file(argv: list[str]) -> None:
    """The ``--job.config_file`` TOML is a regular, size-capped UTF-8 file that parses, with sections
    only at its top level (TorchTitan would log a traceback first, or read a FIFO forever):
    raises ValueError (TOMLDecodeError for a syntax error or a duplicate key)."""
    path = config_file_arg(argv)
    if path is not None:
        check_config_file(path)


def _parse_quietly(manager, argv: list[str]):
    """TorchTitan's parse, with the ``[titan_ext]`` checks left to :func:`check_job_config` and
    TorchTitan's warnings about paths that check reports held back (its own parse in ``main`` follows)."""
    return parse_quietly(manager, argv)


def main(args: list[str] | None = None) -> None:
    """``torchtitan.train.main(TitanExtTrainer)`` with the ``[titan_ext]`` section always available.

    The config is parsed and checked once first, so that a bad value, an unknown key or a malformed
    TOML prints one line and exits 2 (before any process group)."""
    from titan_ext import _flags

    _flags.DEFER_ENV_STRAGGLER = True  # checked below, installed once the process group exists
    import torchtitan.train
    from torchtitan.config import ConfigManager

    from titan_ext.titan import register
    from titan_ext.titan.trainer import TitanExtTrainer

    register()
    try:
        check_ascii_numbers(list(sys.argv[1:] if args is None else args))
        _check_toml_file(list(sys.argv[1:] if args is None else args))
        argv = _with_custom_config_module(list(sys.argv[1:] if args is None else args))
        check_job_config(_parse_quietly(ConfigManager(), argv), world_size=world_size())
        check_launcher_env()
    except ValueError as e:  # TitanExtConfigError, JobConfigError, TOMLDecodeError, unknown keys
        _config_error(e)
    sys.argv = [sys.argv[0], *argv]
    torchtitan.train.main(TitanExtTrainer)


if __name__ == "__main__":
    main()
