#!/usr/bin/env bash
# README's main command: train TorchTitan's llama3 debug model with PP=4 on CPU (gloo), once with
# PipeMorph and once with torch's 1F1B, both under the same injected straggler, and print a
# side-by-side summary (iteration time, bubble rate, loss).
#
#   bash scripts/run_local.sh                 # defaults below; a few minutes on 2 cores
#   STEPS=30 DELAY="2:60" bash scripts/run_local.sh
#
# Environment (defaults):
#   STEPS=20            training steps per run
#   DELAY="2:30"        injected straggler ([titan_ext] inject_delays): link 2 (stages 2-3, the last
#                       link of PP=4) gets +30 ms one way on every PP message; "" = none
#   SCHEDULES="PipeMorph 1F1B"   schedule names the trainer accepts (letters, digits, _ + -): each run's
#                       folder OUT/<name> is emptied first, so anything else is refused before it starts
#   CONFIG=train_configs/debug_cpu.toml
#   OUT=outputs/run_local   (one dump folder per schedule: metrics JSONL, timeline PNGs, logs)
#   WANDB=0             1 = also log to W&B (online after `wandb login` or with WANDB_API_KEY, else offline;
#                       WANDB_MODE decides when set)
#   NPROC=4             ranks (= pipeline_parallel_degree of the config)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

STEPS="${STEPS:-20}"
DELAY="${DELAY-2:30}"
SCHEDULES="${SCHEDULES:-PipeMorph 1F1B}"
CONFIG="${CONFIG:-train_configs/debug_cpu.toml}"
OUT="${OUT:-outputs/run_local}"
WANDB="${WANDB:-0}"
NPROC="${NPROC:-4}"
PORT="${MASTER_PORT:-$((29500 + RANDOM % 2000))}"

# Every schedule names a folder directly inside OUT (emptied before its run): checked before anything
# is removed -- a name, and no link out of OUT.
read -r -d '' -a schedules <<< "$SCHEDULES" || true  # split on any white space, no glob
if [ "${#schedules[@]}" = 0 ]; then
    echo "run_local.sh: SCHEDULES names no schedule" >&2
    exit 2
fi
for sched in "${schedules[@]}"; do
    if ! [[ "$sched" =~ ^[A-Za-z0-9][A-Za-z0-9_+-]*$ ]]; then
        echo "run_local.sh: SCHEDULES: '$sched' is not a schedule name (letters, digits, _ + -)" >&2
        exit 2
    fi
done
mkdir -p "$OUT"
out_dir="$(cd "$OUT" && pwd -P)"
for sched in "${schedules[@]}"; do
    if [ -L "$out_dir/$sched" ] || { [ -e "$out_dir/$sched" ] && [ ! -d "$out_dir/$sched" ]; }; then
        echo "run_local.sh: $out_dir/$sched is not a folder of this script's (a link or a file); not removing it" >&2
        exit 2
    fi
done

bash scripts/setup.sh
PY="$root/.venv/bin/python"

# ... and one the trainer knows (titan_ext's schedules and torch's)
if ! "$PY" -c '
import sys
from titan_ext.titan.registry import get_schedule_class
for name in sys.argv[1:]:
    try:
        get_schedule_class(name)
    except ValueError as e:
        sys.exit(f"run_local.sh: SCHEDULES: {e}")
' "${schedules[@]}"; then
    exit 2
fi

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"

extra=()
[ "$WANDB" = 1 ] && extra+=(--metrics.enable_wandb)

runs=()
for sched in "${schedules[@]}"; do
    dump="$out_dir/$sched"
    case "$(realpath -m -- "$dump")" in
        "$out_dir"/?*) ;;
        *) echo "run_local.sh: $dump is not inside $out_dir; not removing it" >&2; exit 2 ;;
    esac
    rm -rf -- "$dump"
    mkdir -p "$dump"
    echo "[run_local] $sched: $STEPS steps, PP=$NPROC on CPU/gloo, injected delay '${DELAY:-none}' -> $dump/train.log"
    t0=$(date +%s)
    if ! "$PY" -m torch.distributed.run --nproc_per_node "$NPROC" --master_port "$PORT" \
        --local-ranks-filter "$((NPROC - 1))" \
        -m titan_ext.train --job.config_file "$CONFIG" \
        --parallelism.pipeline_parallel_schedule "$sched" \
        --training.steps "$STEPS" \
        --job.dump_folder "$dump" \
        --titan_ext.inject_delays "$DELAY" \
        "${extra[@]}" > "$dump/train.log" 2>&1; then
        echo "[run_local] $sched failed; last lines of $dump/train.log:" >&2
        tail -n 30 "$dump/train.log" >&2
        exit 1
    fi
    grep -E "step: +[0-9]+ +loss" "$dump/train.log" | sed -n '1p;$p' | sed "s/^.*step:/  step:/" || true
    echo "[run_local] $sched done in $(( $(date +%s) - t0 )) s"
    runs+=("$dump")
    PORT=$((PORT + 1))
done

echo
echo "== side by side (medians over steps 4..$STEPS; injected delay '${DELAY:-none}') =="
"$PY" -m titan_ext.titan.summary "${runs[@]}" --skip 3 --json "$OUT/summary.json"
echo
echo "timeline images: $OUT/<schedule>/timelines/*.png   metrics: $OUT/<schedule>/pipeline_metrics.jsonl"
