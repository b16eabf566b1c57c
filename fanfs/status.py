"""What `fanfs status` shows: typed records of each component's counters, and their rendering.

Each component's `statistics()` returns its record (trio's convention); the daemon assembles a
`Status`, which travels as JSON in the mount root's hidden extended attribute
(mounts.STATUS_XATTR). The JSON layout is the documented one (`fanfs status --json`): the
reader's and the transport's counters share the "reader" object. `Status.from_json` rebuilds
the records on the CLI side and refuses a layout it does not know, so no key is ever read on
trust.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from fanfs.progress import human_bytes


@dataclass(frozen=True, slots=True)
class Percentiles:
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    max: float = 0.0  # the longest since the daemon started, not only of the kept samples

    def flat(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}_{k}": v for k, v in asdict(self).items()}

    @classmethod
    def unflat(cls, d: dict[str, Any], prefix: str) -> Percentiles:
        return cls(**{f.name: d.pop(f"{prefix}_{f.name}") for f in fields(cls)})


@dataclass(frozen=True, slots=True)
class CatalogStatus:
    entries: int
    files: int
    memory_bytes: int


@dataclass(frozen=True, slots=True)
class StoreStatus:
    local_dir: str
    partitions_owned: int
    partitions_staged: int
    bytes_staged: int
    bytes_to_stage: int
    staging_done: bool
    staging_seconds: float
    image_reads: int
    staging_stopped: str = ""  # why staging stopped early ("" if it did not): reads go to the image
    keep_dir: str = ""  # --keep DIR, "" without
    partitions_adopted: int = 0  # found in DIR, checked, served from there
    partitions_kept: int = 0  # staged by this mount and left in DIR
    partitions_evicted: int = 0  # removed from DIR by this mount (--keep-size)
    kept_replaced: int = 0  # entries of DIR refused (changed, planted, truncated) and staged again
    bytes_from_image: int = 0  # staged from the image, and read from it before staging


@dataclass(frozen=True, slots=True)
class ReaderStatus:
    reads: int
    local_fetches: int
    cache_hits: int
    bytes_fetched: int
    bytes_served: int
    cache_bytes: int
    cache_limit: int
    bad_files: int
    fallbacks: int
    bad_payloads: int
    native_jobs: int
    lookup_fetches: int  # remote files fetched at their LOOKUP (fanfs/node/reader.py, LookAhead)
    lookup_fetches_read: int
    lookup_fetches_unread: int
    fetch_ms: Percentiles  # local fetches through Python (the front's READs: front.read_ms)
    image_ms: Percentiles  # reads from the image on shared storage when no peer could answer
    hedged: int = 0  # peer fetches asked of a second holder: the first was slow (replicas)
    hedges_won: int = 0  # ... that the second holder answered first


@dataclass(frozen=True, slots=True)
class PeerStatus:
    remote_fetches: int
    remote_bytes: int
    remote_ms: Percentiles
    peer_timeouts: int
    served_to_peers: int
    served_without_event_loop: int  # of those, answered by the transport's threads
    bytes_served_to_peers: int
    refused_to_peers: int
    malformed_messages: int
    dead_peers: list[int]
    peers_said_bye: list[int]
    batch_fetches: int = 0  # round trips that fetched several files for a planned epoch
    batched_files: int = 0  # ... and the files they fetched
    plane_fetches: int = 0  # peers' files the data plane fetched for the front (in C)
    plane_handed_back: int = 0  # ... that it handed back to the MPI thread instead
    plane_left: int = 0  # transfers it left to MPI unfinished (their peers died mid-transfer)


@dataclass(frozen=True, slots=True)
class PlanStatus:
    """Planned epochs (fanfs/node/planner.py)."""

    shares: int  # plans in force
    planned: int  # files named by plans taken so far
    missing: int  # paths in plans that name no file of the image
    position: int  # sum over shares of the job's position in its plan
    prefetched: int  # files read ahead
    pushed_to_kernel: int  # of those, stored straight into the page cache
    prefetched_bytes: int
    held_bytes: int  # read ahead, waiting in the daemon's memory for their READ
    hits: int  # READs answered from bytes held in memory
    misses: int  # READs of planned files that found nothing read ahead
    dropped_unread_bytes: int  # held bytes the job went past without reading
    failed: int  # read-aheads that failed (the READ then fetches the file itself)
    refused: int  # plan requests refused (malformed, too large, another user)
    budget_bytes: int
    followed: int = 0  # LOOKUPs and READs the front answered in C and told the planner of
    followed_lost: int = 0  # ... and could not tell (its record was full)
    pushed_in_c: int = 0  # of the pushed, files read, checked, decoded and stored by the C alone
    pushed_from_peers: int = 0  # ... of them peers' files (fetched as the front's: the data plane)
    pushed_together: int = 0  # ... of those, fetched in a turn of several (fanfs_pool_push_files)


NO_PLAN = PlanStatus(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)


@dataclass(frozen=True, slots=True)
class FrontStatus:
    """The front (fanfs/csrc/front.c): requests its threads took from the FUSE device."""

    running: bool
    lookups: int  # LOOKUPs answered from the catalog in C
    getattrs: int
    reads: int  # READs answered in the thread that took them
    others: int  # IOCTL, FORGET, INTERRUPT: answered or dropped
    forwarded: int  # handed to pyfuse3's session loop
    waits: int  # times the leader slept (no request within its poll)
    lookahead_started: int  # files read into the pool's cache at their LOOKUP
    lookahead_used: int  # ... then READ
    lookahead_unused: int  # ... never READ while remembered (a stat walk)
    read_ms: Percentiles = Percentiles()  # its READs, from taking the request to the reply
    remote_fetched: int = 0  # peers' files the MPI thread fetched for its READs (no Python)
    remote_failed: int = 0  # ... no holder could give (those READs went to Python)
    remote_at_lookup: int = 0  # ... fetches started at a LOOKUP
    protocol: str = ""  # the kernel's FUSE protocol, from its INIT ("7.27"; "" before it)
    off: str = ""  # why the front answers nothing, in one line ("": it answers)


NO_FRONT = FrontStatus(False, 0, 0, 0, 0, 0, 0, 0, 0, 0)


@dataclass(frozen=True, slots=True)
class Status:
    pid: int
    image: str
    mountpoint: str
    rank: int
    size: int
    replicas: int  # ranks holding each partition (not broadcast ones)
    host: str
    node: str
    serving: bool
    no_open: bool
    native_read_pool: bool
    native_crc32: str | None
    native_decodes: bool  # the pool decodes compressed files too (libzstd found)
    native_frame_hits: int  # pieces (frames, parts of files) the pool's cache answered
    native_frame_misses: int
    # What the pool pushed into the kernel's page cache beyond what READs asked for (pieces,
    # bytes), and how it read pieces: O_DIRECT (not in the page cache) or from the page cache.
    native_pushes: int
    native_pushed_bytes: int
    native_direct_reads: int
    native_cached_reads: int
    native_fast_reads: int  # READs the front answered with no Python (not in reader.reads)
    front: FrontStatus
    uptime_s: float
    catalog: CatalogStatus
    store: StoreStatus
    reader: ReaderStatus
    peers: PeerStatus | None  # None: a single daemon, nothing is remote
    plan: PlanStatus
    plan_socket: str  # where fanfs.plan reaches the daemon ("" until it listens)
    # The latency budget (docs/performance.md): READs the front answered ("local_n",
    # "remote_n") and the nanoseconds of each stage ("local_disk_ns", ...), the reads at LOOKUP
    # ("ahead_..."), the legs of peers' pieces ("fetch_..."), the owner's side ("owner_...").
    budget: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["catalog"], d["store"] = asdict(self.catalog), asdict(self.store)
        d["plan"], d["front"] = asdict(self.plan), _flat(self.front)
        d["reader"] = _flat(self.reader)
        peers = d.pop("peers")
        if peers is not None:
            d["reader"].update(_flat(peers))
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Status:
        """The records back from `to_json`'s layout; ValueError if it is not that layout."""
        try:
            d = dict(d)
            reader = dict(d.pop("reader"))
            peers = None
            if "remote_fetches" in reader:
                names = [f.name for f in fields(PeerStatus)]
                part = {k: reader.pop(k) for k in list(reader) if k.startswith("remote_ms_")}
                part.update({k: reader.pop(k) for k in names if k in reader})
                part["remote_ms"] = Percentiles.unflat(part, "remote_ms")
                peers = PeerStatus(**part)
            reader["fetch_ms"] = Percentiles.unflat(reader, "fetch_ms")
            reader["image_ms"] = Percentiles.unflat(reader, "image_ms")
            front = dict(d.pop("front"))
            front["read_ms"] = Percentiles.unflat(front, "read_ms")
            catalog, store = CatalogStatus(**d.pop("catalog")), StoreStatus(**d.pop("store"))
            plan = PlanStatus(**d.pop("plan"))
            return cls(**d, catalog=catalog, store=store, reader=ReaderStatus(**reader),
                       peers=peers, plan=plan, front=FrontStatus(**front))  # fmt: skip
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a status this fanfs knows: {e}") from None


def _flat(record: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(record):
        value = getattr(record, f.name)
        if isinstance(value, Percentiles):
            out.update(value.flat(f.name))
        elif dataclasses.is_dataclass(value):
            out[f.name] = asdict(value)  # type: ignore[arg-type]
        else:
            out[f.name] = value
    return out


def sources(s: Status) -> list[tuple[str, Percentiles, int]]:
    """(name, latency, reads) of each source of a file's bytes that has been timed: the READs
    the front answered in C (this node's files, and peers' ones the MPI thread fetched for it),
    local fetches through Python, fetches from peers, the image."""
    rd, p = s.reader, s.peers
    every = [("front (C)", s.front.read_ms, s.front.reads),
             ("local", rd.fetch_ms, rd.local_fetches),
             ("peer", p.remote_ms if p else Percentiles(), p.remote_fetches if p else 0),
             ("image", rd.image_ms, rd.fallbacks)]  # fmt: skip
    return [(name, ms, n) for name, ms, n in every if n and ms.max > 0]


def _latencies(s: Status) -> str:
    return "; ".join(f"{name} p50 {ms.p50} ms, p99 {ms.p99} ms, max {ms.max} ms"
                     for name, ms, _ in sources(s))  # fmt: skip


# The stages of the latency budget, in the order of fanfs_native.h's FANFS_STAGE_* (their count
# is the C's lib.BUDGET_STAGES: tests/unit checks it), and the legs of peers' pieces on both
# daemons.
STAGES = ("lead", "job", "cache", "disk", "check", "decode", "peer", "reply", "push", "end")
LEGS = {"fetch": ("queued", "away", "fill"), "owner": ("queue", "read", "post")}


def _budget(b: dict[str, int]) -> str:
    """The latency budget in one line: each kind's mean stages in microseconds."""
    parts = []
    for kind, name in (("local", "a local READ"), ("remote", "a peer's READ"),
                       ("ahead", "a read at lookup")):  # fmt: skip
        n = b.get(f"{kind}_n", 0)
        if n:
            us = {st: b[f"{kind}_{st}_ns"] / n / 1e3 for st in STAGES if b.get(f"{kind}_{st}_ns")}
            stages = ", ".join(f"{st} {v:.0f}" for st, v in us.items())
            parts.append(f"{name} {sum(us.values()):.0f} us ({stages})")
    for kind, legs in LEGS.items():
        n = b.get(f"{kind}_n", 0)
        if n:
            what = "fetches" if kind == "fetch" else "answers to peers"
            means = (f"{leg} {b.get(f'{kind}_{leg}_ns', 0) / n / 1e3:.0f}" for leg in legs)
            parts.append(f"{what} ({', '.join(means)} us)")
    if b.get("spin_ns"):
        parts.append(f"the leader polled {b['spin_ns'] / 1e9:.2f} s")
    return "; ".join(parts)


def render(s: Status) -> str:
    """The human view of `fanfs status`."""
    st, rd, p = s.store, s.reader, s.peers
    lines = [
        f"{s.mountpoint}: {'serving' if s.serving else 'starting'} {s.image} "
        f"(rank {s.rank}/{s.size}@{s.host}, pid {s.pid}, up {s.uptime_s:.0f} s)",
        f"catalog:  {s.catalog.files} files, {human_bytes(s.catalog.memory_bytes)} in memory",
        f"staging:  {st.partitions_staged}/{st.partitions_owned} partitions, "
        f"{human_bytes(st.bytes_staged)}/{human_bytes(st.bytes_to_stage)} "
        f"to {st.keep_dir or st.local_dir}{' (done)' if st.staging_done else ''}"
        + (
            f"; kept: {st.partitions_adopted} adopted, {st.partitions_kept} kept, "
            f"{st.partitions_evicted} evicted, {st.kept_replaced} replaced"
            if st.keep_dir
            else ""
        )
        + f"; {human_bytes(st.bytes_from_image)} read from the image"
        + (
            f"; stopped: {st.staging_stopped} (the rest is read from the image)"
            if st.staging_stopped
            else ""
        ),
        f"reads:    {rd.reads} requests, {rd.local_fetches} local fetches, "
        f"{rd.cache_hits} cache hits, {human_bytes(rd.bytes_served)} served, "
        f"{rd.bad_files} bad files",
        "latency:  " + _latencies(s),
    ]
    if s.native_read_pool:
        lines.append(
            f"native:   {rd.native_jobs + s.native_fast_reads} reads answered in C "
            f"({s.native_fast_reads} with no Python; CRC-32 {s.native_crc32}, "
            f"{'decoding zstd' if s.native_decodes else 'raw files only'}), piece cache "
            f"{s.native_frame_hits} hits / {s.native_frame_misses} misses; "
            f"{human_bytes(s.native_pushed_bytes)} pushed to the page cache; "
            f"{s.native_direct_reads} direct reads"
        )
    f = s.front
    if f.off:
        lines.append(f"front:    off: {f.off}")
    elif f.running:
        lines.append(
            f"front:    {f.lookups} lookups, {f.getattrs} getattrs, {f.reads} reads answered "
            f"in C with no event loop, {f.forwarded} forwarded; {f.lookahead_started} reads "
            f"started at lookup ({f.lookahead_used} read, {f.lookahead_unused} never); "
            f"{f.remote_fetched} peers' files fetched for it ({f.remote_at_lookup} at lookup, "
            f"{f.remote_failed} given up); kernel FUSE {f.protocol or '(no INIT yet)'}"
        )
    if p is not None:
        lines.append(
            f"remote:   {p.remote_fetches} fetched ({human_bytes(p.remote_bytes)}; "
            f"{p.plane_fetches} by the data plane, {p.plane_handed_back} handed back), "
            f"p50 {p.remote_ms.p50} ms, p99 {p.remote_ms.p99} ms, {p.batched_files} more in "
            f"{p.batch_fetches} batches, {rd.lookup_fetches} at lookup "
            f"({rd.lookup_fetches_read} read); {p.served_to_peers} served "
            f"to peers ({human_bytes(p.bytes_served_to_peers)}); {rd.hedged} hedged "
            f"({rd.hedges_won} won); {rd.fallbacks} image fallbacks, {p.peer_timeouts} peer "
            f"timeouts, dead peers {p.dead_peers}"
            + (f" ({p.plane_left} transfers with them left to MPI)" if p.plane_left else "")
        )
    if budget := _budget(s.budget):
        lines.append("budget:   " + budget)
    pl = s.plan
    if pl.shares:
        lines.append(
            f"plan:     {pl.shares} shares, {pl.planned} planned ({pl.missing} missing), at "
            f"{pl.position}; {pl.prefetched} read ahead ({pl.pushed_to_kernel} into the page "
            f"cache, {pl.pushed_in_c} of them by the C alone, {pl.pushed_from_peers} from peers, "
            f"{pl.pushed_together} in turns of several), "
            f"{pl.hits} hits, {pl.misses} misses, "
            f"{human_bytes(pl.dropped_unread_bytes)} dropped unread; {pl.followed} opens and "
            f"reads answered in C followed ({pl.followed_lost} lost)"
        )
    return "\n".join(lines)
