"""Mount tier: jobs that come back (`--keep DIR`): a second mount adopts what the first kept, by
content, and refuses what changed; a budget evicts; two mounts share DIR; a DIR that is not the
user's is refused. Every byte read is compared with the source."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from catalogs import columns_of
from conftest import FANFS, REPO, User, fanfs, mounted, prepare, stopping

from fanfs.bench import datagen, launch
from fanfs.bench.compare import assert_same_tree
from fanfs.image import catalog as cat
from fanfs.node.keys import partition_keys


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("keep") / "src"
    datagen.sample(src, n_files=96, classes=4, seed=11)
    return src


@pytest.fixture(scope="module")
def image(src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare(src, tmp_path_factory.mktemp("keep-img") / "img", "--partitions", "8")


def store(m: launch.Daemons, rank: int = 0) -> dict[str, object]:
    st: dict[str, object] = m.status(rank)["store"]
    return st


def kept_once(image: Path, src: Path, base: Path, keep: Path, *extra: str) -> dict[str, object]:
    """Mount with --keep KEEP, wait until staged, compare every byte, unmount: the store's
    status at the end."""
    base.mkdir(exist_ok=True)
    with mounted(image, base / "mnt", base / "local", "--keep", str(keep), *extra) as m:
        m.wait_staged(60)
        assert_same_tree(src, m.mountpoint)
        return store(m)


def packs(keep: Path) -> list[Path]:
    return sorted(keep.glob("*.pack"))


@pytest.mark.mpi
def test_four_daemons_adopt_what_they_kept_and_restage_only_a_changed_partition(
    src: Path, tmp_path: Path
) -> None:
    image = prepare(src, tmp_path / "img", "--partitions", "16")
    size = sum(p.stat().st_size for p in image.glob("part-*.pack"))
    runs = []
    for run, img in enumerate((image, image, None, image)):
        if img is None:  # the image prepared again with one file's bytes changed, same size
            changed = tmp_path / "src2"
            shutil.copytree(src, changed)
            victim = sorted(p for p in changed.rglob("*") if p.is_file())[5]
            data = bytearray(victim.read_bytes())
            data[-100] ^= 0xFF
            victim.write_bytes(bytes(data))
            img = prepare(changed, tmp_path / "img2", "--partitions", "16")
        base = tmp_path / f"run{run}"
        n = 2 if run == 3 else 4  # at last a job with another node count
        with stopping(launch.Daemons(img, base / "mnt-{rank}", base / "local-{rank}", n,
                                     ["--linger", "20", "--keep", str(tmp_path / "keep-{rank}")],
                                     log=tmp_path / f"mpirun{run}.log")) as m:  # fmt: skip
            m.wait_staged(60)
            for r in range(n):
                assert_same_tree(changed if run == 2 else src, m.mnts[r])
            runs.append([store(m, r) for r in range(n)])
    first, second, third, fewer = ([sum(int(s[k]) for s in r)  # type: ignore[call-overload]
                             for k in ("partitions_kept", "partitions_adopted",
                                       "bytes_from_image", "bytes_staged")]
                            for r in runs)  # fmt: skip
    assert first[:2] == [16, 0]
    assert second[:2] == [0, 16], runs[1]
    assert second[3] == 0 and second[2] <= size // 100, runs[1]  # every byte read, all local
    assert third[:2] == [1, 15], runs[2]  # only the changed file's partition staged again
    # 2 daemons, each with the keep directory of the daemon of its rank in the 4-rank jobs:
    # they reuse what they find there and stage the rest (the largest partition is rank 0's
    # in every layout, so at least that one is found)
    assert fewer[1] >= 1 and fewer[0] == 16 - fewer[1], runs[3]
    print(f"staging s by rank, first: {[s['staging_seconds'] for s in runs[0]]}, "
          f"second: {[s['staging_seconds'] for s in runs[1]]}")  # fmt: skip


def test_changed_entries_are_never_served_and_are_replaced(
    image: Path, src: Path, tmp_path: Path, user: User
) -> None:
    keep = tmp_path / "keep"
    first = kept_once(image, src, tmp_path / "a", keep)
    assert first["partitions_kept"] == 8
    entries = packs(keep)
    truncated, corrupted, planted, linked, renamed, foreign = entries[:6]
    with open(truncated, "r+b") as f:
        f.truncate(truncated.stat().st_size - 1)
    with open(corrupted, "r+b") as f:  # same size, one byte flipped
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    data = planted.read_bytes()  # a new file under the name, same bytes but one
    planted.unlink()
    planted.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    planted.chmod(0o600)
    target = tmp_path / "elsewhere.pack"
    linked.rename(target)
    linked.symlink_to(target)
    os.replace(renamed, entries[6])  # one entry moved over another's name
    os.chown(foreign, user.uid, user.gid)  # another user's file: never used, never touched
    entries[7].with_suffix(".seal").write_text("[" * 5000)  # a seal json cannot even parse
    second = kept_once(image, src, tmp_path / "b", keep)
    # truncated, corrupted, planted, linked, renamed over, unreadable seal
    assert second["kept_replaced"] == 6, second
    assert second["partitions_adopted"] == 0, second
    assert target.exists() and foreign.stat().st_uid == user.uid
    assert not linked.is_symlink() and linked.exists()  # replaced by a real copy
    third = kept_once(image, src, tmp_path / "c", keep)
    assert third["partitions_adopted"] == 7 and third["kept_replaced"] == 0, third


def test_a_budget_evicts_the_least_recently_used(image: Path, src: Path, tmp_path: Path) -> None:
    keep = tmp_path / "keep"
    kept_once(image, src, tmp_path / "a", keep)
    total = sum(p.stat().st_size for p in packs(keep))
    other_src = tmp_path / "other"
    datagen.sample(other_src, n_files=40, classes=2, seed=12)
    other = prepare(other_src, tmp_path / "other.img", "--partitions", "4")
    budget = total + sum(p.stat().st_size for p in other.glob("part-*.pack")) // 2
    st = kept_once(other, other_src, tmp_path / "b", keep, "--keep-size", str(budget))
    assert st["partitions_evicted"] > 0 and st["partitions_kept"] == 4, st
    assert sum(p.stat().st_size for p in packs(keep)) <= budget
    # A budget too small for anything: nothing kept, nothing fails.
    st = kept_once(image, src, tmp_path / "c", tmp_path / "keep2", "--keep-size", "1")
    assert st["partitions_kept"] == 0 and st["staging_done"], st


def test_two_mounts_share_a_keep_dir_and_prune_spares_what_is_in_use(
    image: Path, src: Path, tmp_path: Path
) -> None:
    keep = tmp_path / "keep"
    keep.mkdir(mode=0o700)
    users = {keep / "notes.pack": b"mine", keep / "run.lock": b"", keep / "a.seal": b"{}"}
    for path, data in users.items():  # the user's own files in DIR: never listed or removed
        path.write_bytes(data)
    extra = ("--keep", str(keep))
    with mounted(image, tmp_path / "m1", tmp_path / "l1", *extra) as one, \
            mounted(image, tmp_path / "m2", tmp_path / "l2", *extra) as two:  # fmt: skip
        one.wait_staged(60)
        two.wait_staged(60)
        assert_same_tree(src, one.mountpoint)
        assert_same_tree(src, two.mountpoint)
        a, b = store(one), store(two)
        assert int(a["partitions_kept"]) + int(b["partitions_kept"]) == 8, (a, b)  # type: ignore[call-overload]
        assert len(packs(keep)) == 8 + 1
        listed = json.loads(fanfs("keep", "ls", keep, "--json").stdout)
        assert len(listed) == 8 and all(e["in_use"] for e in listed)
        pruned = fanfs("keep", "prune", keep)
        assert pruned.returncode == 0 and "8 in use" in pruned.stdout, pruned.stdout
        assert len(packs(keep)) == 8 + 1
    pruned = fanfs("keep", "prune", keep)
    assert pruned.returncode == 0, pruned.stderr
    assert set(keep.iterdir()) == set(users), list(keep.iterdir())


def test_a_user_keeps_and_adopts_and_is_refused_a_dir_not_theirs(
    image: Path, src: Path, user: User
) -> None:
    work = user.home / "keep-test"
    work.mkdir()
    os.chown(work, user.uid, user.gid)
    img, own_src, mnt = work / "img", work / "src", work / "mnt"
    shutil.copytree(image, img)
    shutil.copytree(src, own_src)
    mnt.mkdir()
    subprocess.run(["chown", "-R", f"{user.uid}:{user.gid}", work], check=True, timeout=60)
    check = REPO / "tools" / "read_check.py"
    for round_ in range(2):
        proc = user.popen(*FANFS, "mount", img, mnt, "--keep", work / "keep",
                          log=work / f"mount{round_}.log")  # fmt: skip
        try:
            assert user.run(*FANFS, "wait", mnt, "--timeout", "30").returncode == 0
            done = user.run(sys.executable, check, own_src, mnt)
            assert done.returncode == 0, done.stdout + done.stderr
            st = json.loads(user.run(*FANFS, "status", mnt, "--json").stdout)["store"]
        finally:
            user.run(*FANFS, "umount", mnt)
            proc.wait(timeout=30)
        assert st["partitions_adopted"] + st["partitions_kept"] == 8, st
    assert st["partitions_adopted"] == 8, st
    foreign = work / "roots"  # root's: the user may not keep there
    foreign.mkdir(mode=0o755)
    done = user.run(*FANFS, "mount", img, mnt, "--keep", foreign)
    assert done.returncode != 0 and "not to you" in done.stderr, done.stderr
    assert not any(foreign.iterdir()) and not os.path.ismount(mnt)


def test_keys_follow_content_and_older_images_have_their_own(image: Path, tmp_path: Path) -> None:
    """Format 4 keys a partition by the SHA-256 the catalog records; an image of format 3 by its
    files' CRCs: both the same for the same content, never equal to each other."""
    four, _ = cat.Catalog.load(image)
    old = tmp_path / "old"
    shutil.copytree(image, old)
    columns, strings, meta, frame_size = columns_of((old / cat.CATALOG_NAME).read_bytes())
    (old / cat.CATALOG_NAME).write_bytes(cat.encode(columns, strings, meta,
                                                    frame_size=frame_size, version=3))  # fmt: skip
    three, _ = cat.Catalog.load(old)
    parts = range(four.n_partitions)
    k4, k3 = partition_keys(four, parts), partition_keys(three, parts)
    assert len(set(k4.values())) == len(set(k3.values())) == four.n_partitions
    assert not set(k4.values()) & set(k3.values())
    assert partition_keys(cat.Catalog.load(image)[0], parts) == k4
    columns["crc"][int(three.files_in_partition(2)[0])] ^= 1  # one file's CRC-32 changed
    changed = cat.Catalog.from_bytes(cat.encode(columns, strings, meta, frame_size=frame_size,
                                                version=3))  # fmt: skip
    k = partition_keys(changed, parts)
    assert [p for p in parts if k[p] != k3[p]] == [2]


def test_verify_finds_bytes_changed_without_a_write(image: Path, src: Path, tmp_path: Path) -> None:
    """What no seal can see (a disk that changes bytes without a write: here the seal is made
    to agree with the changed file) `fanfs keep verify` finds by each copy's SHA-256, removes,
    and the next mount stages again."""
    keep = tmp_path / "keep"
    kept_once(image, src, tmp_path / "a", keep)
    assert fanfs("keep", "verify", keep).returncode == 0
    victim = packs(keep)[3]
    with open(victim, "r+b") as f:
        f.seek(1000)
        f.write(b"\0rot")
    seal_path = victim.with_suffix(".seal")
    seal = json.loads(seal_path.read_text())
    seal["ctime_ns"] = victim.stat().st_ctime_ns  # as if it had changed under the seal
    seal_path.write_text(json.dumps(seal))
    done = fanfs("keep", "verify", keep)
    assert done.returncode == 1 and "(SHA-256 mismatch); removed" in done.stdout, done.stdout
    assert not victim.exists()
    st = kept_once(image, src, tmp_path / "b", keep)
    assert (st["partitions_adopted"], st["partitions_kept"]) == (7, 1), st
