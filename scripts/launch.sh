#!/usr/bin/env bash
# SLURM batch script: multi-node pipeline-parallel training with TorchTitan + titan_ext.
#
#   sbatch scripts/launch.sh                                   # 1 node x 8 GPUs, llama3 8B, PipeMorph
#   sbatch --nodes=8 scripts/launch.sh                          # 8 nodes (NNODES follows SLURM)
#   CONFIG_FILE=train_configs/llama3_70b_pipemorph.toml sbatch --nodes=8 scripts/launch.sh
#   sbatch scripts/launch.sh --training.steps 100               # extra args go to titan_ext.train
#
# One task per node (srun) runs torchrun, which starts NPROC_PER_NODE ranks; the ranks meet with
# torchrun's c10d rendezvous on the first node of the allocation. Environment (defaults):
#   CONFIG_FILE      train_configs/llama3_8b_pipemorph.toml
#   NNODES           $SLURM_JOB_NUM_NODES
#   NPROC_PER_NODE   GPUs on the node ($SLURM_GPUS_ON_NODE), else 8
#   MASTER_ADDR      the first node's hostname (rendezvous host; set it if that name does not resolve)
#   MASTER_PORT      29500 (rendezvous port on the first node)
#   PYTHON           .venv/bin/python if present, else python3
#   LOG_DIR          outputs/logs  (per-job directory LOG_DIR/<job name>-<job id>/<launch id>/ with per-rank logs; launch id: the job id, or an S4 relaunch's)
#   TITAN_EXT_INJECT_DELAYS, WANDB_* , NCCL_* / GLOO_* : passed through to every rank
#   FALCON_S4_RESTARTS  1   relaunches after a Falcon S4 exit (status 75 + <dump>/falcon_s4_plan.json:
#                           the job restarts on the kept nodes/devices; titan_ext/titan/falcon_s4.py)
#   FALCON_S4_DUMP      the job's dump folder when --job.dump_folder is not on the command line
# The job's own log is the SLURM output file below (%x = job name, %j = job id) in the submit dir.
#
#SBATCH --job-name=titan_ext
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=16
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --output=slurm-%x-%j.out
#SBATCH --open-mode=append
set -euo pipefail

cd "${SLURM_SUBMIT_DIR:-$(pwd)}"

CONFIG_FILE="${CONFIG_FILE:-train_configs/llama3_8b_pipemorph.toml}"
NNODES="${NNODES:-${SLURM_JOB_NUM_NODES:-1}}"
gpus_on_node="${SLURM_GPUS_ON_NODE:-}"
NPROC_PER_NODE="${NPROC_PER_NODE:-${gpus_on_node:-8}}"
MASTER_PORT="${MASTER_PORT:-29500}"
LOG_DIR="${LOG_DIR:-outputs/logs}"
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

if [ ! -f "$CONFIG_FILE" ]; then
    echo "launch.sh: CONFIG_FILE=$CONFIG_FILE does not exist (cwd $(pwd))" >&2
    exit 2
fi

# Rendezvous on the first node of the allocation.
if [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    head_node="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
else
    head_node="$(hostname)"
fi
rdzv_host="${MASTER_ADDR:-$head_node}"
job_id="${SLURM_JOB_ID:-local$$}"
job_log_dir="$LOG_DIR/${SLURM_JOB_NAME:-titan_ext}-$job_id"
mkdir -p "$job_log_dir"

# Collective-library environment (override any of these from the caller's environment).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export NCCL_IB_TIMEOUT="${NCCL_IB_TIMEOUT:-22}"
export TORCH_DIST_INIT_BARRIER="${TORCH_DIST_INIT_BARRIER:-1}"
if [ -n "${SOCKET_IFNAME:-}" ]; then   # one knob for both libraries, e.g. SOCKET_IFNAME=ib0
    export NCCL_SOCKET_IFNAME="$SOCKET_IFNAME" GLOO_SOCKET_IFNAME="$SOCKET_IFNAME"
fi
export PYTHONUNBUFFERED=1

echo "[launch] job $job_id: $NNODES node(s) x $NPROC_PER_NODE ranks, config $CONFIG_FILE"
echo "[launch] rendezvous c10d at $rdzv_host:$MASTER_PORT, per-rank logs in $job_log_dir"
echo "[launch] python: $PYTHON ($("$PYTHON" -c 'import torch; print("torch", torch.__version__)'))"

# Falcon S4 (titan_ext/titan/falcon_s4.py, docs/falcon.md "S4 applied"): a job that checkpointed for
# S4 exits with status 75 and leaves <dump_folder>/falcon_s4_plan.json; it is then relaunched on the
# nodes / devices the plan keeps, with the plan's overrides (at most FALCON_S4_RESTARTS times, default 1).
dump_folder="${FALCON_S4_DUMP:-}"
prev=""
for a in "$@"; do
    [ "$prev" = "--job.dump_folder" ] && dump_folder="$a"
    case "$a" in --job.dump_folder=*) dump_folder="${a#*=}" ;; esac
    prev="$a"
done
if [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    hosts="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n "$NNODES" | tr '\n' ' ')"
else
    hosts="$(hostname)"
fi
run_nodes() {  # $1 nnodes, $2 ranks per node, $3 rendezvous id, $4 nodes to exclude, then extra args
    local nnodes="$1" nproc="$2" rdzv_id="$3" exclude="$4"
    shift 4
    local cmd=("$PYTHON" -m torch.distributed.run --nnodes "$nnodes" --nproc_per_node "$nproc"
               --rdzv_backend c10d --rdzv_endpoint "$rdzv_host:$MASTER_PORT" --rdzv_id "$rdzv_id"
               --log-dir "$job_log_dir/$rdzv_id" --tee 3 -m titan_ext.train
               --job.config_file "$CONFIG_FILE" "$@")
    if [ -n "${SLURM_JOB_ID:-}" ]; then
        # each node's visible devices: S4_DEVICES_<index of the node in $hosts> (after an S4 only)
        srun --nodes="$nnodes" ${exclude:+--exclude="$exclude"} --ntasks-per-node=1 --kill-on-bad-exit=1 \
            --export=ALL bash -c 'i=0; for h in $S4_HOSTS; do
                  if [ "$h" = "${SLURMD_NODENAME:-}" ]; then v="S4_DEVICES_$i"
                      [ -n "${!v:-}" ] && export CUDA_VISIBLE_DEVICES="${!v}"; fi; i=$((i + 1)); done
              exec "$@"' _ "${cmd[@]}"
    else
        if [ -n "${S4_DEVICES_0:-}" ]; then CUDA_VISIBLE_DEVICES="$S4_DEVICES_0" "${cmd[@]}"; else "${cmd[@]}"; fi
    fi
}

export S4_HOSTS="$hosts"
nnodes="$NNODES" nproc="$NPROC_PER_NODE" exclude="" rdzv_id="$job_id" extra=()
restarts=0
while :; do
    set +e
    run_nodes "$nnodes" "$nproc" "$rdzv_id" "$exclude" "$@" "${extra[@]}"
    rc=$?
    set -e
    [ "$rc" -eq 0 ] && break
    if [ -z "$dump_folder" ] || [ "$restarts" -ge "${FALCON_S4_RESTARTS:-1}" ] || \
        ! spec="$("$PYTHON" -m titan_ext.titan.falcon_s4 relaunch-spec "$dump_folder" $hosts)"; then
        echo "[launch] job $job_id failed (status $rc)"
        exit "$rc"
    fi
    eval "$spec"   # S4_NNODES, S4_NPROC_PER_NODE, S4_EXCLUDE, S4_ARGS, S4_PLAN, S4_DEVICES_<i>
    for ((i = 0; i < $(wc -w <<< "$hosts"); i++)); do v="S4_DEVICES_$i"; export "S4_DEVICES_$i=${!v}"; done
    restarts=$((restarts + 1))
    nnodes="$S4_NNODES" nproc="$S4_NPROC_PER_NODE" exclude="$S4_EXCLUDE" rdzv_id="$job_id-s4-$restarts"
    eval "extra=($S4_ARGS)"
    export TITAN_EXT_S4_PLAN="$S4_PLAN"
    unset TITAN_EXT_SLOW_DEVICE TITAN_EXT_SLOW_LINK
    echo "[launch] Falcon S4: relaunching on $nnodes node(s) x $nproc ranks (excluded nodes: ${exclude:-none})"
done
echo "[launch] job $job_id finished"
