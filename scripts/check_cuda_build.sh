#!/usr/bin/env bash
# The CUDA build of titan_ext._delegate_C, checked without a GPU.
#
#   scripts/check_cuda_build.sh [PYTHON]
#
# PYTHON: an interpreter with a CUDA torch (torch.version.cuda set) and setuptools + pytest. Default:
# .venvs/torch-2.14.1 at the repository root, created on first use with `pip install torch==2.14.1`
# (a CUDA build) plus setuptools, wheel, numpy and pytest.
#
# Builds the extension WITH CUDA (nvcc from CUDA_HOME, else the nvcc on PATH, else /usr/local/cuda;
# TORCH_CUDA_ARCH_LIST defaults to setup.py's "8.0;9.0;10.0+PTX" since no GPU is there to ask) into a temporary build
# directory — the working tree's own .so files are not touched — then runs
# tests/runtime/test_delegate_bindings.py against that module: the module must have been compiled with CUDA,
# its pybind11 signatures must match the C++ source, and every call site in titan_ext/ must fit them.
# Exit status: 0 when the build and the check pass.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
say() { echo "[check_cuda_build] $*"; }

PY="${1:-}"
if [ -z "$PY" ]; then
    venv="$root/.venvs/torch-2.14.1"
    if [ ! -x "$venv/bin/python" ]; then
        say "creating $venv (torch==2.14.1, a CUDA build)"
        python3 -m venv "$venv"
        "$venv/bin/pip" install -q torch==2.14.1 setuptools wheel numpy pytest
    fi
    PY="$venv/bin/python"
fi
"$PY" - <<'EOF'
import sys
import torch
if not torch.version.cuda:
    sys.exit(f"[check_cuda_build] {sys.executable}: torch {torch.__version__} is not a CUDA build")
print(f"[check_cuda_build] torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"GPU present: {torch.cuda.is_available()}")
EOF

if [ -z "${CUDA_HOME:-}" ]; then  # the toolkit of the nvcc on PATH (not a wrapper's dir), else /usr/local/cuda
    CUDA_HOME=/usr/local/cuda
    if command -v nvcc >/dev/null; then
        d="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"
        [ -f "$d/include/cuda_runtime_api.h" ] && CUDA_HOME="$d"
    fi
fi
[ -x "$CUDA_HOME/bin/nvcc" ] && [ -f "$CUDA_HOME/include/cuda_runtime_api.h" ] || {
    say "no CUDA toolkit at $CUDA_HOME (bin/nvcc, include/cuda_runtime_api.h): set CUDA_HOME"; exit 1; }
export CUDA_HOME PATH="$CUDA_HOME/bin:$PATH"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0;9.0;10.0+PTX}"
unset TITAN_EXT_NO_CUDA
say "nvcc: $("$CUDA_HOME/bin/nvcc" --version | tail -1); TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"

tmp="$(mktemp -d "${TMPDIR:-/tmp}/titan_ext_cuda_build.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
log="$tmp/build.log"
say "building into $tmp"
if ! MAX_JOBS="${MAX_JOBS:-2}" "$PY" setup.py build_ext --build-lib "$tmp/lib" --build-temp "$tmp/temp" >"$log" 2>&1; then
    grep -n -m 20 -E "error|Error" "$log" >&2 || true
    tail -n 15 "$log" >&2
    say "FAILED: the CUDA build (its errors and last lines above)"
    exit 1
fi
grep -F "[titan_ext] building titan_ext._delegate_C" "$log" | sed 's/^/[check_cuda_build] /'
so="$(ls "$tmp"/lib/titan_ext/_delegate_C*.so)"
say "built $(basename "$so"); checking its bindings against the call sites"
TITAN_EXT_DELEGATE_C="$so" TITAN_EXT_EXPECT_CUDA=1 PYTHONPATH="$root" \
    "$PY" -m pytest -q -p no:cacheprovider tests/runtime/test_delegate_bindings.py
