#!/usr/bin/env bash
# Idempotent setup: a local virtual environment in .venv with titan_ext installed (editable),
# its test and solver extras, and the torch 2.13.0 CPU wheel unless a CUDA torch is already present.
# Re-running is cheap: nothing is reinstalled unless pyproject.toml changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PY="${PYTHON:-python3}"
venv="$root/.venv"
if [ ! -x "$venv/bin/python" ]; then
    if "$PY" -c 'import torch,sys; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
        echo "[setup] found a CUDA torch in $PY: the venv will see it (--system-site-packages)"
        "$PY" -m venv --system-site-packages "$venv"
    else
        "$PY" -m venv "$venv"
    fi
fi
vpy="$venv/bin/python"
stamp="$venv/.titan_ext_stamp"
# The stamp covers the C++/CUDA data plane too (setup.py, cpp_ext/): editing them rebuilds it.
want="$(cat pyproject.toml scripts/setup.sh setup.py cpp_ext/*.cpp cpp_ext/*.cu cpp_ext/*.h titan_ext/plan/*.c 2>/dev/null \
        | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
        && "$vpy" -c "import torch, titan_ext._delegate_C, titan_ext.plan._search_c, titan_ext.plan._greedy_c" 2>/dev/null; then
    exit 0
fi
"$vpy" -m pip install -q --upgrade pip
if ! "$vpy" -c 'import torch' 2>/dev/null; then
    # The CPU wheel (on disk on our machines); a plain `torch` requirement would pull a CUDA build.
    "$vpy" -m pip install -q torch==2.13.0
fi
# torchtitan 0.2.2 imports triton at import time, also on CPU machines.
"$vpy" -m pip install -q triton
# --no-build-isolation: setup.py compiles titan_ext._delegate_C (cpp_ext/) against the torch installed
# above (CPU parts always; CUDA parts when nvcc and a CUDA torch are present). An isolated build env
# would download a second, multi-GB CUDA torch.
"$vpy" -m pip install -q "setuptools>=68"
"$vpy" -m pip install -q --no-build-isolation -e ".[test,solver]"
"$vpy" -c "import torch, titan_ext._delegate_C" || { echo "[setup] titan_ext._delegate_C failed to build" >&2; exit 1; }
"$vpy" -c "import titan_ext.plan._search_c" || { echo "[setup] titan_ext.plan._search_c failed to build" >&2; exit 1; }
"$vpy" -c "import titan_ext.plan._greedy_c" || { echo "[setup] titan_ext.plan._greedy_c failed to build" >&2; exit 1; }
echo "$want" > "$stamp"
echo "[setup] environment ready in $venv"
