"""titan_ext: straggler-resilient pipeline-parallel schedules for TorchTitan.

Importing this package is cheap on purpose (no torch import): ``titan_ext.plan`` is used by
CLIs and tests that must start in milliseconds.

TorchTitan integration: with ``[experimental] custom_import = "titan_ext"`` TorchTitan's trainer
imports this package after it has imported torchtitan itself. In that case (torchtitan already in
``sys.modules``) the import registers our pipeline schedules ("PipeMorph", later "CrossPipe"), our
tiny local dataset, and -- on machines without an accelerator -- the CPU/gloo shim. Imported
before torchtitan, it registers as soon as TorchTitan's pipeline builder is imported
(:mod:`titan_ext._import_hook`), so the order does not matter. ``titan_ext.titan.register()`` does
the same explicitly. Under TorchTitan's own entry point (``python -m torchtitan.train``) the import
also runs ``titan_ext.train``'s config checks (:func:`titan_ext.titan.entry.check_stock_entry`).
"""

import sys as _sys

__version__ = "0.1.0"

if "torchtitan" in _sys.modules:  # imported through TorchTitan's custom_import: torch is loaded
    from titan_ext.titan.registry import register as _register

    _register()
    # under TorchTitan's own `python -m torchtitan.train` (this import comes from its config parsing:
    # 0.2's custom_config_module, 0.3's --module titan_ext.titan, or 0.2's custom_import): the command
    # line gets titan_ext.train's checks, a bad value is one line and exit 2 (titan_ext/titan/entry.py)
    from titan_ext.titan.entry import check_stock_entry as _check_stock_entry

    _check_stock_entry()
else:  # torchtitan not loaded yet: register once its pipeline builder is imported
    from titan_ext._import_hook import install as _install

    _install()
