"""Adapter tier: the output wing (output/assemble.py) built without a mount, its pyfuse3
adapter (output/fs.py) called directly under trio, and the lander run in the test's nursery:
what lands at DEST is compared with what was written. No kernel in between, so no front
(WriteFront without pyfuse3's receiver): every WRITE reaches the view."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pyfuse3
import pytest
import trio

from fanfs.node.staging import StagingDir
from fanfs.output import assemble, fs
from fanfs.output.apply import partial_name
from fanfs.output.dest import Dest, LandingError
from fanfs.output.tree import ROOT

CTX = pyfuse3.RequestContext()
WRITE = os.O_WRONLY | os.O_CREAT
LAND_S = 10.0  # a few small files land in well under a second here


@pytest.fixture
def dest(tmp_path: Path) -> Path:
    d = tmp_path / "dest"
    d.mkdir()
    return d


class Outage(Dest):
    """DEST, which the test can take down: while `down` is set, an attempt waits in `root`
    until `up` is set, then fails (as a DEST refusing everything would): the test knows an op
    is being applied (`entered`) and chooses when that attempt ends."""

    def __init__(self, path: str):
        super().__init__(path)
        self.down, self.entered, self.up = threading.Event(), threading.Event(), threading.Event()

    def root(self) -> int:
        if self.down.is_set():
            self.entered.set()
            self.up.wait(LAND_S)
            raise LandingError(f"DEST {self.path}: down (the test's outage)")
        return super().root()


@pytest.fixture
def outage(dest: Path) -> Outage:
    return Outage(str(dest))


@pytest.fixture
def wing(tmp_path: Path, dest: Path, outage: Outage) -> Iterator[assemble.Wing]:
    staging = StagingDir(tmp_path / "local")
    built: list[assemble.Wing] = []

    def status() -> dict[str, object]:
        return assemble.report(built[0], rank=0, size=1, node="0", mountpoint="mnt",
                               dest=str(dest), phase="serving", started=0.0).to_json()  # fmt: skip

    with contextlib.ExitStack() as stack:
        stack.callback(staging.close)
        stack.callback(_empty, staging)  # as the daemon does when everything landed
        place = assemble.Place(None, 0, 1, str(tmp_path / "mnt"), str(dest), "0-test")
        built.append(assemble.build(stack, place, outage, staging, [], replicas=1,
                                    peer_timeout=1.0, max_ops=1 << 20, status=status))  # fmt: skip
        yield built[0]


@pytest.fixture
async def landing(wing: assemble.Wing) -> AsyncIterator[assemble.Wing]:
    """The wing with its lander running (as the daemon's nursery runs it)."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(wing.lander.run)
        yield wing
        nursery.cancel_scope.cancel()


async def landed(wing: assemble.Wing) -> None:
    with trio.fail_after(LAND_S):
        await wing.lander.wait_landed(wing.journal.enqueued)


async def write_file(ops: fs.OutputOperations, parent: int, name: bytes, data: bytes) -> int:
    """create, write, flush, release, as a writer's open/write/close; the file's inode."""
    info, attrs = await ops.create(parent, name, 0o644, WRITE, CTX)
    assert await ops.write(info.fh, 0, data) == len(data)
    await ops.flush(info.fh)
    await ops.release(info.fh)
    return int(attrs.st_ino)


async def test_a_file_written_and_closed_lands_whole(landing: assemble.Wing, dest: Path) -> None:
    ops = landing.ops
    data = os.urandom(300_000)
    ino = await write_file(ops, ROOT, b"ckpt.pt", data)
    await landed(landing)
    assert (dest / "ckpt.pt").read_bytes() == data
    assert stat.S_IMODE((dest / "ckpt.pt").stat().st_mode) == 0o644 & ~_umask()
    attrs = await ops.getattr(ino, CTX)
    assert attrs.st_size == len(data) and stat.S_ISREG(attrs.st_mode)
    assert (await ops.lookup(ROOT, b"ckpt.pt", CTX)).st_ino == ino


async def test_renames_and_removals_land_in_order(landing: assemble.Wing, dest: Path) -> None:
    """A checkpoint rotation (write tmp, rename over, unlink the old) and a directory made,
    filled and renamed: DEST ends as the mount does."""
    ops = landing.ops
    d = await ops.mkdir(ROOT, b"run-tmp", 0o755, CTX)
    await write_file(ops, d.st_ino, b"config.yaml", b"lr: 0.1\n")
    await ops.rename(ROOT, b"run-tmp", ROOT, b"run", 0, CTX)
    for i in range(3):
        await write_file(ops, ROOT, b".tmp", f"epoch {i}".encode())
        await ops.rename(ROOT, b".tmp", ROOT, f"epoch-{i}.pt".encode(), 0, CTX)
        if i >= 1:
            await ops.unlink(ROOT, f"epoch-{i - 1}.pt".encode(), CTX)
    await landed(landing)
    assert sorted(p.name for p in dest.iterdir()) == ["epoch-2.pt", "run"]
    assert (dest / "epoch-2.pt").read_bytes() == b"epoch 2"
    assert (dest / "run" / "config.yaml").read_text() == "lr: 0.1\n"
    e = await ops.mkdir(ROOT, b"empty", 0o755, CTX)
    assert e.st_ino
    await ops.rmdir(ROOT, b"empty", CTX)
    await landed(landing)
    assert not (dest / "empty").exists()


async def test_fsync_returns_once_the_file_is_at_dest(landing: assemble.Wing, dest: Path) -> None:
    ops = landing.ops
    info, _ = await ops.create(ROOT, b"log.txt", 0o644, WRITE, CTX)
    await ops.write(info.fh, 0, b"line 1\n")
    with trio.fail_after(LAND_S):
        await ops.fsync(info.fh, False)
    assert (dest / "log.txt").read_bytes() == b"line 1\n"
    await ops.release(info.fh)


async def test_a_checkpoint_replaced_while_its_put_is_failing_never_lands(
    landing: assemble.Wing, dest: Path, outage: Outage
) -> None:
    """A rotation (write ckpt.tmp, rename it over ckpt.pt) while DEST is down, the replaced
    checkpoint's put in the middle of an attempt (busy: the journal could not drop it then):
    it goes when that attempt fails instead of being tried again, so once DEST is back only
    the newest checkpoint lands, and the partial file the attempt left at DEST goes too."""
    ops = landing.ops
    outage.down.set()
    await write_file(ops, ROOT, b"ckpt.tmp", b"old" * 1000)
    assert await trio.to_thread.run_sync(outage.entered.wait, LAND_S)
    put = landing.lander.current
    assert put is not None and put.busy and put.path == b"ckpt.tmp"
    # What an attempt that got further leaves when DEST refuses its removal too.
    (dest / partial_name(landing.lander.own.token, put.seq)).write_bytes(b"old")
    await ops.rename(ROOT, b"ckpt.tmp", ROOT, b"ckpt.pt", 0, CTX)
    new = b"new" * 2000
    await write_file(ops, ROOT, b"ckpt.tmp", new)
    await ops.rename(ROOT, b"ckpt.tmp", ROOT, b"ckpt.pt", 0, CTX)  # the old one loses its name
    outage.down.clear()
    outage.up.set()  # the attempt fails; DEST takes everything after it
    await landed(landing)
    assert sorted(p.name for p in dest.iterdir()) == ["ckpt.pt"]
    assert (dest / "ckpt.pt").read_bytes() == new
    stats = landing.lander.statistics()
    assert (stats["landed_files"], stats["landed_bytes"]) == (1, len(new)), stats
    assert stats["dropped_puts"] == 1 and put.attempts == 1, stats


async def test_read_back_through_a_read_write_handle(wing: assemble.Wing) -> None:
    ops = wing.ops
    info, attrs = await ops.create(ROOT, b"f", 0o644, os.O_RDWR | os.O_CREAT, CTX)
    await ops.write(info.fh, 0, b"abcdef")
    assert await ops.read(info.fh, 2, 3) == b"cde"
    assert not info.direct_io  # read-write opens use the page cache (mmap)
    await ops.release(info.fh)
    assert (await ops.getattr(attrs.st_ino, CTX)).st_size == 6


async def test_what_dest_cannot_hold_is_refused(wing: assemble.Wing) -> None:
    """Links, symlinks, device nodes: EPERM; extended attributes: ENOTSUP; a name that is
    not there: ENOENT; a directory opened as a file: EISDIR."""
    ops = wing.ops
    for call, args, code in [
        (ops.link, (ROOT, ROOT, b"x", CTX), errno.EPERM),
        (ops.symlink, (ROOT, b"x", b"target", CTX), errno.EPERM),
        (ops.mknod, (ROOT, b"x", stat.S_IFIFO | 0o644, 0, CTX), errno.EPERM),
        (ops.setxattr, (ROOT, b"user.x", b"1", CTX), errno.ENOTSUP),
        (ops.lookup, (ROOT, b"missing", CTX), errno.ENOENT),
    ]:
        with pytest.raises(pyfuse3.FUSEError) as e:
            await call(*args)
        assert e.value.errno == code, call
    d = await ops.mkdir(ROOT, b"d", 0o755, CTX)
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops.open(d.st_ino, os.O_RDONLY, CTX)
    assert e.value.errno == errno.EISDIR


async def test_the_status_attribute_is_the_typed_record(wing: assemble.Wing, dest: Path) -> None:
    """`fanfs status` reads this: OutputStatus.to_json, with the front's typed record (no
    front here: it says why) and every part's statistics."""
    await write_file(wing.ops, ROOT, b"a", b"12345")
    status = json.loads(await wing.ops.getxattr(ROOT, fs.STATUS_XATTR, CTX))
    assert status["kind"] == "output" and status["dest"] == str(dest)
    assert status["files"] == 1 and status["written_bytes"] == 5
    assert status["front"]["running"] is False and status["front"]["off"]
    assert status["landing"]["enqueued"] >= 1 and status["open_handles"] == 0
    assert "replicas" not in status
    with pytest.raises(pyfuse3.FUSEError) as e:
        await wing.ops.getxattr(ROOT, b"user.other", CTX)
    assert e.value.errno == errno.ENODATA


async def test_statfs_answers_dests(wing: assemble.Wing, dest: Path) -> None:
    s = await wing.ops.statfs(CTX)
    v = os.statvfs(dest)
    assert (s.f_blocks, s.f_frsize) == (v.f_blocks, v.f_frsize)


def _empty(staging: StagingDir) -> None:
    for name in os.listdir(staging.fd):
        os.unlink(name, dir_fd=staging.fd)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
