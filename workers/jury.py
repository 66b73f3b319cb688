"""The jury worker: a subset of the heads, evaluated as one stack, with per-session caches.

It runs the second half of a round (`ScoreCall`): the hosted heads read the trunk's
hidden states of the draft positions in one batched call, and the worker returns this
shard's partial log-product over the requested jurors it hosts (the caller adds the
shards' partials, `poe.combine_partials`) and each such juror's argmax vote. No gRPC
here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hydra_jury.hydra_model import HydraModel, KVCache, Segment
from hydra_jury.poe import draft_logprobs, partial_log_product
from hydra_jury.workers.calls import HiddenStates, JuryPrefillCall, ScoreCall, ScoreResult
from hydra_jury.workers.errors import InvalidArgument
from hydra_jury.workers.sessions import (
    SessionLimits,
    SessionTable,
    check_capacity,
    check_distinct_sessions,
    check_start,
)


@dataclass
class JuryCounters:
    """Work done, for tests and benchmarks: forward calls of the hosted stack."""

    calls: int = 0


class JuryWorker:
    def __init__(self, model: HydraModel, *, limits: SessionLimits | None = None) -> None:
        limits = limits or SessionLimits()
        self.model = model
        self.hosted = model.head_names
        self.all_heads = [h.name for h in model.manifest.llm_heads]
        capacity = min(limits.max_session_tokens, model.context_length)
        self.max_session_tokens = capacity
        self.pool = model.head_pool(model.heads.size, limits.max_sessions, capacity)
        self.sessions: SessionTable[KVCache] = SessionTable(
            limits, self.pool.acquire, self.pool.release
        )
        self.counters = JuryCounters()

    def release(self, session: str) -> bool:
        return self.sessions.release(session)

    def finish(self, session: str) -> bool:
        """The session's generation ended: its caches stay, reclaimable at once."""
        return self.sessions.finish(session)

    def _hidden(self, hidden: HiddenStates) -> torch.Tensor:
        """The hidden states [T, D] on the model's device, their shape checked."""
        tensor = hidden.tensor()
        expected = [hidden.rows, self.model.config.hidden_size]
        if list(tensor.shape) != expected:
            raise InvalidArgument(f"hidden: shape {list(tensor.shape)} is not {expected}")
        return tensor.to(self.model.device, self.model.dtype)

    def _forward(
        self, calls: list[JuryPrefillCall | ScoreCall], logits: bool = True
    ) -> list[torch.Tensor]:
        """The hosted heads over each call's hidden states, all calls in one ragged
        forward; each call's logits [H, T, V] (none without `logits`: a prefill only
        fills the caches)."""
        check_distinct_sessions(calls)
        states = [self._hidden(call.hidden) for call in calls]
        # Checks first: a refused call must not open a session.
        for call, rows in zip(calls, states, strict=True):
            check_capacity(call.start + len(rows), self.max_session_tokens)
        caches = [self.sessions.get(call.session, start=call.start) for call in calls]
        for call, cache in zip(calls, caches, strict=True):
            check_start(call.start, cache.length, "the jury")
        for call, cache in zip(calls, caches, strict=True):
            cache.truncate(call.start)
        segments = [
            Segment(cache, call.start, len(rows))
            for call, cache, rows in zip(calls, caches, states, strict=True)
        ]
        self.counters.calls += 1
        if not logits:
            self.model.heads.fill_ragged(torch.cat(states), segments)
            return []
        out = self.model.heads.forward_ragged(torch.cat(states), segments)  # [H, N, V]
        return list(out.split([len(rows) for rows in states], dim=1))

    def prefill(self, call: JuryPrefillCall) -> None:
        """Hidden states of positions start.. into every hosted head's cache."""
        self._forward([call], logits=False)

    def prefill_batch(self, calls: list[JuryPrefillCall]) -> list[None]:
        """Several sessions' prefills in one ragged forward."""
        self._forward(calls, logits=False)
        return [None] * len(calls)

    def score(self, call: ScoreCall) -> ScoreResult:
        return self.score_batch([call])[0]

    def score_batch(self, calls: list[ScoreCall]) -> list[ScoreResult]:
        """Several sessions' score calls in one ragged forward of the hosted heads."""
        for call in calls:
            named = [*call.jury, *([call.amateur] if call.amateur else [])]
            unknown = [name for name in named if name not in self.all_heads]
            if unknown:
                raise InvalidArgument(
                    f"jury: unknown heads {unknown}; the checkpoint has {self.all_heads}"
                )
        logits = self._forward(calls)
        return [self._result(call, rows) for call, rows in zip(calls, logits, strict=True)]

    def _result(self, call: ScoreCall, logits: torch.Tensor) -> ScoreResult:
        """The partial product, votes (and amateur) of one call's logits [H, T, V]."""
        members = [i for i, name in enumerate(self.hosted) if name in call.jury]
        juror_logits = logits[members]  # [J, γ, V]
        log_product = partial_log_product(juror_logits, call.temperature, call.beta)
        decision = None
        if call.with_decision:
            decision = (
                log_product
                if call.temperature in (0.0, 1.0)
                else partial_log_product(juror_logits, 1.0, call.beta)
            )
        amateur = None
        if call.amateur in self.hosted:
            amateur_logits = logits[self.hosted.index(call.amateur)]  # [γ, V]
            amateur = draft_logprobs(amateur_logits, call.temperature)
        return ScoreResult(
            log_product,
            decision,
            juror_logits.argmax(-1).T,  # [γ, J]
            tuple(self.hosted[i] for i in members),
            head_evaluations=len(logits[0]) * self.model.heads.size,
            amateur_logprobs=amateur,
        )
