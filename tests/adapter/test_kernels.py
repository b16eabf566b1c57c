"""Adapter tier: the front (fanfs/csrc/front.c) driven by a scripted kernel.

The front reads FUSE requests from a file descriptor and writes its replies to it. Here that
descriptor is one end of a SOCK_SEQPACKET socket pair (a message per request and per reply,
as the FUSE device gives them), and this test plays the kernel at the other end: the INIT of
each kernel family fanfs users run, with that protocol's layout and flags, then a LOOKUP, a
GETATTR and a READ of a staged file, whose replies are checked byte for byte. The same for the
page sizes of aarch64 kernels (4, 16 and 64 KiB), where the kernel sizes its requests by the
page: the output wing's front must take a WRITE of libfuse's largest max_write whole.

A real mount that the kernel talks to as an old kernel would is in test_front.py
(FANFS_PRETEND_PROTOCOL).
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import prepare

from fanfs.image import catalog as cat
from fanfs.image import format as fmt
from fanfs.native import lib
from fanfs.node.front import Front
from fanfs.node.fuse_ops import BLKSIZE, CACHE_TIMEOUT_S
from fanfs.node.pool import fast_kinds

# linux/fuse.h
INIT, LOOKUP, GETATTR, READ, WRITE = 26, 1, 3, 15, 16
IN_HEADER = struct.Struct("<IIQQIIII")  # len, opcode, unique, nodeid, uid, gid, pid, padding
OUT_HEADER = struct.Struct("<IiQ")  # len, error, unique
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
INIT_EXT = 1 << 30


@dataclass(frozen=True)
class Kernel:
    family: str
    minor: int  # the FUSE protocol minor its INIT announces
    page: int  # bytes

    def init(self) -> bytes:
        """The INIT this kernel sends: every flag its protocol has, in its layout (16 bytes
        before 7.36, 64 from it on, flags2 in the high half)."""
        flags = sum(1 << bit for bit, since in enumerate(FLAG_SINCE) if since <= self.minor)
        body = struct.pack("<IIII", 7, self.minor, 32 * self.page, flags & 0xFFFFFFFF)
        if self.minor >= 36:
            body += struct.pack("<I44x", flags >> 32)
        return body


# The protocol minor each INIT flag bit first came in (linux/fuse.h's changelog; 0: 7.12 or
# older).
FLAG_SINCE = [0] * 7 + [14, 14, 14, 17, 18] + [20, 21, 21, 22, 23, 23, 25, 26, 26, 27, 28, 28, 29,
                                              30, 31, 32, 33, 33, 36, 36, 36, 36, 38, 38, 39, 40,
                                              40, 40, 40, 42]  # fmt: skip

KERNELS = [
    Kernel("RHEL 8 (4.18)", 27, 4096),
    Kernel("RHEL 9, SLES 15 (5.14)", 33, 4096),
    Kernel("Ubuntu 22.04 (5.15)", 34, 4096),
    Kernel("Ubuntu 24.04 (6.8)", 39, 4096),
    Kernel("this machine (6.18)", 45, 4096),
    Kernel("GH200, RHEL 9 aarch64 (5.14, 64 KiB pages)", 33, 65536),
    Kernel("Ubuntu 24.04 aarch64 (6.8, 64 KiB pages)", 39, 65536),
    Kernel("aarch64 with 16 KiB pages (6.8)", 39, 16384),
]


class ScriptedKernel:
    """The kernel's end of the front's descriptor: requests out, replies in."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.unique = 0

    def send(self, opcode: int, nodeid: int, body: bytes) -> int:
        self.unique += 2
        header = IN_HEADER.pack(IN_HEADER.size + len(body), opcode, self.unique, nodeid,
                                os.getuid(), os.getgid(), os.getpid(), 0)  # fmt: skip
        self.sock.sendall(header + body)
        return self.unique

    def reply(self, unique: int, timeout: float = 5.0) -> tuple[int, bytes]:
        """(error, body) of the reply to `unique` (pushes into the page cache, unique 0,
        are let go)."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([self.sock], [], [], left)[0]:
                break
            msg = self.sock.recv(1 << 24)
            length, error, got = OUT_HEADER.unpack_from(msg)
            assert length == len(msg), (length, len(msg))
            if got == unique:
                return error, msg[OUT_HEADER.size :]
            assert got == 0, f"a reply to {got} while waiting for {unique}"
        raise AssertionError(f"no reply to request {unique} within {timeout} s")


def forwarded(fr: lib.Front, timeout: float = 5.0) -> bytes:
    """The next request the front handed to pyfuse3's side."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fr.forwarded()
        if got is not None:
            return bytes(got)
        time.sleep(0.005)
    raise AssertionError("nothing forwarded")


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("kernels")
    rng = np.random.default_rng(7)
    (base / "src" / "d").mkdir(parents=True)
    for i in range(6):
        (base / "src" / "d" / f"f{i}.bin").write_bytes(rng.bytes(int(rng.integers(1, 96 << 10))))
    return base / "src", prepare(base / "src", base / "img", "--compress", "none",
                                 "--partitions", "1")  # fmt: skip


@contextlib.contextmanager
def front(
    sock: socket.socket,
    *,
    page: int = 0,
    pretend: int = 0,
    writes: bool = False,
    c: cat.Catalog | None = None,
    image: Path | None = None,
) -> Iterator[lib.Front]:
    """A front's threads on `sock`: in writes mode (the output wing's), or answering from
    catalog `c` with partition 0 of `image` staged (the dataset wing's); stopped after."""
    rfd, wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    pack = -1
    try:
        meta = None
        if c is not None and image is not None:
            mine = np.ones(c.n_partitions, dtype=np.uint8)
            meta = Front(lambda *a: None, lambda: -1, BLKSIZE, int(CACHE_TIMEOUT_S), mine,
                         0).give_catalog(c)  # fmt: skip
            lib.pool_start(2, wfd)
            lib.pool_fast(c.size, c.part, c.data_off, c.stored_len, c.crc,
                          fast_kinds(c, False), c.n_partitions, 0, 64)  # fmt: skip
            pack = os.open(image / fmt.partition_name(0), os.O_RDONLY | os.O_CLOEXEC)
            lib.pool_fast_part(0, pack, -1)
            lib.pool_fast_enable(True)
        fr = lib.Front(meta, writes=writes)
        fr.pretend(pretend, page)
        fr.start(sock.fileno(), 2, 0)
        try:
            yield fr
        finally:
            fr.stop()
            fr.close()
    finally:
        if c is not None:
            lib.pool_fast_enable(False)
            lib.pool_stop()
        for fd in (rfd, wfd, pack):
            if fd >= 0:
                os.close(fd)


def pair() -> tuple[socket.socket, socket.socket]:
    kernel, daemon = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    return kernel, daemon


def entry_of(c: cat.Catalog, path: bytes) -> int:
    e = 0  # the root
    for name in path.split(b"/"):
        found = c.lookup(e, name)
        assert found is not None, path
        e = found
    return e


def attr_bytes(meta: lib.Meta, entry: int) -> bytes:
    """fuse_attr as the adapter answers it (Meta.attr, which test_fuse_ops checks against the
    adapter's attributes)."""
    a = meta.attr(entry)
    assert a is not None
    return ATTR.pack(a["ino"], a["size"], a["blocks"], a["atime"], a["mtime"], a["ctime"],
                     a["mtimensec"], a["mtimensec"], a["mtimensec"], a["mode"], a["nlink"],
                     a["uid"], a["gid"], 0, a["blksize"], 0)  # fmt: skip


@pytest.mark.parametrize("k", KERNELS, ids=[k.family for k in KERNELS])
def test_every_kernel_family_gets_the_front(k: Kernel, image: tuple[Path, Path]) -> None:
    """INIT is handed to libfuse as the kernel sent it; from then on a LOOKUP, a GETATTR and a
    READ of a staged file are answered in C, byte for byte what the adapter answers."""
    src, img = image
    c, _ = cat.Catalog.load(img)
    kernel_end, daemon_end = pair()
    with kernel_end, daemon_end, front(daemon_end, page=k.page, c=c, image=img) as fr:
        assert fr.meta is not None
        kern = ScriptedKernel(kernel_end)
        init = k.init()
        unique = kern.send(INIT, 0, init)
        got = forwarded(fr)
        assert got == IN_HEADER.pack(IN_HEADER.size + len(init), INIT, unique, 0, os.getuid(),
                                     os.getgid(), os.getpid(), 0) + init  # fmt: skip
        said = fr.kernel()
        assert (said["major"], said["minor"], said["why"]) == (7, k.minor, ""), said
        assert said["bufsize"] == 256 * k.page + 4096  # libfuse's, for this page size
        before = fr.counters()
        d = entry_of(c, b"d")
        f = sorted((src / "d").iterdir())[2]
        e = entry_of(c, b"d/" + f.name.encode())
        error, body = kern.reply(kern.send(LOOKUP, d + 1, f.name.encode() + b"\0"))
        timeout = int(CACHE_TIMEOUT_S)
        assert error == 0
        entry_out = struct.pack("<QQQQII", e + 1, 0, timeout, timeout, 0, 0)
        assert body == entry_out + attr_bytes(fr.meta, e)
        error, body = kern.reply(kern.send(GETATTR, e + 1, struct.pack("<IIQ", 0, 0, 0)))
        assert (error, body) == (0, struct.pack("<QII", timeout, 0, 0) + attr_bytes(fr.meta, e))
        size = f.stat().st_size
        read_in = struct.pack("<QQIIQII", 0, 0, size, 0, 0, os.O_RDONLY, 0)
        error, body = kern.reply(kern.send(READ, e + 1, read_in))
        assert (error, body) == (0, f.read_bytes())
        # Answered in C (by this thread, or by the pool's when the read its LOOKUP started was
        # still under way), none handed to pyfuse3.
        assert fr.counters()["forwarded"] == before["forwarded"]


def test_a_kernel_older_than_7_12_is_left_to_libfuse(image: tuple[Path, Path]) -> None:
    _, img = image
    c, _ = cat.Catalog.load(img)
    kernel_end, daemon_end = pair()
    with kernel_end, daemon_end, front(daemon_end, c=c, image=img) as fr:
        kern = ScriptedKernel(kernel_end)
        kern.send(INIT, 0, struct.pack("<IIII", 7, 8, 131072, 0))
        forwarded(fr)
        assert fr.kernel()["why"] == "protocol"
        sent = kern.send(LOOKUP, 1, b"d\0")
        assert struct.unpack_from("<IIQ", forwarded(fr))[2] == sent  # forwarded, not answered


@pytest.mark.parametrize("minor", [13, 27, 34, 39])
def test_an_init_rewritten_to_an_older_protocol(image: tuple[Path, Path], minor: int) -> None:
    """FANFS_PRETEND_PROTOCOL's rewrite: libfuse sees the INIT that protocol's kernel sends
    (16 bytes before 7.36, only the flags that protocol has), and the front serves as for
    such a kernel."""
    _, img = image
    c, _ = cat.Catalog.load(img)
    kernel_end, daemon_end = pair()
    with kernel_end, daemon_end, front(daemon_end, pretend=minor, c=c, image=img) as fr:
        kern = ScriptedKernel(kernel_end)
        unique = kern.send(INIT, 0, Kernel("new", 45, 4096).init())
        old = Kernel("old", minor, 4096).init()
        header = IN_HEADER.pack(IN_HEADER.size + len(old), INIT, unique, 0, os.getuid(),
                                os.getgid(), os.getpid(), 0)  # fmt: skip
        assert forwarded(fr) == header + old
        assert fr.kernel()["minor"] == minor
        error, _ = kern.reply(kern.send(GETATTR, 1, struct.pack("<IIQ", 0, 0, 0)))
        assert error == 0


@pytest.mark.parametrize("page", [4096, 16384, 65536])
def test_the_output_front_takes_a_write_of_the_largest_max_write(page: int, tmp_path: Path) -> None:
    """libfuse negotiates a max_write of up to 256 pages, and the kernel refuses to hand a
    request to a read smaller than such a WRITE: the front's buffer is sized from the page.
    A socket carries at most about 4 MiB in one message, so with 64 KiB pages the WRITE sent
    is 4 MiB of the 16 the kernel may send (4 times the buffer of 4 KiB pages)."""
    max_write = 256 * page
    assert lib.Front(writes=True).bufsize() >= IN_HEADER.size + 40 + 256 * os.sysconf("SC_PAGESIZE")
    kernel_end, daemon_end = pair()
    size = min(max_write, 4 << 20)
    need = 2 * (IN_HEADER.size + 40 + size)
    try:  # a message this large needs a send buffer only root may force (CI runs as root)
        kernel_end.setsockopt(socket.SOL_SOCKET, 32, need)  # SO_SNDBUFFORCE
    except PermissionError:
        pytest.skip("a socket buffer for a 16 MiB request needs root (CAP_NET_ADMIN)")
    daemon_end.setsockopt(socket.SOL_SOCKET, 33, need)  # SO_RCVBUFFORCE
    target = tmp_path / "out"
    payload = np.random.default_rng(page).bytes(size)
    with kernel_end, daemon_end, open(target, "wb") as out, front(daemon_end, page=page,
                                                                  writes=True) as fr:  # fmt: skip
        assert fr.kernel()["bufsize"] >= IN_HEADER.size + 40 + max_write
        kern = ScriptedKernel(kernel_end)
        kern.send(INIT, 0, Kernel("aarch64", 39, page).init())
        forwarded(fr)
        write_in = struct.pack("<QQIIQII", out.fileno(), 0, size, 0, 0, os.O_WRONLY, 0)
        error, body = kern.reply(kern.send(WRITE, 2, write_in + payload))
        assert (error, body) == (0, struct.pack("<II", size, 0))
        fr.settle()
    assert target.read_bytes() == payload


def test_a_stop_ends_the_taking_at_once_under_a_backlog(tmp_path: Path) -> None:
    """A stop while the device holds a backlog (a SIGTERM while a job still writes or reads)
    ends the front's taking at once instead of after the backlog: what is left in the device
    is pyfuse3's again (the output wing) or the unmount's. Here 300 WRITEs of 256 KiB wait
    before the front starts; it is stopped once it has written one, and takes a few more."""
    n, size = 300, 256 << 10
    kernel_end, daemon_end = pair()
    try:  # a backlog this large needs a send buffer only root may force (CI runs as root)
        kernel_end.setsockopt(socket.SOL_SOCKET, 32, 2 * n * (size + 4096))  # SO_SNDBUFFORCE
    except PermissionError:
        pytest.skip("a socket buffer for a 75 MiB backlog needs root (CAP_NET_ADMIN)")
    daemon_end.setsockopt(socket.SOL_SOCKET, 33, 2 * n * (size + 4096))  # SO_RCVBUFFORCE
    payload = bytes(size)
    with kernel_end, daemon_end, open(tmp_path / "out", "wb") as out:
        kern = ScriptedKernel(kernel_end)
        kern.send(INIT, 0, Kernel("this machine", 45, 4096).init())
        write_in = struct.pack("<QQIIQII", out.fileno(), 0, size, 0, 0, os.O_WRONLY, 0)
        for _ in range(n):
            kern.send(WRITE, 2, write_in + payload)
        fr = lib.Front(writes=True)
        fr.start(daemon_end.fileno(), 1, 0)
        deadline = time.monotonic() + 10
        while fr.written() == 0:  # taking: then the stop
            assert time.monotonic() < deadline, "the front took nothing"
        before = fr.written()  # (taken while this thread waited for a core: not the stop's)
        fr.stop()
        fr.close()
        taken = (fr.written() - before) // size
    # (Without the stop's check every WRITE left is taken: all but the first. A WRITE costs
    # tens of microseconds, so this thread's wait for a core between `before` and the stop
    # lets a few dozen through: half is the margin.)
    assert taken < n // 2, f"{taken} of {n} WRITEs taken after the stop began"
