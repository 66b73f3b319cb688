"""Sessions in Redis (redis-py's asyncio client).

Key schema (`prefix` defaults to "hydra-jury:"; `{id}` is the session's scoped id:
`KEYNAME/SESSIONID` on a server with API keys, else the session id):
- `{prefix}session:{id}` — hash: `version`, `owner`, `lease_until` (ms, Redis clock),
  `created`, `updated` (ms), `doc` (the record as JSON: messages, options, seed, draft
  head, jury, cache id, replicas with their epochs, processed length, the current
  generation and its progress), `tokens` (committed token ids, little-endian int32),
  `result` (the latest finished generation's output, JSON).
- `{prefix}session:{id}:rounds` — list: the current generation's rounds, one JSON array
  of token records each.
- `{prefix}expiry` — sorted set: cache id -> when its session expires (ms), so an
  orchestrator can release the caches of expired sessions on the services.
- `{prefix}key-sessions:{name}` — sorted set: the session ids of an API key -> when each
  was admitted (ms); a session leaves it when deleted, and one whose record expired at
  the key's next admission, so it holds at most the key's limit and needs no TTL.
Both session keys carry the idle TTL, refreshed by every acquire and commit.

Every write is one Lua script, so it is atomic, and checks the version and the owner it
was given (compare-and-set); lease times come from Redis's own clock, so orchestrators
with skewed clocks agree on who owns a session. Redis Cluster is not supported (the
scripts touch a session's keys and the shared expiry index).

Each operation a request makes is a trace span, `session_store.NAME` (`serving.tracing`);
the sweeper's claim of expired sessions is not, so that it starts no trace of its own.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from hydra_jury.orchestrator.sessions.record import (
    SessionRecord,
    pack_tokens,
    scoped_id,
    unpack_tokens,
)
from hydra_jury.orchestrator.sessions.store import (
    RESERVATION_MS,
    Acquired,
    SessionBusy,
    SessionStore,
    StoreSettings,
)
from hydra_jury.serving import tracing
from hydra_jury.serving.errors import (
    ServiceUnavailable,
    SessionConflict,
    SessionExists,
    SessionNotFound,
)

T = TypeVar("T")

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: session, expiry. ARGV: doc, tokens, owner, lease_ms, ttl_ms, cache_id.
_CREATE = (
    _NOW
    + """
if redis.call('EXISTS', KEYS[1]) == 1 then return {0} end
local lease = 0
if ARGV[3] ~= '' then lease = now + tonumber(ARGV[4]) end
redis.call('HSET', KEYS[1], 'version', 1, 'owner', ARGV[3], 'lease_until', lease,
  'created', now, 'updated', now, 'doc', ARGV[1], 'tokens', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[5]), ARGV[6])
return {1, lease, now}
"""
)

# KEYS: session, rounds, expiry. ARGV: owner, lease_ms, ttl_ms.
_ACQUIRE = (
    _NOW
    + """
local f = redis.call('HMGET', KEYS[1], 'version', 'owner', 'lease_until', 'doc', 'tokens',
  'created', 'result')
if not f[1] then return {'missing'} end
local lease_until = tonumber(f[3])
if f[2] ~= '' and f[2] ~= ARGV[1] and lease_until > now then
  return {'busy', lease_until - now}
end
local took_over = 0
if f[2] ~= '' and f[2] ~= ARGV[1] then took_over = 1 end
local version = tonumber(f[1]) + 1
lease_until = now + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'version', version, 'owner', ARGV[1], 'lease_until', lease_until,
  'updated', now)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[3]), cjson.decode(f[4])['cache_id'])
return {'ok', version, took_over, lease_until, now, f[6], f[4], f[5], f[7] or ''}
"""
)

# KEYS: session, rounds, expiry. ARGV: version, owner, lease_ms (0: release), ttl_ms,
# doc, tokens, result ('' keeps it), reset_rounds, cache_id, retired cache ('' none),
# then one JSON string per round to append.
_COMMIT = (
    _NOW
    + """
local f = redis.call('HMGET', KEYS[1], 'version', 'owner')
if not f[1] then return {'missing'} end
if tonumber(f[1]) ~= tonumber(ARGV[1]) or f[2] ~= ARGV[2] then return {'stale'} end
local version = tonumber(f[1]) + 1
local owner, lease_until = ARGV[2], now + tonumber(ARGV[3])
if tonumber(ARGV[3]) == 0 then owner, lease_until = '', 0 end
redis.call('HSET', KEYS[1], 'version', version, 'owner', owner, 'lease_until', lease_until,
  'updated', now, 'doc', ARGV[5], 'tokens', ARGV[6])
if ARGV[7] ~= '' then redis.call('HSET', KEYS[1], 'result', ARGV[7]) end
if ARGV[8] == '1' then redis.call('DEL', KEYS[2]) end
for i = 11, #ARGV do redis.call('RPUSH', KEYS[2], ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], ARGV[4])
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('PEXPIRE', KEYS[2], ARGV[4]) end
if ARGV[10] ~= '' then redis.call('ZREM', KEYS[3], ARGV[10]) end
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[4]), ARGV[9])
return {'ok', version, lease_until, now}
"""
)

# KEYS: session, rounds, expiry.
_DELETE = """
local doc = redis.call('HGET', KEYS[1], 'doc')
if not doc then return false end
local cache_id = cjson.decode(doc)['cache_id']
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('ZREM', KEYS[3], cache_id)
return cache_id
"""

# KEYS: the key's session index. ARGV: the prefix of its sessions' record keys, session
# id, limit, reservation ms. Counts the other sessions whose record exists or that were
# admitted within the reservation, dropping the rest; files the session when under the
# limit. Returns the count.
_ADMIT_KEY_SESSION = (
    _NOW
    + """
local entries = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
local held = 0
for i = 1, #entries, 2 do
  local id, admitted = entries[i], tonumber(entries[i + 1])
  if id ~= ARGV[2] then
    if redis.call('EXISTS', ARGV[1] .. id) == 1 or admitted > now - tonumber(ARGV[4]) then
      held = held + 1
    else
      redis.call('ZREM', KEYS[1], id)
    end
  end
end
if held < tonumber(ARGV[3]) then redis.call('ZADD', KEYS[1], now, ARGV[2]) end
return held
"""
)

# KEYS: expiry. ARGV: limit.
_CLAIM_EXPIRED = (
    _NOW
    + """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
if #ids > 0 then redis.call('ZREM', KEYS[1], unpack(ids)) end
return ids
"""
)


def redacted(url: str) -> str:
    """The URL without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


KEY_PREFIX = "hydra-jury:"  # of every key, unless a deployment names its own


class RedisStore(SessionStore):
    def __init__(
        self,
        url: str,
        *,
        prefix: str = KEY_PREFIX,
        settings: StoreSettings | None = None,
        timeout_s: float = 2.0,
        max_connections: int = 64,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(
                f"redis URL {redacted(url)!r} must start with redis://, rediss:// (TLS) or unix://"
            )
        self.settings = settings or StoreSettings()
        self.prefix = prefix
        self.where = f"Redis at {redacted(url)}"
        # Fail fast: a short connect and command timeout and one quick retry, so a
        # request learns within seconds that Redis is gone (UNAVAILABLE).
        self._client = redis.from_url(
            url,
            socket_connect_timeout=timeout_s,
            socket_timeout=timeout_s,
            max_connections=max_connections,
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), retries=1),
            decode_responses=False,
        )
        self._scripts = {
            name: self._client.register_script(source)
            for name, source in {
                "create": _CREATE,
                "acquire": _ACQUIRE,
                "commit": _COMMIT,
                "delete": _DELETE,
                "claim_expired": _CLAIM_EXPIRED,
                "admit_key_session": _ADMIT_KEY_SESSION,
            }.items()
        }

    def _keys(self, session_id: str, key_name: str = "") -> list[str]:
        session = f"{self.prefix}session:{scoped_id(session_id, key_name)}"
        return [session, f"{session}:rounds", f"{self.prefix}expiry"]

    async def _call(self, command: Awaitable[T]) -> T:
        """A Redis command's reply; any failure is `ServiceUnavailable` naming Redis."""
        try:
            return await command
        except (RedisConnectionError, RedisTimeoutError, OSError) as error:
            raise ServiceUnavailable(f"{self.where} is unavailable: {error}") from None
        except RedisError as error:
            raise ServiceUnavailable(f"{self.where} refused a command: {error}") from None

    async def _run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        return await self._call(self._scripts[name](keys=keys, args=args))

    async def ping(self) -> None:
        await self._call(self._client.ping())

    @tracing.spanned("session_store.create")
    async def create(self, record: SessionRecord, owner: str) -> None:
        session, _rounds, expiry = self._keys(record.session_id, record.key_name)
        reply = await self._run(
            "create",
            [session, expiry],
            [
                record.document(),
                pack_tokens(record.tokens),
                owner,
                self.settings.lease_ms,
                self.settings.ttl_ms,
                record.cache_id,
            ],
        )
        if reply[0] == 0:
            raise SessionExists(f"session {record.session_id!r} already exists")
        record.version, record.owner = 1, owner
        record.lease_until_ms, record.created_ms = int(reply[1]), int(reply[2])
        record.updated_ms = record.created_ms

    @tracing.spanned("session_store.acquire")
    async def acquire(self, session_id: str, owner: str, key_name: str = "") -> Acquired:
        reply = await self._run(
            "acquire",
            self._keys(session_id, key_name),
            [owner, self.settings.lease_ms, self.settings.ttl_ms],
        )
        status = reply[0].decode()
        if status == "missing":
            raise SessionNotFound(f"no session {session_id!r} (unknown, closed or expired)")
        if status == "busy":
            raise SessionBusy(session_id, int(reply[1]) / 1000)
        version, took_over, lease_until, now, created, doc, tokens, result = reply[1:]
        record = SessionRecord.from_document(
            doc,
            version=int(version),
            owner=owner,
            lease_until_ms=int(lease_until),
            created_ms=int(created),
            updated_ms=int(now),
        )
        record.tokens = unpack_tokens(tokens)
        record.result = json.loads(result) if result else None
        return Acquired(record, bool(took_over))

    @tracing.spanned("session_store.load")
    async def load(self, session_id: str, key_name: str = "") -> SessionRecord | None:
        fields = await self._call(self._client.hgetall(self._keys(session_id, key_name)[0]))
        if not fields:
            return None
        record = SessionRecord.from_document(
            fields[b"doc"],
            version=int(fields[b"version"]),
            owner=fields[b"owner"].decode(),
            lease_until_ms=int(fields[b"lease_until"]),
            created_ms=int(fields[b"created"]),
            updated_ms=int(fields[b"updated"]),
        )
        record.tokens = unpack_tokens(fields[b"tokens"])
        record.result = json.loads(fields[b"result"]) if fields.get(b"result") else None
        return record

    @tracing.spanned("session_store.commit")
    async def commit(
        self,
        record: SessionRecord,
        *,
        rounds: list[Any] = (),
        reset_rounds: bool = False,
        release: bool = False,
        retired_cache: str | None = None,
    ) -> None:
        tracing.annotate(rounds=len(rounds))  # a commit may carry several rounds
        reply = await self._run(
            "commit",
            self._keys(record.session_id, record.key_name),
            [
                record.version,
                record.owner,
                0 if release else self.settings.lease_ms,
                self.settings.ttl_ms,
                record.document(),
                pack_tokens(record.tokens),
                json.dumps(record.result) if record.result is not None else "",
                "1" if reset_rounds else "0",
                record.cache_id,
                retired_cache or "",
                *(json.dumps(r, separators=(",", ":")) for r in rounds),
            ],
        )
        status = reply[0].decode()
        if status == "missing":
            raise SessionNotFound(f"session {record.session_id} was closed or expired")
        if status == "stale":
            raise SessionConflict(f"session {record.session_id} was taken over by another request")
        record.version, record.lease_until_ms, record.updated_ms = map(int, reply[1:])
        if release:
            record.owner = ""

    @tracing.spanned("session_store.rounds")
    async def rounds(self, session_id: str, key_name: str = "") -> list[Any]:
        rounds = self._keys(session_id, key_name)[1]
        items = await self._call(self._client.lrange(rounds, 0, -1))
        return [json.loads(item) for item in items]

    @tracing.spanned("session_store.delete")
    async def delete(self, session_id: str, key_name: str = "") -> str | None:
        reply = await self._run("delete", self._keys(session_id, key_name), [])
        if key_name:  # at once, not after its reservation (`admit_key_session`)
            await self._call(self._client.zrem(self._key_sessions(key_name), session_id))
        return reply.decode() if reply else None

    @tracing.spanned("session_store.admit_key_session")
    async def admit_key_session(self, key_name: str, session_id: str, limit: int) -> int:
        records = self._keys("", key_name)[0]  # a session's record key: this and its id
        args = [records, session_id, limit, RESERVATION_MS]
        return int(await self._run("admit_key_session", [self._key_sessions(key_name)], args))

    def _key_sessions(self, key_name: str) -> str:
        """The index of an API key's sessions."""
        return f"{self.prefix}key-sessions:{key_name}"

    async def claim_expired(self, limit: int = 100) -> list[str]:
        reply = await self._run("claim_expired", [f"{self.prefix}expiry"], [limit])
        return [item.decode() for item in reply]

    async def close(self) -> None:
        await self._client.aclose()
