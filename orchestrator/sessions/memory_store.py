"""Sessions in this process's memory, for `hydra-jury generate --local`: the same
interface and the same checks as `RedisStore`, nothing survives the process."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

from hydra_jury.orchestrator.sessions.record import SessionRecord, scoped_id
from hydra_jury.orchestrator.sessions.store import (
    RESERVATION_MS,
    Acquired,
    SessionBusy,
    SessionStore,
    StoreSettings,
)
from hydra_jury.serving.errors import SessionConflict, SessionExists, SessionNotFound


def _now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class _Entry:
    record: SessionRecord
    expires_ms: int
    rounds: list[Any] = field(default_factory=list)


class MemoryStore(SessionStore):
    where = "memory"

    def __init__(self, settings: StoreSettings | None = None) -> None:
        self.settings = settings or StoreSettings()
        self._entries: dict[str, _Entry] = {}
        self._expiry: dict[str, int] = {}  # cache id -> expiry (ms)
        # key name -> session id -> when it was admitted (ms)
        self._key_sessions: dict[str, dict[str, int]] = {}

    def _live(self, session_id: str, key_name: str) -> _Entry | None:
        scoped = scoped_id(session_id, key_name)
        entry = self._entries.get(scoped)
        if entry is not None and entry.expires_ms <= _now_ms():
            del self._entries[scoped]
            return None
        return entry

    def _touch(self, entry: _Entry, now: int) -> None:
        entry.expires_ms = now + self.settings.ttl_ms
        self._expiry[entry.record.cache_id] = entry.expires_ms

    async def ping(self) -> None:
        return None

    async def create(self, record: SessionRecord, owner: str) -> None:
        if self._live(record.session_id, record.key_name) is not None:
            raise SessionExists(f"session {record.session_id!r} already exists")
        now = _now_ms()
        record.version, record.owner = 1, owner
        record.lease_until_ms = now + self.settings.lease_ms if owner else 0
        record.created_ms = record.updated_ms = now
        entry = self._entries[record.scoped_id] = _Entry(copy.deepcopy(record), 0)
        self._touch(entry, now)

    async def acquire(self, session_id: str, owner: str, key_name: str = "") -> Acquired:
        entry = self._live(session_id, key_name)
        if entry is None:
            raise SessionNotFound(f"no session {session_id!r} (unknown, closed or expired)")
        stored, now = entry.record, _now_ms()
        other = stored.owner not in ("", owner)
        if other and stored.lease_until_ms > now:
            raise SessionBusy(session_id, (stored.lease_until_ms - now) / 1000)
        stored.version += 1
        stored.owner, stored.lease_until_ms = owner, now + self.settings.lease_ms
        stored.updated_ms = now
        self._touch(entry, now)
        return Acquired(copy.deepcopy(stored), other)

    async def load(self, session_id: str, key_name: str = "") -> SessionRecord | None:
        entry = self._live(session_id, key_name)
        return None if entry is None else copy.deepcopy(entry.record)

    async def commit(
        self,
        record: SessionRecord,
        *,
        rounds: list[Any] = (),
        reset_rounds: bool = False,
        release: bool = False,
        retired_cache: str | None = None,
    ) -> None:
        entry = self._live(record.session_id, record.key_name)
        if entry is None:
            raise SessionNotFound(f"session {record.session_id} was closed or expired")
        stored = entry.record
        if stored.version != record.version or stored.owner != record.owner:
            raise SessionConflict(f"session {record.session_id} was taken over by another request")
        now = _now_ms()
        record.version += 1
        record.updated_ms = now
        record.owner = "" if release else record.owner
        record.lease_until_ms = 0 if release else now + self.settings.lease_ms
        entry.record = copy.deepcopy(record)
        if reset_rounds:
            entry.rounds = []
        entry.rounds.extend(copy.deepcopy(list(rounds)))
        if retired_cache is not None:
            self._expiry.pop(retired_cache, None)
        self._touch(entry, now)

    async def rounds(self, session_id: str, key_name: str = "") -> list[Any]:
        entry = self._live(session_id, key_name)
        return [] if entry is None else copy.deepcopy(entry.rounds)

    async def delete(self, session_id: str, key_name: str = "") -> str | None:
        entry = self._entries.pop(scoped_id(session_id, key_name), None)
        if entry is None:
            return None
        self._expiry.pop(entry.record.cache_id, None)
        self._key_sessions.get(key_name, {}).pop(session_id, None)
        return entry.record.cache_id

    async def admit_key_session(self, key_name: str, session_id: str, limit: int) -> int:
        filed, now = self._key_sessions.setdefault(key_name, {}), _now_ms()
        held = 0
        for other, admitted in list(filed.items()):
            if other == session_id:
                continue
            if self._live(other, key_name) is not None or admitted > now - RESERVATION_MS:
                held += 1
            else:
                del filed[other]
        if held < limit:
            filed[session_id] = now
        return held

    async def claim_expired(self, limit: int = 100) -> list[str]:
        now = _now_ms()
        expired = [cache for cache, at in self._expiry.items() if at <= now][:limit]
        for cache in expired:
            del self._expiry[cache]
        return expired

    async def close(self) -> None:
        self._entries.clear()
