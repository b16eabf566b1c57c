"""What an epoch costs at 1 to 1,024 nodes: a model fed by costs measured on the user's nodes.

`fanfs bench --calibrate FILE` measures the costs (`Calibration`) on the nodes at hand;
`fanfs project` applies them to a job (`Job`) at each node count. The formulas (docs/scaling.md
explains them and their assumptions), for N nodes with R readers and C cores each, files of mean
decoded size s (stored s / ratio), n files, r replicas:

- remote share: rho = q * (1 - min(r, N) / N)   (q = 1 global shuffle, 0 local, between partial)
- files a node reads per epoch: f = n / N
- per-file latency of one reader, local and remote (alpha-beta: a remote read is a local read
  on the owner plus alpha + beta * stored bytes on the wire):
    t_l = a_l + b_l * s,   t_r = t_l + alpha + alpha_net + beta * s / ratio
  plus decoding (d * s) when compressed. alpha and beta are measured between daemons on the
  calibrated nodes (on one machine: the software's round trip over shared memory); alpha_net
  is what the real network adds (a job parameter, 0 by default), and a given link bandwidth
  replaces 1 / beta.
- per node, each bound below is what the epoch would take were that resource the only limit;
    latency  f * ((1 - rho) t_l + rho t_r) / R          (R readers, each one file at a time)
    cpu      f * ((1 - rho) c_l + rho c_r) / C          (c: core-seconds a file costs the
                                                         node, readers and daemon, at capacity)
    daemon   f * ((1 - rho) d_l + rho d_r)              (d: seconds of the daemon's event loop,
                                                         one thread, per file; a remote file
                                                         costs its reader's and its owner's)
    disk     f * s / ratio / disk_bw                    (every node's disk serves its own files)
    network  f * rho * s / ratio / link_bw              (in and out alike, full duplex)
- staging: r * n * s / ratio / N bytes per node, from the shared file system at
  min(stage_bw, pfs_bw / N) per node.
- the epoch is found by mean value analysis (`epoch_seconds`): the R readers of a node are the
  customers of a closed queueing network whose queues are the cpu, daemon, disk and network
  (each bound over f is a file's demand there) and whose delay is what a file's one-reader
  latency holds beyond them; plus a per-epoch fixed cost: overhead_s (the job's: the first
  files of every reader, the sampler) and a barrier across the nodes at its end,
  (alpha + alpha_net) * ceil(log2 N).
- with the job's compute rate (files a node's training consumes per second), the epoch is the
  longer of that compute time and the I/O time above (a DataLoader reads ahead of training).
- efficiency at N: the one-node epoch time over N times the N-node epoch time.

Everything here is arithmetic on numbers (no I/O): `fanfs.bench.calibrate` measures, the CLI
reads and writes JSON.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

BOUNDS = ("latency", "cpu", "daemon", "disk", "network")
# With a compute rate the job's own pace is a bound too: reads overlap training (a DataLoader
# reads ahead), so the epoch is the longer of the two.
COMPUTE = "compute"
NODES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# Doubling the nodes speeds the epoch up less than this (80 % of the ideal 2x): it stopped
# scaling at the smaller count.
STOP_SPEEDUP = 1.6


@dataclass(frozen=True)
class Calibration:
    """Costs measured on one kind of node (seconds, bytes; per file a + b * bytes)."""

    host: str
    cores: int
    local_s: float  # a_l: per-file latency of a cold local read through fanfs, one reader
    local_s_per_byte: float  # b_l
    local_cpu_s: float  # core-seconds a local file takes of a node's cores (at capacity)
    local_cpu_s_per_byte: float
    local_daemon_s: float  # seconds of the daemon's event loop (one thread) per local file
    local_daemon_s_per_byte: float
    alpha_s: float  # a remote file's added latency (round trip)
    beta_s_per_byte: float  # ... and per stored byte
    remote_cpu_s: float  # core-seconds per remote file (reader's and owner's node together)
    remote_cpu_s_per_byte: float
    remote_daemon_s: float  # event-loop seconds per remote file (requester's and owner's halves)
    remote_daemon_s_per_byte: float
    warm_s: float  # per-file latency of a warm read (page cache), one reader
    warm_s_per_byte: float
    decode_s_per_byte: float  # zstd decoding, per decoded byte (compressed images)
    disk_bytes_per_s: float  # cold reads of large files, several readers (the disk's speed)
    stage_bytes_per_s: float  # staging an image from its directory
    request_s: float  # one FUSE round trip the daemon answers in C (a terminal check)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Calibration:
        names = {f.name for f in fields(cls)}
        missing = names - set(d)
        if missing:
            raise ValueError(f"not a fanfs calibration: missing {', '.join(sorted(missing))}")
        for name in names - {"host"}:
            value = d[name]
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value < 0):  # fmt: skip
                raise ValueError(f"not a fanfs calibration: {name} is {value!r}")
        if not isinstance(d["host"], str) or d["cores"] < 1:
            raise ValueError("not a fanfs calibration: host or cores")
        # Rates divide and a read must cost something: zeros would project nonsense.
        for name in ("disk_bytes_per_s", "stage_bytes_per_s"):
            if d[name] <= 0:
                raise ValueError(f"not a fanfs calibration: {name} is {d[name]!r}, not > 0")
        for a, b in (("local_s", "local_s_per_byte"), ("warm_s", "warm_s_per_byte")):
            if d[a] + d[b] <= 0:
                raise ValueError(f"not a fanfs calibration: {a} and {b} are both 0")
        return cls(**{k: d[k] for k in names})


@dataclass(frozen=True)
class Job:
    """What is read, by how many, how."""

    files: int
    bytes: int  # decoded bytes of all files
    readers: int = 4  # per node
    replicas: int = 1
    q: float = 1.0  # 1 global shuffle, 0 local, between: partial (fanfs.torch.LocalitySampler)
    ratio: float = 1.0  # compression ratio (decoded / stored); 1 = stored raw
    cold: bool = True  # the epoch reads from the disk (False: from the page cache)
    cores: float | None = None  # per node; None: the calibration's
    disk_bytes_per_s: float | None = None  # per node; None: the calibration's
    link_bytes_per_s: float | None = None  # per node's network link; None: 1 / beta
    net_alpha_s: float = 0.0  # what the network adds to the measured round trip
    pfs_bytes_per_s: float | None = None  # the shared file system, for all nodes at once
    overhead_s: float = 0.0  # fixed cost of every epoch (workers' first files, sampler)
    compute_files_per_s: float | None = None  # what a node's training consumes; None: I/O only

    @property
    def file_bytes(self) -> float:
        return self.bytes / max(1, self.files)


@dataclass(frozen=True)
class Projection:
    nodes: int
    remote_share: float
    epoch_s: float
    bound: str  # which of BOUNDS sets epoch_s, or "overhead" when the fixed cost is larger
    bounds_s: dict[str, float]  # BOUNDS and "overhead"
    files_per_s_per_node: float
    mb_per_s_per_node: float
    staging_s: float
    efficiency: float  # against one node

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def remote_share(job: Job, nodes: int) -> float:
    """The share of a node's reads whose file another node holds."""
    held = min(max(1, job.replicas), nodes) / nodes
    return max(0.0, min(1.0, job.q)) * (1.0 - held)


def epoch_bounds(cal: Calibration, job: Job, nodes: int) -> dict[str, float]:
    """Seconds one node's share of an epoch takes under each bound."""
    s, ratio = job.file_bytes, max(job.ratio, 1e-9)
    stored = s / ratio
    rho = remote_share(job, nodes)
    f = job.files / nodes
    decode = cal.decode_s_per_byte * s if job.ratio > 1 else 0.0
    alpha = cal.alpha_s + job.net_alpha_s
    if job.cold:
        t_l = cal.local_s + cal.local_s_per_byte * s + decode
    else:  # warm reads never reach a daemon, local or not
        t_l, rho = cal.warm_s + cal.warm_s_per_byte * s, 0.0
    t_r = t_l + alpha + cal.beta_s_per_byte * stored
    c_l = cal.local_cpu_s + cal.local_cpu_s_per_byte * s + decode
    c_r = cal.remote_cpu_s + cal.remote_cpu_s_per_byte * s + decode
    d_l = cal.local_daemon_s + cal.local_daemon_s_per_byte * s
    d_r = cal.remote_daemon_s + cal.remote_daemon_s_per_byte * s
    cores = cal.cores if job.cores is None else job.cores
    disk = cal.disk_bytes_per_s if job.disk_bytes_per_s is None else job.disk_bytes_per_s
    link = job.link_bytes_per_s
    if link is None:
        link = 1.0 / cal.beta_s_per_byte if cal.beta_s_per_byte > 0 else math.inf
    bounds = {
        "latency": f * ((1 - rho) * t_l + rho * t_r) / max(1, job.readers),
        "cpu": f * ((1 - rho) * c_l + rho * c_r) / max(cores, 1e-9),
        "daemon": f * ((1 - rho) * d_l + rho * d_r),
        "disk": f * stored / disk if job.cold else 0.0,
        "network": f * rho * stored / link,
        "overhead": job.overhead_s + (alpha * math.ceil(math.log2(nodes)) if nodes > 1 else 0),
    }
    if job.compute_files_per_s:
        bounds[COMPUTE] = f / job.compute_files_per_s
    return bounds


def epoch_seconds(bounds: dict[str, float], readers: int = 1) -> tuple[float, str]:
    """`io_seconds`, or the job's compute time when that is longer (bound "compute")."""
    io, bound = io_seconds(bounds, readers)
    compute = bounds.get(COMPUTE, 0.0)
    return (compute, COMPUTE) if compute > io else (io, bound)


def io_seconds(bounds: dict[str, float], readers: int = 1) -> tuple[float, str]:
    """(epoch seconds, what bounds it) from `epoch_bounds`, by mean value analysis of a closed
    queueing network: `readers` customers per node, each cycling through its files; the cpu,
    daemon, disk and network bounds are single-server queues (their per-file demand is the
    bound over f), and what the one-reader latency holds beyond them is a pure delay. With one
    reader that is the latency bound; with many, the busiest resource's queue sets the pace,
    and resources that are busy together add to each other's waits, which max() would ignore.
    The bound named is the busiest queue, or "latency" when no queue is half busy, or
    "overhead" when the fixed cost is larger than the rest."""
    queues = {k: bounds[k] for k in BOUNDS if k != "latency"}
    r = max(1, readers)
    total = sum(queues.values())
    delay = max(0.0, bounds["latency"] * r - total)  # per reader, over all its files
    waits = dict.fromkeys(queues, 0.0)
    backlog = dict.fromkeys(queues, 0.0)
    rate = 0.0  # epochs' worth of files per second, as a fraction
    for k in range(1, r + 1):
        waits = {q: d * (1 + backlog[q]) for q, d in queues.items()}
        rate = k / (delay + sum(waits.values()))
        backlog = {q: rate * w for q, w in waits.items()}
    io = 1.0 / rate if rate > 0 else 0.0
    busiest = max(queues, key=lambda q: rate * queues[q])
    bound = busiest if rate * queues[busiest] >= 0.5 else "latency"
    if bounds["overhead"] > io:
        bound = "overhead"
    return io + bounds["overhead"], bound


def staging_seconds(cal: Calibration, job: Job, nodes: int) -> float:
    per_node = max(1, min(job.replicas, nodes)) * job.bytes / max(job.ratio, 1e-9) / nodes
    bw = cal.stage_bytes_per_s
    if job.pfs_bytes_per_s is not None:
        bw = min(bw, job.pfs_bytes_per_s / nodes)
    return per_node / bw


def project(cal: Calibration, job: Job, nodes: tuple[int, ...] = NODES) -> list[Projection]:
    """The job's epoch at each node count (efficiency against one node)."""
    one, _ = epoch_seconds(epoch_bounds(cal, job, 1), job.readers)
    rows = []
    for n in nodes:
        bounds = epoch_bounds(cal, job, n)
        epoch, bound = epoch_seconds(bounds, job.readers)
        f = job.files / n
        rows.append(Projection(
            nodes=n,
            remote_share=remote_share(job, n),
            epoch_s=epoch,
            bound=bound,
            bounds_s=bounds,
            files_per_s_per_node=f / epoch if epoch > 0 else math.inf,
            mb_per_s_per_node=f * job.file_bytes / epoch / 1e6 if epoch > 0 else math.inf,
            staging_s=staging_seconds(cal, job, n),
            efficiency=one / (n * epoch) if epoch > 0 else 1.0,
        ))  # fmt: skip
    return rows


def stops_scaling(rows: list[Projection]) -> tuple[int | None, str]:
    """(the first node count from 2 on whose doubling speeds the epoch up less than
    STOP_SPEEDUP, why), or (None, "") if it scales to the last. From 2: going from one node to
    two always adds the remote reads of a shared dataset. Why: "overhead" when the fixed cost
    of an epoch, which does not shrink with the nodes, is a quarter of the doubled epoch or
    more; else what bounds the doubled epoch."""
    for a, b in itertools.pairwise(rows):
        if a.nodes >= 2 and b.nodes == 2 * a.nodes and a.epoch_s < STOP_SPEEDUP * b.epoch_s:
            fixed = b.bounds_s.get("overhead", 0.0) >= 0.25 * b.epoch_s
            return a.nodes, "overhead" if fixed else b.bound
    return None, ""


def with_overrides(job: Job, **changes: Any) -> Job:
    return replace(job, **{k: v for k, v in changes.items() if v is not None})
