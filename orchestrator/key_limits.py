"""Per-key limits on the Generation API: generations in progress at once, and generated
tokens in any 60 s (a sliding window), each key by its own `KeyLimits`.

A generation is admitted when its key is under both limits, and holds one of the key's
concurrent slots until it ends; its tokens count against the window as its rounds
commit. A generation already admitted runs to its end, so one long answer can take a
key past its tokens per minute: the next is refused until enough of them are a minute
old. Counts are per server process: N orchestrators let a key use N times its limits.
Limits are read from the key at each admission, so a reloaded key file applies to the
next generation; the counts, kept by key name, carry over.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from hydra_jury.serving.api_keys import ApiKey
from hydra_jury.workers.errors import CapacityError

WINDOW_S = 60.0

# Why a key's request was refused (the refusals metric's reasons).
CONCURRENCY = "concurrency"
TOKENS_PER_MINUTE = "tokens_per_minute"


class KeyLimitExceeded(CapacityError):
    """A key is at one of its limits (RESOURCE_EXHAUSTED); `reason` says which."""


@dataclass
class _Usage:
    running: int = 0
    spent: deque[tuple[float, int]] = field(default_factory=deque)  # (when, tokens)
    spent_total: int = 0  # the sum of `spent`

    def forget_before(self, moment: float) -> None:
        while self.spent and self.spent[0][0] <= moment:
            self.spent_total -= self.spent.popleft()[1]


class KeyLimiter:
    def __init__(
        self,
        *,
        on_refused: Callable[[ApiKey, str], None] = lambda key, reason: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`on_refused` is told each refusal (for metrics): the key and the reason."""
        self.on_refused, self.clock = on_refused, clock
        self._usage: dict[str, _Usage] = {}

    def _usage_of(self, key: ApiKey) -> _Usage:
        usage = self._usage.setdefault(key.name, _Usage())
        usage.forget_before(self.clock() - WINDOW_S)
        return usage

    @contextlib.contextmanager
    def generation(self, key: ApiKey) -> Iterator[None]:
        """Holds one of `key`'s concurrent slots for the block; `KeyLimitExceeded` when
        the key is at a limit."""
        usage = self._usage_of(key)
        refusal = self._refusal(key, usage)
        if refusal is not None:
            self.on_refused(key, refusal.reason)
            raise refusal
        usage.running += 1
        try:
            yield
        finally:
            usage.running -= 1

    def _refusal(self, key: ApiKey, usage: _Usage) -> KeyLimitExceeded | None:
        """Why `key` may not start a generation now, with a retry hint; None if it may."""
        limits = key.limits
        if limits.max_concurrent is not None and usage.running >= limits.max_concurrent:
            return KeyLimitExceeded(
                f"API key {key.name!r} has {usage.running} generations in progress, its "
                "limit; retry when one of them ends",
                reason=CONCURRENCY,
            )
        per_minute = limits.tokens_per_minute
        if per_minute is not None and usage.spent_total >= per_minute:
            return KeyLimitExceeded(
                f"API key {key.name!r} generated {usage.spent_total} tokens in the last "
                f"minute (its limit is {per_minute}); retry in about "
                f"{self._seconds_until_under(usage, per_minute):.1f} s",
                reason=TOKENS_PER_MINUTE,
            )
        return None

    def spend(self, key: ApiKey, tokens: int) -> None:
        """Counts `tokens` generated for `key` now."""
        if tokens:
            usage = self._usage_of(key)
            usage.spent.append((self.clock(), tokens))
            usage.spent_total += tokens

    def _seconds_until_under(self, usage: _Usage, limit: int) -> float:
        """How long until the tokens of the last minute fall below `limit`."""
        total = usage.spent_total
        for when, tokens in usage.spent:
            total -= tokens
            if total < limit:
                return max(0.1, when + WINDOW_S - self.clock())
        return WINDOW_S
