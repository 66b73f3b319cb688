"""Generations on sessions: the one place that joins the decoding loop and the store.

A request runs on a session: a new one (its record created, 128-bit random id) or an
existing one, whose lease it takes (`SessionBusy`, ABORTED, while another generation
holds it). Then one of three things happens:
- replay: the same request id finished before: its stored output, without compute;
- resume: the same request id was interrupted (a broken stream, a dead orchestrator):
  the loop goes on from the last committed round, with the stored seed, draft head and
  progress, so the tokens equal those of an uninterrupted run; its first item is a
  catch-up, every round committed before in one (`caught_up`);
- new turn: the request's messages (or prompt) follow the conversation; the longest
  common prefix of the new context and the committed tokens that the caches hold is
  reused, and only the rest is prefilled.

Write order: each round is committed to the store (tokens, progress, its token records)
before it is handed to the caller, so a caller never sees a token the store could lose;
the next round computes while it commits, and is dropped uncommitted if the generation
stops meanwhile. A refused commit (the session was taken over or closed) stops the
generation and frees its caches; a store that cannot be reached stops it with
UNAVAILABLE, the record left as of the last round. The lease is given back when the
generation ends, however it ends.

Ending early, resumably: a generation that runs past the server's `stream_s` limit, or
is still running when a draining server's grace is over (`drain`), stops after
committing its current round, with DEADLINE_EXCEEDED or UNAVAILABLE and a detail naming
the session and request ids to send again (to any server) to continue it.

The loop runs in worker threads (its calls block on the model or the network); the
store is asyncio, on the caller's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Any, TypeVar

from hydra_jury.orchestrator.engine import Engine, Generation
from hydra_jury.orchestrator.output import GenerationOutput, RoundOutput, token_record_from_dict
from hydra_jury.orchestrator.request import (
    DrafterKind,
    GenerationRequest,
    PreparedRequest,
    RequestError,
    prompt_tokens,
)
from hydra_jury.orchestrator.sessions.record import (
    GenerationRecord,
    SessionRecord,
    check_request_id,
    check_session_id,
    common_prefix,
    new_cache_id,
    new_session_id,
    scoped_id,
)
from hydra_jury.orchestrator.sessions.store import SessionBusy, SessionStore
from hydra_jury.poe import Rule
from hydra_jury.serving import tracing
from hydra_jury.serving.errors import (
    CapacityError,
    DeadlineExceeded,
    ServiceUnavailable,
    SessionConflict,
    SessionNotFound,
)
from hydra_jury.serving.model_thread import compute_on_this_thread_alone, in_executor

log = logging.getLogger("hydra_jury.sessions")
T = TypeVar("T")
# How long a draining server waits for the generations it ended to finish their round.
WIND_UP_S = 5.0


@dataclass(frozen=True)
class Committed:
    """A round, once the store holds it; the last carries the request's summary."""

    session_id: str
    round: RoundOutput
    summary: GenerationOutput | None = None
    replayed: bool = False  # the stored result of a finished request, sent again


@dataclass
class _Plan:
    """What a request will do once it holds the session."""

    record: SessionRecord
    request_id: str
    generation: Generation | None = None
    replay: GenerationOutput | None = None
    # A resumed generation's rounds committed before, as one round: a stream that broke
    # between a commit and its send never delivered the last of them.
    caught_up: RoundOutput | None = None


class _Active:
    """A generation running in this process, for CloseSession to stop."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.closed = False


class SessionRunner:
    def __init__(
        self,
        engine: Engine,
        store: SessionStore,
        *,
        max_concurrency: int = 32,
        observe: Callable[[str], None] = lambda event: None,
    ) -> None:
        """`observe` is told each session event (for metrics): created, continued,
        resumed, replayed, taken_over, fenced, closed, expired (one per cache)."""
        self.engine, self.store, self.backend = engine, store, engine.backend
        self._observe = observe
        self._owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self._pool = ThreadPoolExecutor(
            max_concurrency,
            thread_name_prefix="generation",
            initializer=compute_on_this_thread_alone if self.backend.loop_on_one_thread else None,
        )
        self._max_concurrency = max_concurrency
        self._active: dict[str, _Active] = {}  # by scoped session id
        self._give_backs: set[asyncio.Future] = set()  # leases being given back
        # Draining: new generations are refused; once `_ending`, running ones stop.
        self._draining = self._ending = False
        self._generations = 0  # requests between their first step and their end
        self._idle = asyncio.Event()
        self._idle.set()

    async def _in_thread(self, function: Callable[..., T], *args: Any) -> T:
        """`function(*args)` on a generation thread, in this task's context (its trace)."""
        return await in_executor(self._pool, function, *args)

    async def close(self) -> None:
        await asyncio.to_thread(self._pool.shutdown, wait=True, cancel_futures=True)
        await self.store.close()

    @property
    def draining(self) -> bool:
        """Whether the server is shutting down: new generations are refused."""
        return self._draining

    async def drain(self, grace_s: float) -> None:
        """Refuses new generations, lets the running ones finish for up to `grace_s`,
        then ends the rest after their current round (resumable) and waits up to
        `WIND_UP_S` for them; one still stuck in a call is left to the server's stop."""
        self._draining = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), grace_s)
        if self._generations:
            log.info("ending %d generations past the grace, resumable", self._generations)
            self._ending = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), WIND_UP_S)

    # --- session lifecycle -----------------------------------------------------------

    async def create_session(self, session_id: str | None = None, key_name: str = "") -> str:
        """A new, empty session of the API key `key_name`; `SessionExists` if a chosen id
        is taken (among that key's sessions)."""
        session_id = check_session_id(session_id) if session_id else new_session_id()
        record = SessionRecord(session_id, new_cache_id(session_id, key_name), key_name)
        await self._admit(key_name, session_id)
        await self.store.create(record, owner="")
        self._observe("created")
        return session_id

    async def _admit(self, key_name: str, session_id: str) -> None:
        """A new session of the API key `key_name`, within the server's limit of sessions
        per key (`CapacityError` past it); no limit without keys or server limits."""
        limits = self.engine.limits
        if key_name and limits is not None:
            held = await self.store.admit_key_session(key_name, session_id, limits.sessions_per_key)
            limits.check_sessions_per_key(key_name, held)

    async def close_session(self, session_id: str, key_name: str = "") -> None:
        """Deletes the record, stops a generation on it (here at once; elsewhere at its
        next commit, which the store refuses) and frees its caches on every service. Only
        the sessions of the API key `key_name` are found."""
        cache = await self.store.delete(check_session_id(session_id), key_name)
        if cache is None:
            raise SessionNotFound(f"no session {session_id!r} (unknown, closed or expired)")
        self._observe("closed")
        active = self._active.get(scoped_id(session_id, key_name))
        if active is not None:
            active.closed = True
            active.stop.set()
        await self._in_thread(self.backend.release, cache)

    async def sweep(self) -> int:
        """Frees the caches of sessions whose idle TTL passed; how many."""
        caches = await self.store.claim_expired()
        for cache in caches:
            await self._in_thread(self.backend.release, cache)
            self._observe("expired")
        if caches:
            log.info("released the caches of %d expired sessions", len(caches))
        return len(caches)

    # --- one request -----------------------------------------------------------------

    async def generate(
        self,
        request: GenerationRequest,
        *,
        session_id: str | None = None,
        request_id: str | None = None,
        digest: str = "",
        deadline: float | None = None,
        key_name: str = "",
    ) -> AsyncIterator[Committed]:
        """Each round as soon as the store holds it; `ServiceUnavailable` once the server
        drains. A named session is looked for among the API key `key_name`'s only, and a
        new one is that key's."""
        if self._draining:
            raise ServiceUnavailable(
                "this server is draining (shutting down) and takes no new generations: "
                "send the request to another server"
            )
        # Refused at once rather than queued for a generation thread: under overload a
        # queue only makes every client wait longer (tools.overload).
        if self._generations >= self._max_concurrency:
            raise CapacityError(
                f"all {self._max_concurrency} generations of this server are in progress; "
                "retry later or raise --max-concurrency"
            )
        self._generations += 1
        self._idle.clear()
        rounds = self._generate(request, session_id, request_id, digest, deadline, key_name)
        try:
            async for item in rounds:
                yield item
        finally:
            await rounds.aclose()
            self._generations -= 1
            if not self._generations:
                self._idle.set()

    async def _generate(
        self,
        request: GenerationRequest,
        session_id: str | None,
        request_id: str | None,
        digest: str,
        deadline: float | None,
        key_name: str,
    ) -> AsyncIterator[Committed]:
        if request_id:
            check_request_id(request_id)
        owner = f"{self._owner}:{uuid.uuid4().hex[:12]}"
        plan = await self._plan(
            request, session_id, request_id or "", digest, owner, deadline, key_name
        )
        if plan.replay is not None:
            output, stats = plan.replay, plan.replay.stats
            every_round = RoundOutput(
                len(output.rounds) - 1,
                output.tokens,
                output.text,
                output.finish_reason,
                stats["drafted"],
                stats["accepted"],
            )
            yield Committed(plan.record.session_id, every_round, output, replayed=True)
            return
        if plan.caught_up is not None:
            yield Committed(plan.record.session_id, plan.caught_up, replayed=True)
        async for item in self._drive(plan, deadline):
            yield item

    async def _plan(
        self,
        request: GenerationRequest,
        session_id: str | None,
        request_id: str,
        digest: str,
        owner: str,
        deadline: float | None,
        key_name: str,
    ) -> _Plan:
        retired = None
        if session_id is None:
            # Options are checked before a record exists: a bad request leaves nothing.
            prepared = await self._in_thread(self.engine.prepare, request)
            session_id = new_session_id()
            record = SessionRecord(session_id, new_cache_id(session_id, key_name), key_name)
            await self._admit(key_name, session_id)
            await self._leased(self.store.create(record, owner), lambda _: record)
            self._observe("created")
        else:
            prepared = None
            acquired = await self._leased(
                self._acquire(check_session_id(session_id), owner, request_id, key_name),
                lambda acquired: acquired.record,
            )
            record = acquired.record
            if acquired.took_over:
                # The last owner's lease ran out, and it may still be running: new caches,
                # so that nothing it still sends can reach the ones this request reads.
                retired, record.cache_id = record.cache_id, new_cache_id(session_id, key_name)
                record.processed = 0
                self._observe("taken_over")
        plan = _Plan(record, request_id)
        try:
            finished = record.result if request_id else None
            current = record.generation
            if finished is not None and finished["request_id"] == request_id:
                _check_digest(finished["digest"], digest, request_id)
                plan.replay = GenerationOutput.from_dict(finished["output"])
                self._observe("replayed")
                await self.store.commit(record, release=True, retired_cache=retired)
            elif request_id and current is not None and current.request_id == request_id:
                _check_digest(current.digest, digest, request_id)
                plan.generation, plan.caught_up = await self._resume(record, request)
                self._observe("resumed")
                await self.store.commit(record, retired_cache=retired)
            else:
                if record.kind:
                    self._observe("continued")
                plan.generation = await self._new_turn(record, request, prepared)
                record.generation = GenerationRecord(request_id, digest, len(record.tokens))
                await self.store.commit(record, reset_rounds=True, retired_cache=retired)
        except BaseException:
            await self._give_back(record)
            raise
        return plan

    async def _leased(self, taking: Awaitable[T], record_of: Callable[[T], SessionRecord]) -> T:
        """Awaits `taking`, which takes a session's lease. A request cancelled meanwhile
        (its deadline, its client gone) may find the lease already taken in the store:
        it is given back once the taking is over, not left to run out."""
        task = asyncio.ensure_future(taking)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:

            def give_back(done: asyncio.Future) -> None:
                if not done.cancelled() and done.exception() is None:
                    returning = asyncio.ensure_future(self._give_back(record_of(done.result())))
                    self._give_backs.add(returning)
                    returning.add_done_callback(self._give_backs.discard)

            task.add_done_callback(give_back)
            raise

    async def _acquire(self, session_id: str, owner: str, request_id: str, key_name: str):
        """The session's lease. A request resuming its own interrupted generation waits
        (up to one lease) for the previous attempt to stop or its lease to run out."""
        waited = 0.0
        while True:
            try:
                return await self.store.acquire(session_id, owner, key_name)
            except SessionBusy as busy:
                if not request_id or waited > self.store.settings.lease_s:
                    raise
                record = await self.store.load(session_id, key_name)
                current = record.generation if record is not None else None
                if current is None or current.request_id != request_id:
                    raise
                pause = min(0.1, busy.retry_after_s + 0.01)
                await asyncio.sleep(pause)
                waited += pause

    async def _resume(
        self, record: SessionRecord, request: GenerationRequest
    ) -> tuple[Generation, RoundOutput | None]:
        """The generation going on from its last committed round, and those rounds as one
        (None before the first)."""
        current = record.generation
        context = record.tokens[: current.context_length]
        # The stored seed and draft head: the request may have left them to the server.
        request = replace(request, seed=record.seed, draft_head=record.draft_head)
        prepared = await self._in_thread(self.engine.prepare, request, context)
        rounds = await self.store.rounds(record.session_id, record.key_name)
        records = [token_record_from_dict(t) for round_ in rounds for t in round_]
        generation = self.engine.begin(
            prepared,
            record.cache_id,
            reused=await self._reusable(record, record.tokens),
            progress=current.progress,
            records=records,
        )
        progress = current.progress
        if not progress.round_sizes:
            return generation, None
        text = progress.text[: progress.sent]  # what the rounds' deltas handed out
        return generation, RoundOutput(len(progress.round_sizes) - 1, records, text)

    async def _new_turn(
        self,
        record: SessionRecord,
        request: GenerationRequest,
        prepared: PreparedRequest | None,
    ) -> Generation:
        """Prepares the turn (the whole conversation as context) and updates the record:
        new context, the processed length cut to what is reused."""
        kind = "chat" if request.messages is not None else "text"
        if record.kind and record.kind != kind:
            wanted = "messages" if record.kind == "chat" else "a prompt"
            raise RequestError(
                f"session {record.session_id} is a {record.kind} session: send {wanted}"
            )
        if prepared is None:
            if request.seed is None and record.seed is not None:
                request = replace(request, seed=record.seed)
            # The session's draft head, for a turn that drafts with a head (prompt lookup
            # takes none, verifier_only does not draft).
            head_drafts = (
                request.rule != Rule.VERIFIER_ONLY and request.drafter != DrafterKind.NGRAM
            )
            if request.draft_head is None and record.draft_head is not None and head_drafts:
                request = replace(request, draft_head=record.draft_head)
            context = None
            if kind == "chat":
                request = replace(request, messages=[*record.messages, *request.messages])
            else:
                added = await self._in_thread(prompt_tokens, request, self.engine.tokenizer)
                context = record.tokens + added
            prepared = await self._in_thread(self.engine.prepare, request, context)
        context = list(prepared.prompt_tokens)
        reused = min(common_prefix(record.tokens, context), await self._reusable(record, context))
        if kind == "chat":
            record.messages = list(prepared.request.messages)
        record.kind = kind
        record.tokens, record.processed = context, reused
        record.options = _options(prepared.request)
        record.seed, record.draft_head, record.jury = (
            prepared.seed,
            prepared.draft_head,
            list(prepared.jury),
        )
        return self.engine.begin(prepared, record.cache_id, reused=reused)

    async def _reusable(self, record: SessionRecord, tokens: list[int]) -> int:
        """Places the session's caches (on the replicas its record names, while they are
        ready) and returns the positions they can be trusted to hold: none when the
        replicas changed (moved, restarted)."""
        stored = record.replicas
        record.replicas = await self._in_thread(self.backend.place, record.cache_id, stored)
        if record.replicas != stored:
            return 0
        return min(record.processed, len(tokens) - 1)

    async def _give_back(self, record: SessionRecord) -> None:
        """Releases the lease, best effort (it runs out by itself otherwise)."""
        if record.owner:
            with contextlib.suppress(Exception):
                await self.store.commit(record, release=True)

    def _ended_early(self, plan: _Plan, stream_ends: float | None) -> Exception | None:
        """Why a generation must stop after the round it just committed, if it must: the
        server's drain is past its grace, or the generation ran its limit of time."""
        if self._ending:
            error_type, reason = ServiceUnavailable, "this server is shutting down"
        elif stream_ends is not None and time.monotonic() >= stream_ends:
            running = "the generation's running time in seconds"
            error_type, reason = DeadlineExceeded, self.engine.limits.refusal("stream_s", running)
        else:
            return None
        resume = (
            f"send the request again with session_id {plan.record.session_id!r} and "
            f"request_id {plan.request_id!r} to continue it"
            if plan.request_id
            else "a request with a request_id can be continued by sending it again"
        )
        return error_type(
            f"{reason}: the generation stopped after its last committed round; {resume}"
        )

    async def _drive(self, plan: _Plan, deadline: float | None) -> AsyncIterator[Committed]:
        loop = asyncio.get_running_loop()
        record, generation = plan.record, plan.generation
        queue: asyncio.Queue = asyncio.Queue()
        active = self._active[record.scoped_id] = _Active()
        limits = self.engine.limits
        stream_ends = time.monotonic() + limits.stream_s if limits is not None else None

        def put(item) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        async def commit_then_send(outputs: list[RoundOutput], summary) -> None:
            rounds = [[t.to_dict() for t in output.tokens] for output in outputs]
            await self.store.commit(record, rounds=rounds, release=bool(summary))
            for output in outputs[:-1]:
                queue.put_nowait(("round", output, None))
            queue.put_nowait(("round", outputs[-1], summary))

        interval = self.store.settings.commit_interval_s

        def produce() -> None:
            # Rounds are committed while the next ones compute: the model never waits
            # for the store. A round computed while a commit is in flight, or within
            # `interval` of the last commit's start, waits for the next commit, which
            # takes every round waiting (`StoreSettings.commit_interval_s`); the first
            # and the last round, and one after which the generation must stop, are
            # committed at once. The record changes only once the previous commit is
            # done, a round reaches the caller only after its own commit, in order, and
            # nothing (an error, the end) reaches it before the rounds committed ahead
            # of it. Rounds computed and not yet committed when the caller goes away are
            # never committed.
            committing: Future | None = None
            ended_early: Exception | None = None
            waiting: list[RoundOutput] = []
            last_commit = float("-inf")

            def settle() -> None:
                if committing is not None:
                    with contextlib.suppress(Exception):  # already failing: its error or ours
                        committing.result()

            try:
                with self.backend.call_scope(deadline):
                    for output in generation:
                        if active.closed or active.stop.is_set():
                            break
                        waiting.append(output)
                        last = output.finish_reason is not None
                        ended_early = None if last else self._ended_early(plan, stream_ends)
                        if not last and ended_early is None:
                            in_flight = committing is not None and not committing.done()
                            if in_flight or time.monotonic() - last_commit < interval:
                                continue
                        if committing is not None:
                            committing.result()
                        summary = self._record_round(plan, generation, output)
                        last_commit = time.monotonic()
                        # The commit's task takes this context: its spans are the round's.
                        with tracing.attached(generation.trace_context):
                            committing = asyncio.run_coroutine_threadsafe(
                                commit_then_send(waiting, summary), loop
                            )
                        waiting = []
                        if ended_early is not None:
                            break
                    if committing is not None:
                        committing.result()
                if active.closed:
                    raise SessionConflict(f"session {record.session_id} was closed")
                if ended_early is not None:
                    raise ended_early
            except (SessionConflict, SessionNotFound) as error:
                settle()
                # Another writer has the session, or it was closed: these caches are no
                # longer anyone's.
                self.backend.release(record.cache_id)
                self._observe("fenced")
                if isinstance(error, SessionNotFound):
                    error = SessionConflict(f"session {record.session_id} was closed")
                put(("error", error, None))
            except Exception as error:
                settle()
                put(("error", error, None))
            finally:
                generation.close()
                put(("end", None, None))

        in_executor(self._pool, produce)
        kind = ""
        try:
            while True:
                kind, item, summary = await queue.get()
                if kind == "error":
                    raise item
                if kind == "end":
                    break
                yield Committed(record.session_id, item, summary)
        finally:
            # Finished, failed or cancelled by the caller: stop between rounds. Shielded:
            # a second cancellation must not skip giving the lease back.
            active.stop.set()
            winding_up = asyncio.ensure_future(self._wind_up(queue, kind, active, record))
            self._give_backs.add(winding_up)
            winding_up.add_done_callback(self._give_backs.discard)
            await asyncio.shield(winding_up)

    async def _wind_up(
        self, queue: asyncio.Queue, kind: str, active: _Active, record: SessionRecord
    ) -> None:
        """Waits for the producer to end, then gives the session's lease back."""
        while kind != "end":
            kind, _item, _summary = await queue.get()
        if self._active.get(record.scoped_id) is active:
            del self._active[record.scoped_id]
        await self._give_back(record)

    def _record_round(
        self, plan: _Plan, generation: Generation, output: RoundOutput
    ) -> GenerationOutput | None:
        """The record after this round (and, on the last, the summary it stores)."""
        record = plan.record
        record.tokens = list(generation.committed)
        record.processed = len(record.tokens) - 1
        record.generation.progress = generation.progress()
        record.replicas = self.backend.placement(record.cache_id)
        if output.finish_reason is None:
            return None
        summary = generation.result()
        summary.session, summary.request_id = record.session_id, plan.request_id
        record.result = {
            "request_id": plan.request_id,
            "digest": record.generation.digest,
            "output": summary.to_dict(),
        }
        if record.kind == "chat":
            record.messages.append({"role": "assistant", "content": summary.text})
        return summary


def _check_digest(stored: str, digest: str, request_id: str) -> None:
    if stored != digest:
        raise RequestError(
            f"request_id {request_id!r} was already used on this session for a "
            "different request; use a new request_id"
        )


def _options(request: GenerationRequest) -> dict[str, Any]:
    """The request's decoding options, for the record (its input lives in the messages
    and tokens)."""
    options = asdict(request)
    options.pop("prompt")
    options.pop("messages")
    return options
