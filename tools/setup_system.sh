#!/usr/bin/env bash
# Installs the Debian packages fanfs needs, only those that are missing.
# libfuse3-dev, pkg-config and gcc build pyfuse3; fuse3 gives fusermount3; Open MPI is the transport.
set -euo pipefail
# slurm-wlm, munge, libpmix-dev: the single-machine Slurm cluster of the tests (srun --mpi=pmix).
# fio, rsync, zip: real clients the tests run through a mount.
# libisal2: ISA-L's CRC-32, ten times zlib's, for fanfs's C extension
# (fanfs/csrc, loaded at run time; zlib's is the fallback); libzstd1: it decodes zstd with it.
# squashfs-tools, squashfuse: `fanfs bench --against squashfs` measures squashfuse_ll beside fanfs.
want=(libfuse3-dev fuse3 pkg-config gcc openmpi-bin libopenmpi-dev slurm-wlm munge libpmix-dev
      fio rsync zip libisal2 libzstd1 squashfs-tools squashfuse)
missing=()
for pkg in "${want[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
# The Python the venv is made from (make setup PYTHON=...): it needs venv and, to build
# pyfuse3, its headers. Debian splits both out of its own python3.
python=${PYTHON:-python3}
if ! "$python" -c 'import venv, ensurepip' 2>/dev/null; then
    missing+=(python3-venv)
fi
if ! "$python" -c 'import os, sysconfig, sys
sys.exit(not os.path.exists(os.path.join(sysconfig.get_path("include"), "Python.h")))' 2>/dev/null; then
    missing+=(python3-dev)
fi
# The fuse control file system, where `fanfs umount` aborts a hung daemon's connection so that
# its readers get an error instead of waiting for ever. systemd mounts it at boot; a machine
# without systemd (a container) may not have it. Only root can mount it; without it fanfs
# works, and `fanfs umount` says it could not abort.
if [ -d /sys/fs/fuse/connections ] && ! grep -q ' /sys/fs/fuse/connections fusectl ' /proc/mounts \
        && [ "$(id -u)" -eq 0 ]; then
    mount -t fusectl none /sys/fs/fuse/connections || echo "fanfs setup: could not mount fusectl"
fi
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
echo "fanfs setup: installing system packages: ${missing[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then
    sudo="sudo"
fi
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
