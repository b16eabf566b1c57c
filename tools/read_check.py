"""A sample training command: read every file under MOUNT and compare it with SOURCE.

Usage: python tools/read_check.py SOURCE [MOUNT]   (MOUNT defaults to $FANFS_MOUNTPOINT, which
deploy/slurm/fanfs-job.sbatch sets to the node's own mount point)
Prints one line (`<node>: OK <n> files`) and exits 0, or names the first difference and exits 1.
"""

from __future__ import annotations

import os
import sys

from fanfs.bench.compare import assert_same_tree


def main() -> int:
    args = sys.argv[1:]
    if len(args) == 1 and os.environ.get("FANFS_MOUNTPOINT"):
        args.append(os.environ["FANFS_MOUNTPOINT"])
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    node = os.environ.get("SLURMD_NODENAME", "local")
    try:
        n = assert_same_tree(args[0], args[1])
    except (AssertionError, OSError) as e:
        print(f"{node}: MISMATCH {e!r}", flush=True)
        return 1
    print(f"{node}: OK {n} files", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
