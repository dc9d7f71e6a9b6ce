"""titan_ext: straggler-resilient pipeline-parallel schedules for TorchTitan.

Importing this package is cheap on purpose (no torch import): ``titan_ext.plan`` is used by
CLIs and tests that must start in milliseconds.

TorchTitan integration: with ``[experimental] custom_import = "titan_ext"`` TorchTitan's trainer
imports this package after it has imported torchtitan itself. In that case (torchtitan already in
``sys.modules``) the import registers our pipeline schedules ("PipeMorph", later "CrossPipe"), our
tiny local dataset, and -- on machines without an accelerator -- the CPU/gloo shim. Imported
before torchtitan, it registers as soon as TorchTitan's pipeline builder is imported
(:mod:`titan_ext._import_hook`), so the order does not matter. ``titan_ext.titan.register()`` does
the same explicitly.
"""

import sys as _sys

__version__ = "0.1.0"

# Set by ``titan_ext.train`` before anything imports ``titan_ext.runtime``: TITAN_EXT_INJECT_DELAYS is then
# checked against the job (one line, exit 2) and installed once the process group exists, instead of at
# that import (where a malformed value was a traceback and a link beyond the pipeline was announced).
DEFER_ENV_STRAGGLER = False

if "torchtitan" in _sys.modules:  # imported through TorchTitan's custom_import: torch is loaded
    from titan_ext.titan.registry import register as _register

    _register()
else:  # torchtitan not loaded yet: register once its pipeline builder is imported
    from titan_ext._import_hook import install as _install

    _install()
