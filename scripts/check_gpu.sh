#!/usr/bin/env bash
# The GPU tier: what only a machine with a CUDA GPU can show (about 9 min on one H100, of which the
# runtime step at most 6: an estimate, this version of the runtime step has not run on a GPU yet).
#
#   bash scripts/check_gpu.sh [OUT_DIR]        # OUT_DIR: logs + JSON (default ./gpu_check)
#
# Needs: a CUDA GPU, nvcc, and a python (PYTHON, default python3) with a CUDA torch >= 2.11, numpy,
# setuptools and pytest -- what the GPU machines' image has (torch 2.11.0+cu130, Python 3.12): nothing is
# installed. Not part of README's two commands or of CI (neither has a GPU).
# Steps (each logged to OUT_DIR/<step>.log; a failing step does not stop the others):
#   env       the GPU, torch, nvcc, and the torch internals titan_ext.runtime needs (missing ones named)
#   build     titan_ext's extensions built in place WITH CUDA (TORCH_CUDA_ARCH_LIST default: this GPU's)
#   bindings  tests/runtime/test_delegate_bindings.py: the module was compiled with CUDA, its pybind11
#             signatures match the C++ source, every call site fits them (the d2h_signal class of bug)
#   gpu       every test marked `gpu` (tests/runtime/test_delegate_gpu.py, tests/runtime/test_gpu_runtime.py)
#   bench     scripts/bench_delegate.py's CUDA section: our D2H/H2D-with-signal copies vs cudaMemcpyAsync
#   runtime   scripts/gpu_tier.py: torch's 1F1B and ZBV, PipeMorph, CrossPipe and delegated PipeMorph on
#             CUDA stages, 2 and 4 ranks sharing the GPU (gloo: NCCL refuses two ranks on one device),
#             +0 / +60 ms on one link, every action a 50 ms kernel so the device is behind the host, no
#             synchronize in a step: host syncs per steady step by kind and site against the budget, the
#             host ahead at each boundary, GPU idle fraction from events, losses vs CPU (float64), peak
#             CUDA memory vs the planner's prediction, device time vs CUDA events
#   multi     scripts/gpu_tier_multi.py: PipeMorph over real NCCL, one process per GPU, one CUDA context per
#             GPU (nvidia-smi), host syncs per steady step; on fewer than 2 GPUs it says why it skips (rc 0)
# Then OUT_DIR/summary.json: every step's status and time, and the runtime, multi and bench JSON in one file.
# Exit status: the number of failed steps.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PY="${PYTHON:-python3}"
out="${1:-$root/gpu_check}"
mkdir -p "$out"
: >"$out/steps.tsv"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
failed=()

step() {  # step NAME CMD...: run, log, record
    local name=$1; shift
    echo "== $name: $*"
    local t0=$SECONDS
    "$@" >"$out/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$out/$name.log"
    echo "== $name: rc=$rc in $((SECONDS - t0)) s"
    echo "$name $rc $((SECONDS - t0))" >>"$out/steps.tsv"
    [ $rc -eq 0 ] || failed+=("$name")
}

env_report() {
    nvidia-smi -L
    nvcc --version | tail -2
    "$PY" - <<'EOF'
import torch
from titan_ext.runtime._torch_compat import TESTED, missing_internals
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), GPU: {torch.cuda.get_device_name(0)}, "
      f"capability {torch.cuda.get_device_capability(0)}")
print(f"titan_ext is tested on torch{TESTED}; internals missing here: {missing_internals() or 'none'}")
EOF
}

build() {
    if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
        TORCH_CUDA_ARCH_LIST="$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability(0))')"
        export TORCH_CUDA_ARCH_LIST
    fi
    unset TITAN_EXT_NO_CUDA
    MAX_JOBS="${MAX_JOBS:-8}" "$PY" setup.py build_ext --inplace &&
        "$PY" -c 'from titan_ext.runtime.comm.delegate._ext import load_ext; e = load_ext(); print("cuda_compiled:", e.cuda_compiled()); assert e.cuda_compiled()'
}

step env env_report
step build build
step bindings env TITAN_EXT_EXPECT_CUDA=1 "$PY" -m pytest -q -p no:cacheprovider tests/runtime/test_delegate_bindings.py
step gpu "$PY" -m pytest -v -p no:cacheprovider -m gpu --junitxml="$out/gpu_junit.xml" \
    tests/runtime/test_delegate_gpu.py tests/runtime/test_gpu_runtime.py
step bench "$PY" scripts/bench_delegate.py --quick --skip-p2p --skip-e2e --json "$out/bench_delegate_cuda.json"
step runtime "$PY" scripts/gpu_tier.py --steps "${GPU_TIER_STEPS:-6}" --json "$out/gpu_tier.json"
step multi "$PY" scripts/gpu_tier_multi.py --json "$out/gpu_tier_multi.json"

"$PY" - "$out" "${failed[*]:-}" <<'EOF'
import json, os, subprocess, sys
out, failed = sys.argv[1], sys.argv[2].split()
summary = {"failed_steps": failed, "steps": {}}
for line in open(os.path.join(out, "steps.tsv")):
    name, rc, seconds = line.split()
    log = os.path.join(out, f"{name}.log")
    summary["steps"][name] = {"rc": int(rc), "seconds": int(seconds),
                              "log_tail": open(log).read()[-1500:] if os.path.exists(log) else None}
for key, file in (("runtime", "gpu_tier.json"), ("runtime_multi", "gpu_tier_multi.json"),
                  ("delegate_copies", "bench_delegate_cuda.json")):
    path = os.path.join(out, file)
    summary[key] = json.load(open(path)) if os.path.exists(path) else None
summary["nvidia_smi"] = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip()
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
print("summary:", os.path.join(out, "summary.json"))
EOF

echo "failed steps: ${failed[*]:-none}"
exit ${#failed[@]}
