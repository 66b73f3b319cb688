"""Per-session cache bookkeeping shared by the trunk and jury workers.

Terms
- session: a conversation whose caches a worker keeps between requests.
- position rule: every stateful call names the position its cache must start from; the
  worker truncates to it first (so calls are idempotent and need no rollback call). A
  start beyond what the worker holds is a `PositionError`: the caller re-prefills.
- limits: how many sessions a worker holds at once, how many positions one may reach,
  and how long an idle one is kept.
- reclaim: a full table makes room for a new session by dropping the least recently
  used one, if that one has been idle at least `reclaim_after_s`. Sessions outlive
  requests (a conversation's next turn reuses its caches), and the orchestrator's
  session record can always rebuild dropped caches (a re-prefill), so an idle session's
  caches are a cache, not a commitment; a session used within the last moments is
  probably mid-generation, and the newcomer is refused (`CapacityError`) instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from hydra_jury.workers.errors import (
    CapacityError,
    InvalidArgument,
    PositionError,
    UnknownSessionError,
)

State = TypeVar("State")


@dataclass(frozen=True)
class SessionLimits:
    """A worker's session limits, checked on construction."""

    max_sessions: int = 4
    max_session_tokens: int = 2048  # capped by the model's context length
    idle_timeout_s: float | None = None  # None (or 0 from a flag): never evicted
    reclaim_after_s: float = 1.0  # a full table drops its LRU session if idle this long

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


@dataclass
class _Entry(Generic[State]):
    state: State
    last_used: float = field(default_factory=time.monotonic)
    held: bool = False  # a call spanning several model-thread jobs is using it


class SessionTable(Generic[State]):
    """Session id -> worker state, with a fixed maximum and idle eviction."""

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

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, session: str, *, start: int) -> State:
        """The session's state for a call starting at `start`; a call at 0 may open it."""
        entry = self._entries.get(session)
        if entry is None:
            if start != 0:
                raise UnknownSessionError(
                    f"unknown session {session!r}: this service holds "
                    f"no positions of it (re-prefill from 0)"
                )
            self.evict_idle()
            if len(self._entries) >= self.max_sessions and not self._reclaim():
                raise CapacityError(
                    f"all {self.max_sessions} sessions are in use; retry later "
                    f"or raise --max-sessions"
                )
            entry = self._entries[session] = _Entry(self._create())
        entry.last_used = time.monotonic()
        return entry.state

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
        """Drops the least recently used session if it has been idle long enough."""
        idle = [session for session, entry in self._entries.items() if not entry.held]
        if not idle:
            return False
        oldest = min(idle, key=lambda s: self._entries[s].last_used)
        if time.monotonic() - self._entries[oldest].last_used < self.reclaim_after_s:
            return False
        self.release(oldest)
        return True

    def evict_idle(self) -> list[str]:
        if self.idle_timeout_s is None:
            return []
        now = time.monotonic()
        idle = [
            s
            for s, e in self._entries.items()
            if not e.held and now - e.last_used > self.idle_timeout_s
        ]
        for session in idle:
            self.release(session)
        return idle


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
            f"{capacity} tokens per session"
        )
