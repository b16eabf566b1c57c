#!/bin/bash
# Slurm node epilog: remove the fanfs mounts and staged data that job $SLURM_JOB_ID left on this
# node (a cancelled or killed job, a daemon killed with SIGKILL). Install on every node with
#   Epilog=/path/to/deploy/slurm/epilog.sh
# in slurm.conf; Slurm runs it as root after every job, when the job's processes are gone.
# It cleans the default locations of fanfs and of deploy/slurm/fanfs-job.sbatch; custom
# FANFS_MOUNTPOINT/FANFS_LOCAL paths are covered by the stale-mount sweep only.
job=${SLURM_JOB_ID:-}
node=${SLURMD_NODENAME:-}
[ -n "$job" ] || exit 0

unmount() { fusermount3 -u -z "$1" 2>/dev/null || umount -l "$1" 2>/dev/null; }

# Every fanfs mount whose daemon is gone is stale, whoever made it: stat on it fails at once
# ("Transport endpoint is not connected"). Live mounts of other jobs answer and are left alone.
awk '$3 == "fuse.fanfs" { print $2 }' /proc/mounts | while read -r escaped; do
    mnt=$(printf '%b' "$escaped")
    case "$mnt" in
        */fanfs-mnt-"$job"-"$node") unmount "$mnt" ;;
        *) timeout 5 stat "$mnt" >/dev/null 2>&1 || unmount "$mnt" ;;
    esac
done

for d in /tmp/fanfs-mnt-"$job"-"$node"; do
    [ -d "$d" ] && rmdir "$d" 2>/dev/null
done
rm -rf /tmp/fanfs-local-"$job"-"$node" "${TMPDIR:-/tmp}"/fanfs-*/job"$job"-"$node"
exit 0
