"""Unit tier: the WRITEs an output daemon's front answered and had not written when it was
killed (fanfs/csrc/writes.c, "Kept"), read back by its recovery (fanfs/output/recover.py,
`write_kept`): the layout the C writes, the order they are written in, and a file that is
not one left as it is. The whole path, a real daemon killed with its writer thread stopped,
is tests/mount/test_output.py's `test_after_a_sigkill_umount_lands_what_was_closed_and_no_
partial_stays`."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from fanfs.native import lib
from fanfs.node.staging import pid_alive
from fanfs.output.front import KEPT_WRITES, PATH_AT, WriteFront, sweep
from fanfs.output.journal import NAME
from fanfs.output.recover import _HEAD, _MAGIC, _REC, open_dead, write_kept


@pytest.fixture
def staging(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    yield tmp_path, fd
    os.close(fd)


def test_the_front_lays_its_buffers_out_as_recovery_reads_them(staging: tuple[Path, int]) -> None:
    path, dir_fd = staging
    kernel_end, daemon_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fr = lib.Front(writes=True)
    fd = os.open(path / KEPT_WRITES, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    with kernel_end, daemon_end:
        fr.keep_writes(fd)
        fr.start(daemon_end.fileno(), 3, 0)
        os.close(fd)
        try:
            raw = (path / KEPT_WRITES).read_bytes()
        finally:
            fr.stop()
            fr.close()
    magic, nbufs, at, stride = _HEAD.unpack_from(raw)
    assert magic.rstrip(b"\0") == _MAGIC
    assert nbufs == 8 + 3  # the spares, and one per front thread
    assert at == 4096 and stride >= fr.bufsize() and stride % 4096 == 0
    assert len(raw) == at + nbufs * stride  # allocated whole
    assert all(r[0] == 0 for r in _REC.iter_unpack(raw[_HEAD.size : _HEAD.size + nbufs * 64]))
    assert write_kept(dir_fd, KEPT_WRITES, dir_fd) == 0


def kept(path: Path, recs: list[tuple[int, int, int, int, bytes]], *, nbufs: int = 4,
         stride: int = 8192, magic: bytes = _MAGIC) -> None:  # fmt: skip
    """A KEPT_WRITES with `recs` (seq, dev, ino, off, data), one per buffer."""
    raw = bytearray(4096 + nbufs * stride)
    _HEAD.pack_into(raw, 0, magic, nbufs, 4096, stride)
    for i, (seq, dev, ino, off, data) in enumerate(recs):
        _REC.pack_into(raw, _HEAD.size + i * _REC.size, seq, dev, ino, off, len(data), 80)
        raw[4096 + i * stride + 80 : 4096 + i * stride + 80 + len(data)] = data
    (path / KEPT_WRITES).write_bytes(raw)
    os.chmod(path / KEPT_WRITES, 0o600)


def test_answered_writes_land_in_their_files_in_the_order_they_were_answered(
    staging: tuple[Path, int],
) -> None:
    path, dir_fd = staging
    (path / "o3").write_bytes(b"0123456789")
    (path / "o4").write_bytes(b"")
    a, b = os.stat(path / "o3"), os.stat(path / "o4")
    kept(path, [
        (7, a.st_dev, a.st_ino, 2, b"later"),  # answered after the next one: lands over it
        (6, a.st_dev, a.st_ino, 0, b"ABCDEFG"),
        (0, b.st_dev, b.st_ino, 0, b"written already"),
        (8, b.st_dev, b.st_ino, 3, b"log line\n"),
    ])  # fmt: skip
    (path / "x9").write_bytes(b"")  # not a local file: never a target
    assert write_kept(dir_fd, KEPT_WRITES, dir_fd) == 3
    assert (path / "o3").read_bytes() == b"ABlater789"
    assert (path / "o4").read_bytes() == b"\0\0\0log line\n"


BAD = ["magic", "nbufs", "stride", "past its buffer", "short", "symlink", "shared", "fifo"]


@pytest.mark.parametrize("bad", BAD)
def test_a_kept_file_that_is_not_one_is_left_and_nothing_raised(
    bad: str, staging: tuple[Path, int], caplog: pytest.LogCaptureFixture
) -> None:
    path, dir_fd = staging
    (path / "o1").write_bytes(b"as it was")
    st = os.stat(path / "o1")
    rec = (1, st.st_dev, st.st_ino, 0, b"XX")
    if bad == "magic":
        kept(path, [rec], magic=b"fanfs-writes-0")
    elif bad == "nbufs":
        kept(path, [rec], nbufs=1 << 30, stride=0)
    elif bad == "stride":  # buffers the file does not hold (never read into memory)
        kept(path, [rec])
        raw = bytearray((path / KEPT_WRITES).read_bytes())
        _HEAD.pack_into(raw, 0, _MAGIC, 4, 4096, 1 << 40)
        (path / KEPT_WRITES).write_bytes(raw)
    elif bad == "past its buffer":  # after a good one, which is not written either
        kept(path, [rec, (2, *rec[1:4], b"Y" * 8200)], stride=8192)
    elif bad == "short":
        (path / KEPT_WRITES).write_bytes(struct.pack("=16s", _MAGIC))
    elif bad == "symlink":
        (path / "elsewhere").write_bytes(b"")
        (path / KEPT_WRITES).symlink_to(path / "elsewhere")
    elif bad == "shared":  # another user could have written it (in /dev/shm, all users')
        kept(path, [rec])
        os.chmod(path / KEPT_WRITES, 0o644)
    else:  # planted there by another user: never waited on
        os.mkfifo(path / KEPT_WRITES, 0o600)
    assert write_kept(dir_fd, KEPT_WRITES, dir_fd) is None
    assert (path / "o1").read_bytes() == b"as it was"
    assert "cannot be read back" in caplog.text


def test_the_buffers_go_to_the_next_place_where_one_cannot_take_them(
    staging: tuple[Path, int],
) -> None:
    """/dev/shm missing or full: the staging directory; no place at all: no front (the event
    loop answers WRITEs), and nothing left behind either way."""
    path, dir_fd = staging
    kernel_end, daemon_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    hook = (lambda receiver, fd: None, daemon_end.fileno)
    with kernel_end, daemon_end:
        front = WriteFront(hook, [(str(path / "no-shm" / "x"), None), (KEPT_WRITES, dir_fd)],
                           path)  # fmt: skip
        with contextlib.ExitStack() as stack:
            assert front.start(stack)
            assert front.statistics().kept == KEPT_WRITES
            assert (path / KEPT_WRITES).stat().st_size > 8 << 20
            raw = (path / KEPT_WRITES).read_bytes()[PATH_AT : PATH_AT + 1024]
            parent = path.parent.stat()  # for `sweep`: the staging directory, its parent's id
            line = f"{parent.st_dev} {parent.st_ino} {path}".encode()
            assert raw.split(b"\0", 1)[0] == line
            front.stop()
        assert not (path / KEPT_WRITES).exists()
        (path / "taken").write_bytes(b"someone else's")  # O_EXCL: never opened, never removed
        nowhere = WriteFront(hook, [(str(path / "no-shm" / "x"), None), ("taken", dir_fd)],
                             path)  # fmt: skip
        with contextlib.ExitStack() as stack:
            assert not nowhere.start(stack)
        assert nowhere.statistics().kept == ""
        assert (path / "taken").read_bytes() == b"someone else's"


def test_a_dead_daemons_buffers_go_once_its_staging_directory_is_gone(tmp_path: Path) -> None:
    """`sweep`: only this user's private files whose daemon is dead and whose staging
    directory is no longer in its parent, the same directory as when it was made; nothing
    else in /dev/shm."""
    shm, me = tmp_path / "shm", os.geteuid()
    shm.mkdir()
    (tmp_path / "still-here").mkdir()
    dead = 2**22 + 1  # above the kernel's largest pid_max: no such process
    assert not pid_alive(dead)
    parent = tmp_path.stat()

    def kept_file(pid: int, where: str, mode: int = 0o600, ident: str = "") -> Path:
        f = shm / f"fanfs-{me}-fanfs-stage-{pid}-x{len(list(shm.iterdir()))}-writes"
        line = f"{ident or f'{parent.st_dev} {parent.st_ino}'} {where}".encode() if where else b""
        raw = bytearray(4096)
        raw[PATH_AT : PATH_AT + len(line)] = line
        f.write_bytes(raw)
        os.chmod(f, mode)
        return f

    gone = kept_file(dead, str(tmp_path / "wiped"))
    stays = [
        kept_file(dead, str(tmp_path / "still-here")),  # its recovery may still come
        kept_file(os.getpid(), str(tmp_path / "wiped")),  # its daemon runs
        kept_file(dead, str(tmp_path / "wiped"), 0o644),  # not this user's alone
        kept_file(dead, ""),  # no path: a longer one than fits
        # its parent another directory now (a per-job /tmp, a --local not mounted now):
        kept_file(dead, str(tmp_path / "wiped"), ident=f"{parent.st_dev} {parent.st_ino + 1}"),
        kept_file(dead, str(tmp_path / "unmounted" / "wiped")),  # its parent is not there
    ]
    (shm / f"fanfs-{me + 1}-fanfs-stage-{dead}-y-writes").write_bytes(b"")  # another user's
    os.mkfifo(shm / f"fanfs-{me}-fanfs-stage-{dead}-fifo-writes")  # planted: never waited on
    sweep(str(shm))
    assert not gone.exists()
    assert all(f.exists() for f in stays)
    assert (shm / f"fanfs-{me + 1}-fanfs-stage-{dead}-y-writes").exists()
    assert (shm / f"fanfs-{me}-fanfs-stage-{dead}-fifo-writes").exists()


def test_a_buffers_file_never_set_up_holds_nothing(staging: tuple[Path, int]) -> None:
    """Its daemon killed between making it and starting the front: nothing to write, and the
    file can go (not kept, with a warning, for ever)."""
    path, dir_fd = staging
    (path / KEPT_WRITES).write_bytes(bytes(8192))
    os.chmod(path / KEPT_WRITES, 0o600)
    assert write_kept(dir_fd, KEPT_WRITES, dir_fd) == 0
    (path / KEPT_WRITES).write_bytes(b"")
    assert write_kept(dir_fd, KEPT_WRITES, dir_fd) == 0


def test_writes_that_cannot_be_written_keep_their_file_and_the_journal(tmp_path: Path) -> None:
    """A recovery whose replay fails (here a write past what the file system allows; a full
    disk alike) leaves the buffers' file and the journal, so a later one tries again."""
    d = tmp_path / "fanfs-stage-1-x"
    d.mkdir(mode=0o700)
    records = [{"fanfs_journal": 1, "dest": "/nowhere"}, {"name": "run.log", "node": 5,
               "data": 1}, {"writing": 5}]  # fmt: skip
    (d / NAME).write_text("".join(json.dumps(r) + "\n" for r in records))
    (d / "o1").write_bytes(b"as it was")
    st = os.stat(d / "o1")
    kept(d, [(1, st.st_dev, st.st_ino, 1 << 62, b"far")])
    dead = open_dead(d)
    assert dead is not None and dead.writes_left
    dead.finish()
    assert sorted(p.name for p in d.iterdir()) == [NAME, "kept.json", "o1", KEPT_WRITES]
    again = open_dead(d)  # the next recovery finds it
    assert again is not None and again.writes_left
    again.close()
