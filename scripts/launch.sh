#!/usr/bin/env bash
# Multi-node pipeline-parallel training with TorchTitan + titan_ext: a SLURM batch script, or run
# directly on one machine. Either config system:
#
#   CONFIG_FILE=train_configs/llama3_8b_pipemorph.toml sbatch --nodes=2 scripts/launch.sh   # TorchTitan 0.2 (TOML)
#   MODULE=titan_ext.titan CONFIG=llama3_8b_pipemorph sbatch --nodes=2 scripts/launch.sh     # TorchTitan 0.3 (Python)
#   CONFIG_FILE=train_configs/debug_cpu.toml NPROC_PER_NODE=4 bash scripts/launch.sh         # one machine, no SLURM
#   DRY_RUN=1 MODULE=titan_ext.titan CONFIG=llama3_70b_pipemorph bash scripts/launch.sh      # will it fit? (a CPU)
#   DRY_RUN=print MODULE=titan_ext.titan CONFIG=pipemorph_debugmodel bash scripts/launch.sh  # the command only
#   CONFIG_FILE=... sbatch scripts/launch.sh --training.steps 100    # extra args go to the trainer
#
# Without a config it prints this usage and exits 2. Outside SLURM it refuses (exit 2) a config whose
# model would not fit this machine: parameters x 16 bytes (weights, gradients, AdamW states) against
# the GPUs' memory, or the RAM when there is no GPU (not with DRY_RUN, which prints the command for any size).
#
# One task per node (srun) runs torchrun, which starts NPROC_PER_NODE ranks; the ranks meet with
# torchrun's c10d rendezvous on the first node of the allocation. The config's world size is the product
# of its [parallelism] degrees (TOML; a 0.3 config: the ParallelismConfig(...) its function in
# MODULE/config_registry.py builds, read from the source; --parallelism.*_degree arguments win), with
# data_parallel_shard_degree = -1 (FSDP over the rest) counted as 1: the fewest ranks the config runs on.
# Environment (defaults):
#   CONFIG_FILE      a TorchTitan 0.2 TOML config (runs -m titan_ext.train --job.config_file CONFIG_FILE)
#   MODULE, CONFIG   a TorchTitan 0.3 config function (runs -m torchtitan.train --module MODULE --config CONFIG)
#   DRY_RUN          print: print the environment the script exports and the exact srun/torchrun command line,
#                    and exit; 1: that, then build the job on a CPU for NNODES x NPROC_PER_NODE ranks on
#                    torch's fake process group and say whether it fits (python -m titan_ext.titan.dryrun:
#                    the mesh, the stage split, each stage's activations against its memory budget and
#                    1F1B's in-flight counts, PipeMorph's first plan, the delegate slots; exit 1 if not)
#   NNODES           $SLURM_JOB_NUM_NODES; outside SLURM the nodes the config's world size needs, else 1
#   NPROC_PER_NODE   GPUs on the node ($SLURM_GPUS_ON_NODE), else the config's world size up to 8, else 8
#   CPUS_PER_TASK    CPUs srun gives each node's torchrun, its ranks and their data loaders and delegates:
#                    sbatch's --cpus-per-task when given, else the node's ($SLURM_CPUS_ON_NODE, else nproc)
#   LOG_RANK         the ranks whose output the console (slurm-*.out) shows, e.g. 3 or 0,3, or all;
#                    default the first rank of the last PP stage (where TorchTitan logs the loss), else 0.
#                    It is torchrun's --local-ranks-filter: on several nodes every node shows its local
#                    ranks LOG_RANK mod NPROC_PER_NODE (so NNODES ranks for one LOG_RANK, that rank among
#                    them), each line prefixed with its global rank, [rankN]:. Every rank's full output
#                    is in its log file under LOG_DIR either way.
#   MASTER_ADDR      the first node's hostname (rendezvous host; set it if that name does not resolve)
#   MASTER_PORT      29500 (rendezvous port on the first node)
#   PYTHON           .venv/bin/python if present, else python3
#   LOG_DIR          outputs/logs  (per-job directory LOG_DIR/<job name>-<job id>/<launch id>/ with per-rank logs; launch id: the job id, or an S4 relaunch's)
#   TITAN_EXT_INJECT_DELAYS, WANDB_* , NCCL_* / GLOO_* : passed through to every rank
#   FALCON_S4_RESTARTS  1   relaunches after a Falcon S4 exit (status 75 + <dump>/falcon_s4_plan.json:
#                           the job restarts on the kept nodes/devices; titan_ext/titan/falcon_s4.py)
#   FALCON_S4_DUMP      the job's dump folder when --job.dump_folder is not on the command line
#   (exported) TITAN_EXT_SPARE_NODES  under SLURM, the allocation's nodes beyond NNODES: with one, S4
#                           restarts on a spare node (--exclude=<slow node>, same node count, DP kept)
#                           instead of shrinking DP (e.g. sbatch --nodes=3 with NNODES=2)
#   STOP_GRACE_S     30  seconds the job has to end after a SIGTERM / SIGINT to this script, then SIGKILL
# The job's own log is the SLURM output file below (%x = job name, %j = job id) in the submit dir.
#
# Each run of the job, and each relaunch, gets its own TITAN_EXT_LAUNCH_ID (exported): the job writes
# it into its S4 plan, and a relaunch happens only after a failed run (status 75, or torchrun's 1; under
# SLURM any srun failure) whose plan carries that run's id, with nothing in it but what the planner writes.
# SIGTERM or SIGINT to this script ends the job and exits 143 / 130. Without SLURM torchrun runs in a
# session of its own (setsid) and the signal goes to its whole process group (torchrun and its ranks);
# under SLURM srun gets SIGTERM, which it forwards to every task. What is left after STOP_GRACE_S gets
# SIGKILL.
#
# Exported to every rank unless already set: OMP_NUM_THREADS=1, NCCL_DEBUG=WARN, NCCL_IB_TIMEOUT=22,
# TORCH_DIST_INIT_BARRIER=1, PYTHONFAULTHANDLER=1, PYTORCH_ALLOC_CONF=expandable_segments:True (unless
# PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF is set: PipeMorph changes its in-flight micro-batches at
# run time, so the allocator's fragmentation matters), TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[rank${rank}]:';
# and PYTHONUNBUFFERED=1. TORCH_NCCL_ASYNC_ERROR_HANDLING is left to TorchTitan.
#
#SBATCH --job-name=titan_ext
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
# no --cpus-per-task: --exclusive gives the job every CPU of its nodes, and srun hands them to torchrun (CPUS_PER_TASK)
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --output=slurm-%x-%j.out
#SBATCH --open-mode=append
set -euo pipefail

cd "${SLURM_SUBMIT_DIR:-$(pwd)}"

usage() {
    sed -n '2,/^#SBATCH/p' "${BASH_SOURCE[0]}" | grep -v '^#SBATCH' | sed 's/^# \{0,1\}//' >&2
}
CONFIG_FILE="${CONFIG_FILE:-}"
MODULE="${MODULE:-}"
CONFIG="${CONFIG:-}"
NNODES="${NNODES:-${SLURM_JOB_NUM_NODES:-}}"                  # empty: from the config (below)
NPROC_PER_NODE="${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}"   # empty: from the config (below)
CPUS_PER_TASK="${CPUS_PER_TASK:-${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-$(nproc 2>/dev/null || echo 1)}}}"
LOG_RANK="${LOG_RANK:-}"                                      # empty: the loss rank (below)
MASTER_PORT="${MASTER_PORT:-29500}"
LOG_DIR="${LOG_DIR:-outputs/logs}"
STOP_GRACE_S="${STOP_GRACE_S:-30}"
FALCON_S4_RESTARTS="${FALCON_S4_RESTARTS:-1}"
for v in NNODES NPROC_PER_NODE CPUS_PER_TASK MASTER_PORT STOP_GRACE_S FALCON_S4_RESTARTS; do
    if [ -n "${!v}" ] && ! [[ "${!v}" =~ ^(0|[1-9][0-9]{0,5})$ ]]; then
        echo "launch.sh: $v=${!v} is not a number" >&2
        exit 2
    fi
done
if [ "${NNODES:-1}" -lt 1 ] || [ "${NPROC_PER_NODE:-1}" -lt 1 ] || [ "$CPUS_PER_TASK" -lt 1 ] || \
    [ "$MASTER_PORT" -lt 1 ] || [ "$MASTER_PORT" -gt 65535 ]; then
    echo "launch.sh: NNODES=$NNODES, NPROC_PER_NODE=$NPROC_PER_NODE and CPUS_PER_TASK=$CPUS_PER_TASK must be >= 1," \
        "MASTER_PORT=$MASTER_PORT in [1, 65535]" >&2
    exit 2
fi
if [ -n "$LOG_RANK" ] && [ "$LOG_RANK" != all ] && ! [[ "$LOG_RANK" =~ ^(0|[1-9][0-9]{0,5})(,(0|[1-9][0-9]{0,5}))*$ ]]; then
    echo "launch.sh: LOG_RANK=$LOG_RANK is not a rank, a comma-separated list of ranks, or all" >&2
    exit 2
fi
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

case "${DRY_RUN:-0}" in
    0 | "") dry=0 ;;
    1 | print) dry=1 ;;
    *) echo "launch.sh: DRY_RUN=$DRY_RUN: use 1 (print the command, then build the job on a CPU) or print" >&2; exit 2 ;;
esac
if [ -n "$CONFIG_FILE" ] && [ -n "$MODULE$CONFIG" ]; then
    echo "launch.sh: set CONFIG_FILE (TorchTitan 0.2) or MODULE and CONFIG (TorchTitan 0.3), not both" >&2
    exit 2
elif [ -n "$CONFIG_FILE" ]; then
    if [ ! -f "$CONFIG_FILE" ]; then
        echo "launch.sh: CONFIG_FILE=$CONFIG_FILE does not exist (cwd $(pwd))" >&2
        exit 2
    fi
    trainer=(-m titan_ext.train --job.config_file "$CONFIG_FILE")
    config_name="$CONFIG_FILE"
    config_ref=(toml "$CONFIG_FILE")
elif [ -n "$MODULE" ] && [ -n "$CONFIG" ]; then
    trainer=(-m torchtitan.train --module "$MODULE" --config "$CONFIG")
    config_name="$MODULE:$CONFIG"
    config_ref=(registry "$MODULE" "$CONFIG")
else
    [ -n "$MODULE$CONFIG" ] && echo "launch.sh: MODULE and CONFIG go together (got MODULE='$MODULE' CONFIG='$CONFIG')" >&2
    usage
    exit 2
fi

# The config's parallel layout: "<world size> <fill> <loss stages>" -- the product of its degrees (a
# data_parallel_shard_degree of -1 counted as 1), fill 1 when that degree is -1 (any multiple of the world
# size runs), and the PP degree TorchTitan's metrics rank is computed from (1 for ZBVZeroBubble, whose loss
# is on rank 0). A 0.3 config function is read from its registry's source, not imported (that needs the
# TorchTitan it was written for). Nothing printed when the layout cannot be read.
config_layout_py='
import ast, os, sys, tomllib

DEGREES = ("pipeline_parallel_degree", "data_parallel_replicate_degree", "data_parallel_shard_degree",
           "context_parallel_degree", "tensor_parallel_degree")


def value(node, names):
    if isinstance(node, ast.Name):
        return names.get(node.id)
    try:
        return ast.literal_eval(node)
    except Exception:
        return None


def registry_parallelism(module, name):
    """The keywords of the first ParallelismConfig(...) the config function builds, following its
    calls of other functions of the registry (their keyword arguments bound)."""
    rel = os.path.join(*module.split("."), "config_registry.py")
    path = next(p for p in (os.path.join(d or ".", rel) for d in sys.path) if os.path.isfile(p))
    with open(path) as f:
        funcs = {n.name: n for n in ast.parse(f.read()).body if isinstance(n, ast.FunctionDef)}

    def search(fn, kwargs, depth):
        a = funcs[fn].args
        params = a.posonlyargs + a.args
        names = {p.arg: value(d, {}) for p, d in zip(params[len(params) - len(a.defaults):], a.defaults)}
        names.update({p.arg: value(d, {}) for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None})
        names.update(kwargs)
        for node in ast.walk(funcs[fn]):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                kw = {k.arg: value(k.value, names) for k in node.keywords if k.arg}
                if node.func.id == "ParallelismConfig":
                    return kw
                if node.func.id in funcs and depth < 8:
                    found = search(node.func.id, kw, depth + 1)
                    if found is not None:
                        return found
        return None

    return search(name, {}, 0)


args = sys.argv[1:]
split = args.index("--")
ref, extra = args[:split], args[split + 1:]
if ref[0] == "toml":
    with open(ref[1], "rb") as f:
        par = tomllib.load(f).get("parallelism", {})
else:
    par = registry_parallelism(ref[1], ref[2])
for i, a in enumerate(extra):  # --parallelism.<key> V / --parallelism.<key>=V on the command line win
    key, eq, v = a.partition("=")
    key = key.removeprefix("--parallelism.").replace("-", "_")
    if a.startswith("--parallelism.") and (key in DEGREES or key == "pipeline_parallel_schedule"):
        par[key] = v if eq else (extra[i + 1] if i + 1 < len(extra) else "")
degrees = [int(par.get(k, -1 if k == "data_parallel_shard_degree" else 1)) for k in DEGREES]
world = 1
for d in degrees:
    world *= max(d, 1)
schedule = par.get("pipeline_parallel_schedule", "1F1B")
print(world, int(degrees[2] < 0), 1 if schedule == "ZBVZeroBubble" else max(degrees[0], 1))
'
cfg_world="" cfg_fill=0 cfg_pp=1
read -r w f p _ < <("$PYTHON" -c "$config_layout_py" "${config_ref[@]}" -- "$@" 2>/dev/null || true) || true
if [[ "${w:-}" =~ ^[1-9][0-9]{0,5}$ && "${f:-}" =~ ^[01]$ && "${p:-}" =~ ^[1-9][0-9]{0,5}$ ]]; then
    cfg_world="$w" cfg_fill="$f" cfg_pp="$p"
fi
if [ -z "$NPROC_PER_NODE" ]; then
    NPROC_PER_NODE=8
    if [ -n "$cfg_world" ] && [ "$cfg_world" -lt 8 ]; then NPROC_PER_NODE="$cfg_world"; fi
fi
if [ -z "$NNODES" ]; then
    NNODES=1
    if [ -n "$cfg_world" ]; then NNODES=$(((cfg_world + NPROC_PER_NODE - 1) / NPROC_PER_NODE)); fi
fi
if [ -n "$cfg_world" ] && ((cfg_fill ? NNODES * NPROC_PER_NODE % cfg_world : NNODES * NPROC_PER_NODE != cfg_world)); then
    echo "launch.sh: note: $config_name runs on $([ "$cfg_fill" = 1 ] && echo "a multiple of ")$cfg_world ranks;" \
        "NNODES x NPROC_PER_NODE = $NNODES x $NPROC_PER_NODE" >&2
fi

# Outside SLURM: refuse a model this machine cannot hold (scripts/launch_fit.py says why, in one line).
if [ -z "${SLURM_JOB_ID:-}" ] && [ "$dry" = 0 ]; then
    "$PYTHON" "$(dirname "${BASH_SOURCE[0]}")/launch_fit.py" --ranks "$((NNODES * NPROC_PER_NODE))" \
        ${CONFIG_FILE:+--config-file "$CONFIG_FILE"} ${CONFIG:+--config "$CONFIG"} || exit 2
fi

# Rendezvous on the first node of the allocation.
if [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    # sed reads the whole list: `head -n 1` closed the pipe early, and scontrol's SIGPIPE (141) ended the
    # launch under pipefail without a word (a 3-node list did it once in the tests; a long one would often)
    head_node="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"
else
    head_node="$(hostname)"
fi
rdzv_host="${MASTER_ADDR:-$head_node}"
job_id="${SLURM_JOB_ID:-local$$}"
job_log_dir="$LOG_DIR/${SLURM_JOB_NAME:-titan_ext}-$job_id"
[ "$dry" = 1 ] || mkdir -p "$job_log_dir"

# The ranks' environment (override any of these from the caller's environment).
# TORCH_NCCL_ASYNC_ERROR_HANDLING is left alone: TorchTitan's init_distributed sets it to 3 (tear down
# without cleanup, which its flight recorder needs) on every rank; a value from the caller's environment
# passes through (and TorchTitan still overrides it).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export NCCL_IB_TIMEOUT="${NCCL_IB_TIMEOUT:-22}"
export TORCH_DIST_INIT_BARRIER="${TORCH_DIST_INIT_BARRIER:-1}"
if [ -n "${SOCKET_IFNAME:-}" ]; then   # one knob for both libraries, e.g. SOCKET_IFNAME=ib0
    export NCCL_SOCKET_IFNAME="$SOCKET_IFNAME" GLOO_SOCKET_IFNAME="$SOCKET_IFNAME"
fi
export PYTHONUNBUFFERED=1
export PYTHONFAULTHANDLER="${PYTHONFAULTHANDLER:-1}"
if [ -z "${PYTORCH_ALLOC_CONF:-}${PYTORCH_CUDA_ALLOC_CONF:-}" ]; then
    export PYTORCH_ALLOC_CONF=expandable_segments:True
fi
global_rank_prefix='[rank${rank}]:'   # torchrun's line prefix: the global rank (its own is the local one)
export TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="${TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE:-$global_rank_prefix}"
shown_env=(OMP_NUM_THREADS NCCL_DEBUG NCCL_IB_TIMEOUT TORCH_DIST_INIT_BARRIER NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME
           PYTHONUNBUFFERED PYTHONFAULTHANDLER PYTORCH_ALLOC_CONF PYTORCH_CUDA_ALLOC_CONF
           TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE S4_HOSTS TITAN_EXT_LAUNCH_ID TITAN_EXT_SPARE_NODES)

if [ "$dry" = 0 ]; then
    echo "[launch] job $job_id: $NNODES node(s) x $NPROC_PER_NODE ranks, config $config_name"
    echo "[launch] rendezvous c10d at $rdzv_host:$MASTER_PORT, per-rank logs in $job_log_dir"
    echo "[launch] python: $PYTHON ($("$PYTHON" -c 'import torch; print("torch", torch.__version__)'))"
fi

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
# Under SLURM every node of the allocation: those beyond NNODES are spare nodes, exported to the job as
# TITAN_EXT_SPARE_NODES; with one, S4 restarts the slow device's node on a spare (srun --exclude=<slow
# node>, the same node count and DP: Falcon's S4) instead of shrinking DP. Allocate one with e.g.
# sbatch --nodes=3 and NNODES=2.
if [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    hosts="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | tr '\n' ' ')"
    spare_nodes=$(($(wc -w <<< "$hosts") - NNODES))
    if [ "$spare_nodes" -gt 0 ]; then export TITAN_EXT_SPARE_NODES="$spare_nodes"; fi
else
    hosts="$(hostname)"
fi
# each node's visible devices: S4_DEVICES_<index of the node in $hosts> (after an S4 only)
node_wrapper='i=0; for h in $S4_HOSTS; do
    if [ "$h" = "${SLURMD_NODENAME:-}" ]; then v="S4_DEVICES_$i"
        [ -n "${!v:-}" ] && export CUDA_VISIBLE_DEVICES="${!v}"; fi; i=$((i + 1)); done
exec "$@"'
local_ranks() {  # $1 nnodes, $2 ranks per node: LOG_RANK as each node's local ranks (empty: all)
    local want="$LOG_RANK" r out=""
    [ -z "$want" ] && want=$(($1 * $2 / cfg_pp * (cfg_pp - 1)))  # the first rank of the last PP stage
    [ "$want" = all ] && return 0
    for r in ${want//,/ }; do out="${out:+$out,}$((r % $2))"; done
    echo "$out"
}
run_nodes() {  # $1 nnodes, $2 ranks per node, $3 rendezvous id, $4 nodes to exclude, then extra args
    local nnodes="$1" nproc="$2" rdzv_id="$3" exclude="$4" shown
    shift 4
    shown="$(local_ranks "$nnodes" "$nproc")"
    local cmd=("$PYTHON" -m torch.distributed.run --nnodes "$nnodes" --nproc_per_node "$nproc"
               --rdzv_backend c10d --rdzv_endpoint "$rdzv_host:$MASTER_PORT" --rdzv_id "$rdzv_id"
               --log-dir "$job_log_dir/$rdzv_id" --role rank --tee 3 ${shown:+--local-ranks-filter "$shown"}
               "${trainer[@]}" "$@")
    local what="local rank(s) $shown of each node"
    [ -z "$shown" ] && what="every rank"
    what="$nnodes node(s) x $nproc ranks, the console shows $what (LOG_RANK=${LOG_RANK:-default})"
    if [ "$dry" = 1 ]; then  # the environment the script exports and the exact command line, shell-quoted
        echo "# $what"
        for v in "${shown_env[@]}"; do
            if [ -n "${!v+x}" ]; then printf 'export %s=%q\n' "$v" "${!v}"; fi
        done
        if [ -n "${SLURM_JOB_ID:-}" ]; then
            printf '%q ' srun --nodes="$nnodes" ${exclude:+--exclude="$exclude"} --ntasks-per-node=1 \
                --cpus-per-task="$CPUS_PER_TASK" --kill-on-bad-exit=1 --export=ALL bash -c "$node_wrapper" _ "${cmd[@]}"
        else
            printf '%q ' "${cmd[@]}"
        fi
        echo
        return 0
    fi
    echo "[launch] $what; every rank's log under $job_log_dir/$rdzv_id"
    # in the background, so that the trap below runs while it does; SIGINT at its default again (a
    # background command of a script starts with SIGINT and SIGQUIT ignored)
    if [ -n "${SLURM_JOB_ID:-}" ]; then
        ( trap - INT QUIT
          exec srun --nodes="$nnodes" ${exclude:+--exclude="$exclude"} --ntasks-per-node=1 \
              --cpus-per-task="$CPUS_PER_TASK" --kill-on-bad-exit=1 --export=ALL bash -c "$node_wrapper" _ "${cmd[@]}" ) &
    else
        ( trap - INT QUIT
          if [ -n "${S4_DEVICES_0:-}" ]; then export CUDA_VISIBLE_DEVICES="$S4_DEVICES_0"; fi
          exec "${new_session[@]}" "${cmd[@]}" ) &
    fi
    job_pid=$!
    local rc=0
    wait "$job_pid" || rc=$?
    job_pid=""
    return "$rc"
}

# SIGTERM / SIGINT: the running job ends too, then this script with 128 + the signal (as srun does).
new_session=()
command -v setsid >/dev/null && new_session=(setsid)  # torchrun's process group: torchrun and its ranks
job_pid=""
group_alive() {  # $1 a process group: whether a process of it still runs (a zombie does not)
    if command -v ps >/dev/null; then
        ps -e -o pgid=,stat= | awk -v g="$1" '$1 == g && $2 !~ /^Z/ {n++} END {exit n == 0}'
    else
        kill -0 -- "-$1" 2>/dev/null
    fi
}
stop_job() {  # $1 the signal, $2 the exit status
    trap '' TERM INT
    set +e
    if [ -n "$job_pid" ]; then
        local deadline=$((SECONDS + STOP_GRACE_S))
        if [ -n "${SLURM_JOB_ID:-}" ]; then  # srun forwards SIGTERM to every task
            kill -s TERM "$job_pid" 2>/dev/null
            while kill -0 "$job_pid" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.2; done
            kill -0 "$job_pid" 2>/dev/null && kill -s KILL "$job_pid"
        else
            kill -s "$1" -- "-$job_pid" 2>/dev/null || kill -s "$1" "$job_pid" 2>/dev/null
            while { kill -0 "$job_pid" 2>/dev/null || group_alive "$job_pid"; } && [ "$SECONDS" -lt "$deadline" ]; do
                sleep 0.2
            done
            kill -s KILL -- "-$job_pid" 2>/dev/null || kill -s KILL "$job_pid" 2>/dev/null
        fi
        wait "$job_pid" 2>/dev/null
    fi
    echo "[launch] job $job_id stopped by SIG$1 (status $2)" >&2
    exit "$2"
}
trap 'stop_job TERM 143' TERM
trap 'stop_job INT 130' INT

export S4_HOSTS="$hosts"
nnodes="$NNODES" nproc="$NPROC_PER_NODE" exclude="" rdzv_id="$job_id" extra=()
restarts=0
run_id="$job_id.$(date +%s%N).$$"
while :; do
    export TITAN_EXT_LAUNCH_ID="$run_id.$restarts"
    set +e
    run_nodes "$nnodes" "$nproc" "$rdzv_id" "$exclude" "$@" "${extra[@]}"
    rc=$?
    if [ "${DRY_RUN:-0}" = 1 ] && [ "$rc" = 0 ]; then  # then build the job on fake process groups
        NGPU="$((nnodes * nproc))" "$PYTHON" -m titan_ext.titan.dryrun "${trainer[@]:2}" "$@" || rc=$?
    fi
    [ "$dry" = 1 ] && exit "$rc"
    set -e
    [ "$rc" -eq 0 ] && break
    s4_status=0  # the ranks' S4 exit (75) reaches here as torchrun's 1; srun's status mixes its tasks'
    if [ "$rc" -eq 75 ] || [ "$rc" -eq 1 ] || [ -n "${SLURM_JOB_ID:-}" ]; then s4_status=1; fi
    if [ "$s4_status" = 0 ] || [ -z "$dump_folder" ] || [ "$restarts" -ge "$FALCON_S4_RESTARTS" ] || \
        ! spec="$("$PYTHON" -m titan_ext.titan.falcon_s4 relaunch-spec "$dump_folder" $hosts)"; then
        echo "[launch] job $job_id failed (status $rc)"
        exit "$rc"
    fi
    S4_SPARE_NODES=""
    eval "$spec"   # S4_NNODES, S4_NPROC_PER_NODE, S4_EXCLUDE, S4_ARGS, S4_PLAN, S4_DEVICES_<i>[, S4_SPARE_NODES]
    if [ -n "$S4_SPARE_NODES" ]; then export TITAN_EXT_SPARE_NODES="$S4_SPARE_NODES"; fi
    for ((i = 0; i < $(wc -w <<< "$hosts"); i++)); do v="S4_DEVICES_$i"; export "S4_DEVICES_$i=${!v}"; done
    restarts=$((restarts + 1))
    nnodes="$S4_NNODES" nproc="$S4_NPROC_PER_NODE" exclude="$S4_EXCLUDE" rdzv_id="$job_id-s4-$restarts"
    if [ -z "${MASTER_ADDR:-}" ] && [ -n "$exclude" ]; then  # rendezvous on the first node srun keeps
        for h in $hosts; do
            if [[ ",$exclude," != *",$h,"* ]]; then rdzv_host="$h"; break; fi
        done
    fi
    eval "extra=($S4_ARGS)"
    export TITAN_EXT_S4_PLAN="$S4_PLAN"
    unset TITAN_EXT_SLOW_DEVICE TITAN_EXT_SLOW_LINK
    echo "[launch] Falcon S4: relaunching on $nnodes node(s) x $nproc ranks (excluded nodes: ${exclude:-none})"
done
echo "[launch] job $job_id finished"
