"""Per-session cache bookkeeping shared by the trunk and jury workers.

Terms
- session: a conversation whose caches a worker keeps between requests.
- position rule: every stateful call names the position its cache must start from; the
  worker truncates to it first (so calls are idempotent and need no rollback call). A
  start beyond what the worker holds is a `PositionError`: the caller re-prefills.
- limits: how many sessions a worker holds at once, how many positions one may reach,
  and how long an idle one is kept.
- running / finished: a session is running from any call on it until the caller says its
  generation ended (`finish`); then it is finished, its caches kept for the
  conversation's next turn, which makes it running again.
- reclaim: a full table makes room for a new session by dropping, least recently used
  first, a finished session at once, else a running one idle at least `reclaim_after_s`
  (a generation between rounds is never idle that long; one idle longer was abandoned
  without a word, its orchestrator gone). The orchestrator's session record can always
  rebuild dropped caches (a re-prefill), so a finished session's caches are a cache,
  not a commitment. Only when every slot is held by a running session is the newcomer
  refused (`CapacityError`, reason `sessions_running`).
- on_reclaim: told why each slot was freed for another or evicted ("finished", "idle",
  "evicted"), for the service's metrics.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from hydra_jury.workers.errors import (
    SESSION_LENGTH,
    SESSIONS_RUNNING,
    CapacityError,
    InvalidArgument,
    PositionError,
    UnknownSessionError,
)

State = TypeVar("State")


@dataclass(frozen=True)
class SessionLimits:
    """A worker's session limits, checked on construction. The defaults are what every
    server runs with unless told otherwise (--max-sessions, --max-session-tokens)."""

    max_sessions: int = 16
    max_session_tokens: int = 4096  # capped by the model's context length
    idle_timeout_s: float | None = None  # None (or 0 from a flag): never evicted
    reclaim_after_s: float = 1.0  # a running session idle this long may be reclaimed

    def __post_init__(self) -> None:
        if self.max_sessions < 1:
            raise InvalidArgument(f"max sessions must be >= 1, got {self.max_sessions}")
        if self.max_session_tokens < 1:
            raise InvalidArgument(f"max session tokens must be >= 1, got {self.max_session_tokens}")
        if self.idle_timeout_s is not None and self.idle_timeout_s < 0:
            raise InvalidArgument(
                f"idle timeout must be >= 0 (0 = never), got {self.idle_timeout_s}"
            )
        if self.reclaim_after_s < 0:
            raise InvalidArgument(f"reclaim time must be >= 0, got {self.reclaim_after_s}")
        if self.idle_timeout_s == 0:
            object.__setattr__(self, "idle_timeout_s", None)


# Why a session's slot was freed for another (the reclaimed-sessions metric's reasons).
FINISHED = "finished"  # its generation had ended
IDLE = "idle"  # running, but idle past the reclaim grace
EVICTED = "evicted"  # idle past the idle timeout


@dataclass
class _Entry(Generic[State]):
    state: State
    last_used: float = field(default_factory=time.monotonic)
    held: bool = False  # a call spanning several model-thread jobs is using it
    running: bool = True  # a generation is using it (until `finish`)


class SessionTable(Generic[State]):
    """Session id -> worker state, with a fixed maximum, reclaiming and idle eviction."""

    def __init__(
        self,
        limits: SessionLimits,
        create: Callable[[], State],
        destroy: Callable[[State], None],
    ) -> None:
        self.max_sessions = limits.max_sessions
        self.idle_timeout_s = limits.idle_timeout_s
        self.reclaim_after_s = limits.reclaim_after_s
        self._create, self._destroy = create, destroy
        self._entries: dict[str, _Entry[State]] = {}
        self.on_reclaim: Callable[[str], None] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def running(self) -> int:
        """Sessions a generation is using (the others are finished, kept for a next turn)."""
        return sum(entry.running for entry in self._entries.values())

    def get(self, session: str, *, start: int) -> State:
        """The session's state for a call starting at `start`; a call at 0 may open it.
        Either way the session is running from now on."""
        entry = self._entries.get(session)
        if entry is None:
            if start != 0:
                raise UnknownSessionError(
                    f"unknown session {session!r}: this service holds "
                    f"no positions of it (re-prefill from 0)"
                )
            self.evict_idle()
            if len(self._entries) >= self.max_sessions and not self._reclaim():
                raise self._full()
            entry = self._entries[session] = _Entry(self._create())
        entry.last_used = time.monotonic()
        entry.running = True
        return entry.state

    def check_room(self, session: str, start: int) -> None:
        """Raises the error `get` would raise for a newcomer when every slot is held by a
        running generation, from a look at the table that changes nothing: a server's
        event loop refuses such a call at once instead of queueing it behind the running
        sessions' batches. A slot freed meanwhile makes room a moment later: `get`, on the
        model thread, decides every call this lets through."""
        entries = dict(self._entries)  # one copy, made in one step: no iteration races
        if session in entries or start != 0 or len(entries) < self.max_sessions:
            return
        now = time.monotonic()
        for entry in entries.values():
            if self._evictable(entry, now) or (
                not entry.held and (not entry.running or self._stale(entry, now))
            ):
                return
        raise self._full()

    def _full(self) -> CapacityError:
        return CapacityError(
            f"all {self.max_sessions} sessions are in use by running generations; "
            f"retry later or raise --max-sessions",
            reason=SESSIONS_RUNNING,
        )

    def peek(self, session: str) -> State | None:
        """The session's state, if the table holds it, without using it (no call)."""
        entry = self._entries.get(session)
        return None if entry is None else entry.state

    def finish(self, session: str) -> bool:
        """The session's generation ended: its caches stay for a next turn, but its slot
        goes to the first newcomer that needs one. False if the table does not hold it."""
        entry = self._entries.get(session)
        if entry is None:
            return False
        entry.running = False
        entry.last_used = time.monotonic()
        return True

    def hold(self, session: str) -> None:
        """Keeps the session from being reclaimed or evicted as idle while a call that
        spans several model-thread jobs (a draft call stepped with others) uses it."""
        self._entries[session].held = True

    def let_go(self, session: str, state: State) -> None:
        """Ends `hold`, if `state` is still the session's."""
        entry = self._entries.get(session)
        if entry is not None and entry.state is state:
            entry.held = False
            entry.last_used = time.monotonic()

    def holds(self, session: str, state: State) -> bool:
        """Whether `state` is still the session's (not released, not reopened since)."""
        entry = self._entries.get(session)
        return entry is not None and entry.state is state

    def release(self, session: str) -> bool:
        entry = self._entries.pop(session, None)
        if entry is not None:
            self._destroy(entry.state)
        return entry is not None

    def _reclaim(self) -> bool:
        """Drops the least recently used finished session, else the least recently used
        running one idle past the grace; False when neither exists."""
        free = {s: e for s, e in self._entries.items() if not e.held}
        finished = [s for s, e in free.items() if not e.running]
        now = time.monotonic()
        stale = [s for s, e in free.items() if self._stale(e, now)]
        candidates, reason = (finished, FINISHED) if finished else (stale, IDLE)
        if not candidates:
            return False
        session = min(candidates, key=lambda s: free[s].last_used)
        self.release(session)
        self._reclaimed(reason)
        return True

    def evict_idle(self) -> list[str]:
        if self.idle_timeout_s is None:
            return []
        now = time.monotonic()
        idle = [s for s, e in self._entries.items() if self._evictable(e, now)]
        for session in idle:
            self.release(session)
            self._reclaimed(EVICTED)
        return idle

    def _stale(self, entry: _Entry[State], now: float) -> bool:
        """Running, but idle past the reclaim grace: its slot may go to a newcomer."""
        return now - entry.last_used >= self.reclaim_after_s

    def _evictable(self, entry: _Entry[State], now: float) -> bool:
        """Idle past the idle timeout, and not held by a call."""
        idle_timeout = self.idle_timeout_s
        return not entry.held and idle_timeout is not None and now - entry.last_used > idle_timeout

    def _reclaimed(self, reason: str) -> None:
        if self.on_reclaim is not None:
            self.on_reclaim(reason)


def check_start(start: int, held: int, what: str) -> None:
    """The position rule: a call may start anywhere up to what `what` holds."""
    if start > held:
        raise PositionError(
            f"{what} holds {held} positions of this session; cannot start "
            f"at {start} (re-prefill from {held})"
        )


def check_distinct_sessions(calls: Sequence) -> None:
    """A batch runs each session once: its calls must name different sessions."""
    if len({call.session for call in calls}) != len(calls):
        raise InvalidArgument("calls: a session appears twice in one batch")


def check_capacity(end: int, capacity: int) -> None:
    if end > capacity:
        raise CapacityError(
            f"the session would reach {end} positions, over the limit of "
            f"{capacity} tokens per session",
            reason=SESSION_LENGTH,
        )
