#!/usr/bin/env bash
# Idempotent setup: a local virtual environment in .venv with titan_ext installed (editable), its
# test extra and every optional one (all: solver, wandb, plot; the tests use them), and a CPU-only
# torch 2.13 unless a CUDA torch is already present.
# Re-running is cheap: nothing is reinstalled unless pyproject.toml, this script or the C sources
# changed.
#
# Quiet by default: one progress line per step; pip's output goes to .venv/setup.log, whose path and
# last lines are printed when a step fails. VERBOSE=1 shows everything.
# Environment: PYTHON (python3), TORCH_CPU_INDEX (the PyTorch CPU wheel index; "" = do not try it),
# TORCHTITAN (the TorchTitan version to install: 0.2.2 by default; 0.3.0 installs over torch 2.14.1),
# TORCH_VERSION (the torch installed when the environment has none: 2.13.0, or 2.14.1 with TorchTitan 0.3).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PY="${PYTHON:-python3}"
venv="$root/.venv"
TORCHTITAN_VERSION="${TORCHTITAN:-0.2.2}"  # TORCHTITAN=0.3.0 for the Python-config TorchTitan (default: 0.2.2, TOML)
case "$TORCHTITAN_VERSION" in  # inside pyproject.toml's pinned range; TorchTitan 0.3 is built on torch 2.14
    0.3*) TORCH_VERSION="${TORCH_VERSION:-2.14.1}" ;;
    *) TORCH_VERSION="${TORCH_VERSION:-2.13.0}" ;;
esac
TORCH_CPU_INDEX="${TORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}"

say() { echo "[setup] $*"; }
log="$venv/setup.log"
step() {  # step "what" cmd...: run quietly (VERBOSE=1: loudly), name the log on failure
    local what="$1"; shift
    say "$what"
    if [ "${VERBOSE:-0}" = 1 ]; then
        "$@" 2>&1 | tee -a "$log"; local rc=${PIPESTATUS[0]}
    else
        local rc=0; "$@" >>"$log" 2>&1 || rc=$?
    fi
    if [ "$rc" != 0 ]; then
        echo "[setup] FAILED: $what (exit $rc); details in $log; its last lines:" >&2
        tail -n 15 "$log" >&2
        exit 1
    fi
}

if [ ! -x "$venv/bin/python" ]; then
    if "$PY" -c 'import torch,sys; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
        say "found a CUDA torch in $PY: the venv will see it (--system-site-packages)"
        "$PY" -m venv --system-site-packages "$venv"
    else
        "$PY" -m venv "$venv"
    fi
fi
vpy="$venv/bin/python"
stamp="$venv/.titan_ext_stamp"
# The stamp covers the C++/CUDA data plane too (setup.py, cpp_ext/): editing them rebuilds it.
want="$(echo "torchtitan=$TORCHTITAN_VERSION"; cat pyproject.toml scripts/setup.sh setup.py cpp_ext/*.cpp cpp_ext/*.cu cpp_ext/*.h titan_ext/plan/*.c 2>/dev/null \
        | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
        && "$vpy" -c "import torch, titan_ext._delegate_C, titan_ext.plan._search_c, titan_ext.plan._greedy_c, titan_ext.plan._pipemorph_c" 2>/dev/null; then
    exit 0
fi
: > "$log"
step "upgrading pip" "$vpy" -m pip install --upgrade pip
if ! "$vpy" -c 'import torch' 2>/dev/null; then
    # A plain `torch` requirement would pull the multi-GB CUDA build on Linux: take the CPU wheel from
    # PyTorch's CPU index where it answers, else `torch==2.13.0` from the configured indexes (on our
    # machines that is the CPU wheel kept on disk).
    if [ -n "$TORCH_CPU_INDEX" ] && "$vpy" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10)" \
            "$TORCH_CPU_INDEX/torch/" >>"$log" 2>&1; then
        step "installing torch $TORCH_VERSION (CPU wheel from $TORCH_CPU_INDEX)" \
            "$vpy" -m pip install --extra-index-url "$TORCH_CPU_INDEX" "torch==$TORCH_VERSION+cpu"
    else
        step "installing torch==$TORCH_VERSION (PyTorch's CPU index not reachable)" \
            "$vpy" -m pip install "torch==$TORCH_VERSION"
    fi
fi
# --no-build-isolation: setup.py compiles titan_ext._delegate_C (cpp_ext/) against the torch installed
# above (CPU parts always; CUDA parts when nvcc and a CUDA torch are present). An isolated build env
# would download a second, multi-GB CUDA torch.
step "installing build tools" "$vpy" -m pip install "setuptools>=68"
step "installing titan_ext and its dependencies; building its C/C++ extensions (minutes the first time)" \
    "$vpy" -m pip install --no-build-isolation -e ".[test,all]" "torchtitan==$TORCHTITAN_VERSION"
for mod in titan_ext._delegate_C titan_ext.plan._search_c titan_ext.plan._greedy_c titan_ext.plan._pipemorph_c; do
    step "checking $mod" "$vpy" -c "import torch, $mod"
done
echo "$want" > "$stamp"
say "environment ready in $venv"
