"""The loop runtime/execute/executor.py mirrors, diffed against a stored copy per torch version.

``titan_ext.runtime.execute.executor`` re-implements torch's ``_PipelineScheduleRuntime._step_microbatches``
(with timing, transports and free microbatch order). Each torch release may change that loop (2.15
added send waits, start/wait gradient reduction and ``finalize_gradients``); this test finds such a
change in the installed torch instead of a user finding it. When it fails: read the diff, port the
change to executor.py, then store the new loop with
``python tests/runtime/test_torch_loops.py`` (writes tests/torch_loops/torch-<major.minor>.py.txt).
"""

import difflib
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1]  # tests/
LOOPS = HERE / "torch_loops"


def _stored(version: tuple[int, int]) -> Path:
    return LOOPS / f"torch-{version[0]}.{version[1]}.py.txt"


def test_every_tracked_torch_has_a_stored_loop_named_in_the_executor():
    from titan_ext.runtime.execute import executor
    from titan_ext.runtime._torch_compat import TRACKED

    for version in TRACKED:
        assert _stored(version).is_file(), f"no stored loop for torch {version}"
        assert f"**{version[0]}.{version[1]}**" in executor.__doc__, f"executor.py does not name torch {version}"


def test_installed_torch_loop_equals_the_stored_copy():
    from titan_ext.runtime._torch_compat import TRACKED, mirrored_loop, torch_version

    version = torch_version()
    if version not in TRACKED:
        pytest.fail(f"torch {version} is not tracked by runtime/execute/executor.py (tracked: {TRACKED})")
    stored = _stored(version).read_text()
    current = mirrored_loop()
    diff = "".join(difflib.unified_diff(stored.splitlines(True), current.splitlines(True),
                                        f"stored torch {version}", "installed torch"))
    assert current == stored, f"torch's _step_microbatches changed; port it to executor.py:\n{diff}"


def test_the_2_15_loop_differs_from_2_13_where_the_executor_says():
    """The stored copies themselves: 2.15's loop has the waits and finalize_gradients, 2.13's has not."""
    old, new = _stored((2, 13)).read_text(), _stored((2, 15)).read_text()
    for name in ("WAIT_SEND_F", "WAIT_REDUCE_GRAD", "release_fwd_send_outputs", "_finalize_gradients",
                 "start_gradient_reduction"):
        assert name in new and name not in old, name


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    from titan_ext.runtime._torch_compat import mirrored_loop, torch_version

    LOOPS.mkdir(exist_ok=True)
    path = _stored(torch_version())
    path.write_text(mirrored_loop())
    print(f"wrote {path}")
