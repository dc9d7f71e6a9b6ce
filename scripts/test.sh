#!/usr/bin/env bash
# README's second command: set up (idempotent) and run the whole test suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/test_plan_paper.py -x`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -ra "$@"
