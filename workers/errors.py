"""Every exception a worker raises on purpose, one class per thing a caller can do about it.

Terms
- invalid argument: the caller sent something that can never work (an unknown head, a
  token outside the vocabulary, γ out of range); retrying the same call fails again.
- position not held: the call starts at a position the worker's caches do not reach
  (the worker restarted, evicted the session, or never saw it); the caller re-prefills.
- capacity: the worker is full (sessions) or the call would pass a limit (tokens per
  session); a later or smaller call can succeed.

Anything else escaping a worker is a bug and is reported as such (INTERNAL over gRPC,
see `serving.errors`), never as the caller's fault.
"""

from __future__ import annotations


class InvalidArgument(ValueError):
    """Input that cannot be used; the message names the field and what was wrong."""


class PositionError(RuntimeError):
    """A call starts at a position the worker does not hold: re-prefill from what it holds."""


class UnknownSessionError(PositionError):
    """A session the worker does not hold, asked for at a position > 0: a position not
    held, so the caller re-prefills (FAILED_PRECONDITION over gRPC)."""


# Why a worker refused a call for capacity (the refused-calls metric's reasons).
SESSIONS_RUNNING = "sessions_running"  # every slot is held by a running generation
SESSION_LENGTH = "session_length"  # the call would pass the tokens per session


class CapacityError(RuntimeError):
    """Too many sessions, or a session longer than the worker's limit. `reason` says which
    (None where it is not known: an error rebuilt from a status code)."""

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
