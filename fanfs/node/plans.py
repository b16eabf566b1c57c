"""Planned epochs' state, in one owner: every share's order, the job's position in it, how far
ahead the daemon has read, the budget, and the bytes read ahead that wait for their READ.

A *share* is one training rank's plan on this node (fanfs/node/planner.py reads ahead of it,
fanfs/node/plansocket.py takes it from the job). What this module decides:

- **Where the job is.** The job's position moves with the READs and LOOKUPs of planned files
  (those the front answers in C it records for the daemon: `accessed`, `answered`) and with
  progress messages. A file may appear several times in a plan
  (samplers pad ranks by repeating samples, sampling with replacement repeats them) and in
  several shares (ranks of one node share padding): an access is matched to its first
  occurrence at or after the share's *window* behind the reads, so a repeat later in the plan
  never moves the position there early; among several shares the one whose reads are nearest
  takes it. Reads arrive out of order and behind what progress messages say (a DataLoader's
  workers read what the sampler drew `workers x prefetch_factor x batch_size` samples ago):
  the window is the largest such lag seen, doubled, at least MIN_WINDOW, and carries over to
  the share's next plan.
- **How far ahead.** The budget (`--prefetch-mb`) counts *decoded* bytes, the memory they take
  in the page cache or here: each share reads ahead while its bytes from its position to its
  read-ahead position stay within its part of the budget (the budget over the shares still
  reading). A file is read ahead once per plan, at its first occurrence; a framed file only
  up to PARTIAL_SHARE of the budget (its first frames), the job's READs fetch the rest.
- **Bytes held.** Bytes the kernel could not take (it did not know the file's inode yet) wait
  here until their READ, within the budget; those the job's READs passed by more than the
  window are dropped and counted as dropped unread (progress messages alone drop nothing:
  what was drawn may not have been read yet).

Building a share's order (sorting a million entries) is `ShareOrder.build`, a pure function
for a worker thread; installing it is O(size) numpy on the event loop.

Concurrency: `Plans` runs in the trio thread only (no awaits inside: every method is atomic
with respect to other tasks). `ShareOrder.build` and `read_ahead_bytes` are pure.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import trio

from fanfs.image import catalog as cat
from fanfs.node.order import ShareOrder
from fanfs.status import PlanStatus

MIN_WINDOW = 256  # positions behind the job's position that still count as in flight
MISSED_KEPT = 4096  # recent READs that found nothing read ahead (their late bytes are not held)
MAX_SHARES = 1024


@dataclass
class Share:
    plan: ShareOrder
    position: int = 0  # the job has drawn or read plan positions [0, position)
    read_at: int = 0  # ... and READ or LOOKUP reached the daemon from [0, read_at)
    next: int = 0  # the next position to read ahead
    lag: int = 0  # the largest distance behind `position` a READ or LOOKUP has come from
    held: dict[int, int] = field(default_factory=dict)  # position -> entry whose bytes wait
    held_order: list[int] = field(default_factory=list)  # a heap of held positions
    held_bytes: int = 0
    # Positions READ before they were read ahead (the kernel has those files): not read ahead
    # (once overtaken, the pushers fetched each file twice). A byte a position, beside forty.
    overtaken: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.overtaken = np.zeros(len(self.plan), dtype=bool)

    @property
    def window(self) -> int:
        return max(MIN_WINDOW, 2 * self.lag)

    @property
    def floor(self) -> int:
        """Positions before this are behind the job: not read ahead any more."""
        return max(0, self.position - self.window)

    @property
    def read_floor(self) -> int:
        """Bytes held for positions before this were passed by the job's reads: dropped.
        (Held bytes are files whose READ must reach the daemon, so READs tell.)"""
        return max(0, self.read_at - self.window)

    def ahead_bytes(self) -> int:
        """Decoded bytes read ahead beyond the job's position (what the budget bounds)."""
        return self.plan.upto(self.next) - self.plan.upto(min(self.position, self.next))

    # The share's own changes, which `Plans` (its owner) asks for.

    def advance(self, position: int) -> bool:
        """The job has drawn or read up to `position`: True if that moved it."""
        if position <= self.position:
            return False
        self.position = min(position, len(self.plan))
        return True

    def accessed(self, pos: int, overtook: bool) -> bool:
        """A READ or LOOKUP of position `pos` reached the daemon (`overtook`: a READ that found
        nothing read ahead): learn how far behind the drawn position reads come; True if it
        moved the reads on."""
        self.overtaken[pos] |= overtook
        if pos < self.position:
            self.lag = max(self.lag, self.position - pos)
        if pos < self.read_at:
            return False
        self.read_at = pos + 1
        return True

    def rewind(self, pos: int) -> None:
        """Read `pos` ahead again (its bytes were not kept)."""
        self.next = min(self.next, pos)

    def take(self) -> int:
        """The next position to read ahead, skipping what the job has passed."""
        self.next = max(self.next, self.floor)
        pos = self.next
        self.next += 1
        return pos

    def keep(self, pos: int, entry: int, nbytes: int) -> None:
        self.held[pos] = entry
        self.held_bytes += nbytes
        heapq.heappush(self.held_order, pos)

    def let_go(self, pos: int, nbytes: int) -> None:
        if self.held.pop(pos, None) is not None:
            self.held_bytes -= nbytes


@dataclass
class Held:
    data: bytes
    share: int
    position: int


class Plans:
    def __init__(self, catalog: cat.Catalog, budget: int,
                 on_install: Callable[[], None] = lambda: None,
                 on_hold: Callable[[int, bool], None] = lambda entry, held: None):  # fmt: skip
        """`on_install`: called when a plan comes in (the front starts telling which files
        it looks up and reads); `on_hold(entry, held)`: bytes of `entry` are held here for its
        READ (True, its READs must reach the daemon) or not any more (False)."""
        self.catalog = catalog
        self.budget = budget
        self.on_install = on_install
        self.on_hold = on_hold
        self.shares: dict[int, Share] = {}
        n = catalog.n_entries
        self._share_of = np.full(n, -1, dtype=np.int32)  # the latest share naming each entry
        self._naming = np.zeros(n, dtype=np.uint16)  # how many shares name it
        self._held: dict[int, Held] = {}  # entry -> bytes read ahead, waiting for its READ
        # Files whose READ came (before their read-ahead finished, or to bytes held for it):
        # bytes arriving for them now would wait for a READ that has been (the kernel has the
        # file): not held.
        self._missed: OrderedDict[int, None] = OrderedDict()
        self.held_bytes = 0
        self.planned = 0
        self.missing = 0
        self.hits = 0
        self.misses = 0
        self.scanning = False  # `due` stopped with positions left to pass over
        self.dropped_unread_bytes = 0
        self.refused = 0
        self._changed = trio.Event()  # set when a plan or a position moves

    async def changed(self) -> None:
        """Return once a plan was installed or a position moved since the last call."""
        await self._changed.wait()
        self._changed = trio.Event()

    # -- plans and progress ------------------------------------------------------------------

    def refuse(self) -> None:
        """A plan request was refused (counted in the status)."""
        self.refused += 1

    def install(self, share: int, plan: ShareOrder, missing: int = 0) -> None:
        """Replace `share`'s plan (a new epoch; `missing`: its paths that named no file); the
        job's lag carries over."""
        self.on_install()
        old = self.shares.pop(share, None)
        lag = 0
        if old is not None:
            lag = old.lag
            self._drop(share, old, len(old.plan) + 1)
            self._naming[old.plan.unique] -= 1
        self.shares[share] = Share(plan, lag=lag)
        self._share_of[plan.unique] = share
        self._naming[plan.unique] += 1
        self.planned += len(plan)
        self.missing += missing
        self._rebalance()
        self._changed.set()

    def _rebalance(self) -> None:
        """Shares that read ahead past their part of the budget while fewer shares had plans
        (ranks publish a few milliseconds apart) give back the held bytes furthest ahead, to
        be read again in turn: otherwise the first plan keeps the whole budget and every
        other rank's first reads miss."""
        per_share = self.budget // max(1, self.active())
        for s in self.shares.values():
            ahead = sorted((p for p in s.held if p >= s.position), reverse=True)
            used = self._outstanding(s)
            for pos in ahead:
                if used <= per_share:
                    break
                held = self._release(s.held[pos])
                if held is not None:
                    used -= len(held.data)
                    s.rewind(pos)

    def progress(self, share: int, position: int) -> None:
        """The job of `share` has read (or drawn) its plan up to `position`."""
        s = self.shares.get(share)
        if s is not None and s.advance(position):
            self._changed.set()

    def accessed(self, entry: int, hit: bool | None) -> None:
        """A LOOKUP (`hit` None) or a READ of `entry` reached the daemon, answered from bytes
        read ahead (`hit`) or not: the job is there in its plan."""
        naming = int(self._naming[entry])
        if naming == 0:
            return
        candidates = [int(self._share_of[entry])] if naming == 1 else list(self.shares)
        best: tuple[int, int, int] | None = None  # (distance ahead, share, position)
        for share in candidates:
            s = self.shares.get(share)
            if s is None:
                continue
            pos = s.plan.occurrence(entry, s.read_floor)
            if pos is not None and (best is None or max(0, pos - s.read_at) < best[0]):
                best = (max(0, pos - s.read_at), share, pos)
        if best is None:
            return
        _, share, pos = best
        s = self.shares[share]
        self.misses += hit is False
        if s.accessed(pos, hit is False):
            self._drop(share, s, s.read_floor)
        self.progress(share, pos + 1)

    def answered(self, entry: int) -> None:
        """The front answered a READ of `entry` from its start with no daemon's Python (it
        read the file itself, nothing was held for it then): the job is there in its plan (a
        miss), and bytes held or still coming for it are not wanted any more (bytes held
        since: their read-ahead lost the race to the READ, which is counted as the miss)."""
        if not self.shares or not self._naming[entry]:
            return
        self.accessed(entry, False)
        self._miss(entry)
        self._release(entry)

    def _miss(self, entry: int) -> None:
        self._missed[entry] = None
        if len(self._missed) > MISSED_KEPT:
            self._missed.popitem(last=False)

    # -- what to read ahead ------------------------------------------------------------------

    def active(self) -> int:
        """Shares whose job has not read its whole plan (they split the budget)."""
        return sum(1 for s in self.shares.values() if s.position < len(s.plan))

    def due(self, limit: int) -> list[tuple[int, Share, int, int, int]]:
        """Up to `limit` positions to read ahead now, within the budget: (share, its Share,
        position, entry, decoded bytes). Each is taken (`next` moves past it). A share takes
        what fits in its part of the budget (at least one file at a time); the bytes held
        for all shares never pass the budget. Positions with nothing to read (a file's later
        draws) are passed over, at most `limit` of them per call: `scanning` then says that
        more are left (a plan of one file drawn 400,000 times froze the event loop for a
        second in one call)."""
        out: list[tuple[int, Share, int, int, int]] = []
        per_share = self.budget // max(1, self.active())
        free = self.budget - self.held_bytes
        passed = 0
        self.scanning = False
        for share, s in list(self.shares.items()):
            used = self._outstanding(s)
            while len(out) < limit and (at := max(s.next, s.floor)) < len(s.plan):
                cost = 0 if s.overtaken[at] else int(s.plan.cost[at])
                if (used and used + cost > per_share) or (self.held_bytes and cost > free):
                    break
                if not cost and passed == limit:
                    self.scanning = True
                    break
                pos = s.take()
                if cost:
                    out.append((share, s, pos, int(s.plan.order[pos]), cost))
                    used += cost
                    free -= cost
                else:
                    passed += 1
        return out

    def _outstanding(self, s: Share) -> int:
        """Decoded bytes read ahead for `s` that its job has not read: those beyond its
        position, and those held for positions it drew but has not read yet."""
        behind = sum(len(self._held[e].data) for p, e in s.held.items() if p < s.position)
        return s.ahead_bytes() + behind

    def current(self, share: int, s: Share, pos: int) -> bool:
        """Whether a read-ahead of `pos` is still wanted (its plan not replaced, the job not
        past it, its READ not come). Safe from any thread: reads of plain attributes, a stale
        answer only costs one read-ahead."""
        return self.shares.get(share) is s and pos >= s.floor and not s.overtaken[pos]

    # -- bytes held until their READ --------------------------------------------------------

    def hold(self, share: int, s: Share, pos: int, entry: int, data: bytes) -> bool:
        """Keep a whole file's bytes until its READ, within the budget and the share's part
        of it. Read-aheads finish out of order: when the share is full, bytes held for
        positions further ahead give way to these (they are read again in turn); when nothing
        further ahead is held, False, and this position is read ahead again once there is
        room."""
        if not self.current(share, s, pos) or entry in self._held or entry in self._missed:
            return False
        per_share = self.budget // max(1, self.active())

        def full() -> bool:
            return bool((self.held_bytes and self.held_bytes + len(data) > self.budget) or
                        (s.held_bytes and s.held_bytes + len(data) > per_share))  # fmt: skip

        while full():
            further = max((p for p in s.held if p > pos), default=None)
            if further is None:
                s.rewind(pos)
                return False
            self._release(s.held[further])
            s.rewind(further)
        self._held[entry] = Held(data, share, pos)
        s.keep(pos, entry, len(data))
        self.held_bytes += len(data)
        self.on_hold(entry, True)
        return True

    def has(self, entry: int) -> bool:
        return entry in self._held

    def read(self, entry: int, offset: int, size: int) -> memoryview | None:
        """A READ of `entry` reached the daemon: the bytes held for it, or None. Either way
        the job is there in its plan. The held bytes go once the READ reaches their end
        (the kernel keeps the file from then on)."""
        held = self._held.get(entry)
        if self.shares:
            self.accessed(entry, held is not None)
        if held is None:
            if self.shares:
                self._miss(entry)
            return None
        self.hits += 1
        if offset + size >= len(held.data):
            self._release(entry)
            # Read: the kernel keeps it now. A read-ahead of it again (a rewind of a position
            # before it, to make room, reads the positions after it again too) would hold
            # bytes for a READ that never comes.
            self._miss(entry)
        return memoryview(held.data)[offset : offset + size]

    def _release(self, entry: int) -> Held | None:
        held = self._held.pop(entry, None)
        if held is not None:
            self.on_hold(entry, False)
            self.held_bytes -= len(held.data)
            self._changed.set()  # room in the budget again
            s = self.shares.get(held.share)
            if s is not None:
                s.let_go(held.position, len(held.data))
        return held

    def _drop(self, share: int, s: Share, before: int) -> None:
        """Drop what is held for positions before `before`, oldest first (positions whose
        bytes their READ took are skipped as they come up)."""
        while s.held_order and s.held_order[0] < before:
            entry = s.held.get(heapq.heappop(s.held_order))
            held = self._release(entry) if entry is not None else None
            if held is not None:
                self.dropped_unread_bytes += len(held.data)

    def statistics(self, prefetched: int, pushed: int, prefetched_bytes: int, failed: int,
                   followed: int = 0, followed_lost: int = 0,
                   in_c: int = 0, from_peers: int = 0, together: int = 0,
                   ) -> PlanStatus:  # fmt: skip
        shares = list(self.shares.values())
        return PlanStatus(
            shares=len(shares), planned=self.planned, missing=self.missing,
            position=sum(s.position for s in shares), prefetched=prefetched,
            pushed_to_kernel=pushed, pushed_in_c=in_c, pushed_from_peers=from_peers,
            pushed_together=together, prefetched_bytes=prefetched_bytes,
            held_bytes=self.held_bytes, hits=self.hits, misses=self.misses,
            dropped_unread_bytes=self.dropped_unread_bytes, failed=failed, refused=self.refused,
            budget_bytes=self.budget, followed=followed, followed_lost=followed_lost,
        )  # fmt: skip
