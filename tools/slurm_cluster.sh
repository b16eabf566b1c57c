#!/usr/bin/env bash
# A real single-machine Slurm cluster with N virtual nodes (n1..nN), for the tests and for
# trying deploy/slurm/ without a cluster. Needs root and slurm-wlm, munge, libpmix-dev
# (`make setup` installs them).
#
#   tools/slurm_cluster.sh up DIR [N]   start munged (if not running), slurmctld, N slurmd
#   tools/slurm_cluster.sh down DIR     cancel jobs, stop what `up` started
#
# Clients then use `export SLURM_CONF=DIR/slurm.conf`. Every virtual node runs on this machine
# and reports hostname "vm": per-node paths must come from SLURMD_NODENAME, never the hostname.
set -euo pipefail

usage() { echo "usage: $0 up DIR [N] | down DIR" >&2; exit 2; }
[ $# -ge 2 ] || usage
cmd=$1
dir=$(realpath -m "$2")
nodes=${3:-4}
repo=$(cd "$(dirname "$0")/.." && pwd)
export SLURM_CONF=$dir/slurm.conf

munge_works() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
    # Ask munge itself: a leftover zombie "munged" would fool pgrep.
    if munge_works; then
        return
    fi
    mkdir -p /run/munge /var/log/munge /var/lib/munge /etc/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge
    if [ ! -s /etc/munge/munge.key ]; then
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
        chown munge:munge /etc/munge/munge.key
        chmod 400 /etc/munge/munge.key
    fi
    runuser -u munge -- /usr/sbin/munged
    touch "$dir/munged.started-by-us"
    for _ in $(seq 1 50); do
        munge_works && return
        sleep 0.1
    done
    echo "munged did not start" >&2
    return 1
}

write_conf() {
    local last=$((17000 + nodes))
    cat >"$SLURM_CONF" <<EOF
ClusterName=fanfs-test
SlurmctldHost=localhost
SlurmctldPort=16817
SlurmdPort=17001
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
TmpFS=$dir/tmpfs/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
KillWait=20
Epilog=$repo/deploy/slurm/epilog.sh
NodeName=n[1-$nodes] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[17001-$last] CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=n[1-$nodes] Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
}

up() {
    mkdir -p "$dir"/{state,log}
    for i in $(seq 1 "$nodes"); do
        mkdir -p "$dir/spool/n$i" "$dir/tmpfs/n$i"
    done
    start_munge
    write_conf
    slurmctld -c
    for i in $(seq 1 "$nodes"); do
        slurmd -N "n$i"
    done
    for _ in $(seq 1 100); do
        if [ "$(sinfo -h -o '%t' 2>/dev/null | sort -u | tr -d '\n')" = "idle" ]; then
            echo "slurm cluster up: $nodes nodes, SLURM_CONF=$SLURM_CONF"
            return 0
        fi
        sleep 0.2
    done
    echo "slurm cluster did not come up; see $dir/log" >&2
    sinfo >&2 || true
    return 1
}

stop_pid() {
    local pidfile=$1
    [ -s "$pidfile" ] || return 0
    local pid
    pid=$(cat "$pidfile")
    kill "$pid" 2>/dev/null || return 0
    for _ in $(seq 1 50); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.1
    done
    kill -9 "$pid" 2>/dev/null || true
}

down() {
    [ -f "$SLURM_CONF" ] || return 0
    scancel --quiet --user=root 2>/dev/null || true
    for pidfile in "$dir"/slurmd-*.pid; do
        stop_pid "$pidfile"
    done
    stop_pid "$dir/slurmctld.pid"
    if [ -f "$dir/munged.started-by-us" ]; then
        pkill -x munged || true
        rm -f "$dir/munged.started-by-us"
    fi
}

case $cmd in
    up) up ;;
    down) down ;;
    *) usage ;;
esac
