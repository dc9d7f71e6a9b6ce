"""Shared pytest set-up.  The harness the tests and scripts share (test backends, ``run_ranks``,
``free_port``, the torchrun launcher, the small models) is the package :mod:`titan_ext.testing`; no test
file imports another test file.  What stays here, as helper modules of the test suite (underscore
names, never collected), and why:

* ``_titan_version.py`` -- the TorchTitan 0.2/0.3 markers (``tt02_only``), the bundled debug jobs'
  configs under either version, the Falcon DP 2 x PP 2 job launcher: it needs pytest and
  ``titan_ext.titan`` (the adapters), and ``titan_ext.testing`` sits below titan/ (it may import only
  runtime/ and plan/, tests/plan/test_plan_imports.py);
* ``_fake_cuda.py`` -- a fake CUDA that monkeypatches ``torch.cuda`` in the pytest process: its module
  name must *not* start with ``titan_ext``, because the host-sync accounting (``testing/host_syncs.py``)
  and the ``nccl_rules`` backend attribute calls and tensors to titan_ext code by module name, and the
  fake device must read as the hardware side, not as titan_ext code;
* ``_bindings.py`` -- the static checker of the ``_delegate_C`` bindings against their call sites: it
  reads ``cpp_ext/`` and the source tree of the checkout (not part of the installed package), one user
  (test_delegate_bindings.py; scripts/check_cuda_build.sh runs that test);
* ``_plan_cases.py`` -- plan-level cases several plan test files share (CrossPipe's reference profiles,
  random CrossPipe problems, validator-fuzz mutations): test data, pure plan/;
* ``_falcon_model.py``, ``_falcon_s4_job.py``, ``_falcon_trainer.py`` -- what several Falcon test files
  share (the host model of ``FalconJob.apply``, the S4 job, ``FalconJob`` on a stand-in TorchTitan
  trainer): they model titan/'s Falcon job, which ``titan_ext.testing`` may not import;
* ``_allocations.py`` -- the bytes of every storage an operation creates (a dispatch mode): the bound
  two Falcon test files put on what a measurement or an exchange allocates.

Every test must leave the pytest process's signal handling as it found it (the Python API's promise to
its callers): :func:`signal_handling_kept` compares, before and after each test, the Python handlers of
SIGINT and SIGTERM, the kernel's disposition of those signals (caught / ignored / default, from
``/proc/self/status``: native code can change it behind Python's back) and the main thread's blocked
mask; a test that changes any of them fails, naming what changed, and the state is put back so that the
next tests run as usual. ``TITAN_EXT_SIGNAL_CHECK=0`` turns the check off.

A pytest started as a background job of a non-interactive shell (``pytest ... &``, ``nohup ... &``, how
harnesses start CI) inherits SIGINT *ignored* (POSIX: such a shell starts asynchronous commands with
SIGINT and SIGQUIT ignored, and Python keeps an ignored SIGINT), and a blocked signal stays blocked
across ``exec``: the processes the tests start would inherit that too, and a test that ignores SIGINT
would go unseen. :func:`pytest_configure` therefore starts the session with SIGINT at Python's default
handler and SIGINT/SIGTERM unblocked, and the report header says what was inherited.
"""

import os
import signal
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the repository (titan_ext) and tests/ (the helper modules ``_titan_version``, ``_fake_cuda`` … that the
#: tests in tests/<layer>/ import by name)
for _path in (ROOT, os.path.dirname(os.path.abspath(__file__))):
    if _path not in sys.path:
        sys.path.insert(0, _path)


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where CUDA is present (CI has none). A ``soak`` test is a ``slow`` one that CI
    does not run: without ``slow`` it would fall into the default tier, so that is a usage error."""
    unmarked = [item.nodeid for item in items if "soak" in item.keywords and "slow" not in item.keywords]
    if unmarked:
        raise pytest.UsageError(f"marked soak but not slow: {unmarked}")
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


_KEPT = tuple(s for s in (getattr(signal, "SIGINT", None), getattr(signal, "SIGTERM", None)) if s is not None)


def _kernel_disposition() -> dict[str, int] | None:
    """The kernel's view of this thread's signals (``/proc/thread-self/status``: SigBlk, SigIgn, SigCgt
    bit masks), None where there is no procfs."""
    for path in ("/proc/thread-self/status", "/proc/self/status"):
        try:
            with open(path) as f:
                return {k: int(v, 16) for k, _, v in (line.partition(":\t") for line in f)
                        if k in ("SigBlk", "SigIgn", "SigCgt")}
        except (OSError, ValueError):
            continue
    return None


def _signal_state() -> dict:
    state: dict = {f"python handler of {signal.Signals(sig).name}": signal.getsignal(sig) for sig in _KEPT}
    if hasattr(signal, "pthread_sigmask"):
        state["blocked mask"] = frozenset(signal.pthread_sigmask(signal.SIG_BLOCK, []))
    kernel = _kernel_disposition()
    if kernel is not None:
        for sig in _KEPT:
            bit = 1 << (sig - 1)
            what = "ignored" if kernel["SigIgn"] & bit else "caught" if kernel["SigCgt"] & bit else "default"
            state[f"kernel action of {signal.Signals(sig).name}"] = what
    return state


def _restore(before: dict) -> None:
    for sig in _KEPT:
        handler = before[f"python handler of {signal.Signals(sig).name}"]
        if handler is not None:  # signal.signal also sets the kernel's action again
            signal.signal(sig, handler)
    if "blocked mask" in before:
        signal.pthread_sigmask(signal.SIG_SETMASK, before["blocked mask"])


@pytest.fixture(autouse=True)
def signal_handling_kept(request):
    """Fails a test that leaves the SIGINT/SIGTERM handlers, their kernel actions or the blocked-signal mask
    changed (and puts them back)."""
    import threading

    if os.environ.get("TITAN_EXT_SIGNAL_CHECK") == "0" or threading.current_thread() is not threading.main_thread():
        yield
        return
    before = _signal_state()
    yield
    after = _signal_state()
    changed = [f"{k}: {before[k]!r} -> {after.get(k)!r}" for k in before if after.get(k) != before[k]]
    if changed:
        _restore(before)
        pytest.fail(f"{request.node.nodeid} left the process's signal handling changed: " + "; ".join(changed),
                    pytrace=False)


#: processes started by the running test (its setup included): ``multiprocessing`` starts (``run_ranks``,
#: torch's spawn) and ``subprocess`` children (the CLI, torchrun, launch scripts)
_STARTS: list[str] = []


def _watch_process_starts() -> None:
    """Note every process the pytest process starts, for :func:`pytest_runtest_makereport`."""
    import subprocess
    from multiprocessing.process import BaseProcess

    if getattr(subprocess.Popen, "_titan_ext_watched", False):
        return
    execute_child, start = subprocess.Popen._execute_child, BaseProcess.start

    def _execute_child(self, args, *rest, **kwargs):
        _STARTS.append(f"subprocess {args if isinstance(args, (str, bytes)) else ' '.join(map(str, args))}"[:160])
        return execute_child(self, args, *rest, **kwargs)

    def _start(self):
        _STARTS.append(f"process {self.name}")
        return start(self)

    subprocess.Popen._execute_child, BaseProcess.start = _execute_child, _start
    subprocess.Popen._titan_ext_watched = True


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _STARTS.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """The ``multiprocess`` marker's rule: a test outside the ``slow`` tier that starts a process (in its
    setup or its body) must carry it (so must the tests sharing a module fixture that does), so that ``-m "not slow and not multiprocess"`` selects the
    single-process tests. ``TITAN_EXT_PROCESS_CHECK=1`` (set by scripts/test.sh, README's test command)
    fails an unmarked one, naming what it started; ``=report:PATH`` appends their ids to PATH instead."""
    outcome = yield
    report = outcome.get_result()
    mode = os.environ.get("TITAN_EXT_PROCESS_CHECK", "")
    if call.when != "call" or not mode or not _STARTS:
        return
    if "multiprocess" in item.keywords or "slow" in item.keywords:
        return
    if mode.startswith("report:"):
        with open(mode[len("report:"):], "a") as f:
            f.write(item.nodeid + "\n")
        return
    if report.failed:
        return
    report.outcome = "failed"
    report.longrepr = (f"{item.nodeid} started {len(_STARTS)} process(es) ({_STARTS[0]}) but is not marked "
                       "`multiprocess` (pytest.mark.multiprocess; or `slow`): tests/conftest.py")


_INHERITED: list[str] = []


def pytest_configure(config):
    """SIGINT at Python's default handler and SIGINT/SIGTERM unblocked for the session, whatever the
    launcher left (see the module docstring); what was changed is shown in the report header. Process
    starts are watched (the ``multiprocess`` marker's check)."""
    import threading

    _watch_process_starts()

    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _INHERITED.append("SIGINT ignored")
    if hasattr(signal, "pthread_sigmask"):
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, []) & set(_KEPT)
        if blocked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)
            _INHERITED.append("blocked " + ", ".join(sorted(signal.Signals(s).name for s in blocked)))


def pytest_report_header(config):
    if _INHERITED:
        return [f"signals: inherited {'; '.join(_INHERITED)} from the launcher: reset for this session"]
    return []


@pytest.fixture
def cli_main():
    """``titan-ext ARGS`` in this process: ``titan_ext.cli.main`` with stdout and stderr captured, returned
    as a ``subprocess.CompletedProcess`` (``returncode`` from ``main``'s status, or from ``SystemExit`` as
    ``--help`` raises it).  For tests of what a command computes or says: a new interpreter costs seconds
    (torch's import) each time on a busy 2-core host.  Each entry point keeps tests through a real process
    (``python -m titan_ext.cli``: exit codes, signals, one line on stderr), e.g. tests/plan/test_plan_export_cli.py."""
    import contextlib
    import io
    import subprocess

    from titan_ext.cli import main

    def run(*args: str) -> subprocess.CompletedProcess:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        return subprocess.CompletedProcess(["titan-ext", *args], code, out.getvalue(), err.getvalue())

    return run
