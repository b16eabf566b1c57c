"""The image directory on disk: what counts as a fanfs image, and who may read one.

`prepare --force` replaces IMAGE only when it is a fanfs image: a real directory holding a
catalog (fanfs magic) and nothing but image files (the catalog and `part-NNNNN.pack`). Anything
else, a directory of someone's work, the parent of SRC, a symlink, is refused: it is never
deleted. Removal unlinks the image's own files by name and then removes the directory, so even
a file that appears in it meanwhile survives (the directory is then left in place, with a
warning). Nothing here calls `shutil.rmtree` on a path that a user named.

Work in progress lives in hidden siblings named `.IMAGE.partial-HOST-PID` (the new image) and
`.IMAGE.old-HOST-PID` (the replaced one, between the two renames). A prepare that was killed
leaves one behind; the next prepare of the same IMAGE removes those whose process is gone (same
host, pid not running) and which hold only image files. A sibling from another host is left
alone: its process may still run there, on the shared file system.

Who may read: an image is as private as the most private file it holds. `readers` tells which
of group and others can read a source file (its mode and the search bits of every directory
above it, SRC's own ancestors included); the image gets the intersection over all files, unless
`--mode` says otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import stat
from pathlib import Path

from fanfs.errors import ImageExists, SourceError
from fanfs.image import catalog as cat
from fanfs.node.staging import pid_alive

log = logging.getLogger(__name__)

GROUP, OTHERS = 1, 2  # reader classes beyond the owner, as a bit set
EVERYONE = GROUP | OTHERS
MODES = {"private": 0, "group": GROUP, "public": EVERYONE}  # --mode names
_PART = re.compile(r"part-\d{5}\.pack")


def readers(st: os.stat_result, image_gid: int | None, above: int) -> int:
    """Who besides the owner can read this entry (files) or pass through it (directories),
    given who can reach its parent (`above`). GROUP means the members of the group the image
    will belong to: the entry's group bits apply to them only if it has that group, otherwise
    they are "others" to it (another group's members must not gain access via the image)."""
    is_dir = stat.S_ISDIR(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        return above  # a symlink's text is readable by whoever reaches it
    g_bit, o_bit = (0o010, 0o001) if is_dir else (0o040, 0o004)
    who = OTHERS if st.st_mode & o_bit else 0
    same_group = image_gid is None or st.st_gid == image_gid
    if st.st_mode & (g_bit if same_group else o_bit):
        who |= GROUP
    return who & above


def reach(src: Path, image_gid: int | None) -> int:
    """Who can reach SRC itself: the search bits of every directory above it."""
    who = EVERYONE
    for d in reversed(src.absolute().parents):
        with contextlib.suppress(OSError):
            who = readers(os.stat(d), image_gid, who)
    return who


def image_gid(parent: Path) -> int:
    """The group a new directory in `parent` gets (the parent's if set-gid, else ours)."""
    st = os.stat(parent)
    return st.st_gid if st.st_mode & stat.S_ISGID else os.getegid()


def permissions(who: int) -> tuple[int, int]:
    """(directory mode, file mode) of an image readable by `who` besides its owner."""
    d, f = 0o700, 0o600
    if who & GROUP:
        d, f = d | 0o050, f | 0o040
    if who & OTHERS:
        d, f = d | 0o005, f | 0o004
    return d, f


def umask() -> int:
    """The process's umask, read without changing it (os.umask would, for a moment)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022


def describe(who: int) -> str:
    return {0: "only you", GROUP: "you and your group", EVERYONE: "every user"}.get(
        who, "you and others"
    )


def check_nesting(src: Path, image: Path) -> None:
    """IMAGE must be neither SRC, nor inside it, nor hold it, after resolving symlinks."""
    s, i = Path(os.path.realpath(src)), Path(os.path.realpath(image))
    if i == s or s in i.parents:
        raise SourceError(f"{image}: the image must not be inside the source directory ({s})")
    if i in s.parents:
        raise SourceError(f"{image}: the source directory ({s}) must not be inside the image")


def not_an_image(path: Path) -> str | None:
    """Why `path` is not a fanfs image that may be replaced, or None if it is one."""
    if path.is_symlink():
        return "it is a symlink"
    if not path.is_dir():
        return "it is not a directory"
    try:
        with open(path / cat.CATALOG_NAME, "rb") as f:
            if f.read(len(cat.MAGIC)) != cat.MAGIC:
                return f"its {cat.CATALOG_NAME} is not a fanfs catalog"
        names = os.listdir(path)
    except OSError as e:
        return f"it has no readable {cat.CATALOG_NAME} ({e.strerror})"
    for name in names:
        if not _is_image_file(path, name):
            return f"it holds {name!r}, which is not part of a fanfs image"
    return None


def _is_image_file(path: Path, name: str) -> bool:
    if name != cat.CATALOG_NAME and not _PART.fullmatch(name):
        return False
    return stat.S_ISREG(os.lstat(path / name).st_mode)


def check_replaceable(image: Path, force: bool) -> None:
    """Refuse an existing IMAGE unless --force and it is a fanfs image."""
    if not (image.exists() or image.is_symlink()):
        return
    if not force:
        raise ImageExists(f"{image}: already exists (use --force to replace a fanfs image)")
    why = not_an_image(image)
    if why is not None:
        raise ImageExists(f"{image}: not replacing it with --force: {why}")


def remove(path: Path) -> None:
    """Delete an image directory's own files, then the directory (if nothing else is in it)."""
    for name in os.listdir(path):
        if _is_image_file(path, name):
            (path / name).unlink()
    try:
        path.rmdir()
    except OSError as e:
        log.warning("left %s in place: %s", path, e.strerror)


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())


def partial_path(image: Path) -> Path:
    return image.parent / f".{image.name}.partial-{_host()}-{os.getpid()}"


def old_path(image: Path) -> Path:
    return image.parent / f".{image.name}.old-{_host()}-{os.getpid()}"


def sweep(image: Path) -> None:
    """Remove the leftovers of killed prepares of IMAGE on this host (see the module doc)."""
    pattern = re.compile(re.escape(f".{image.name}.") + r"(partial|old)-(.+)-(\d+)")
    try:
        names = os.listdir(image.parent)
    except OSError:
        return
    for name in names:
        m = pattern.fullmatch(name)
        if m is None or m.group(2) != _host() or pid_alive(int(m.group(3))):
            continue
        path = image.parent / name
        if path.is_symlink() or not path.is_dir():
            continue
        try:
            if all(_is_image_file(path, n) for n in os.listdir(path)):
                log.info("removing %s, left by a prepare that was killed", path)
                remove(path)
        except OSError as e:
            log.warning("cannot remove %s: %s", path, e.strerror)
