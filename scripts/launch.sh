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
#   LOG_DIR          outputs/logs  (per-job directory LOG_DIR/<job name>-<job id>/ with per-rank logs)
#   TITAN_EXT_INJECT_DELAYS, WANDB_* , NCCL_* / GLOO_* : passed through to every rank
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

torchrun_cmd=(
    "$PYTHON" -m torch.distributed.run
    --nnodes "$NNODES"
    --nproc_per_node "$NPROC_PER_NODE"
    --rdzv_backend c10d
    --rdzv_endpoint "$rdzv_host:$MASTER_PORT"
    --rdzv_id "$job_id"
    --log-dir "$job_log_dir"
    --tee 3
    -m titan_ext.train
    --job.config_file "$CONFIG_FILE"
    "$@"
)

if [ -n "${SLURM_JOB_ID:-}" ]; then
    srun --nodes="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 "${torchrun_cmd[@]}"
else
    "${torchrun_cmd[@]}"   # outside SLURM: a single-node run, same command
fi
echo "[launch] job $job_id finished"
