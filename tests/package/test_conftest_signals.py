"""The suite's own guard (tests/conftest.py): a test that leaves SIGINT/SIGTERM's handlers, their kernel
actions or the blocked-signal mask changed fails, naming what changed, and the next test starts clean."""

import signal
from pathlib import Path

pytest_plugins = ["pytester"]

LEAKS = '''
import ctypes, signal

def test_ignores_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)

def test_clean_after_the_leak():
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

def test_blocks_sigterm():
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])

def test_kernel_action_behind_pythons_back():
    # what OR-Tools' solver did: the kernel's SIGINT action reset, Python's handler still reported
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal(signal.SIGINT, ctypes.c_void_p(0))  # SIG_DFL

def test_changes_and_puts_back():
    old = signal.signal(signal.SIGTERM, lambda *a: None)
    signal.signal(signal.SIGTERM, old)
'''


def test_a_test_leaving_signal_handling_changed_fails(pytester):
    pytester.makeconftest((Path(__file__).parents[1] / "conftest.py").read_text())
    pytester.makepyfile(test_leaks=LEAKS)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), signal.pthread_sigmask(signal.SIG_BLOCK, [])
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=5, errors=3)
    text = result.stdout.str()
    assert "test_ignores_sigint left the process's signal handling changed: python handler of SIGINT" in text
    assert "kernel action of SIGINT: 'caught' -> 'ignored'" in text
    assert "test_blocks_sigterm left the process's signal handling changed: blocked mask" in text
    assert "test_kernel_action_behind_pythons_back left the process's signal handling changed: " \
           "kernel action of SIGINT: 'caught' -> 'default'" in text
    after = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert after == before  # put back each time
