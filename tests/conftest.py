"""Shared pytest set-up.  The harness the tests and scripts share (test backends, ``run_ranks``,
``free_port``, the torchrun launcher, the small models) is the package :mod:`titan_ext.testing`; no test
file imports another test file.  What stays here, as helper modules of the test suite (underscore
names, never collected), and why:

* ``_titan_version.py`` -- the TorchTitan 0.2/0.3 markers (``tt02_only``), the bundled debug jobs'
  configs under either version, the Falcon DP 2 x PP 2 job launcher: it needs pytest and
  ``titan_ext.titan`` (the adapters), and ``titan_ext.testing`` sits below titan/ (it may import only
  runtime/ and plan/, tests/test_plan_imports.py);
* ``_fake_cuda.py`` -- a fake CUDA that monkeypatches ``torch.cuda`` in the pytest process: its module
  name must *not* start with ``titan_ext``, because the host-sync accounting (``runtime/host_syncs.py``)
  and the ``nccl_rules`` backend attribute calls and tensors to titan_ext code by module name, and the
  fake device must read as the hardware side, not as titan_ext code;
* ``_bindings.py`` -- the static checker of the ``_delegate_C`` bindings against their call sites: it
  reads ``cpp_ext/`` and the source tree of the checkout (not part of the installed package), one user
  (test_delegate_bindings.py; scripts/check_cuda_build.sh runs that test);
* ``_plan_cases.py`` -- plan-level cases several plan test files share (CrossPipe's reference profiles,
  random CrossPipe problems, validator-fuzz mutations): test data, pure plan/.
"""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where CUDA is present (CI has none)."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
