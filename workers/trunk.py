"""The trunk worker: the trunk and the drafter heads, with per-session caches.

It runs the first half of a round (`DraftCall`): from the pending token, γ trunk steps,
each followed by the session's draft head, which samples the next draft token. It keeps
every trunk output (hidden state) of a session, so a draft head that has not seen some
positions (a new session, a different drafter on a later turn) catches up from them
without re-running the trunk. No gRPC here: the trunk service wraps this, and so does
the in-process backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hydra_jury.hydra_model import HeadStack, HydraModel, KVCache
from hydra_jury.poe import categorical, draft_logprobs, filter_logprobs
from hydra_jury.workers.calls import (
    DraftCall,
    DraftResult,
    HiddenStates,
    PrefillCall,
    check_sampling,
)
from hydra_jury.workers.errors import InvalidArgument
from hydra_jury.workers.sessions import SessionLimits, SessionTable, check_capacity, check_start


@dataclass
class TrunkCounters:
    """Work done, for tests and benchmarks: trunk calls and the positions they ran
    (prefill and draft), and draft-head calls (drafting and catching up)."""

    trunk_calls: int = 0
    trunk_positions: int = 0
    draft_head_calls: int = 0


@dataclass
class _Session:
    trunk: KVCache
    hidden: torch.Tensor  # [capacity, D] trunk output per processed position
    draft_cache: KVCache
    draft_head: int | None = None  # which head's keys/values draft_cache holds


def check_token_ids(field: str, tokens: torch.Tensor, vocab_size: int) -> None:
    """Raises `InvalidArgument` unless every id of `tokens` is in [0, vocab_size)."""
    outside = tokens[(tokens < 0) | (tokens >= vocab_size)]
    if len(outside):
        raise InvalidArgument(
            f"{field}: token id {int(outside[0])} is outside the vocabulary [0, {vocab_size})"
        )


class TrunkWorker:
    def __init__(
        self,
        model: HydraModel,
        *,
        drafter_heads: list[str] | None = None,
        limits: SessionLimits | None = None,
    ) -> None:
        if model.trunk is None:
            raise ValueError("the trunk worker needs a model loaded with its trunk")
        limits = limits or SessionLimits()
        self.model = model
        self.drafters = list(drafter_heads or model.head_names)
        for name in self.drafters:
            model.head_index(name)  # raises for an unknown head
        capacity = min(limits.max_session_tokens, model.context_length)
        self.max_session_tokens = capacity
        self._trunk_pool = model.trunk_pool(limits.max_sessions, capacity)
        self._draft_pool = model.head_pool(1, limits.max_sessions, capacity)
        self._hidden = torch.zeros(
            limits.max_sessions,
            capacity,
            model.config.hidden_size,
            dtype=model.dtype,
            device=model.device,
        )
        self.sessions: SessionTable[_Session] = SessionTable(
            limits, self._new_session, self._free_session
        )
        self.counters = TrunkCounters()

    def _new_session(self) -> _Session:
        trunk = self._trunk_pool.acquire()
        return _Session(trunk, self._hidden[trunk.slot], self._draft_pool.acquire())

    def _free_session(self, session: _Session) -> None:
        self._trunk_pool.release(session.trunk)
        self._draft_pool.release(session.draft_cache)

    def release(self, session: str) -> bool:
        return self.sessions.release(session)

    def prefill(self, call: PrefillCall) -> HiddenStates:
        """Runs the tokens through the trunk; returns their hidden states [T, D]."""
        # Checks first: a refused call must not open a session.
        check_token_ids("tokens", call.tokens, self.model.config.vocab_size)
        check_capacity(call.start + len(call.tokens), self.max_session_tokens)
        state = self.sessions.get(call.session, start=call.start)
        check_start(call.start, state.trunk.length, "the trunk")
        hidden = self._trunk_step(state, call.tokens.to(self.model.device), call.start)
        return HiddenStates(len(hidden), hidden)

    def _trunk_step(self, state: _Session, tokens: torch.Tensor, start: int) -> torch.Tensor:
        state.trunk.truncate(start)
        hidden = self.model.trunk.forward(tokens, state.trunk, start)  # [T, D]
        state.hidden[start : start + len(tokens)] = hidden
        self.counters.trunk_calls += 1
        self.counters.trunk_positions += len(tokens)
        return hidden

    def _check_draft(self, call: DraftCall) -> None:
        vocab_size = self.model.config.vocab_size
        check_token_ids("pending_token", torch.tensor([call.pending]), vocab_size)
        check_sampling(call.sampling, vocab_size)
        if call.draft_head is not None and call.draft_head not in self.drafters:
            raise InvalidArgument(
                f"draft_head: {call.draft_head!r} is not a drafter of this service; "
                f"drafters: {self.drafters}"
            )
        check_capacity(call.start + call.gamma, self.max_session_tokens)

    def draft(self, call: DraftCall) -> DraftResult:
        """Feeds the pending token (position `start`) and then each new draft token
        through the trunk and the draft head: γ trunk steps, γ draft tokens at positions
        start+1..start+γ. Without a draft head only the trunk runs, once."""
        self._check_draft(call)
        state = self.sessions.get(call.session, start=call.start)
        check_start(call.start, state.trunk.length, "the trunk")
        device = self.model.device
        if call.draft_head is None:
            hidden = self._trunk_step(
                state, torch.tensor([call.pending], device=device), call.start
            )
            return DraftResult(
                torch.empty(0, dtype=torch.long), None, None, HiddenStates(1, hidden), 1
            )
        head = self._catch_up_draft_head(state, self.model.head_index(call.draft_head), call.start)
        sampling, token = call.sampling, call.pending
        tokens, logprobs, decisions, hiddens = [], [], [], []
        for step in range(call.gamma):
            position = call.start + step
            hidden = self._trunk_step(state, torch.tensor([token], device=device), position)
            logits = head.forward(hidden, state.draft_cache, position)[0]  # [1, V]
            self.counters.draft_head_calls += 1
            step_logprobs = draft_logprobs(logits, sampling.temperature)  # [1, V]
            if sampling.greedy:
                # Greedy reads the temperature-1 draft; filters never move its argmax.
                token = int(step_logprobs[0].argmax())
            else:
                step_logprobs = filter_logprobs(step_logprobs, sampling)
                draw_at = torch.tensor([position + 1])
                token = int(categorical(step_logprobs.exp(), call.seed, draw_at, "draft")[0])
            tokens.append(token)
            logprobs.append(step_logprobs)
            hiddens.append(hidden)
            if call.with_decision:
                decisions.append(draft_logprobs(logits, 1.0))
        return DraftResult(
            torch.tensor(tokens),
            torch.cat(logprobs),
            torch.cat(decisions) if call.with_decision else None,
            HiddenStates(call.gamma, torch.cat(hiddens)),
            trunk_steps=call.gamma,
            head_evaluations=call.gamma,
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
            self.counters.draft_head_calls += 1
        return head
