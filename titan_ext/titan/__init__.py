"""TorchTitan + W&B integration of titan_ext.

``register()`` makes our schedule names, the ``titan_ext_tiny`` dataset and the CPU/gloo shim known to
stock TorchTitan 0.2.2 (see :mod:`titan_ext.titan.registry`). The ``[titan_ext]`` config section
lives in :mod:`titan_ext.titan.config`; the trainer entry point is ``python -m titan_ext.train``.
"""


def register(cpu_shim=None):
    from titan_ext.titan.registry import register as _register

    _register(cpu_shim=cpu_shim)


__all__ = ["register"]
