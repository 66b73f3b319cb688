"""The jury worker: a subset of the heads, evaluated as one stack, with per-session caches.

It runs the second half of a round: the hosted heads read the γ trunk hidden states of
the draft positions in one batched call, and the worker returns this shard's partial
log-product over the requested jurors it hosts (shards' partials are added by the
caller) and each such juror's argmax vote. No gRPC here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hydra_model import HydraModel, KVCache
from hydra_model.sessions import SessionTable, check_capacity, check_start
from poe import partial_log_product


@dataclass
class ScoreResult:
    log_product: torch.Tensor  # [γ, V] Σ over this shard's jurors of β·log_softmax(z/T)
    decision_log_product: torch.Tensor | None  # [γ, V] the same at temperature 1
    votes: torch.Tensor  # [γ, J] long, argmax of each juror below
    voters: list[str]  # the jurors of this shard, in checkpoint order
    head_evaluations: int = 0  # positions × hosted heads this call ran


@dataclass
class JuryCounters:
    calls: int = 0
    positions: int = 0
    head_evaluations: int = 0  # positions × hosted heads


class JuryWorker:
    def __init__(
        self,
        model: HydraModel,
        *,
        max_sessions: int = 4,
        max_session_tokens: int = 2048,
        idle_timeout_s: float | None = None,
    ) -> None:
        self.model = model
        self.hosted = model.head_names
        self.all_heads = [h.name for h in model.manifest.llm_heads]
        capacity = min(max_session_tokens, model.context_length)
        self.max_session_tokens = capacity
        self._pool = model.head_pool(model.heads.size, max_sessions, capacity)
        self.sessions: SessionTable[KVCache] = SessionTable(
            max_sessions, idle_timeout_s, self._pool.acquire, self._pool.release
        )
        self.counters = JuryCounters()

    @property
    def cache_bytes(self) -> int:
        return self._pool.nbytes

    def release(self, session: str) -> bool:
        return self.sessions.release(session)

    def _forward(self, session: str, start: int, hidden: torch.Tensor) -> torch.Tensor:
        # Limits first: a refused call must not open a session.
        check_capacity(start + len(hidden), self.max_session_tokens)
        cache = self.sessions.get(session, start=start)
        check_start(start, cache.length, "the jury")
        cache.truncate(start)
        logits = self.model.heads.forward(
            hidden.to(self.model.device, self.model.dtype), cache, start
        )  # [H, T, V]
        self.counters.calls += 1
        self.counters.positions += len(hidden)
        self.counters.head_evaluations += len(hidden) * self.model.heads.size
        return logits

    def prefill(self, session: str, start: int, hidden: torch.Tensor) -> None:
        """Hidden states [T, D] of positions start.. into every hosted head's cache."""
        self._forward(session, start, hidden)

    def score(
        self,
        session: str,
        start: int,
        hidden: torch.Tensor,
        jury: list[str],
        temperature: float,
        beta: float,
        with_decision: bool = False,
    ) -> ScoreResult:
        unknown = [name for name in jury if name not in self.all_heads]
        if unknown:
            raise ValueError(f"unknown jury heads {unknown}; the checkpoint has {self.all_heads}")
        logits = self._forward(session, start, hidden)
        members = [i for i, name in enumerate(self.hosted) if name in jury]
        juror_logits = logits[members]  # [J, γ, V]
        log_product = partial_log_product(juror_logits, temperature, beta)
        decision = None
        if with_decision:
            decision = (
                log_product
                if temperature in (0.0, 1.0)
                else partial_log_product(juror_logits, 1.0, beta)
            )
        votes = juror_logits.argmax(-1).T  # [γ, J]
        return ScoreResult(
            log_product,
            decision,
            votes,
            [self.hosted[i] for i in members],
            head_evaluations=len(hidden) * self.model.heads.size,
        )
