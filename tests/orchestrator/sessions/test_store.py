"""The session stores: Redis (a real server) and memory behave alike — ownership,
fencing by version, atomic commits with their rounds, deletion and expiry."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from hydra_jury.orchestrator.output import FinishReason, Progress
from hydra_jury.orchestrator.sessions import memory_store, redis_store
from hydra_jury.orchestrator.sessions.memory_store import MemoryStore
from hydra_jury.orchestrator.sessions.record import (
    GenerationRecord,
    SessionRecord,
    common_prefix,
    new_cache_id,
    pack_tokens,
    unpack_tokens,
)
from hydra_jury.orchestrator.sessions.redis_store import RedisStore, redacted
from hydra_jury.orchestrator.sessions.store import SessionBusy, StoreSettings
from hydra_jury.poe import RequestStats
from hydra_jury.serving.errors import (
    ServiceUnavailable,
    SessionConflict,
    SessionExists,
    SessionNotFound,
)


@pytest.fixture(params=["redis", "memory"])
def make_store(request, redis_url):
    """A factory of stores over one shared backing (two Redis clients share a server)."""
    prefix = f"store-{uuid.uuid4().hex[:8]}:"
    shared = MemoryStore(StoreSettings(ttl_s=60, lease_s=0.3))

    def make(ttl_s: float = 60, lease_s: float = 0.3):
        settings = StoreSettings(ttl_s=ttl_s, lease_s=lease_s)
        if request.param == "redis":
            return RedisStore(redis_url, prefix=prefix, settings=settings)
        shared.settings = settings
        return shared

    return make


def run(coroutine):
    return asyncio.run(coroutine)


def new_record(tokens=(1, 2, 3)) -> SessionRecord:
    session_id = uuid.uuid4().hex
    record = SessionRecord(session_id, new_cache_id(session_id), tokens=list(tokens))
    record.generation = GenerationRecord("r1", "digest", 2, Progress(generated=[3]))
    return record


def test_create_acquire_commit_and_load(make_store):
    async def scenario():
        store = make_store()
        record = new_record()
        await store.create(record, owner="a")
        assert (record.version, record.owner) == (1, "a")
        with pytest.raises(SessionExists):
            await store.create(record, owner="b")
        record.tokens.append(9)
        record.processed = 3
        await store.commit(record, rounds=[[{"token_id": 9}]], reset_rounds=True)
        assert record.version == 2
        loaded = await store.load(record.session_id)
        assert loaded.tokens == [1, 2, 3, 9] and loaded.processed == 3
        assert loaded.generation == record.generation
        assert loaded.owner == "a" and loaded.lease_until_ms > 0
        await store.commit(record, rounds=[[{"token_id": 10}]], release=True)
        assert await store.rounds(record.session_id) == [[{"token_id": 9}], [{"token_id": 10}]]
        loaded = await store.load(record.session_id)
        assert loaded.owner == "" and loaded.version == 3
        await store.close()

    run(scenario())


def test_a_leased_session_is_busy_until_released_or_expired(make_store):
    async def scenario():
        store = make_store()
        record = new_record()
        await store.create(record, owner="a")
        with pytest.raises(SessionBusy, match="busy"):
            await store.acquire(record.session_id, "b")
        await asyncio.sleep(0.4)  # the 0.3 s lease runs out without a release
        taken = await store.acquire(record.session_id, "b")
        assert taken.took_over and taken.record.owner == "b"
        # The stale owner's write is refused, and changes nothing.
        record.tokens = [7, 7, 7]
        with pytest.raises(SessionConflict, match="taken over"):
            await store.commit(record)
        assert (await store.load(record.session_id)).tokens == [1, 2, 3]
        await store.commit(taken.record, release=True)
        again = await store.acquire(record.session_id, "c")
        assert not again.took_over  # released cleanly: no takeover
        with pytest.raises(SessionNotFound):
            await store.acquire("nope", "c")
        await store.close()

    run(scenario())


def test_racing_writers_exactly_one_wins(make_store):
    """Two copies of one record (same version, same owner) commit at once: one write
    lands, the other is refused; the stored record is the winner's, field by field."""

    async def scenario():
        store = make_store()
        record = new_record()
        await store.create(record, owner="a")
        copies = [await store.load(record.session_id) for _ in range(2)]
        for index, copy in enumerate(copies):
            copy.tokens = [index] * (5 + index)
            copy.processed = index
        results = await asyncio.gather(
            *(store.commit(copy, rounds=[[index]]) for index, copy in enumerate(copies)),
            return_exceptions=True,
        )
        winners = [i for i, result in enumerate(results) if result is None]
        assert len(winners) == 1
        assert isinstance(results[1 - winners[0]], SessionConflict)
        stored = await store.load(record.session_id)
        winner = copies[winners[0]]
        assert (stored.tokens, stored.processed, stored.version) == (
            winner.tokens,
            winner.processed,
            winner.version,
        )
        assert await store.rounds(record.session_id) == [[winners[0]]]
        await store.close()

    run(scenario())


def test_delete_and_expiry(make_store):
    async def scenario():
        store = make_store(ttl_s=0.3, lease_s=0.1)
        record = new_record()
        await store.create(record, owner="")
        assert await store.delete(record.session_id) == record.cache_id
        assert await store.delete(record.session_id) is None
        with pytest.raises(SessionNotFound):
            await store.commit(record)
        expiring = new_record()
        await store.create(expiring, owner="")
        assert await store.claim_expired() == []
        await asyncio.sleep(0.4)
        assert await store.load(expiring.session_id) is None
        assert await store.claim_expired() == [expiring.cache_id]
        assert await store.claim_expired() == []  # each cache id is claimed once
        await store.close()

    run(scenario())


def test_each_api_key_has_its_own_sessions(make_store):
    """One session id under two keys is two sessions: neither key finds, busies or
    deletes the other's."""

    async def scenario():
        store = make_store()
        session_id = uuid.uuid4().hex
        records = {
            name: SessionRecord(session_id, new_cache_id(session_id, name), name, tokens=[n])
            for n, name in enumerate(("alice", "bob"))
        }
        for record in records.values():
            await store.create(record, owner=f"{record.key_name}-owner")
        assert records["alice"].cache_id.startswith(f"alice/{session_id}~")
        assert await store.load(session_id) is None  # no key: neither
        assert (await store.load(session_id, "bob")).tokens == [1]
        with pytest.raises(SessionBusy):  # bob's own lease, not alice's
            await store.acquire(session_id, "someone", "bob")
        with pytest.raises(SessionNotFound):
            await store.acquire(session_id, "someone", "carol")
        assert await store.delete(session_id, "carol") is None
        assert await store.delete(session_id, "alice") == records["alice"].cache_id
        with pytest.raises(SessionNotFound):
            await store.commit(records["alice"])
        await store.commit(records["bob"], rounds=[[7]], release=True)
        assert await store.rounds(session_id, "bob") == [[7]]
        assert await store.rounds(session_id, "alice") == []
        assert (await store.acquire(session_id, "bob-owner", "bob")).record.key_name == "bob"
        await store.close()

    run(scenario())


def test_an_unreachable_redis_is_unavailable_and_named():
    async def scenario():
        store = RedisStore("redis://:secret@127.0.0.1:1/0", timeout_s=0.5)
        with pytest.raises(ServiceUnavailable, match=r"Redis at redis://:\*\*\*@127.0.0.1:1/0"):
            await store.acquire("x", "a")
        await store.close()

    began = time.monotonic()
    run(scenario())
    assert time.monotonic() - began < 5  # fails fast


def test_bad_settings_and_urls_are_refused():
    with pytest.raises(ValueError, match="must start with redis://"):
        RedisStore("http://localhost:6379")
    with pytest.raises(ValueError, match="lease must be positive and at most the TTL"):
        StoreSettings(ttl_s=10, lease_s=20)
    for interval in (-0.01, 20):
        with pytest.raises(ValueError, match="commit interval must be at least 0 and less"):
            StoreSettings(ttl_s=60, lease_s=20, commit_interval_s=interval)
    assert redacted("rediss://user:pw@host:6380/1") == "rediss://user:***@host:6380/1"


def test_tokens_pack_compactly_and_prefixes():
    assert len(pack_tokens([1, 2, 49151])) == 12
    assert unpack_tokens(pack_tokens([5, 0, 49151])) == [5, 0, 49151]
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0


def test_a_document_holds_every_field_but_the_stores_the_tokens_and_the_result():
    record = new_record(tokens=range(40))
    record.kind, record.messages = "chat", [{"role": "user", "content": "hi"}]
    record.processed, record.options, record.seed = 39, {"gamma": 4, "stop": ["\n"]}, 7
    record.draft_head, record.jury = "head0", ["head1", "head2"]
    record.key_name = "alice"
    record.replicas = {"trunk": "127.0.0.1:1@e1"}
    record.version, record.owner, record.result = 5, "a", {"output": {"text": "x" * 100}}
    record.generation.progress = Progress(
        generated=[3, 4],
        round_sizes=[2],
        stats=RequestStats(rounds=1, accepted_per_position=[1, 0]),
        text="ab",
        detokenizer_offsets=(1, 2),
        finish_reason=FinishReason.STOP,
    )
    restored = SessionRecord.from_document(record.document())
    assert restored == SessionRecord(
        **{**vars(record), "version": 0, "owner": "", "tokens": [], "result": None}
    )


def keyed_record(key_name: str, session_id: str) -> SessionRecord:
    return SessionRecord(session_id, new_cache_id(session_id, key_name), key_name)


def test_a_key_s_sessions_count_while_their_records_exist(make_store, monkeypatch):
    for module in (memory_store, redis_store):  # a session counts only by its record
        monkeypatch.setattr(module, "RESERVATION_MS", 0)
    key = f"k{uuid.uuid4().hex[:6]}"

    async def scenario() -> None:
        store = make_store(ttl_s=0.5)
        assert await store.admit_key_session(key, "a", 2) == 0
        await store.create(keyed_record(key, "a"), owner="")
        assert await store.admit_key_session(key, "b", 2) == 1
        await store.create(keyed_record(key, "b"), owner="")
        assert await store.admit_key_session(key, "c", 2) == 2  # refused: nothing filed
        assert await store.admit_key_session(key, "a", 2) == 1  # filed already: once
        assert await store.admit_key_session("other", "c", 2) == 0  # keys count apart
        await store.delete("a", key)
        assert await store.admit_key_session(key, "c", 2) == 1  # a closed one stops counting
        await store.create(keyed_record(key, "c"), owner="")
        await asyncio.sleep(0.6)  # b and c expire
        assert await store.admit_key_session(key, "d", 2) == 0
        await store.close()

    run(scenario())


def test_an_admitted_session_counts_before_its_record_exists(make_store):
    key = f"k{uuid.uuid4().hex[:6]}"

    async def scenario() -> None:
        store = make_store()
        assert await store.admit_key_session(key, "a", 1) == 0
        # A's record is not written yet, and already counts.
        assert await store.admit_key_session(key, "b", 1) == 1
        await store.close()

    run(scenario())


def test_a_progress_dict_is_a_copy_that_round_trips():
    """A round's snapshot is stored while the request goes on: its dict shares no list
    with the progress, and gives back an equal one."""
    progress = Progress(
        generated=[3, 4],
        round_sizes=[2],
        stats=RequestStats(rounds=1, reached_per_position=[1, 1], accepted_per_position=[1, 0]),
        finish_reason=FinishReason.LENGTH,
    )
    values = progress.to_dict()
    assert Progress.from_dict(values) == progress
    progress.generated.append(5)
    progress.round_sizes.append(1)
    progress.stats.observe_round(2, 2)
    assert values["generated"] == [3, 4] and values["round_sizes"] == [2]
    assert values["stats"]["accepted_per_position"] == [1, 0]
    assert values["stats"]["rounds"] == 1
