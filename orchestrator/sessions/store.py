"""The session store interface: atomic, version-checked writes of `SessionRecord`s.

Two implementations: `redis_store.RedisStore` (every server) and
`memory_store.MemoryStore` (`hydra-jury generate --local` only). Both keep, per session,
the record, the token records of its current generation's rounds (so a resumed request
can return the whole output), and an expiry index of cache ids (so the caches of a
session whose idle TTL passed are released on the services).

Sessions per API key: `admit_key_session` files a key's new session in an index of the
key's sessions, unless the key already holds its limit; a filed session counts while its
record exists (deleted or expired, it stops counting), and from its admission on, for
`RESERVATION_MS`, before its record does; `delete` unfiles it at once.

Ownership: `acquire` gives a request the lease (refused with `SessionBusy` while another
owner's lease runs); every `commit` names the version it read and its owner, and is
refused (`SessionConflict`) when the record changed under it — taken over after its lease
ran out, or deleted by CloseSession. A refused write changes nothing: a record is always
before or after a round, never in between.

Key names: a session belongs to the API key that created it (`SessionRecord.key_name`)
and is filed under its scoped id (`record.scoped_id`): every method that takes a
session id takes the caller's key name too, and finds only that key's sessions.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from hydra_jury.orchestrator.sessions.record import SessionRecord
from hydra_jury.serving.errors import SessionConflict

# How long an admitted session counts against its key before its record exists: the
# record is created right after, and meanwhile another admission must not drop it.
RESERVATION_MS = 10_000


class SessionBusy(SessionConflict):
    """Another generation holds the session's lease."""

    def __init__(self, session_id: str, retry_after_s: float) -> None:
        super().__init__(
            f"session {session_id} is busy with another generation; retry in "
            f"{retry_after_s:.1f} s or use another session"
        )
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Acquired:
    record: SessionRecord
    took_over: bool  # the previous owner's lease ran out without a release


@dataclass(frozen=True)
class StoreSettings:
    ttl_s: float = 3600.0  # an idle session's record is deleted after this long
    lease_s: float = 30.0  # an owner that stops committing loses the session after this
    # A generation's rounds computed within this long of its last commit go with its next
    # commit, together (the first and the last round are committed at once). A commit
    # costs the server's event loop and Redis about 0.5 ms of CPU, which on a 2-core
    # machine takes a core from the model's threads in mid-step: `serve` decoding int8
    # (a token every 7-10 ms) ran 1.10x faster committing at most every 20 ms than every
    # round (2-core Intel Xeon, 8 pairs, all faster). Rounds slower than this (float32
    # on a CPU, or under load) are each committed as before. 0: every round is
    # committed when the last commit is done.
    commit_interval_s: float = 0.02

    def __post_init__(self) -> None:
        if not self.ttl_s > 0:
            raise ValueError(f"session TTL must be positive, got {self.ttl_s}")
        if not 0 < self.lease_s <= self.ttl_s:
            raise ValueError(
                f"session lease must be positive and at most the TTL, got {self.lease_s}"
            )
        if not 0 <= self.commit_interval_s < self.lease_s:
            raise ValueError(
                "session commit interval must be at least 0 and less than the lease, got "
                f"{self.commit_interval_s}"
            )

    @property
    def ttl_ms(self) -> int:
        return int(self.ttl_s * 1000)

    @property
    def lease_ms(self) -> int:
        return int(self.lease_s * 1000)


def store_settings_from(settings: object) -> StoreSettings:
    """The session store's settings a server's settings hold, as `session_ttl_s`,
    `session_lease_s` and `session_commit_interval_s` (the parsed flags, or the
    orchestrator's configuration)."""
    return StoreSettings(
        ttl_s=settings.session_ttl_s,
        lease_s=settings.session_lease_s,
        commit_interval_s=settings.session_commit_interval_s,
    )


class SessionStore(ABC):
    settings: StoreSettings
    where: str  # for messages: "Redis at HOST:PORT", "memory"

    @abstractmethod
    async def ping(self) -> None:
        """Raises `ServiceUnavailable` (naming the store) when it cannot be reached."""

    @abstractmethod
    async def create(self, record: SessionRecord, owner: str) -> None:
        """Stores a new record, leased to `owner` ("" for none); `SessionExists` if its
        id is taken. Sets the record's store fields."""

    @abstractmethod
    async def acquire(self, session_id: str, owner: str, key_name: str = "") -> Acquired:
        """The record, leased to `owner`; `SessionNotFound` or `SessionBusy`."""

    @abstractmethod
    async def load(self, session_id: str, key_name: str = "") -> SessionRecord | None:
        """The record as it is, without taking the lease."""

    @abstractmethod
    async def commit(
        self,
        record: SessionRecord,
        *,
        rounds: list[Any] = (),
        reset_rounds: bool = False,
        release: bool = False,
        retired_cache: str | None = None,
    ) -> None:
        """Writes the record if its version and owner are still the stored ones; appends
        `rounds` (JSON-ready) to the generation's round records (after clearing them
        with `reset_rounds`); renews the lease and the TTL, or gives the lease up with
        `release`; drops `retired_cache` from the expiry index. Bumps `record.version`.
        `SessionConflict` (`SessionNotFound` once deleted) if the record changed."""

    @abstractmethod
    async def rounds(self, session_id: str, key_name: str = "") -> list[Any]:
        """The current generation's round records, in order."""

    @abstractmethod
    async def delete(self, session_id: str, key_name: str = "") -> str | None:
        """Deletes the session; its cache id, or None if there was no such session."""

    @abstractmethod
    async def admit_key_session(self, key_name: str, session_id: str, limit: int) -> int:
        """How many other sessions the API key `key_name` holds; `session_id` is filed
        among them when that is under `limit` (one already filed counts once)."""

    @abstractmethod
    async def claim_expired(self, limit: int = 100) -> list[str]:
        """Cache ids of sessions whose TTL passed, each handed to one caller only."""

    @abstractmethod
    async def close(self) -> None:
        """Closes connections."""
