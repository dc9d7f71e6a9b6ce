#!/usr/bin/env bash
# README's second command: set up (idempotent) and run the test suite.
#   bash scripts/test.sh                 # the default tier: every test not marked `slow` (<= 8 min on 2 cores)
#   TIER=slow bash scripts/test.sh       # the `slow` tier: long multi-process runs (CI runs it after the default tier)
#   TIER=soak bash scripts/test.sh       # the slow tests also marked `soak`: what CI's 90 minutes cannot hold
#                                        # (run it before landing a change to what they cover)
#   TIER=all bash scripts/test.sh        # all three
# Extra arguments go to pytest; with arguments the default tier is `all`
# (e.g. `bash scripts/test.sh tests/plan/test_plan_paper.py -x`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
tier="${TIER:-$([ $# -gt 0 ] && echo all || echo default)}"
case "$tier" in
    default) select=(-m "not slow") ;;
    slow) select=(-m "slow and not soak") ;;
    soak) select=(-m soak) ;;
    all) select=() ;;
    *) echo "scripts/test.sh: TIER=$tier: use default, slow, soak or all" >&2; exit 2 ;;
esac
# a default-tier test that starts a process must be marked `multiprocess` (tests/conftest.py)
export TITAN_EXT_PROCESS_CHECK="${TITAN_EXT_PROCESS_CHECK:-1}"
exec .venv/bin/python -m pytest -q -ra "${select[@]}" "$@"
