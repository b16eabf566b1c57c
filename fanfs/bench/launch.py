"""Running fanfs as a user would, from Python: the one helper that starts daemons and always
stops them, shared by `fanfs bench`, the demo (tools/demo.py) and the tests.

`run` and `check` call the `fanfs` command (the same interpreter's); `Daemons` starts one
`fanfs mount`, or N under mpirun, waits until every mount serves, and on `stop` escalates until
nothing is left: `fanfs umount` on every node at once, then SIGTERM, SIGKILL, and a lazy
unmount of anything still mounted. Every step has a timeout: nothing here waits forever.
`scratch` is where a run's generated data lives: a new directory of its own under the
`--workdir` the user names, the only thing it ever removes.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from fanfs import mounts
from fanfs.errors import FanfsError, UsageError

log = logging.getLogger(__name__)

# The installed command next to this interpreter, else the same code run as a module.
_SCRIPT = Path(sys.executable).with_name("fanfs")
FANFS = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "fanfs.cli"]
STEP_TIMEOUT = 120  # any one fanfs command: a hang fails instead of blocking its caller
# mpirun refuses root without these; harmless for everyone else.
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def run(*args: str | os.PathLike[str], timeout: float = STEP_TIMEOUT
        ) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """`fanfs ARGS...`, its output captured; never raises for a failed command."""
    return subprocess.run([*FANFS, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip


def check(*args: str | os.PathLike[str], timeout: float = STEP_TIMEOUT) -> str:
    """`fanfs ARGS...`'s standard output; FanfsError with its error line if it failed."""
    done = run(*args, timeout=timeout)
    if done.returncode != 0:
        raise FanfsError(f"fanfs {args[0]} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def stop_process(proc: subprocess.Popen[bytes], mountpoints: Sequence[Path],
                 umount: Any = None) -> None:  # fmt: skip
    """Escalate until nothing is left: `umount()`, SIGTERM, SIGKILL, then lazy unmounts."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        if proc.poll() is None and callable(umount):
            umount()
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            break
        proc.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)
    for m in mountpoints:
        if mounts.find(m):
            subprocess.run(["fusermount3", "-u", "-z", str(m)], timeout=10, check=False)


class Daemons:
    """`fanfs mount IMAGE MOUNTPOINT --local LOCAL EXTRA...`, under `mpirun -np RANKS` when
    RANKS > 1 (`{rank}` in MOUNTPOINT and LOCAL tells the daemons apart). Serving on return."""

    def __init__(
        self,
        image: Path,
        mountpoint: str | os.PathLike[str],
        local: str | os.PathLike[str],
        ranks: int = 1,
        extra: Sequence[str] = (),
        log: Path | None = None,
        mpirun: Sequence[str] = ("mpirun", "--oversubscribe", "--enable-recovery"),
        wait_s: float = 60,
    ):
        self.image = image
        self.ranks = ranks
        self.mnts = [Path(str(mountpoint).replace("{rank}", str(r))) for r in range(ranks)]
        self.locals = [Path(str(local).replace("{rank}", str(r))) for r in range(ranks)]
        for m in self.mnts:
            m.mkdir(parents=True, exist_ok=True)
        self.log = log or self.mnts[0].parent / f"{self.mnts[0].name}.log"
        cmd = [*FANFS, "mount", str(image), str(mountpoint), "--local", str(local), *extra]
        if ranks > 1:
            cmd = [*mpirun, "-np", str(ranks), *cmd]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, **MPI_ENV})  # fmt: skip
        try:
            for m in self.mnts:
                done = run("wait", m, "--timeout", str(wait_s), timeout=wait_s + 30)
                if done.returncode != 0:
                    raise FanfsError(f"{m} did not come up: {done.stderr}\n{self.log_text()}")
        except BaseException:  # also a stop signal (the bench's KeyboardInterrupt): no leftovers
            self.stop()
            raise

    @property
    def mountpoint(self) -> Path:
        return self.mnts[0]

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def status(self, rank: int = 0) -> dict[str, Any]:
        """What `fanfs status --json` says, asked of the daemon directly (its status
        attribute: these are this user's mounts), not by a process per question."""
        status = mounts.probe_status(self.mnts[rank], STEP_TIMEOUT)
        if status is None:
            raise FanfsError(f"{self.mnts[rank]}: daemon not answering\n{self.log_text()}")
        return status

    def wait_staged(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not all(self.status(r)["store"]["staging_done"] for r in range(self.ranks)):
            if time.monotonic() > deadline:
                raise FanfsError(f"staging did not finish in {timeout:.0f} s")
            time.sleep(0.2)

    def umount_all(self) -> list[subprocess.CompletedProcess[str]]:
        """`fanfs umount` on every node at once, as a job's teardown step does (each daemon
        lingers until its peers have unmounted too)."""
        live = [m for m in self.mnts if mounts.find(m)]
        if not live:
            return []
        with concurrent.futures.ThreadPoolExecutor(len(live)) as pool:
            return list(pool.map(lambda m: run("umount", m, "--timeout", "60", timeout=90), live))

    def stop(self) -> None:
        stop_process(self.proc, self.mnts, self.umount_all)


@contextlib.contextmanager
def mounted(*args: Any, **kwargs: Any) -> Iterator[Daemons]:
    """`Daemons(...)` for the length of a with block, stopped however the block ends."""
    d = Daemons(*args, **kwargs)
    try:
        yield d
    finally:
        d.stop()


@contextlib.contextmanager
def scratch(parent: str | os.PathLike[str], name: str, keep: bool = False) -> Iterator[Path]:
    """A new, private directory `parent/NAME-XXXXXXXX` for one run's files, removed with all
    it holds when the block ends (unless `keep`). `parent` is created if missing (and removed
    again if it is empty then); nothing that was in it is touched, whatever its name: a
    user's `--workdir` may hold their data. A directory with a mount still under it is left
    in place with a warning (removing through a mount would delete what it shows)."""
    parent = Path(os.path.abspath(parent))
    made = not parent.exists()
    try:
        parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=parent))
    except OSError as e:
        raise UsageError(f"{parent}: cannot make a working directory there: {e.strerror}") from None
    try:
        yield path
    finally:
        if keep:
            log.info("kept %s", path)
        elif mounts.under(path):
            log.warning("left %s in place: %s is still mounted", path, mounts.under(path)[0])
        else:
            shutil.rmtree(path, ignore_errors=True)
            if made:
                with contextlib.suppress(OSError):
                    parent.rmdir()
