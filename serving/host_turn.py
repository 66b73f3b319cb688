"""The host turn: services that share one host's cores (the local stack's trunk and jury
shards) run their batches in turn, each with every core, instead of at once.

Two OpenMP teams on the same cores stall each other: a parallel region ends only when
every one of its threads has run its part, and a thread that lost its core to the other
team's waits for its time slice. Measured on a 2-core machine (8 sessions through the
split stack, float32): the trunk's Draft batch of about 4 sessions took 63 ms beside the
shards' Score batches against 16 ms for one session alone.

The turn is a lock on a file every service of the host names (`flock`, so a process that
dies lets go of it). The trunk takes it alone; the jury shards share it with one another
(they score the same sessions' positions at once, and on two cores two shards side by
side scored one session in 18.5 ms where one after the other took 12 ms each), but never
with the trunk. A batcher chooses its batch once it holds the turn, so calls that arrive
while another service's batch runs join the next batch; and it waits for the sessions it
expects back while another service holds the turn, since that wait costs the host nothing
(`serving.batcher.CallBatcher._gather`).

Waiting has one trap: sessions that fell into two groups, one group's calls queued at the
trunk and the other's at the shards, each service waiting for the group the other holds.
Both windows then end together, both run a part, and the groups go round apart for good
(8 sessions, 2-core Intel Xeon: Draft batches of 5.2 sessions and 62–65 tokens/s, against
7.8 and 77 in step). So a shard that waits with calls queued says so (a shared lock on
one byte of the file: `mark_gathering`), and the trunk, seeing it, runs its batch at once
(`yields`) while the shards wait on: their window lasts while the trunk's batch runs, the
trunk's group comes to them, and the next Score batch holds every session.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from collections.abc import AsyncIterator
from pathlib import Path

# The byte of the lock file a shard waiting with calls queued holds a shared POSIX record
# lock on (apart from the `flock` of the turn itself: Linux keeps the two kinds apart).
GATHERING_BYTE = 0


class HostTurn:
    """The host turn on the lock file `path` (created if missing), taken alone
    (`shared=False`, the trunk) or beside the other shared holders (the jury shards)."""

    def __init__(self, path: str | Path, shared: bool = False) -> None:
        self._mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
        self._gathering = False  # this shared holder's mark is set (`mark_gathering`)
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as error:
            raise ValueError(
                f"--host-turn: cannot open the lock file {path}: {error.strerror}"
            ) from error
        self.held = False

    @property
    def shared(self) -> bool:
        return self._mode == fcntl.LOCK_SH

    def close(self) -> None:
        os.close(self._fd)

    def try_acquire(self) -> bool:
        """Takes the turn if no other process holds it against this one; whether it did."""
        try:
            fcntl.flock(self._fd, self._mode | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        self.held = True
        return True

    @contextlib.asynccontextmanager
    async def holding(self) -> AsyncIterator[None]:
        """The turn, from `acquire` to `release`."""
        await self.acquire()
        try:
            yield
        finally:
            self.release()

    async def acquire(self) -> None:
        """Waits for the turn (on a worker thread, off the event loop). Cancelled while
        waiting, it lets go of the turn as soon as the wait ends, so a cancelled caller
        never keeps it."""
        if self.try_acquire():
            return
        waited = asyncio.get_running_loop().run_in_executor(None, fcntl.flock, self._fd, self._mode)
        try:
            await asyncio.shield(waited)
        except asyncio.CancelledError:
            waited.add_done_callback(lambda done: done.exception() or self._unlock())
            raise
        self.held = True

    def release(self) -> None:
        self.held = False
        self._unlock()

    def _unlock(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def busy(self) -> bool:
        """Whether another process holds the turn against this one now (a batch of
        another service is running on the host's cores)."""
        if self.held:
            return False
        if not self.try_acquire():
            return True
        self.release()
        return False

    def mark_gathering(self) -> None:
        """A shared holder's batcher is waiting for more calls with some queued: says so
        to the exclusive holder (`yields`) until `unmark_gathering`. Called again at each
        look while the wait lasts: a mark that met the exclusive holder's look (which
        takes the byte for an instant) is made at the next."""
        if self.shared and not self._gathering:
            self._gathering = self._record_lock(fcntl.LOCK_SH)

    def unmark_gathering(self) -> None:
        if self._gathering:
            self._record_unlock()
            self._gathering = False

    def yields(self) -> bool:
        """Whether this, the exclusive holder, should run its batch now rather than wait
        for more calls: a shared holder is waiting with calls queued (`mark_gathering`),
        so the sessions this one waits for may be queued there, waiting for this one's."""
        if self.shared:
            return False
        if not self._record_lock(fcntl.LOCK_EX):
            return True
        self._record_unlock()
        return False

    def _record_lock(self, mode: int) -> bool:
        """Takes a record lock of `mode` on GATHERING_BYTE without waiting; whether it did."""
        try:
            fcntl.lockf(self._fd, mode | fcntl.LOCK_NB, 1, GATHERING_BYTE)
        except (BlockingIOError, PermissionError):
            return False
        return True

    def _record_unlock(self) -> None:
        fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, GATHERING_BYTE)
