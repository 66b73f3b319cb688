"""Wall time of one round, by phase: `draft_s` (the draft call, or the trunk forward of a
one-pass round), `score_s` (the jury call) and `accept_s` (the rest: acceptance,
sampling, metrics, commit) — `RoundOutput.timings`. Each timed phase is a trace span too
(`draft`, `score`), the child of the round's."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from hydra_jury.serving import tracing


class RoundTimer:
    def __init__(self) -> None:
        self._began = time.perf_counter()
        self._phases: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Times the block as `name` (added up when a round runs it more than once, as a
        beam search does, or a round run again after rebuilding lost caches)."""
        began = time.perf_counter()
        try:
            with tracing.span(name.removesuffix("_s")):
                yield
        finally:
            self._phases[name] = self._phases.get(name, 0.0) + time.perf_counter() - began

    def timings(self) -> dict[str, float]:
        """The phases so far, and `accept_s`: the round's time outside them."""
        spent = time.perf_counter() - self._began
        return {**self._phases, "accept_s": spent - sum(self._phases.values())}
