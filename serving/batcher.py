"""Continuous batching of a service's calls: the concurrent calls of one kind (the jury's
Score calls of different sessions, say) run as one batched forward on the model thread.

While the model thread runs a batch, the calls that arrive wait in a queue; the next
batch takes as many of them as its token budget allows (at least one), so sessions join
and leave between batches and nobody waits for a batch to fill. A call that takes
several steps (a draft call, one position per step: `serving.draft_scheduler`) answers
`CONTINUE` until it is done and runs again in the next batch, ahead of the queue: a
step-level scheduler, where sessions join and leave between steps. Admission is bounded: a
full queue refuses a call at once with RESOURCE_EXHAUSTED and a retry hint, and a call
that waited past the maximum wait is refused the same way. The handler runs a batch
with each call's failure kept to that call (`run_isolated`): one bad session never fails
the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from opentelemetry.trace import Span

from hydra_jury.serving import tracing
from hydra_jury.serving.cost_line import LinearCost, batch_shares
from hydra_jury.serving.metrics import BatchObserver
from hydra_jury.serving.model_thread import ModelThread
from hydra_jury.workers.errors import CapacityError

Request = TypeVar("Request")
Response = TypeVar("Response")
Call = TypeVar("Call")
Result = TypeVar("Result")


CONTINUE = object()  # a handler's result for a call that goes on in the next batch


@dataclass
class _Queued:
    request: object
    future: asyncio.Future  # of (response, share)
    queued: float  # time.monotonic() when it arrived
    span: Span | None  # its call's trace span, told the batches it ran in
    share: float = 0.0  # seconds of the batches it ran in that are its own (`batch_shares`)
    started: threading.Event | None = None  # set when its first batch begins on the model


class QueueFull(CapacityError):
    """The service's queue is full, or a call waited too long in it."""


@dataclass(frozen=True)
class BatchLimits:
    max_tokens: int = 4096  # positions one batched forward may run (one call may exceed it)
    max_queue: int = 256  # calls waiting; one more is refused
    max_wait_s: float = 30.0  # a call waiting longer is refused
    # A longer prefill runs in chunks of this many positions (0: whole), so that the
    # other sessions' steps run between them instead of waiting for the whole prompt.
    prefill_chunk: int = 256
    # A batch smaller than the recent ones waits this long for more calls, while the
    # model thread has nothing else to run: sessions in a closed loop arrive a little
    # apart (8 sessions of `serve`, 2-core AMD EPYC: their maths between a Score and
    # the next Draft spread over about 20 ms), and a fuller batch costs little more than
    # a part of it. With 20 ms the Draft batches held 6.4 of 8 sessions on average,
    # with 5 ms 4.2; a lone session never waits. The window starts again at each call
    # that arrives, and while another service holds the host turn (`serving.host_turn`),
    # up to `WINDOW_STRETCH` windows in all.
    window_s: float = 0.020


# The longest a batch waits for the sessions it expects, in windows. Sessions come back
# one after another from the work between their calls (the split stack's orchestrator
# handles 8 sessions' results in about 35 ms on 2 cores, one at a time under the
# interpreter lock), and a window that ended on the last of them split 8 sessions into
# batches of 4 (the split stack, 2-core Intel Xeon: 45–49 tokens/s; waiting for all 8,
# 75.6).
WINDOW_STRETCH = 8
RECENT_BATCHES = 8  # the batches whose callers the next batch expects (`_expected`)
# How often a window waiting on another service's batch looks whether that batch is done.
HOST_TURN_POLL_S = 0.002


def _session_of(request) -> str | None:
    """The session a call belongs to, where it names one."""
    session = getattr(request, "session", None)
    return session if isinstance(session, str) else None


def _callers(requests: list) -> frozenset | int:
    """The sessions `requests` belong to, or their number where one names none."""
    sessions = [_session_of(request) for request in requests]
    if any(session is None for session in sessions):
        return len(requests)
    return frozenset(sessions)


def _sessions_done(batch: list[_Queued], results: list) -> frozenset[str]:
    """The sessions whose calls a batch completed (not those going on in the next)."""
    return frozenset(
        session
        for entry, result in zip(batch, results, strict=True)
        if result is not CONTINUE and (session := _session_of(entry.request)) is not None
    )


def run_isolated(
    calls: list[Call],
    run_batch: Callable[[list[Call]], list[Result]],
    run_one: Callable[[Call], Result],
) -> list[Result | Exception]:
    """`run_batch(calls)`; if it fails, each call alone, so that only the calls that fail
    by themselves fail (their exception in their place)."""
    try:
        return list(run_batch(calls))
    except Exception:
        if len(calls) == 1:
            raise
    results: list[Result | Exception] = []
    for call in calls:
        try:
            results.append(run_one(call))
        except Exception as error:
            results.append(error)
    return results


def _signalled(
    handle: Callable[[list[Request]], list[Response | Exception]], started: list[threading.Event]
) -> Callable[[list[Request]], list[Response | Exception]]:
    """`handle`, setting `started` first, on the model thread. Set there, not by the
    loop before it hands the batch over: the callers waiting for them (a session's
    metrics, commit and stream, `LocalBackend.draft_ahead`) then find the model thread
    already holding the interpreter for the batch's first Python, instead of taking it
    while the loop and the model thread still need it to start the batch (8 sessions of
    `serve`, 2-core AMD EPYC, 4 pairs taken turn about: the model thread's wait between
    a Score batch and the next Draft batch 6.9-7.9 ms against 9.2-10.2)."""
    if not started:
        return handle

    def run(requests: list[Request]) -> list[Response | Exception]:
        for event in started:
            event.set()
        return handle(requests)

    return run


class CallBatcher(Generic[Request, Response]):
    """Batches the requests of one RPC: `submit(request)` returns its response, or
    raises its error. `handle(requests)` runs on the model thread and returns, for each
    request in order, its response, its exception, or `CONTINUE` (run it again in the
    next batch); `size(request)` is the positions it runs per batch, for the token
    budget. An `observer` gets each batch's size, tokens, time
    and waits, and each refusal. `recurring`: a session that made a call makes the
    next too (a round's calls: Draft, Score), unlike a prefill, which a session makes
    once a request (`_expected`)."""

    def __init__(
        self,
        name: str,
        thread: ModelThread,
        handle: Callable[[list[Request]], list[Response | Exception]],
        size: Callable[[Request], int],
        limits: BatchLimits | None = None,
        observer: BatchObserver | None = None,
        recurring: bool = True,
    ) -> None:
        self.name = name
        self.recurring = recurring
        self.thread = thread
        self.handle = handle
        self.size = size
        self.limits = limits or BatchLimits()
        self.largest = 0  # calls in the largest batch so far (the retry hint's batch size)
        self._queue: deque[_Queued] = deque()
        self._runner: asyncio.Task | None = None
        self._batch_s = 0.01  # a decayed mean of batch times, for the retry hint
        self.running = 0  # calls in the batch on the model thread now
        # The callers of the last batches: sessions where the calls name one, else a
        # batch's size (`_expected`).
        self._recent: deque[frozenset | int] = deque(maxlen=RECENT_BATCHES)
        self._carried = 0  # calls that go on in the next batch, waiting for the turn
        self.cost = LinearCost()  # a batch's seconds against its positions
        thread.batchers.append(self)
        self.observer = observer
        if observer is not None:
            observer.watch_queue(lambda: len(self._queue))

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def submit(self, request: Request) -> Response:
        return (await self.submit_shared(request))[0]

    async def submit_shared(
        self, request: Request, started: threading.Event | None = None
    ) -> tuple[Response, float]:
        """The call's response and its share of the batches it ran in, in seconds: the
        fixed cost of each batch divided among its calls, plus what the call's own
        positions cost it (`cost_line.batch_shares`, from this batcher's cost line) —
        what the call cost the server's throughput, where its wait is the whole batch.
        `started` (optional) is set when the call's first batch begins on the model thread."""
        if len(self._queue) >= self.limits.max_queue:
            self._refused("queue_full")
            raise QueueFull(
                f"{self.name}: {len(self._queue)} calls are queued (the most is "
                f"{self.limits.max_queue}); retry in about {self._retry_hint_ms()} ms"
            )
        future = asyncio.get_running_loop().create_future()
        self._queue.append(
            _Queued(request, future, time.monotonic(), tracing.current_span(), started=started)
        )
        self.thread.arrivals().set()
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run())
        return await future

    def _retry_hint_ms(self) -> int:
        batches_ahead = 1 + len(self._queue) // max(1, self.largest)
        return max(1, round(1000 * self._batch_s * batches_ahead))

    def _refused(self, reason: str) -> None:
        if self.observer is not None:
            self.observer.refused(reason)

    async def _run(self) -> None:
        carried: list[_Queued] = []  # calls that go on
        while self._queue or carried:
            self._carried = len(carried)
            async with self.thread.turn():
                if not carried:  # calls arriving during a stepped call join its next step
                    await self._gather()
                # The batch is chosen once the host's cores are this service's.
                host = self.thread.host_turn
                async with host.holding() if host is not None else contextlib.nullcontext():
                    carried = await self._run_batch(carried)
        self._carried = 0

    @property
    def pending(self) -> int:
        """Calls waiting for a batch: queued, or going on in the next one."""
        return len(self._queue) + self._carried

    async def _run_batch(self, carried: list[_Queued]) -> list[_Queued]:
        """One batch on the model thread: the calls that go on, then those queued now;
        the calls that go on after it."""
        used = sum(self.size(entry.request) for entry in carried)
        joined = self._take(used, first_fits=not carried)
        batch = carried + joined
        if not batch:
            return []
        began = time.monotonic()
        requests = [entry.request for entry in batch]
        self.largest = max(self.largest, len(batch))
        self._recent.append(_callers(requests))
        self.running = len(batch)
        started = [entry.started for entry in joined if entry.started is not None]
        try:
            results = await self.thread.run(_signalled(self.handle, started), requests)
        except Exception as error:  # the handler itself failed: every call fails
            results = [error] * len(batch)
        finally:
            self.running = 0
        ended = time.monotonic()
        self._batch_s = 0.8 * self._batch_s + 0.2 * (ended - began)
        sizes = [self.size(request) for request in requests]
        tokens = sum(sizes)
        shares = batch_shares(ended - began, sizes, self.cost.line())
        for entry, share in zip(batch, shares, strict=True):
            entry.share += share
        self.cost.observe(tokens, ended - began)
        if self.observer is not None:
            self.observer.batch(
                len(batch), tokens, [began - entry.queued for entry in joined], ended - began
            )
        for entry in joined:
            tracing.describe(entry.span, queue_wait_s=round(began - entry.queued, 6))
        for entry in batch:
            tracing.describe(entry.span, batch_size=len(batch), batch_tokens=tokens)
        self.thread.last_done = (self, _sessions_done(batch, results))
        carried = []
        for entry, result in zip(batch, results, strict=True):
            future = entry.future
            if result is CONTINUE:  # (even if its caller went away: the handler
                carried.append(entry)  # holds its state until it is done)
                continue
            if future.done():  # the caller went away
                continue
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result((result, entry.share))
        return carried

    async def _gather(self) -> None:
        """With the turn: waits up to the window while the next batch would be smaller
        than the recent ones and no other batcher of the model thread has calls waiting
        (a lone session never waits, and the model thread never idles for it while it
        has other work), or while sessions the last batch sent this way are still on it
        (`_coming`). Sessions in a closed loop arrive a little apart — their previous
        call's results in their hands first — and a batch of all of them costs little
        more than a batch of some. The expected size counts the sessions that came back
        in the last batches, so that sessions split over two batches meet again in the
        next. The window starts again at each arrival (the others are on their way), and
        while another service of the host holds the host turn (the batch could not run
        before it ends anyway), up to `WINDOW_STRETCH` windows in all. A window that ends
        short forgets them but for those waiting now: a session has gone, and the next
        batches do not wait for it; a session whose generation has ended is forgotten at
        once (`forget`). The host turn's exclusive holder (the trunk) does not
        wait while a shared holder (a jury shard) waits with calls queued: the sessions
        each waits for may be queued at the other (`serving.host_turn`)."""
        expected = self._expected()
        window = self.limits.window_s
        if not window or len(self._queue) >= expected:
            return
        began = time.monotonic()
        deadline, longest = began + window, began + WINDOW_STRETCH * window
        arrived = len(self._queue)
        arrivals, host = self.thread.arrivals(), self.thread.host_turn
        try:
            while len(self._queue) < expected and (
                not self.thread.others_pending(self) or self._coming()
            ):
                now = time.monotonic()
                if host is not None:
                    if host.yields():  # the sessions waited for may be waiting for these
                        return
                    host.mark_gathering()
                if len(self._queue) > arrived or (host is not None and host.busy()):
                    arrived = len(self._queue)
                    deadline = min(now + window, longest)
                left = deadline - now
                if left <= 0:
                    self._recent.clear()
                    self._recent.append(_callers([entry.request for entry in self._queue]))
                    return
                # Woken by the next call of any batcher of the thread, not by polling: the
                # sessions on their way here need the interpreter more than this loop
                # does. (Another service's batch ending wakes nothing: that is looked at
                # often.)
                if host is not None:
                    left = min(left, HOST_TURN_POLL_S)
                arrivals.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(arrivals.wait(), left)
                expected = self._expected()  # less a session that has left (`forget`)
        finally:
            if host is not None:
                host.unmark_gathering()

    def _coming(self) -> bool:
        """Whether sessions this batcher has seen lately are on their way to it: the
        thread's last batch, another batcher's, completed their calls (a round's Score
        follows its Draft, the next round's Draft its Score), and they are not queued
        here yet. The batch waits for them even while another batcher has calls queued:
        else sessions split over two batches stay split. (8 sessions of `serve`, 2-core
        AMD EPYC: a session whose Draft call came a millisecond after its batch had
        started stayed a phase behind the others, and then another, for 60 steps: three
        Draft batches and three Score batches a step, of 1, 6 and 1 sessions, as each
        batcher ran what it had while the other held calls.)"""
        last = self.thread.last_done
        if not self.recurring or last is None or last[0] is self or not last[1]:
            return False
        queued = {_session_of(entry.request) for entry in self._queue}
        seen = set().union(*(c for c in self._recent if isinstance(c, frozenset)))
        return any(session in seen and session not in queued for session in last[1])

    def forget(self, session: str) -> None:
        """`session`'s generation has ended: the next batches do not wait for it."""
        self._recent = deque(
            (
                (callers - {session} if isinstance(callers, frozenset) else callers)
                for callers in self._recent
                if callers != frozenset({session})
            ),
            maxlen=RECENT_BATCHES,
        )

    def _expected(self) -> int:
        """The calls the next batch waits for: as many as the largest of the last
        batches, or as many sessions as came in them — once, for calls that recur every
        round; twice or more otherwise (sessions in a closed loop, not the one-off calls
        of sessions that come and go, as prefills). Waiting for only the round's
        sessions seen twice, two jury shards that each ran 7 of 8 sessions (each the
        first 7 to reach it) went on scoring different sessions, and every session's
        round waited for the slower shard (the split stack, 8 sessions, 2-core Intel
        Xeon: Draft batches of 5.7–7.5 sessions; waiting for every one seen, 7.6–7.8)."""
        if not self._recent:
            return 1
        largest = max(len(c) if isinstance(c, frozenset) else c for c in self._recent)
        if not all(isinstance(callers, frozenset) for callers in self._recent):
            return largest
        seen = Counter(session for callers in self._recent for session in callers)
        least = 1 if self.recurring else 2
        return max(largest, sum(1 for count in seen.values() if count >= least))

    def _take(self, tokens: int = 0, first_fits: bool = True) -> list[_Queued]:
        """Queued calls in order while the token budget (`tokens` of it used) lasts, the
        first always fitting unless `first_fits` is off; calls that waited too long are
        refused instead."""
        batch, now = [], time.monotonic()
        while self._queue:
            entry = self._queue[0]
            request, future, queued = entry.request, entry.future, entry.queued
            if future.done():  # cancelled while queued
                self._queue.popleft()
                continue
            if now - queued > self.limits.max_wait_s:
                self._queue.popleft()
                self._refused("waited_too_long")
                future.set_exception(
                    QueueFull(
                        f"{self.name}: the call waited {now - queued:.1f} s in the queue "
                        f"(the most is {self.limits.max_wait_s:g} s); retry in about "
                        f"{self._retry_hint_ms()} ms"
                    )
                )
                continue
            size = self.size(request)
            if (batch or not first_fits) and tokens + size > self.limits.max_tokens:
                break
            self._queue.popleft()
            batch.append(entry)
            tokens += size
        return batch
