"""`fanfs bench`: fanfs against native reads of the same files, side by side, in one run.

For each file size: generate a dataset (incompressible bytes), prepare it, mount it (staging
finished first), then for each reader count, cold (kernel caches dropped, when permitted) and
warm, read every file whole in a random order with that many reader processes, alternating
native and fanfs runs (and which of them goes first) so that drift on a shared machine hits
both alike; a warm pass reads the files as many times as it takes to last half a second. With
`--ranks N` it also mounts N daemons under mpirun and reads, through daemon 0, only the files
other daemons own (remote), against the same files read natively.

How a file is read (`--client`): "raw" opens it unbuffered and reads it into one buffer, as C,
TensorFlow or DALI readers do; "python" is `open(path, "rb").read()`, what PIL, numpy.load and
torch.load do, which on Python 3.13 and older also asks the file whether it is a terminal
(an ioctl that FUSE sends to the daemon on every open). Reports files/s, MB/s, per-file latency
percentiles and the fanfs/native ratio (median of the repetitions, with min and max), as a
table, JSON and a PNG plot.

The ratio is what matters: absolute numbers on a shared VM mean little (docs/performance.md).
"""

from __future__ import annotations

from fanfs.bench.passes import (
    Case,
    Result,
    _read_files,
    drop_caches,
    list_dirs,
    make_dataset,
    measure,
    read_all,
    size_label,
)
from fanfs.bench.report import NOT_DROPPED, format_table, plot, summarize
from fanfs.bench.runs import run, serving

__all__ = ["NOT_DROPPED", "Case", "Result", "_read_files", "drop_caches", "format_table",
           "list_dirs", "make_dataset", "measure", "plot", "read_all", "run", "serving",
           "size_label", "summarize"]  # fmt: skip
