"""Build and install pyfuse3 with fanfs's small, generic patch (tools/pyfuse3_patch/).

fanfs's read path is its own extension (fanfs/_native.pyx, built by `pip install -e .`); pyfuse3
gets only what a file system needs from it to use one, pinned to pyfuse3 3.5.0 (another release
fails loudly instead of silently building an unpatched module) and tested on its own
(tests/mount/test_pyfuse3_patch.py):

1. The inode for file handle 0: fanfs answers OPEN with ENOSYS so the kernel stops sending
OPEN/RELEASE ("no_open") and keeps the page cache across opens; the kernel then sends READ with
file handle 0, and stock pyfuse3 passes only the handle to `Operations.read`. Patched, `read`
gets the inode when the handle is 0 (fanfs's own handles always equal the inode).

2. A read hook: `pyfuse3.set_read_hook(capsule)` registers a C function; a read handler that
returns a tuple instead of bytes hands it the request (with the session and the inode), and
the function answers it from its own threads, without the GIL or the event loop. Nonzero from
the function, or no function: pyfuse3 answers EIO (a request is never left unanswered).

3. A receiver: `pyfuse3.set_receiver(capsule, fd)` registers a C function that takes requests
from the FUSE device in threads of its own (answering what it can) and hands the session loop
the others; the loop calls it instead of reading the device and waits for `fd` instead of the
device's fd (`terminate` wakes that wait too). `session_fileno()` gives it the device.

4. The background limit: `pyfuse3.set_background(n)` before `init` makes the INIT ask the
kernel for `n` requests in the background (and a congestion threshold of 3/4 of it), so that
many readers' readahead READs are neither queued in the kernel nor skipped.

5. The session loop takes a request that is already queued at once, going through trio's wait
for readability (a lock, an epoll_ctl, an epoll_wait) only when there is none.

Idempotent: does nothing when the patched build is already installed in this interpreter (its
patch level and the digest of the patch's sources, this script included, both match).
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "3.5.0"
MARKER = "FANFS_READ_PASSES_INODE"
# The patch level is defined once, in fanfs/node/fuse_ops.py (read as text: fanfs may not be
# installed yet); it is written into the build as pyfuse3.FANFS_PATCH.
_NATIVE = Path(__file__).resolve().parents[1] / "fanfs" / "node" / "fuse_ops.py"
PATCH_LEVEL = int(re.search(r"^PATCH_LEVEL = (\d+)", _NATIVE.read_text(), re.M).group(1))  # type: ignore[union-attr]
HOOKS = Path(__file__).resolve().parent / "pyfuse3_patch" / "fanfs_hooks.pxi"
# Any change to the patch (the Cython or the anchors here) rebuilds, not only a new level.
DIGEST = hashlib.sha256(Path(__file__).resolve().read_bytes() + HOOKS.read_bytes()).hexdigest()[:16]

# The anchor is pyfuse3 3.5.0's fuse_read(); a different release fails loudly instead of
# silently building an unpatched module.
ANCHOR = """    c.off = off
    c.fh = fi.fh
    save_retval(fuse_read_async(c))"""
REPLACEMENT = """    c.off = off
    # fanfs: with no_open the kernel sends fh 0; hand the inode to read() instead.
    c.fh = fi.fh if fi.fh != 0 else ino
    c.ino = ino  # for the read hook
    save_retval(fuse_read_async(c))"""

REPLY_ANCHOR = """    else:
        PyObject_GetBuffer(buf, &pybuf, PyBUF_CONTIG_RO)
        ret = fuse_reply_buf(c.req, <const_char*> pybuf.buf, <size_t> pybuf.len)
        PyBuffer_Release(&pybuf)
"""
REPLY_REPLACEMENT = """    else:
        if type(buf) is tuple:
            # fanfs: the handler hands the request to the read hook (fanfs_hooks.pxi).
            if _hand_to_hook(c.req, c.ino, buf) == 0:
                return
            ret = fuse_reply_err(c.req, errno.EIO)
        else:
            PyObject_GetBuffer(buf, &pybuf, PyBUF_CONTIG_RO)
            ret = fuse_reply_buf(c.req, <const_char*> pybuf.buf, <size_t> pybuf.len)
            PyBuffer_Release(&pybuf)
"""
HANDLERS_INCLUDE = 'include "handlers.pxi"'
# The INIT handler, before it calls Operations.init (handlers.pxi).
INIT_ANCHOR = """    # Blocking rather than async, in case we decide to let the
    # init handler modify `conn` in the future.
    operations.init()
"""
INIT_REPLACEMENT = """    _fanfs_init(conn)  # fanfs: the background limit (fanfs_hooks.pxi)
    operations.init()
"""
# terminate() wakes the loop's wait: with a receiver that is a wait on the receiver's fd.
TERMINATE_ANCHOR = """    fuse_session_exit(session)
    trio.lowlevel.notify_closing(session_fd)
"""
TERMINATE_REPLACEMENT = """    fuse_session_exit(session)
    trio.lowlevel.notify_closing(session_fd)
    _fanfs_notify_closing()
"""

# pyfuse3 3.5.0's session loop waits for the FUSE fd through trio (a lock, an epoll_ctl and an
# epoll_wait) before every request, even when the next one is already queued. Pairs of (anchor
# in internal.pxi, replacement).
LOOP_PATCHES = (
    (
        """\
    buf.flags = 0
    while not fuse_session_exited(session):
""",
        """\
    buf.flags = 0
    cdef int streak = 0
    os.set_blocking(session_fd, False)  # fanfs: see below
    while not fuse_session_exited(session):
""",
    ),
    (
        """\
        if not await _wait_fuse_readable():
            break

        res = fuse_session_receive_buf(session, &buf)
""",
        """\
        # fanfs: the fd is non-blocking; take a request that is already queued at once
        # and wait through trio only when there is none. With a receiver
        # (fanfs_hooks.pxi), requests come from it instead of the fd.
        res = _fanfs_receive(&buf)
        if res == -errno.EAGAIN:
            streak = 0
            if not await _wait_fuse_readable():
                break
            res = _fanfs_receive(&buf)
        elif res > 0:
            # Requests taken without waiting through trio do not let it look at its other
            # file descriptors (signals, pipes, sockets): yield to it every 16 of them.
            streak += 1
            if streak >= 16:
                streak = 0
                await trio.lowlevel.cancel_shielded_checkpoint()
""",
    ),
    (
        """\
            await trio.lowlevel.wait_readable(session_fd)
""",
        """\
            await trio.lowlevel.wait_readable(_fanfs_wait_fd())  # fanfs: or the receiver's
""",
    ),
    (
        """\
        if res == -errno.EINTR:
            continue
""",
        """\
        if res == -errno.EINTR or res == -errno.EAGAIN:  # fanfs: another task took it
            continue
""",
    ),
)


def safe_extract(tar: tarfile.TarFile, dest: Path) -> None:
    """Extract a source archive that may be hostile, on every Python fanfs supports.

    `extractall(filter="data")` exists only from Python 3.12 (and 3.11.4, 3.10.12); Debian 12
    ships 3.11.2. The rule here is stricter than that filter and needs nothing new: regular
    files and directories only (no links, devices or fifos), relative names with no `..`, and
    no permission bits taken from the archive.
    """
    root = dest.resolve()
    for member in tar.getmembers():
        target = (root / member.name).resolve()
        if (
            not (member.isfile() or member.isdir())
            or member.name.startswith("/")
            or ".." in Path(member.name).parts
            or (target != root and root not in target.parents)
        ):
            sys.exit(f"install_pyfuse3: refusing archive member {member.name!r}")
    # Where the standard filter exists, it applies too (and keeps 3.12+ from warning).
    extra = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    for member in tar.getmembers():
        tar.extract(member, root, set_attrs=False, **extra)  # type: ignore[arg-type]


def installed_is_patched() -> bool:
    probe = (
        f"import pyfuse3, sys; sys.exit(0 if getattr(pyfuse3, {MARKER!r}, False) and "
        f"getattr(pyfuse3, 'FANFS_PATCH', 0) >= {PATCH_LEVEL} and "
        f"getattr(pyfuse3, 'FANFS_PATCH_DIGEST', '') == {DIGEST!r} else 1)"
    )
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def main() -> int:
    if installed_is_patched():
        return 0
    with tempfile.TemporaryDirectory(prefix="fanfs-pyfuse3-") as tmp:
        work = Path(tmp)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--no-binary",
                "pyfuse3",  # the sdist; its build tools (Cython) may come as wheels
                f"pyfuse3=={VERSION}",
                "-d",
                str(work),
            ],
            check=True,
        )
        (sdist,) = work.glob("pyfuse3-*.tar.gz")
        with tarfile.open(sdist) as tar:
            safe_extract(tar, work)
        src = work / f"pyfuse3-{VERSION}" / "src" / "pyfuse3"
        handlers = src / "handlers.pxi"
        init = src / "__init__.pyx"
        internal = src / "internal.pxi"
        text, init_text, loop = handlers.read_text(), init.read_text(), internal.read_text()
        reply_at = text.find("async def fuse_read_async")
        if (text.count(ANCHOR) != 1 or text.find(REPLY_ANCHOR, reply_at) < 0
                or text.count(INIT_ANCHOR) != 1
                or init_text.count(HANDLERS_INCLUDE) != 1
                or init_text.count(TERMINATE_ANCHOR) != 1
                or any(loop.count(a) != 1 for a, _ in LOOP_PATCHES)):  # fmt: skip
            sys.exit(
                f"install_pyfuse3: unexpected pyfuse3 source in {sdist.name}; patch not applied"
            )
        text = text.replace(ANCHOR, REPLACEMENT).replace(INIT_ANCHOR, INIT_REPLACEMENT)
        text = text[:reply_at] + text[reply_at:].replace(REPLY_ANCHOR, REPLY_REPLACEMENT, 1)
        handlers.write_text(text)
        for anchor, replacement in LOOP_PATCHES:
            loop = loop.replace(anchor, replacement)
        internal.write_text(loop)
        text = HOOKS.read_text().replace("@PATCH_LEVEL@", str(PATCH_LEVEL))
        (src / HOOKS.name).write_text(text)
        init_text = init_text.replace(
            HANDLERS_INCLUDE, f'include "{HOOKS.name}"\n{HANDLERS_INCLUDE}'
        ).replace(TERMINATE_ANCHOR, TERMINATE_REPLACEMENT)
        init.write_text(init_text + f"\n{MARKER} = True\nFANFS_PATCH_DIGEST = {DIGEST!r}\n")
        print(f"fanfs setup: building patched pyfuse3 {VERSION} (about 30 s)", flush=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--force-reinstall",
                str(work / f"pyfuse3-{VERSION}"),
            ],
            check=True,
        )
    if not installed_is_patched():
        sys.exit("install_pyfuse3: the patched build did not install")
    return 0


if __name__ == "__main__":
    sys.exit(main())
