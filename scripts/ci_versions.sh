#!/usr/bin/env bash
# The version matrix beside the default environment (torch 2.13 CPU + TorchTitan 0.2.2, scripts/test.sh):
#   bash scripts/ci_versions.sh torch-2.11       # torch 2.11.0 (the GPU machines' image): plan + runtime default tier
#   bash scripts/ci_versions.sh torch-2.15       # torch 2.15.0 + TorchTitan 0.2.2: plan + runtime default tier
#   bash scripts/ci_versions.sh torchtitan-0.3   # TorchTitan 0.3.0 over torch 2.14.1: every titan test + Falcon's
#                                                # job tests (+ its DP x PP runs) + 3 PipeMorph steps
#   bash scripts/ci_versions.sh all              # all three (what .ci/run calls after the default tier)
# Each environment lives in .venvs/<name> (git-ignored) with its own copy of the sources in
# .venvs/<name>/src, whose C/C++ extensions are built against that environment's torch, so the default
# .venv's in-place build is never touched. Re-running reuses both (a stamp of the install list).
# An environment that cannot be made (no disk room for the torch wheels, ~3-6 GB; pip cannot get them)
# is reported as SKIPPED with the reason and makes the exit status non-zero: CI cannot pass by skipping.
# Disk: CI machines have had as little as 8 GB free. pip keeps no cache here (PIP_NO_CACHE_DIR), torch
# is installed without its dependencies and then each dependency by its own pip call (so at most one
# wheel lies unpacked beside the environment), and with CI_VERSIONS_PRUNE=1 (.ci/run) an environment is
# deleted once its tier has run, except torchtitan-0.3, which the CUDA build check uses after it. The
# room asked for (make_env's NEED_MB) is each environment's peak measured on 2026-11-28 (torch-2.11
# 5.2 GB, torch-2.15 6.1 GB, torchtitan-0.3 6.2 GB) plus a margin of 0.7 GB (0.9 GB for torchtitan-0.3,
# whose environment the CUDA build check builds in later); the sources and their build take 0.05 GB.
# Environment: TORCH215_INDEX (PyTorch's CPU wheel index, tried first for torch 2.15; "" = skip it).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PY="${PYTHON:-python3}"
TORCH215_INDEX="${TORCH215_INDEX-https://download.pytorch.org/whl/cpu}"
# what every environment needs besides torch and torchtitan (TorchTitan's and our own dependencies)
COMMON=(numpy pytest pytest-timeout packaging tomli matplotlib ortools wandb torchdata tokenizers tyro
        tensorboard einops pillow safetensors setuptools)
say() { echo "[ci-versions] +${SECONDS}s $*"; }  # the seconds since the start: where the time goes
export PIP_NO_CACHE_DIR=1
PRUNE="${CI_VERSIONS_PRUNE:-0}"

room_mb() { df -Pk "$root" | awk 'NR==2 {print int($4 / 1024)}'; }

sources_to() {  # copy the tracked + untracked (not ignored) files into $1, as CI's checkout has them
    mkdir -p "$1"
    git ls-files -co --exclude-standard -z | tar --null -cf - -T - | tar -xf - -C "$1"
}

pip_env() {  # pip_env ENV ARGS...: the machine's pip configuration minus its torch cap
    local env="$1"; shift
    PIP_CONSTRAINT="$root/.venvs/$env/constraints.txt" "$root/.venvs/$env/bin/python" -m pip install -q "$@"
}

torch_pip() {  # torch_pip ENV ARGS...: pip install for torch itself: the machine's configuration (its cap
    # replaced by the environment's pin), else PyTorch's CPU index, else PyPI, both without the cap
    local env="$1" dir="$root/.venvs/$1"; shift
    pip_env "$env" "$@" && return 0
    { [ -n "$TORCH215_INDEX" ] && PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= PIP_CONSTRAINT= \
        "$dir/bin/python" -m pip install -q "$@" --index-url "$TORCH215_INDEX"; } && return 0
    PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= PIP_CONSTRAINT= "$dir/bin/python" -m pip install -q "$@"
}

install_torch() {  # install_torch ENV VERSION: torch alone, then each of its requirements by its own pip call
    local env="$1" v="$2" dir="$root/.venvs/$1" req
    torch_pip "$env" --no-deps "torch==$v" || return 1
    # torch's requirements for this interpreter (markers evaluated), read from the installed metadata
    "$dir/bin/python" - >"$dir/torch_requires.txt" <<'PYEOF' || return 1
import importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement
for r in map(Requirement, md.requires("torch") or []):
    if r.marker is None or r.marker.evaluate({"extra": ""}):
        print(str(r).split(";")[0].strip())
PYEOF
    while read -r req; do
        torch_pip "$env" "$req" || { echo "cannot install torch's requirement $req"; return 1; }
    done <"$dir/torch_requires.txt"
}

make_env() {  # make_env NAME TORCH_VERSION TORCHTITAN_VERSION NEED_MB EXTRA_DEPS...: venv, torch, deps, torchtitan
    local env="$1" torch_v="$2" tt_v="$3" need="$4"; shift 4
    local dir="$root/.venvs/$env" stamp="$env $torch_v $tt_v ${COMMON[*]} $*"
    if [ -f "$dir/.stamp" ] && [ "$(cat "$dir/.stamp")" = "$stamp" ]; then
        return 0
    fi
    rm -rf "$dir"
    if [ "$(room_mb)" -lt "$need" ]; then
        say "SKIPPED $env: $(room_mb) MB free on $root, need $need (its measured peak + 0.7 GB)"; return 1
    fi
    "$PY" -m venv "$dir"
    echo "torch==$torch_v" > "$dir/constraints.txt"   # pins torch through every later install
    local log="$dir/install.log"
    say "$env: installing torch $torch_v (log: $log)"
    install_torch "$env" "$torch_v" >>"$log" 2>&1 \
        || { say "SKIPPED $env: pip cannot install torch $torch_v (last lines of $log below)"; tail -n 5 "$log"; return 1; }
    say "$env: installing TorchTitan $tt_v and the dependencies"
    pip_env "$env" "${COMMON[@]}" "$@" >>"$log" 2>&1 \
        || { say "SKIPPED $env: pip cannot install the dependencies (last lines of $log below)"; tail -n 5 "$log"; return 1; }
    pip_env "$env" --no-deps "torchtitan==$tt_v" >>"$log" 2>&1 \
        || { say "SKIPPED $env: pip cannot install TorchTitan $tt_v (last lines of $log below)"; tail -n 5 "$log"; return 1; }
    echo "$stamp" > "$dir/.stamp"
    say "$env: $(du -sh "$dir" | cut -f1) in $dir, $(room_mb) MB left free"
}

prune() {  # prune ENV: with CI_VERSIONS_PRUNE=1, delete the environment once its tier has run (CI's disk)
    if [ "$PRUNE" = 1 ]; then rm -rf "$root/.venvs/$1"; say "$1: deleted (CI_VERSIONS_PRUNE=1), $(room_mb) MB free"; fi
}

build_in() {  # fresh sources in .venvs/ENV/src, C/C++ extensions built against ENV's torch
    local env="$1" dir="$root/.venvs/$1"
    rm -rf "$dir/src"; sources_to "$dir/src"
    say "$env: building the C/C++ extensions against $("$dir/bin/python" -c 'import torch; print(torch.__version__)')"
    (cd "$dir/src" && TITAN_EXT_NO_CUDA=1 "$dir/bin/python" setup.py -q build_ext --inplace >"$dir/build.log" 2>&1) \
        || { say "FAILED $env: build (see $dir/build.log)"; tail -n 15 "$dir/build.log"; return 1; }
}

torch_plan_tests() {  # the planner's test files that touch torch (its validator, its schedules, the IR's
    # lowering): the others test pure Python/C that no torch version changes, and the default tier runs them
    grep -l torch tests/plan/test_plan_*.py
}

tier() {  # tier ENV PYTEST_ARGS...: pytest in ENV's sources; a failure is re-run once, only the failed
    # tests (multi-process runs on a shared 2-core machine, as .ci/run's slow tier): a failure that
    # repeats fails the tier, one that does not is printed as FLAKY for the next session
    local env="$1" src="$root/.venvs/$1/src" py="$root/.venvs/$1/bin/python"; shift
    (cd "$src" && "$py" -m pytest -q -ra "$@") && return 0
    say "$env: re-running only the failed tests once"
    (cd "$src" && "$py" -m pytest -q -ra --lf "$@") || return 1
    say "$env: FLAKY: the failures above passed when re-run alone"
}

run_torch215() {
    local env=torch-2.15
    make_env "$env" 2.15.0 0.2.2 7000 "datasets>=2.21" || return 1
    build_in "$env" || return 1
    say "$env: plan + runtime default tier (the 2.15 FSDP start/wait path: tests/runtime/test_runtime_waits.py, on real FSDP2 stages: tests/runtime/test_runtime_fsdp_cpu.py)"
    tier "$env" -m "not slow and not gpu" tests/runtime/test_torch_compat.py tests/runtime/test_torch_loops.py \
        tests/runtime/test_runtime_waits.py tests/runtime/test_nccl_rules.py $(torch_plan_tests) tests/runtime/test_runtime_*.py
}

run_torch211() {
    # torch 2.11.0 is what the GPU machines' image has (with CUDA 13; PyPI's wheel is that CUDA build,
    # which runs on the CPU here). TorchTitan needs a newer torch: the plan + runtime tiers only.
    local env=torch-2.11
    make_env "$env" 2.11.0 0.2.2 6000 || return 1
    build_in "$env" || return 1
    say "$env: plan + runtime default tier, the NCCL-rules backend and the one-GPU staging transport"
    tier "$env" -m "not slow and not gpu" tests/runtime/test_torch_compat.py tests/runtime/test_torch_loops.py \
        tests/runtime/test_nccl_rules.py tests/runtime/test_shared_gpu.py tests/runtime/test_host_syncs.py $(torch_plan_tests) tests/runtime/test_runtime_*.py
}

run_tt03() {
    local env=torchtitan-0.3
    make_env "$env" 2.14.1 0.3.0 7200 "datasets>=3.6.0,<4.8.0" "spmd_types==0.2.3" torch_checkpointing || return 1
    build_in "$env" || return 1
    local src="$root/.venvs/$env/src"
    # every titan test file: each test runs under 0.3 or skips naming the 0.2-only API it needs
    # (tests/_titan_version.py); Falcon's job tests too (titan/falcon_job.py through the 0.3 adapter)
    say "$env: the whole titan test set and Falcon's job tests (default tier)"
    tier "$env" -m "not slow and not gpu" tests/titan/test_titan_*.py tests/falcon/test_falcon_job.py \
        tests/falcon/test_falcon_groups.py tests/runtime/test_torch_compat.py || { say "FAILED $env: titan tests"; return 1; }
    say "$env: Falcon end to end, DP 2 x PP 2 with an emulated slow device (config falcon_dp2_pp2_debugmodel)"
    tier "$env" -m "slow and not gpu" tests/falcon/test_falcon_job.py -k "slow_device or s2_run" \
        || { say "FAILED $env: Falcon end to end"; return 1; }
    say "$env: 3 training steps of PipeMorph on the CPU (README's TorchTitan 0.3 command)"
    (cd "$src" && rm -rf outputs/debug_cpu_tt03 && \
        "$root/.venvs/$env/bin/torchrun" --nproc_per_node 4 -m torchtitan.train --module titan_ext.titan \
        --config pipemorph_debugmodel --training.steps 3 >"$root/.venvs/$env/train.log" 2>&1) \
        || { say "FAILED $env: training run"; grep -E "Error|error" "$root/.venvs/$env/train.log" | tail -n 10; return 1; }
    grep -q "step:  3  pipeline:" "$root/.venvs/$env/train.log" \
        || { say "FAILED $env: no step-3 pipeline metrics in the log"; return 1; }
    say "$env: $(grep 'step:  3  loss' "$root/.venvs/$env/train.log" | grep -v 'loss: -1' | head -n 1 | sed 's/.*step:/step:/')"
}

case "${1:-all}" in
    torch-2.11) run_torch211 ;;
    torch-2.15) run_torch215 ;;
    torchtitan-0.3) run_tt03 ;;
    all) rc=0; run_torch211 || rc=1; prune torch-2.11; run_torch215 || rc=1; prune torch-2.15; run_tt03 || rc=1; exit $rc ;;
    *) echo "scripts/ci_versions.sh: use torch-2.11, torch-2.15, torchtitan-0.3 or all" >&2; exit 2 ;;
esac
