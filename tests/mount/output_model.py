"""A model-based test of `fanfs output` (run as a script by tests/mount/test_output.py, as
the user).

Random sequences of create, write, append, truncate, rename (over existing names too),
unlink, mkdir, rmdir, fsync, close, sync, DEST failing and coming back, and a SIGKILL of the
daemon are applied to a real output mount and to a reference model (Mountpoint for S3 tests
its file system the same way). After every step the mount must read exactly as the model;
after every sync DEST must hold exactly what the mount holds (open files too: a sync lands
them as they are); after a SIGKILL, `fanfs umount` of the dead mount lands what the daemon
left, and DEST must hold every file as it was last closed.

    python output_model.py FANFS WORK SEED STEPS   ->  prints "ok" or raises with the step
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

NAMES = ["a", "b", "c", "d.pt", "log"]
DIRS = ["", "x", "y", "x/z"]


@dataclass
class Model:
    """What the mount must show: files by inode (so open handles follow renames), names."""

    data: dict[int, bytearray] = field(default_factory=dict)
    names: dict[str, int] = field(default_factory=dict)  # path -> inode
    dirs: set[str] = field(default_factory=set)
    closed: dict[int, bytes] = field(default_factory=dict)  # inode -> its bytes at last close
    next: int = 1

    def tree(self) -> dict[str, bytes]:
        return {p: bytes(self.data[i]) for p, i in self.names.items()}

    def parent_ok(self, path: str) -> bool:
        parent = os.path.dirname(path)
        return parent == "" or parent in self.dirs

    def children(self, d: str) -> list[str]:
        prefix = d + "/"
        return [p for p in [*self.names, *self.dirs] if p.startswith(prefix)]


def read_tree(root: Path) -> tuple[dict[str, bytes], set[str]]:
    files, dirs = {}, set()
    for base, dnames, fnames in os.walk(root):
        rel = os.path.relpath(base, root)
        for d in dnames:
            dirs.add(os.path.normpath(os.path.join(rel, d)))
        for f in fnames:
            p = os.path.normpath(os.path.join(rel, f))
            with open(os.path.join(base, f), "rb") as fh:
                files[p] = fh.read()
    return files, dirs


class Run:
    def __init__(self, fanfs: str, work: Path, seed: int):
        self.fanfs, self.work, self.rng = fanfs, work, random.Random(seed)
        self.mnt, self.local = work / "mnt", work / "local"
        self.generation = 0
        self.model = Model()
        self.handles: dict[int, tuple[int, bool]] = {}  # fd -> (inode, append)
        self.dest_up = True
        self.proc: subprocess.Popen[bytes] | None = None
        self.log: list[str] = []
        for d in (self.mnt, self.local):
            d.mkdir(exist_ok=True)
        self.start()

    # -- the daemon ------------------------------------------------------------------------

    @property
    def dest(self) -> Path:
        return self.work / f"dest-{self.generation}"

    def start(self) -> None:
        self.dest.mkdir(exist_ok=True)
        with open(self.work / f"daemon-{self.generation}.log", "wb") as out:
            self.proc = subprocess.Popen(
                [self.fanfs, "output", str(self.dest), str(self.mnt), "--local", str(self.local),
                 "--interval", "0.3"], stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        done = subprocess.run([self.fanfs, "wait", str(self.mnt), "--timeout", "30"],
                              capture_output=True, text=True, check=False)  # fmt: skip
        assert done.returncode == 0, done.stderr

    def status(self, name: str = "user.fanfs.status") -> dict[str, object]:
        return dict(json.loads(os.getxattr(self.mnt, name)))

    def sync(self) -> None:
        """As `fanfs sync` does: everything written now, then wait until it is at DEST."""
        target = self.status("user.fanfs.retry")["landing"]["enqueued"]  # type: ignore[index]
        deadline = time.monotonic() + 30
        while True:
            landing = self.status()["landing"]
            if landing["landed"] >= target:  # type: ignore[index]
                return
            assert time.monotonic() < deadline, f"sync: not landed in 30 s: {landing}"
            time.sleep(0.01)

    # -- steps -----------------------------------------------------------------------------

    def path(self) -> str:
        return os.path.join(self.rng.choice(DIRS), self.rng.choice(NAMES)).lstrip("/")

    def step(self) -> None:
        m, rng = self.model, self.rng
        kind = rng.choices(
            ["open", "write", "close", "truncate", "rename", "unlink", "mkdir", "rmdir",
             "fsync", "sync", "dest", "kill", "append"],
            [8, 12, 8, 3, 4, 3, 3, 2, 1, 2, 1, 0.4, 4],
        )[0]  # fmt: skip
        getattr(self, f"do_{kind}")(m, rng)

    def note(self, what: str) -> None:
        self.log.append(what)

    def do_open(self, m: Model, rng: random.Random) -> None:
        if len(self.handles) >= 3:
            return
        p = self.path()
        if not m.parent_ok(p) or p in m.dirs:
            return
        mode = rng.choice(["wb", "ab", "r+b"] if p in m.names else ["wb", "ab"])
        flags = {"wb": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                 "ab": os.O_WRONLY | os.O_CREAT | os.O_APPEND, "r+b": os.O_RDWR}[mode]  # fmt: skip
        fd = os.open(self.mnt / p, flags, 0o644)
        if p not in m.names:
            m.names[p] = m.next
            m.data[m.next] = bytearray()
            m.next += 1
        ino = m.names[p]
        if mode == "wb":
            m.data[ino][:] = b""
        self.handles[fd] = (ino, mode == "ab")
        self.note(f"open {p} {mode} -> {fd}")

    def _write(self, fd: int, size: int, at_end: bool) -> None:
        ino, append = self.handles[fd]
        data = self.model.data[ino]
        buf = self.rng.randbytes(size)
        off = len(data) if append or at_end else self.rng.randrange(0, len(data) + 1)
        n = os.pwrite(fd, buf, off) if not append else os.write(fd, buf)
        assert n == size
        if len(data) < off:
            data.extend(bytes(off - len(data)))
        data[off : off + size] = buf
        self.note(f"write {fd} {size}@{off}")

    def do_write(self, m: Model, rng: random.Random) -> None:
        if self.handles:
            self._write(rng.choice(list(self.handles)), rng.choice([1, 100, 5000, 70000]), False)

    def do_append(self, m: Model, rng: random.Random) -> None:
        if self.handles:
            self._write(rng.choice(list(self.handles)), rng.randrange(1, 200), True)

    def do_close(self, m: Model, rng: random.Random) -> None:
        if self.handles:
            fd = rng.choice(list(self.handles))
            ino, _ = self.handles.pop(fd)
            os.close(fd)
            m.closed[ino] = bytes(m.data[ino])
            self.note(f"close {fd}")

    def do_fsync(self, m: Model, rng: random.Random) -> None:
        if self.handles and self.dest_up:
            fd = rng.choice(list(self.handles))
            os.fsync(fd)
            self.note(f"fsync {fd}")

    def do_truncate(self, m: Model, rng: random.Random) -> None:
        if m.names:
            p = rng.choice(sorted(m.names))
            data = m.data[m.names[p]]
            size = rng.choice([0, len(data) // 2, len(data) + 3000])
            os.truncate(self.mnt / p, size)
            if size < len(data):
                del data[size:]
            else:
                data.extend(bytes(size - len(data)))
            self.note(f"truncate {p} {size}")

    def do_rename(self, m: Model, rng: random.Random) -> None:
        if rng.random() < 0.3 and len(m.dirs) > 0:  # a directory
            src = rng.choice(sorted(m.dirs))
            dst = rng.choice(["x", "y", "q", "x/w"])
            if dst == src or dst.startswith(src + "/") or not m.parent_ok(dst) or \
                    dst in m.names or (dst in m.dirs and m.children(dst)):  # fmt: skip
                return
            os.rename(self.mnt / src, self.mnt / dst)
            m.dirs.discard(dst)
            moved = {p: dst + p[len(src) :] for p in [*m.names, *m.dirs]
                     if p == src or p.startswith(src + "/")}  # fmt: skip
            m.names = {moved.get(p, p): i for p, i in m.names.items()}
            m.dirs = {moved.get(p, p) for p in m.dirs}
            self.note(f"rename dir {src} {dst}")
            return
        if not m.names:
            return
        src = rng.choice(sorted(m.names))
        dst = self.path()
        if dst == src or not m.parent_ok(dst) or dst in m.dirs:
            return
        os.rename(self.mnt / src, self.mnt / dst)
        m.names[dst] = m.names.pop(src)
        self.note(f"rename {src} {dst}")

    def do_unlink(self, m: Model, rng: random.Random) -> None:
        if m.names:
            p = rng.choice(sorted(m.names))
            os.unlink(self.mnt / p)
            del m.names[p]
            self.note(f"unlink {p}")

    def do_mkdir(self, m: Model, rng: random.Random) -> None:
        d = rng.choice([*DIRS[1:], "q", "x/w"])
        if d in m.dirs or d in m.names or not m.parent_ok(d):
            return
        os.mkdir(self.mnt / d)
        m.dirs.add(d)
        self.note(f"mkdir {d}")

    def do_rmdir(self, m: Model, rng: random.Random) -> None:
        empty = [d for d in sorted(m.dirs) if not m.children(d)]
        if empty:
            d = rng.choice(empty)
            os.rmdir(self.mnt / d)
            m.dirs.discard(d)
            self.note(f"rmdir {d}")

    def do_dest(self, m: Model, rng: random.Random) -> None:
        self.dest_up = not self.dest_up
        self.dest.chmod(0o755 if self.dest_up else 0o555)
        self.note(f"dest {'up' if self.dest_up else 'down'}")

    def do_sync(self, m: Model, rng: random.Random) -> None:
        if not self.dest_up:
            return
        self.sync()
        self.note("sync")
        self.check(self.dest, "DEST after sync")

    def do_kill(self, m: Model, rng: random.Random) -> None:
        """Close everything, SIGKILL the daemon, `fanfs umount` (which lands what it left):
        DEST must hold every file as last closed. Then a new daemon, a new DEST."""
        for fd in list(self.handles):
            self.do_close_fd(fd)
        assert self.proc is not None
        # Some SIGKILLs land while puts are pending; each after the RELEASEs of the closes,
        # which the kernel sends after close() returns (a file only created lands at its RELEASE):
        # the daemon counts no open handle then.
        deadline = time.monotonic() + 10
        while self.status()["open_handles"] != 0:
            assert time.monotonic() < deadline, "the closes' RELEASEs never came"
            time.sleep(0.005)
        time.sleep(rng.choice([0.0, 0.05, 0.3]))
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        if not self.dest_up:
            self.do_dest(m, rng)
        done = subprocess.run([self.fanfs, "umount", str(self.mnt)], capture_output=True,
                              text=True, check=False)  # fmt: skip
        assert done.returncode == 0, f"umount of the killed daemon: {done.stderr}"
        self.note("kill")
        self.check(self.dest, "DEST after a SIGKILL and the umount's recovery")
        partials = [p for p in self.dest.rglob("*") if p.name.startswith(".fanfs-")]
        assert not partials, partials
        self.generation += 1
        self.model = Model()
        self.start()

    def do_close_fd(self, fd: int) -> None:
        ino, _ = self.handles.pop(fd)
        os.close(fd)
        self.model.closed[ino] = bytes(self.model.data[ino])

    # -- checks ----------------------------------------------------------------------------

    def check(self, root: Path, where: str) -> None:
        files, dirs = read_tree(root)
        want = self.model.tree()
        if files != want or dirs != self.model.dirs:
            diff = {p for p in set(files) | set(want) if files.get(p) != want.get(p)}
            raise AssertionError(
                f"{where}: files differ at {sorted(diff)} (sizes "
                f"{[(p, len(files.get(p, b'')), len(want.get(p, b''))) for p in sorted(diff)]}), "
                f"dirs {sorted(dirs ^ self.model.dirs)}; last steps: {self.log[-12:]}"
            )

    def finish(self) -> None:
        for fd in list(self.handles):
            self.do_close_fd(fd)
        if not self.dest_up:
            self.do_dest(self.model, self.rng)
        done = subprocess.run([self.fanfs, "umount", str(self.mnt)], capture_output=True,
                              text=True, check=False)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert self.proc is not None and self.proc.wait(30) == 0
        self.check(self.dest, "DEST after umount")
        left = [p for p in self.local.iterdir()]
        assert not left, f"left on the node: {left}"


def main() -> None:
    fanfs, work, seed, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    run = Run(fanfs, work, seed)
    try:
        for i in range(steps):
            try:
                run.step()
            except OSError as e:
                raise AssertionError(
                    f"seed {seed} step {i}: {e} ({errno.errorcode.get(e.errno or 0)}); "
                    f"last steps: {run.log[-12:]}"
                ) from e
            run.check(run.mnt, f"seed {seed} step {i}: the mount")
        run.finish()
    finally:
        if run.proc is not None and run.proc.poll() is None:
            run.proc.kill()
            subprocess.run([fanfs, "umount", str(run.mnt)], capture_output=True, check=False)
    print("ok")


if __name__ == "__main__":
    main()
