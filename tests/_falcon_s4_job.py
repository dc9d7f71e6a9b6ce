"""The DP 2 x PP 2 Falcon S4 job the S4 tests share (tests/falcon/test_falcon_s4.py, tests/falcon/test_falcon_spares.py):
its fault, steps, arguments and environment, and the JSONL reader of its dump folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

from titan_ext.testing.cpu_setup import job_env

SLOW_FROM, SLOW_FACTOR, STEPS, PASS_MS = 5, 24, 40, 15
"""Dedicated-device emulation (every forward 15 ms, backward 30 ms) and device 3 24x slower from
step 5: a chunk takes ~0.14 s on healthy devices and ~2.2 s on device 3's replica, so after S2
([5, 1]: that replica still runs one chunk) a step takes ~2.3 s against a healthy ~0.5 s, and S4
pays (replica 0 alone: 6 chunks, ~0.9 s a step; the gate of ``runtime.falcon.apply.s4_pays``). The
accumulated impact reaches S4's measured cost (start-up + checkpoint, ~15-30 s on the loaded
host) well before step 40."""
_COMMON = ["--training.local_batch_size", "2", "--training.global_batch_size", "12",
           "--training.seq_len", "32", "--titan_ext.no-adaptive"]
"""A fixed pipeline plan: the reference and the restarted job then run the same operations in the
same order, so their losses must be equal bit for bit."""


def _env() -> dict:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "GLOO_SOCKET_IFNAME": "lo",
                "PYTHONWARNINGS": "ignore"})
    for var in ("TITAN_EXT_INJECT_DELAYS", "TITAN_EXT_SLOW_DEVICE", "TITAN_EXT_SLOW_LINK",
                "TITAN_EXT_S4_PLAN"):
        env.pop(var, None)
    return job_env(env)  # the CPU shim's test set-up (TITAN_EXT_TEST_BACKEND) in the launcher's jobs too


def _rows(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
