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

from hydra_jury.hydra_model import HydraModel, KVCache
from hydra_jury.poe import draft_logprobs, partial_log_product
from hydra_jury.workers.calls import HiddenStates, JuryPrefillCall, ScoreCall, ScoreResult
from hydra_jury.workers.errors import InvalidArgument
from hydra_jury.workers.sessions import SessionLimits, SessionTable, check_capacity, check_start


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
        self._pool = model.head_pool(model.heads.size, limits.max_sessions, capacity)
        self.sessions: SessionTable[KVCache] = SessionTable(
            limits, self._pool.acquire, self._pool.release
        )
        self.counters = JuryCounters()

    def release(self, session: str) -> bool:
        return self.sessions.release(session)

    def _hidden(self, hidden: HiddenStates) -> torch.Tensor:
        """The hidden states [T, D] on the model's device, their shape checked."""
        tensor = hidden.tensor()
        expected = [hidden.rows, self.model.config.hidden_size]
        if list(tensor.shape) != expected:
            raise InvalidArgument(f"hidden: shape {list(tensor.shape)} is not {expected}")
        return tensor.to(self.model.device, self.model.dtype)

    def _forward(self, session: str, start: int, hidden: HiddenStates) -> torch.Tensor:
        states = self._hidden(hidden)
        # Checks first: a refused call must not open a session.
        check_capacity(start + len(states), self.max_session_tokens)
        cache = self.sessions.get(session, start=start)
        check_start(start, cache.length, "the jury")
        cache.truncate(start)
        logits = self.model.heads.forward(states, cache, start)  # [H, T, V]
        self.counters.calls += 1
        return logits

    def prefill(self, call: JuryPrefillCall) -> None:
        """Hidden states of positions start.. into every hosted head's cache."""
        self._forward(call.session, call.start, call.hidden)

    def score(self, call: ScoreCall) -> ScoreResult:
        named = [*call.jury, *([call.amateur] if call.amateur else [])]
        unknown = [name for name in named if name not in self.all_heads]
        if unknown:
            raise InvalidArgument(
                f"jury: unknown heads {unknown}; the checkpoint has {self.all_heads}"
            )
        logits = self._forward(call.session, call.start, call.hidden)
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
