"""Landing what dead output daemons left, without a mount: `fanfs output --recover DEST`
and the next `fanfs output` with the same DEST and --local (daemon.py), and `fanfs umount` of
an output mount whose daemon is gone (`recover_dir`). What they left is read by recover.py.

A stop signal, or an op that keeps failing (GIVE_UP attempts, about 3 s), ends the landing:
what is left stays where it is, named in NotLanded's one line, for a later try.

Concurrency: `land_dead` runs its own trio loop in the calling thread (no mount's loop runs).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import trio

from fanfs.errors import NotLanded
from fanfs.output import recover
from fanfs.output.dest import Dest, LandingError
from fanfs.output.journal import Journal
from fanfs.output.lander import Lander, Source
from fanfs.stopsignals import STOP_SIGNALS

GIVE_UP = 3  # failed attempts of one op after which a recovery without a mount gives up


def land_dead(lander: Lander) -> None:
    """Land `lander.recovering` (what dead daemons left) and nothing else; NotLanded naming
    what is left if an op fails GIVE_UP times (about 3 s) or a stop signal comes."""

    async def land() -> None:
        hurry = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lander.run)
            with trio.open_signal_receiver(*STOP_SIGNALS) as signals:
                nursery.start_soon(_set_on_signal, signals, hurry)
                with trio.CancelScope() as scope:
                    nursery.start_soon(cancel_on, hurry, scope)
                    with contextlib.suppress(LandingError):
                        await lander.wait_landed(0, give_up_after_failures=GIVE_UP)
                nursery.cancel_scope.cancel()

    trio.run(land)
    left = lander.recovering
    if left:
        failing = lander.statistics()["failing"]
        raise NotLanded(f"{sum(len(d.pending) for d in left)} changes left by a dead daemon "
                        f"did not land at {lander.dest.path}"
                        + (f" ({failing['op']} {failing['path']}: {failing['error']})"
                           if failing else "")
                        + f"; they stay in {', '.join(str(d.path) for d in left)}")  # fmt: skip


async def _set_on_signal(signals: AsyncIterator[int], event: trio.Event) -> None:
    async for _ in signals:
        event.set()


async def cancel_on(event: trio.Event, scope: trio.CancelScope) -> None:
    """Cancel `scope` once `event` is set."""
    await event.wait()
    scope.cancel()


def recover_dir(path: Path) -> None:
    """What the dead daemon whose staging directory is `path` left, landed (umount of its
    mount); NotLanded if it cannot be (read, or landed)."""
    dead = recover.open_dead(path)
    if dead is None:
        raise NotLanded(f"{path}: what its daemon left cannot be read (or it is still alive)")
    try:
        dest = Dest(str(dead.header.get("dest")))
    except OSError as e:
        dead.close()
        raise NotLanded(f"{path}: its DEST {dead.header.get('dest')}: {e.strerror}; what it "
                        "left stays there") from None  # fmt: skip
    own = Source("recovery", "r", lambda data: None, lambda record: None)
    land_dead(Lander(dest, Journal(None), own, recovering=[dead]))
