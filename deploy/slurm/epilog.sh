#!/bin/bash
# Slurm node epilog: remove the fanfs mounts and staged data that job $SLURM_JOB_ID left on this
# node (a cancelled or killed job, a daemon killed with SIGKILL). Install on every node with
#   Epilog=/path/to/deploy/slurm/epilog.sh
# in slurm.conf; Slurm runs it as root after every job, when the job's processes are gone.
# It cleans the default locations of fanfs and of deploy/slurm/fanfs-job.sbatch; custom
# FANFS_MOUNTPOINT paths are covered by the stale-mount sweep only.
job=${SLURM_JOB_ID:-}
node=${SLURMD_NODENAME:-}
[ -n "$job" ] || exit 0

unmount() { fusermount3 -u -z "$1" 2>/dev/null || umount -l "$1" 2>/dev/null; }

# A mount of this job is unmounted. Any other fanfs mount is unmounted only if its daemon is
# gone: the kernel then answers ENOTCONN ("not connected") at once. Root gets EACCES on another
# user's live FUSE mount, and a busy daemon may answer slowly: both are alive, left alone.
# An output mount's files are never lost this way: its staging directory holds them and its
# journal, which the next `fanfs output` with the same DEST and --local, or `fanfs output
# --recover`, lands; it is left in place.
awk '$3 == "fuse.fanfs" || $3 == "fuse.fanfs-output" { print $2 }' /proc/mounts |
while read -r escaped; do
    mnt=$(printf '%b' "$escaped")
    case "$mnt" in
        */fanfs-mnt-"$job"-"$node" | */fanfs-out-"$job"-"$node") unmount "$mnt"; continue ;;
    esac
    err=$(LC_ALL=C timeout 5 stat -- "$mnt" 2>&1 >/dev/null)  # C: the message is matched
    case "$err" in *"not connected"*) unmount "$mnt" ;; esac
done

for d in /tmp/fanfs-mnt-"$job"-"$node" /tmp/fanfs-out-"$job"-"$node"; do
    [ -d "$d" ] && rmdir "$d" 2>/dev/null
done
# Staged partitions are anonymous files that vanish with their daemon; what a killed daemon
# leaves is its empty private staging directory, named fanfs-stage-PID-*. rmdir removes only
# empty ones, and only where that daemon is gone.
for d in "${TMPDIR:-/tmp}"/fanfs-stage-* /tmp/fanfs-stage-*; do
    [ -d "$d" ] && [ ! -L "$d" ] || continue
    pid=${d##*/fanfs-stage-}; pid=${pid%%-*}
    case "$pid" in ''|*[!0-9]*) continue ;; esac
    kill -0 "$pid" 2>/dev/null || rmdir -- "$d" 2>/dev/null
done
exit 0
