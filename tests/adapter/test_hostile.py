"""Adapter tier: property-based tests of every parser of untrusted input: the catalog loader, the
peer request parser, the serving side of peer requests and the FUSE adapter (including the
status interface). Random and mutated inputs get a clean error or a correct result: never
another exception, a hang or a dead daemon."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import parts
import pyfuse3
import pytest
import trio
from catalogs import columns_of, encode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fanfs import lifecycle
from fanfs.errors import FanfsError, ImageError
from fanfs.image import catalog as cat
from fanfs.node.fuse_ops import ROOT, STATUS_XATTR, FanfsOperations
from fanfs.node.reader import Reader
from fanfs.node.sources import PeerServer
from fanfs.node.store import PartitionStore
from fanfs.node.transport import PeerTimeout
from fanfs.node.transport.inbox import (
    BATCH_HEADER,
    BATCH_MAX,
    FIRST_REPLY_TAG,
    batch_header,
    parse_batch,
    parse_request,
)
from fanfs.output.assemble import owner_place
from fanfs.prepare import fanout

SETTINGS = settings(max_examples=300, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
CTX = pyfuse3.RequestContext()


def exercise(c: cat.Catalog) -> None:
    """What a mount does with a catalog it accepted: none of it may raise."""
    for entry, path in c.walk():
        assert c.resolve(path) == entry
        c.name(entry)
        if c.is_link[entry]:
            c.symlink_target(entry)
        for child in c.children(entry):
            assert int(c.parent[child]) == entry


@pytest.fixture(scope="module")
def raw(awkward_image: Path) -> bytes:
    return (awkward_image / cat.CATALOG_NAME).read_bytes()


@SETTINGS
@given(data=st.data())
def test_random_bytes_flipped_in_a_catalog(raw: bytes, data: st.DataObject) -> None:
    mutated = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(0, len(raw) - 1))
        mutated[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    for candidate in (bytes(mutated), bytes(mutated[:cut])):
        with contextlib.suppress(ImageError):
            exercise(cat.Catalog.from_bytes(candidate))


# The integer columns: any bytes are a valid `part_sha256` (a wrong one only changes the key a
# kept partition is looked up by, tests/mount/test_keep.py)
COLUMNS = [name for name, dtype in cat.ENTRY_COLUMNS + cat.PARTITION_COLUMNS
           if np.dtype(dtype).kind in "iu"]  # fmt: skip


@SETTINGS
@given(data=st.data())
def test_columns_rewritten_with_valid_checksums(raw: bytes, data: st.DataObject) -> None:
    """Mutations behind correct checksums reach the structural checks themselves."""
    columns, strings, meta, frame_size = columns_of(raw)
    original = columns_of(raw)[0]
    for _ in range(data.draw(st.integers(1, 4))):
        name = data.draw(st.sampled_from(COLUMNS))
        column = columns[name]
        if not len(column):
            continue
        i = data.draw(st.integers(0, len(column) - 1))
        info = np.iinfo(column.dtype)
        column[i] = data.draw(
            st.one_of(
                st.integers(int(info.min), int(info.max)),
                st.integers(0, min(300, int(info.max))),
                st.sampled_from([int(x) for x in original[name][:50]]),
            )
        )
    if data.draw(st.booleans()):
        at = data.draw(st.integers(0, max(0, len(strings) - 1)))
        strings = (
            strings[:at] + data.draw(st.sampled_from([b"/", b"\0", b".", b"a"])) + strings[at + 1 :]
        )
    with contextlib.suppress(ImageError):
        exercise(cat.Catalog.from_bytes(encode(columns, strings, meta, frame_size)))


@pytest.fixture(scope="module")
def small_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small image with every codec: raw, zstd, dictionaries, framed (a 5 MiB file)."""
    from conftest import prepare

    src = tmp_path_factory.mktemp("hostile-src") / "src"
    rng = np.random.default_rng(3)
    for i in range(70):
        (src / "t").mkdir(parents=True, exist_ok=True)
        (src / "t" / f"{i}.csv").write_bytes(b"id,value\n" + b"".join(
            b"%d,%d\n" % (k, rng.integers(0, 99)) for k in range(60)))  # fmt: skip
    (src / "noise.bin").write_bytes(rng.bytes(50_000))
    (src / "framed.bin").write_bytes(bytes(3 << 20) + rng.bytes(2 << 20))
    return prepare(src, tmp_path_factory.mktemp("hostile-img") / "img", "--compress", "zstd")


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(data=st.data())
def test_verify_names_the_file_for_any_catalog(
    small_image: Path, tmp_path: Path, data: st.DataObject
) -> None:
    """Whatever a catalog that loads claims (sizes near 2**64, lengths past the partition,
    wrong codecs), `fanfs verify` reports it as lines naming files or partitions: never a
    MemoryError, a hang or a traceback (a frame count that wrapped around in u64 passed the
    load check and killed verify)."""
    from fanfs.image.verify import verify

    raw = (small_image / cat.CATALOG_NAME).read_bytes()
    columns, strings, meta, frame_size = columns_of(raw)
    files = np.flatnonzero((columns["mode"] & 0o170000) == 0o100000)
    for _ in range(data.draw(st.integers(1, 3))):
        name = data.draw(st.sampled_from(["size", "stored_len", "data_off", "crc", "codec"]))
        i = int(data.draw(st.sampled_from(files.tolist())))
        info = np.iinfo(columns[name].dtype)
        columns[name][i] = data.draw(st.one_of(
            st.sampled_from([int(info.max), int(info.max) - 5, 0, 1, 2**40, 2**63]),
            st.integers(0, int(info.max)))) % (int(info.max) + 1)  # fmt: skip
    frame_size = data.draw(st.sampled_from([frame_size, frame_size, 0, 1 << 28, 4096]))
    image = Path(tempfile.mkdtemp(dir=tmp_path))  # one per example
    for part in small_image.glob("part-*.pack"):
        (image / part.name).symlink_to(part)
    (image / cat.CATALOG_NAME).write_bytes(encode(columns, strings, meta, frame_size))
    try:
        lines = list(verify(image))
    except ImageError:
        return  # refused at load: one line (exit 4) from the command
    for line in lines:
        assert isinstance(line, str) and ("partition" in line or line.split(":")[0]), line


def test_a_frame_count_that_wraps_is_named(small_image: Path, tmp_path: Path) -> None:
    from fanfs.image.verify import verify

    raw = (small_image / cat.CATALOG_NAME).read_bytes()
    columns, strings, meta, frame_size = columns_of(raw)
    c = cat.Catalog.from_bytes(raw)
    framed = int(np.flatnonzero(c.codec == cat.CODEC_FRAMED)[0])
    columns["size"][framed] = 2**64 - 1  # (size + frame - 1) // frame wrapped to 0 frames
    image = tmp_path / "img"
    image.mkdir()
    for part in small_image.glob("part-*.pack"):
        (image / part.name).symlink_to(part)
    (image / cat.CATALOG_NAME).write_bytes(encode(columns, strings, meta, frame_size))
    try:
        lines = list(verify(image))
    except ImageError as e:
        assert "framed file shorter than its frame table" in str(e)
        return
    assert any(line.startswith("framed.bin:") for line in lines), lines


@SETTINGS
@given(header=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=0, max_size=6))
def test_peer_request_parser(header: list[int]) -> None:
    got = parse_request(np.array(header, dtype=np.int64), 32767)
    if got is not None:
        entry, offset, length, tag = got
        assert len(header) == 4 and entry >= -1 and offset >= 0 and length >= 0
        assert FIRST_REPLY_TAG <= tag < 32767


@SETTINGS
@given(header=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=0, max_size=BATCH_HEADER + 2))
def test_peer_batch_parser(header: list[int]) -> None:
    got = parse_batch(np.array(header, dtype=np.int64), 32767)
    if got is not None:
        tag, entries = got
        assert len(header) == BATCH_HEADER and FIRST_REPLY_TAG <= tag < 32767
        assert 1 <= len(entries) <= BATCH_MAX and min(entries) >= 0


def test_peer_batch_header_round_trip() -> None:
    for n in (1, 7, BATCH_MAX):
        entries = list(range(3, 3 + n))
        assert parse_batch(batch_header(FIRST_REPLY_TAG + 1, entries), 32767) == (
            FIRST_REPLY_TAG + 1,
            entries,
        )
    header = batch_header(FIRST_REPLY_TAG, [5])
    header[2] = -1  # an entry that cannot be
    assert parse_batch(header, 32767) is None
    assert parse_batch(batch_header(32767, [5]), 32767) is None  # a tag beyond the bound


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@SETTINGS
@given(said=JSON | st.tuples(st.integers(-5, 200), st.text()).map(list)
       | st.tuples(st.text(), st.text()).map(list))  # fmt: skip
def test_start_up_messages_are_checked_as_data(said: object) -> None:
    """What a peer says in a start-up collective (fanfs.world's JSON: a verdict, an output
    daemon's token and DEST, prepare's settings) is a correct value or a FanfsError naming
    the rank, never another exception."""
    try:
        err = lifecycle.verdict(said, 3)
        assert err is None or isinstance(err, FanfsError)
        if said is None:
            assert err is None
        elif "not fanfs's" not in str(err):  # a verdict: its code and message, as sent
            assert isinstance(said, list) and err.exit_code == said[0] and str(err) == said[1]
    except FanfsError as e:
        raise AssertionError(f"{said!r}: {e}") from None
    with contextlib.suppress(FanfsError):
        token, dest = owner_place(said, 4)
        assert re.fullmatch(r"4-[0-9a-f]{8}", token) and dest.startswith("/")
    with contextlib.suppress(FanfsError):
        fanout._setup(said)


def test_a_peers_token_cannot_reach_outside_dest() -> None:
    assert owner_place(["4-0123abcd", "/scratch/out"], 4) == ("4-0123abcd", "/scratch/out")
    for token, dest in [("4-../../x", "/d"), ("4-0123abcd/..", "/d"), ("3-0123abcd", "/d"),
                        ("4-0123abcd", "rel"), ("4-0123abcd", "/d\0x")]:  # fmt: skip
        with pytest.raises(FanfsError, match="rank 4 sent a token and DEST"):
            owner_place([token, dest], 4)


@pytest.fixture
def adapter(awkward_image: Path, tmp_path: Path) -> Iterator[tuple[FanfsOperations, Reader]]:
    c, _ = cat.Catalog.load(awkward_image)
    store = PartitionStore(awkward_image, c, tmp_path / "local", range(c.n_partitions))
    reader = parts.reader(c, store)
    try:
        yield FanfsOperations(c, reader, lambda: {"serving": True}), reader
    finally:
        store.close()


BIG = st.integers(-(2**63), 2**64)


@SETTINGS
@given(entry=BIG, offset=BIG, length=BIG)
def test_serving_any_peer_request(
    adapter: tuple[FanfsOperations, Reader], entry: int, offset: int, length: int
) -> None:
    """A peer's (entry, offset, length): the stored bytes it asked for, or None; where the
    transport's threads may read it alone (`locate`), they read exactly those bytes."""
    _, reader = adapter
    c = reader.catalog
    server = PeerServer(c, reader.local)
    got = trio.run(server.serve, entry, offset, length)
    if got is not None:
        assert 0 <= entry < c.n_entries and c.is_file[entry] and len(got) == length
        assert bytes(got) == bytes(trio.run(reader.local.read, entry, offset, length))
    located = server.locate(entry, offset, length)
    if located is not None:
        assert got is not None
        part, start = located
        assert start + length <= int(c.part_size[part])
        assert server.pread(part, start, length) == bytes(got)


async def fuse_call(ops: FanfsOperations, call: str, *args: object) -> object:
    try:
        return await getattr(ops, call)(*args)
    except pyfuse3.FUSEError as e:
        assert e.errno in (errno.ENOENT, errno.ENOTDIR, errno.EINVAL, errno.EIO, errno.EROFS,
                           errno.ENOSYS, errno.EISDIR, pyfuse3.ENOATTR)  # fmt: skip
        return e


@SETTINGS
@given(
    inode=st.one_of(st.integers(-5, 400), st.integers(-(2**63), 2**64)),
    name=st.binary(max_size=300),
    offset=BIG,
    size=st.integers(0, 1 << 22),
)
def test_fuse_requests_with_any_arguments(
    adapter: tuple[FanfsOperations, Reader], inode: int, name: bytes, offset: int, size: int
) -> None:
    ops, _ = adapter

    async def requests() -> None:
        await fuse_call(ops, "lookup", inode, name, CTX)
        await fuse_call(ops, "getattr", inode, CTX)
        await fuse_call(ops, "readlink", inode, CTX)
        await fuse_call(ops, "getxattr", inode, name, CTX)
        await fuse_call(ops, "listxattr", inode, CTX)
        await fuse_call(ops, "access", inode, size & 7, CTX)
        await fuse_call(ops, "read", inode, max(0, min(offset, 2**63 - 1)), size)

    trio.run(requests)


def test_status_is_only_where_it_belongs(adapter: tuple[FanfsOperations, Reader]) -> None:
    ops, _ = adapter
    assert trio.run(ops.getxattr, ROOT, STATUS_XATTR, CTX) == b'{"serving": true}'
    got = trio.run(fuse_call, ops, "getxattr", ROOT + 1, STATUS_XATTR, CTX)
    assert isinstance(got, pyfuse3.FUSEError) and got.errno == pyfuse3.ENOATTR


class HostilePeer:
    """A transport whose one peer answers every fetch with bytes chosen by hypothesis: the
    right ones, other ones of the right length, a wrong length, nothing, or silence."""

    rank, size = 0, 2
    blocking_fetch = False

    def __init__(self, replies: st.DataObject, right: Path):
        self.replies = replies
        self.right = right  # the image: where the right stored bytes are

    async def fetch(self, peer: int, entry: int, offset: int, length: int) -> bytes | None:
        kind = self.replies.draw(st.sampled_from(["right", "garbage", "short", "none", "timeout"]))
        if kind == "timeout":
            raise PeerTimeout(f"rank {peer} did not answer")
        if kind == "none":
            return None
        if kind == "short":
            return self.replies.draw(st.binary(max_size=max(0, length - 1)))
        if kind == "garbage":
            return self.replies.draw(st.binary(min_size=length, max_size=length))
        c, _ = cat.Catalog.load(self.right)
        with open(self.right / cat.partition_name(int(c.part[entry])), "rb") as f:
            f.seek(int(c.data_off[entry]) + offset)
            return f.read(length)

    def is_dead(self, peer: int) -> bool:
        return False

    def statistics(self) -> dict[str, object]:
        return {}


@SETTINGS
@given(replies=st.data())
def test_hostile_replies_never_reach_the_reader(
    awkward_image: Path, awkward_src: Path, tmp_path: Path, replies: st.DataObject
) -> None:
    """Every file is held by the hostile peer alone: whatever it answers, a read returns the
    source's bytes (from the peer when they check out, else from the image)."""
    c, _ = cat.Catalog.load(awkward_image)
    store = PartitionStore(awkward_image, c, tmp_path / "local", [])
    owners = [(1,)] * c.n_partitions
    reader = parts.reader(c, store, owners=owners, transport=HostilePeer(replies, awkward_image))
    files = [e for e, _ in c.walk() if c.is_file[e] and 0 < c.size[e] <= 1 << 20]
    try:
        for e in replies.draw(st.lists(st.sampled_from(files), min_size=1, max_size=4)):
            want = (awkward_src / os.fsdecode(c.path(e))).read_bytes()
            got = trio.run(reader.read, e, 0, len(want))
            assert bytes(got) == want  # type: ignore[arg-type]
    finally:
        store.close()
