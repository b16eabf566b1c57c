"""`fanfs bench`: fanfs against native reads of the same files, side by side, in one run.

For each kind of data (`--data`: incompressible bytes of each `--sizes` size, float arrays,
CSV text, JPEG images): generate a dataset, prepare it, mount it (staging finished first), then
for each reader count, cold and warm, read every file whole in a random order with that many
reader processes, each side in turn (native reads of the source files, fanfs, and with
`--against squashfs` a squashfs image under squashfuse_ll; compressible data also prepared raw)
so that drift on a shared machine hits all alike; a warm pass reads the files as many times as
it takes to last half a second. Cold passes are cold as whoever runs the bench
(bench/passes.py, `make_cold`): root drops the kernel's caches, a user drops the files' pages
and has each daemon drop its own (`fanfs drop`). With `--ranks N` it also mounts N daemons
under mpirun and reads, through daemon 0, only the files other daemons own (remote), against
the same files read natively.

How a file is read (`--client`): "raw" opens it unbuffered and reads it into one buffer, as C,
TensorFlow or DALI readers do; "python" is `open(path, "rb").read()`, what PIL, numpy.load and
torch.load do, which on Python 3.13 and older also asks the file whether it is a terminal
(an ioctl that FUSE sends to the daemon on every open); "torch" is a PyTorch DataLoader
decoding JPEGs (`--data jpeg`). Reports files/s, MB/s, per-file latency percentiles, the
fanfs/native ratio (median of the repetitions, with min and max) and the others (fanfs/squashfs,
fanfs/raw), the daemon's CPU per file and while idle, as a table, JSON and a PNG plot.

The ratio is what matters: absolute numbers on a shared VM mean little (docs/performance.md).
"""

from __future__ import annotations

from fanfs.bench.passes import (
    COLD_BY,
    Case,
    Result,
    Side,
    _read_files,
    drop_caches,
    evict,
    list_dirs,
    make_cold,
    make_dataset,
    measure,
    read_all,
    size_label,
)
from fanfs.bench.report import format_table, plot, summarize
from fanfs.bench.runs import run, serving

__all__ = ["COLD_BY", "Case", "Result", "Side", "_read_files", "drop_caches", "evict",
           "format_table", "list_dirs", "make_cold", "make_dataset", "measure", "plot",
           "read_all", "run", "serving", "size_label", "summarize"]  # fmt: skip
