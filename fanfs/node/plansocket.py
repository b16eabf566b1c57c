"""Planned epochs, the channel: the job hands the daemon its order through a Unix socket.

An abstract Unix socket with a random name (nothing in any file system, so nothing is left
behind by a killed daemon), published in the status attribute, which only the user who
mounted can read. Every connection's uid is checked first (SO_PEERCRED: the daemon's own or
root) and another user's is closed at once; the client checks the daemon's the same way
(docs/security.md). One request per connection, a header line then the body (fanfs/plan.py is
the client):

    FANFS-PLAN 1 order SHARE N\\n  then N paths relative to the mount, each ended by NUL
    FANFS-PLAN 1 at SHARE POSITION\\n  the job has read up to POSITION of SHARE's plan
    FANFS-PLAN 1 drop 0 0\\n  drop what is cached of the mount's files (`fanfs drop`)

answered with one JSON line: {"planned": k, "missing": m, "first_missing": path or null},
{"ok": true}, what was dropped, or {"error": "..."}. The client does not wait for the answer
to `at` (fanfs/plan.py): it may be gone when the answer is sent. An error is sent as soon as
it is known, also before the body has been read (the client reads the answer even when the
daemon stopped reading).

Bounded: at most CONNECTIONS requests are read at once (others wait their turn; another
user's connection is refused before it takes one, so no flood of them holds the owner's); a plan
names at most MAX_PATHS_PER_FILE paths per file of the image, each at most as long as the
image's longest path (no longer one can name a file), so a body is bounded too; a client that
stops sending is dropped after REQUEST_TIMEOUT_S. Nothing here holds the event loop for long:
the body's NULs are counted as it arrives, and paths are resolved and the plan indexed in a
worker thread that hands the GIL back every few hundred paths.

Concurrency: the trio thread, and one worker thread per plan being resolved (pure work on the
immutable catalog); `Plans` is changed on the trio thread only.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import socket
import struct
import time
from collections.abc import Awaitable, Callable

import numpy as np
import trio

from fanfs.image import catalog as cat
from fanfs.image import paths as paths_mod
from fanfs.node.order import ShareOrder, read_ahead_bytes
from fanfs.node.plans import MAX_SHARES, Plans

MAGIC = b"FANFS-PLAN 1"
HEADER_MAX = 200
CONNECTIONS = 8  # requests read at once; each may hold a plan's body
# Positions all plans of a node may hold at once (about 40 bytes of memory each): repeats are
# normal (padding, sampling with replacement, several ranks), eight times the files is ample;
# and any image may take a million.
MAX_PATHS_PER_FILE = 8
MAX_PATHS_MIN = 1 << 20
REQUEST_TIMEOUT_S = 120.0  # a client that stops sending mid-plan is dropped
PATH_MAX = 4096  # bytes of a path (Linux's limit)
DRAIN_S = 5.0  # after a refusal, how long the rest of a request is read and thrown away


class PlanError(Exception):
    """A plan request that cannot be taken (its message goes back to the client)."""


def parse_header(header: bytes) -> tuple[str, int, int]:
    """(kind, share, n) of a request header; PlanError if it is not one."""
    parts = header.split(b" ")
    if (len(parts) != 5 or b" ".join(parts[:2]) != MAGIC
            or parts[2] not in (b"order", b"at", b"drop")):  # fmt: skip
        raise PlanError("not a fanfs plan request")
    try:
        share, n = int(parts[3]), int(parts[4])
    except ValueError:
        raise PlanError("share and count must be integers") from None
    if not (0 <= share < 1 << 31 and 0 <= n < 1 << 40):
        raise PlanError("share or count out of range")
    return parts[2].decode(), share, n


def longest_path(catalog: cat.Catalog) -> int:
    """Bytes of the image's longest path (relative to its root), at most PATH_MAX (no longer
    path can be opened anyway): one numpy pass per directory level."""
    names = catalog.name_len.astype(np.int64)
    names[0] = 0
    parent = catalog.parent.astype(np.int64)
    length = names.copy()
    for _ in range(PATH_MAX // 2):  # a level costs at least two bytes ("a/")
        deeper = names + np.where(parent == 0, 0, length[parent] + 1)
        deeper[0] = 0
        if np.array_equal(deeper, length):
            return int(length.max())
        length = deeper
    return PATH_MAX


def _resolve(catalog: cat.Catalog, body: bytes, n: int, budget: int,
             whole_limit: int) -> tuple[ShareOrder, int, str | None]:  # fmt: skip
    """(the plan's files indexed, how many paths named no file, the first such path). Runs in
    a worker thread: `time.sleep(0)` lets the event loop take the GIL every few hundred."""
    names = body.split(b"\0", n)[:n]
    found = paths_mod.resolve_many(catalog, names, pause=lambda: time.sleep(0))
    ok = found >= 0
    ok[ok] = catalog.is_file[found[ok]]
    missing = int(n - ok.sum())
    first = None if not missing else os.fsdecode(names[int(np.flatnonzero(~ok)[0])])[:300]
    entries = found[ok]
    cost = read_ahead_bytes(catalog, entries, budget, whole_limit)
    return ShareOrder.build(entries, cost), missing, first


class PlanServer:
    def __init__(self, catalog: cat.Catalog, plans: Plans, whole_limit: int,
                 drop: Callable[[], Awaitable[dict[str, object]]]):  # fmt: skip
        """`whole_limit`: raw files up to this are read ahead (the reader checks larger
        ones as a whole first); `drop()`: drops what the daemon and the kernel cache of the
        mount's files, and says what it dropped."""
        self.catalog = catalog
        self.plans = plans
        self.whole_limit = whole_limit
        self.drop = drop
        self._files = int(catalog.is_file.sum())
        self._longest: int | None = None  # computed at the first plan
        self._reading = trio.Semaphore(CONNECTIONS)

    async def serve(self, *, task_status: trio.TaskStatus[str]) -> None:
        """Take plans until cancelled; `started` with the socket's name ("@" + abstract name)."""
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        while True:  # a random name: nobody can take it first (and a clash only costs a retry)
            name = f"fanfs-plan-{os.getpid()}-{secrets.token_hex(16)}"
            try:
                await sock.bind("\0" + name)
                break
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    raise
        sock.listen(64)
        task_status.started("@" + name)
        await trio.serve_listeners(self._client, [trio.SocketListener(sock)])

    async def _client(self, stream: trio.SocketStream) -> None:
        async with stream:
            try:
                self._check_peer(stream.socket)
            except OSError:
                return  # (no peer to check: gone already)
            except PlanError as e:  # before it may hold one of the CONNECTIONS: none of its
                self.plans.refuse()  # connections holds the owner's (no drain: it is not owed)
                with _quietly():
                    await stream.send_all(json.dumps({"error": str(e)}).encode() + b"\n")
                return
            async with self._reading:
                await self._answer(stream)

    async def _answer(self, stream: trio.SocketStream) -> None:
        reply: dict[str, object]
        try:
            with trio.fail_after(REQUEST_TIMEOUT_S):
                reply = await self._request(stream)
        except PlanError as e:
            self.plans.refuse()
            reply = {"error": str(e)}
        except trio.TooSlowError:
            self.plans.refuse()
            reply = {"error": f"request not complete after {REQUEST_TIMEOUT_S:.0f} s"}
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            return
        with _quietly():
            await stream.send_all(json.dumps(reply).encode() + b"\n")
            # A refusal may come before the body was read: read the rest (a while at most),
            # or closing with unread data resets the connection before the client reads why.
            with trio.move_on_after(DRAIN_S):
                while await stream.receive_some(1 << 20):
                    pass

    def _check_peer(self, sock: trio.socket.SocketType) -> None:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _, uid, _ = struct.unpack("3i", creds)
        if uid not in (os.geteuid(), 0):
            raise PlanError(f"uid {uid} may not plan for this mount")

    async def _request(self, stream: trio.SocketStream) -> dict[str, object]:
        buf = bytearray()
        while b"\n" not in buf:
            chunk = await stream.receive_some(4096)
            if not chunk:
                raise PlanError("no request header")
            buf += chunk
            if len(buf) > HEADER_MAX and b"\n" not in buf[:HEADER_MAX]:
                raise PlanError("request header too long")
        header, _, rest = bytes(buf).partition(b"\n")
        kind, share, n = parse_header(header)
        if kind == "at":
            self.plans.progress(share, n)
            return {"ok": True}
        if kind == "drop":
            return await self.drop()
        most = max(MAX_PATHS_MIN, MAX_PATHS_PER_FILE * self._files)
        if n > most:
            raise PlanError(f"{n} paths: more than this image takes in one plan ({most})")
        held = sum(len(s.plan) for k, s in self.plans.shares.items() if k != share)
        if held + n > most:
            raise PlanError(
                f"{n} paths: with the {held} of the other plans, more than this "
                f"image takes at once ({most}); fewer shares, or shorter plans"
            )
        if len(self.plans.shares) >= MAX_SHARES and share not in self.plans.shares:
            raise PlanError(f"at most {MAX_SHARES} shares")
        if self._longest is None:
            self._longest = await trio.to_thread.run_sync(longest_path, self.catalog)
        limit = n * (self._longest + 1)
        body = bytearray(rest)
        seen = body.count(0)  # NULs so far; each chunk is counted once, as it comes
        while seen < n:
            if len(body) > limit:
                raise PlanError("paths longer than any path of the image")
            chunk = await stream.receive_some(1 << 20)
            if not chunk:
                raise PlanError(f"plan ended after {seen} of {n} paths")
            body += chunk
            seen += chunk.count(0)
        order, missing, first = await trio.to_thread.run_sync(
            _resolve, self.catalog, bytes(body), n, self.plans.budget, self.whole_limit
        )
        self.plans.install(share, order, missing)
        return {"planned": len(order), "missing": missing, "first_missing": first}


def _quietly() -> contextlib.suppress:
    """For replies to a client that may have gone."""
    return contextlib.suppress(OSError, trio.BrokenResourceError, trio.ClosedResourceError)
