"""The trunk worker: the trunk and the drafter heads, with per-session caches.

It runs the first half of a round: from the pending token, γ trunk steps, each followed
by the session's draft head, which samples the next draft token. It keeps every trunk
output (hidden state) of a session, so a draft head that has not seen some positions
(a new session, a different drafter on a later turn) catches up from them without
re-running the trunk. No gRPC here: the service wraps this, and so does the in-process
backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hydra_model import HeadStack, HydraModel, KVCache
from hydra_model.sessions import SessionTable, check_capacity, check_start
from poe import SamplingParams, categorical, draft_logprobs, filter_logprobs

MAX_GAMMA = 16  # draft tokens per call: the service's and the orchestrator's limit


@dataclass
class DraftResult:
    tokens: torch.Tensor  # [γ] long; empty when no draft head was asked for
    logprobs: torch.Tensor | None  # [γ, V] draft distributions, tempered and filtered
    decision_logprobs: torch.Tensor | None  # [γ, V] at temperature 1, unfiltered
    hidden: torch.Tensor  # [γ, D] trunk outputs of positions start..start+γ-1
    trunk_steps: int = 0  # trunk positions this call ran
    head_evaluations: int = 0  # draft-head positions of the round (not the catch-up)


@dataclass
class TrunkCounters:
    """Work done, for tests and benchmarks: positions through the trunk (prefill and
    draft) and through a draft head."""

    trunk_calls: int = 0
    trunk_positions: int = 0
    draft_head_positions: int = 0
    draft_head_calls: int = 0


@dataclass
class _Session:
    trunk: KVCache
    hidden: torch.Tensor  # [capacity, D] trunk output per processed position
    draft_cache: KVCache
    draft_head: int | None = None  # which head's keys/values draft_cache holds


class TrunkWorker:
    def __init__(
        self,
        model: HydraModel,
        *,
        drafter_heads: list[str] | None = None,
        max_sessions: int = 4,
        max_session_tokens: int = 2048,
        idle_timeout_s: float | None = None,
    ) -> None:
        if model.trunk is None:
            raise ValueError("the trunk worker needs a model loaded with its trunk")
        self.model = model
        self.drafters = list(drafter_heads or model.head_names)
        for name in self.drafters:
            model.head_index(name)  # raises for an unknown head
        capacity = min(max_session_tokens, model.context_length)
        self.max_session_tokens = capacity
        self._trunk_pool = model.trunk_pool(max_sessions, capacity)
        self._draft_pool = model.head_pool(1, max_sessions, capacity)
        self._hidden = torch.zeros(
            max_sessions, capacity, model.config.hidden_size, dtype=model.dtype, device=model.device
        )
        self.sessions: SessionTable[_Session] = SessionTable(
            max_sessions, idle_timeout_s, self._new_session, self._free_session
        )
        self.counters = TrunkCounters()

    def _new_session(self) -> _Session:
        trunk = self._trunk_pool.acquire()
        return _Session(trunk, self._hidden[trunk.slot], self._draft_pool.acquire())

    def _free_session(self, session: _Session) -> None:
        self._trunk_pool.release(session.trunk)
        self._draft_pool.release(session.draft_cache)

    @property
    def cache_bytes(self) -> int:
        return (
            self._trunk_pool.nbytes
            + self._draft_pool.nbytes
            + self._hidden.numel() * self._hidden.element_size()
        )

    def release(self, session: str) -> bool:
        return self.sessions.release(session)

    def prefill(self, session: str, start: int, tokens: torch.Tensor) -> torch.Tensor:
        """Runs tokens [T] at positions start.. through the trunk; returns hidden [T, D]."""
        # Limits first: a refused call must not open a session.
        check_capacity(start + len(tokens), self.max_session_tokens)
        state = self.sessions.get(session, start=start)
        check_start(start, state.trunk.length, "the trunk")
        return self._trunk_step(state, tokens.to(self.model.device), start)

    def _trunk_step(self, state: _Session, tokens: torch.Tensor, start: int) -> torch.Tensor:
        state.trunk.truncate(start)
        hidden = self.model.trunk.forward(tokens, state.trunk, start)
        state.hidden[start : start + len(tokens)] = hidden
        self.counters.trunk_calls += 1
        self.counters.trunk_positions += len(tokens)
        return hidden

    def draft(
        self,
        session: str,
        start: int,
        pending: int,
        gamma: int,
        draft_head: str | None,
        sampling: SamplingParams,
        seed: int,
        with_decision: bool = False,
    ) -> DraftResult:
        """Feeds the pending token (position `start`) and then each new draft token
        through the trunk and the draft head: γ trunk steps, γ draft tokens at positions
        start+1..start+γ. Without a draft head (non-speculative decoding) γ must be 1 and
        only the trunk runs."""
        check_capacity(start + gamma, self.max_session_tokens)
        state = self.sessions.get(session, start=start)
        check_start(start, state.trunk.length, "the trunk")
        if draft_head is None:
            if gamma != 1:
                raise ValueError("without a draft head only one trunk step can be taken")
            hidden = self._trunk_step(
                state, torch.tensor([pending], device=self.model.device), start
            )
            return DraftResult(torch.empty(0, dtype=torch.long), None, None, hidden, trunk_steps=1)
        if draft_head not in self.drafters:
            raise ValueError(f"unknown draft head {draft_head!r}; drafters: {self.drafters}")
        head = self._catch_up_draft_head(state, self.model.head_index(draft_head), start)
        token = pending
        tokens, logprobs, decisions, hiddens = [], [], [], []
        for step in range(gamma):
            position = start + step
            hidden = self._trunk_step(
                state, torch.tensor([token], device=self.model.device), position
            )
            logits = head.forward(hidden, state.draft_cache, position)[0]  # [1, V]
            self.counters.draft_head_positions += 1
            self.counters.draft_head_calls += 1
            step_logprobs = draft_logprobs(logits, sampling.temperature)
            if sampling.greedy:
                # Greedy reads the temperature-1 draft; filters never move its argmax.
                token = int(step_logprobs[0].argmax())
            else:
                step_logprobs = filter_logprobs(step_logprobs, sampling)
                token = int(
                    categorical(step_logprobs.exp(), seed, torch.tensor([position + 1]), "draft")[0]
                )
            tokens.append(token)
            logprobs.append(step_logprobs)
            hiddens.append(hidden)
            if with_decision:
                decisions.append(draft_logprobs(logits, 1.0))
        return DraftResult(
            torch.tensor(tokens),
            torch.cat(logprobs),
            torch.cat(decisions) if with_decision else None,
            torch.cat(hiddens),
            trunk_steps=gamma,
            head_evaluations=gamma,
        )

    def _catch_up_draft_head(self, state: _Session, index: int, start: int) -> HeadStack:
        """The session's draft head, its cache brought to `start` from the kept hidden
        states (a different head than last time starts from scratch)."""
        head = self.model.heads.select(index)
        if state.draft_head != index:
            state.draft_cache.truncate(0)
            state.draft_head = index
        held = min(state.draft_cache.length, start)
        state.draft_cache.truncate(held)
        if held < start:
            head.forward(state.hidden[held:start], state.draft_cache, held)
            self.counters.draft_head_positions += start - held
            self.counters.draft_head_calls += 1
        return head
