#!/usr/bin/env bash
# Install and start a real single-node SLURM (Debian slurm-wlm + munge) for CI.
#
#   sudo bash scripts/ci_slurm_setup.sh        # idempotent; prints "[slurm] ready" when sinfo shows the node idle
#
# Needs root and apt (Debian/Ubuntu). No systemd needed: munged, slurmctld and slurmd are started
# directly. The node is this host with all its CPUs; partition "ci" (default). Job output goes where
# the job says. Stop everything with:  bash scripts/ci_slurm_setup.sh --stop
set -euo pipefail

if [ "$(id -u)" != 0 ]; then
    echo "[slurm] must run as root (apt-get install, daemons)" >&2
    exit 1
fi

host="$(hostname -s)"
conf_dir=/etc/slurm
state=/var/spool/slurmctld
spool=/var/spool/slurmd
logdir=/var/log/slurm

if [ "${1:-}" = "--stop" ]; then
    # pid files written by the daemons themselves (slurm.conf below; munged's default)
    for f in /run/slurmd.pid /run/slurmctld.pid /run/munge/munged.pid; do
        if [ -s "$f" ]; then
            kill "$(cat "$f")" 2>/dev/null || true
        fi
    done
    for _ in $(seq 50); do
        pgrep -x slurmd >/dev/null || pgrep -x slurmctld >/dev/null || pgrep -x munged >/dev/null || break
        sleep 0.2
    done
    echo "[slurm] stopped"
    exit 0
fi

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null \
    || ! command -v sbatch >/dev/null; then
    echo "[slurm] installing slurm-wlm and munge with apt"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi

# --- munge ----------------------------------------------------------------------------------------
mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
if [ ! -s /etc/munge/munge.key ]; then
    if command -v mungekey >/dev/null; then mungekey --create --keyfile=/etc/munge/munge.key --force;
    else dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none; fi
fi
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge
chmod 0700 /etc/munge /var/lib/munge /var/log/munge
chmod 0755 /run/munge
chmod 0400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    echo "[slurm] starting munged"
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
fi
munge -n | unmunge >/dev/null

# --- slurm.conf -------------------------------------------------------------------------------------
cpus="$(nproc)"
mem_mb="$(awk '/MemTotal/ {print int($2/1024*0.9)}' /proc/meminfo)"
mkdir -p "$conf_dir" "$state" "$spool" "$logdir"
cat > "$conf_dir/slurm.conf" <<EOF
# written by titan_ext scripts/ci_slurm_setup.sh: single-node CI cluster
ClusterName=titanextci
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$state
SlurmdSpoolDir=$spool
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$logdir/slurmctld.log
SlurmdLogFile=$logdir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=10
MinJobAge=600
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=ci Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
# Slurm 22.05 has no "disabled" cgroup plugin; without cgroup.conf it autodetects and, with
# proctrack/linuxproc + task/none, does not need to write cgroups (works in containers).
rm -f "$conf_dir/cgroup.conf"

if ! pgrep -x slurmctld >/dev/null; then
    echo "[slurm] starting slurmctld"
    slurmctld -i || { tail -n 20 "$logdir/slurmctld.log" >&2; exit 1; }
    sleep 1
fi
if ! pgrep -x slurmd >/dev/null; then
    echo "[slurm] starting slurmd"
    slurmd || { tail -n 20 "$logdir/slurmd.log" >&2; exit 1; }
fi

for _ in $(seq 60); do
    st="$(sinfo -h -n "$host" -o %t 2>/dev/null || true)"
    case "$st" in
        idle*|mix*|alloc*) echo "[slurm] ready: node $host ($cpus CPUs) state $st"; exit 0 ;;
        down*|drain*) scontrol update nodename="$host" state=resume 2>/dev/null || true ;;
    esac
    sleep 1
done
echo "[slurm] node $host did not become idle; sinfo:" >&2
sinfo >&2 || true
tail -20 "$logdir/slurmctld.log" "$logdir/slurmd.log" >&2 || true
exit 1
