"""The trunk worker: the trunk, the drafter heads and an optional draft model, with
per-session caches.

It runs the first half of a round (`DraftCall`): from the pending token, either γ trunk
steps, each followed by the session's draft head, which samples the next draft token;
or γ steps of the draft model (a separate small LM) followed by one trunk forward over
the pending token and the γ drafts (one-pass verification). It keeps every token and
trunk output (hidden state) of a session, so a draft head or the draft model that has
not seen some positions (a new session, another drafter on a later turn) catches up
from them without re-running the trunk. No gRPC here: the trunk service wraps this,
and so does the in-process backend.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

import torch

from hydra_jury.hydra_model import (
    DraftCache,
    DraftModel,
    HeadRun,
    HeadStack,
    HydraModel,
    KVCache,
    Segment,
)
from hydra_jury.hydra_model.graphs import (
    MAX_STATIC_ROWS,
    StepGraphs,
    graph_mode,
    heads_step,
    trunk_step,
)
from hydra_jury.hydra_model.uncertainty import (
    check_hidden,
    find_witness,
    load_uncertainty_head,
    p_correct,
)
from hydra_jury.poe import draft_logprobs, draw_token
from hydra_jury.workers.calls import (
    DraftCall,
    DraftResult,
    HiddenStates,
    PrefillCall,
    UncertaintyCall,
    UncertaintyResult,
    check_sampling,
    to_device,
    to_host,
)
from hydra_jury.workers.errors import InvalidArgument, UnknownSessionError
from hydra_jury.workers.sessions import (
    SessionLimits,
    SessionTable,
    check_capacity,
    check_distinct_sessions,
    check_start,
)

Call = TypeVar("Call", PrefillCall, DraftCall)
# A plain step's draft tokens: none. Shared, as making an empty tensor a step costs a
# dispatcher call.
NO_TOKENS = torch.empty(0, dtype=torch.long)


@dataclass
class TrunkCounters:
    """Work done, for tests and benchmarks: trunk calls and the positions they ran
    (prefill and draft), draft-head calls (drafting and catching up), and draft-model
    calls and the positions they ran."""

    trunk_calls: int = 0
    trunk_positions: int = 0
    draft_head_calls: int = 0
    draft_model_calls: int = 0
    draft_model_positions: int = 0


@dataclass
class _DrafterCache:
    """A drafter's cache (the draft head's or the draft model's) and the token of each
    position it holds. A later turn or another continuation can replace tokens the
    drafter has seen, so the cache is trusted only as far as its tokens agree with the
    session's."""

    cache: KVCache | DraftCache
    tokens: torch.Tensor  # [capacity] long

    def valid_up_to(self, tokens: torch.Tensor, start: int) -> int:
        """Cuts the cache back to its longest prefix, at most `start` long, whose tokens
        equal `tokens`; returns that length."""
        held = min(self.cache.length, start)
        differs = (self.tokens[:held] != tokens[:held]).nonzero()
        if len(differs):
            held = int(differs[0])
        self.cache.truncate(held)
        return held

    def record(self, tokens: torch.Tensor, start: int) -> None:
        self.tokens[start : start + len(tokens)] = tokens


@dataclass
class _Session:
    trunk: KVCache
    tokens: torch.Tensor  # [capacity] long: the token of each processed position
    hidden: torch.Tensor  # [capacity, D] trunk output per processed position
    draft: _DrafterCache  # of the draft head
    draft_model: _DrafterCache | None
    draft_head: int | None = None  # which head's keys/values the draft cache holds


def check_token_id(field: str, token: int, vocab_size: int) -> None:
    """Raises `InvalidArgument` unless `token` is in [0, vocab_size)."""
    if not 0 <= token < vocab_size:
        raise InvalidArgument(
            f"{field}: token id {token} is outside the vocabulary [0, {vocab_size})"
        )


def check_token_ids(field: str, tokens: torch.Tensor, vocab_size: int) -> None:
    """Raises `InvalidArgument` unless every id of `tokens` is in [0, vocab_size)."""
    outside = tokens[(tokens < 0) | (tokens >= vocab_size)]
    if len(outside):
        check_token_id(field, int(outside[0]), vocab_size)


class TrunkWorker:
    def __init__(
        self,
        model: HydraModel,
        *,
        drafter_heads: list[str] | None = None,
        draft_model: DraftModel | None = None,
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
        self.draft_model = draft_model
        self._draft_model_pools = None
        if draft_model is not None:
            draft_model.check_compatible(model)
            capacity = min(capacity, draft_model.model.context_length)
            self._draft_model_pools = draft_model.pools(limits.max_sessions, capacity)
        self.max_session_tokens = capacity
        self._trunk_pool = model.trunk_pool(limits.max_sessions, capacity)
        self._draft_pool = model.head_pool(1, limits.max_sessions, capacity)
        # Per slot: the tokens of the trunk, the draft head and the draft model.
        self._tokens = torch.zeros(limits.max_sessions, 3, capacity, dtype=torch.long)
        self._hidden = model.hidden_store(limits.max_sessions, capacity)
        self.uncertainty_head = load_uncertainty_head(model)
        mode = graph_mode(model.device)
        # A few positions of a batch of sessions (a decode step, a draft head's step, a
        # draft model's round) at fixed shapes, replayed from CUDA graphs on a GPU
        # (`hydra_model.graphs`).
        self.graphs = StepGraphs(mode, model.device) if mode is not None else None
        self.sessions: SessionTable[_Session] = SessionTable(
            limits, self._new_session, self._free_session
        )
        self.counters = TrunkCounters()

    def _new_session(self) -> _Session:
        trunk = self._trunk_pool.acquire()
        tokens = self._tokens[trunk.slot]
        draft_model = None
        if self._draft_model_pools is not None:
            trunk_pool, head_pool = self._draft_model_pools
            cache = DraftCache(trunk_pool.acquire(), head_pool.acquire())
            draft_model = _DrafterCache(cache, tokens[2])
        draft = _DrafterCache(self._draft_pool.acquire(), tokens[1])
        return _Session(trunk, tokens[0], self._hidden[trunk.slot], draft, draft_model)

    def _free_session(self, session: _Session) -> None:
        self._trunk_pool.release(session.trunk)
        self._draft_pool.release(session.draft.cache)
        if session.draft_model is not None:
            trunk_pool, head_pool = self._draft_model_pools
            trunk_pool.release(session.draft_model.cache.trunk)
            head_pool.release(session.draft_model.cache.head)

    def release(self, session: str) -> bool:
        return self.sessions.release(session)

    def finish(self, session: str) -> bool:
        """The session's generation ended: its caches stay, reclaimable at once."""
        return self.sessions.finish(session)

    def prefill(self, call: PrefillCall) -> HiddenStates:
        """Runs the tokens through the trunk; returns their hidden states [T, D]."""
        return self.prefill_batch([call])[0]

    def prefill_batch(self, calls: list[PrefillCall]) -> list[HiddenStates]:
        """Several sessions' tokens through the trunk in one ragged forward (each from
        its own start); their hidden states, in order."""
        states = self._open_sessions(calls, self.check_prefill)
        work = [(state, call.tokens, call.start) for call, state in zip(calls, states, strict=True)]
        return [HiddenStates(len(hidden), hidden) for hidden in self._trunk_steps(work)]

    def _open_sessions(
        self, calls: Sequence[Call], check: Callable[[Call], None]
    ) -> list[_Session]:
        """The sessions of a batch's calls, each at its call's start. Every call is
        checked first (distinct sessions, then `check`): a refused call must not open a
        session. Then the position rule, against what the trunk holds."""
        check_distinct_sessions(calls)
        for call in calls:
            check(call)
        states = [self.sessions.get(call.session, start=call.start) for call in calls]
        for call, state in zip(calls, states, strict=True):
            check_start(call.start, state.trunk.length, "the trunk")
        return states

    def check_prefill(self, call: PrefillCall) -> None:
        """Refuses a prefill whose tokens are not ids of the vocabulary or that would
        take the session past its length limit (touches no session)."""
        check_token_ids("tokens", call.tokens, self.model.config.vocab_size)
        check_capacity(call.start + len(call.tokens), self.max_session_tokens)

    def _trunk_step(self, state: _Session, tokens: torch.Tensor, start: int) -> torch.Tensor:
        return self._trunk_steps([(state, tokens, start)])[0]

    def _trunk_steps(self, work: list[tuple[_Session, torch.Tensor, int]]) -> list[torch.Tensor]:
        """(session, tokens, start) of each session, in one ragged trunk forward; the
        hidden states [T, D] of each."""
        for state, _tokens, start in work:
            state.trunk.truncate(start)
        every = [tokens for _state, tokens, _start in work]
        if self.graphs is not None and sum(len(tokens) for tokens in every) <= MAX_STATIC_ROWS:
            outputs = self._trunk_positions(work)
        else:
            segments = [Segment(state.trunk, start, len(tokens)) for state, tokens, start in work]
            tokens = every[0] if len(every) == 1 else torch.cat(every)
            hidden = self.model.trunk.forward_ragged(to_device(tokens, self.model.device), segments)
            # (one session, a decode step's usual case: no split)
            outputs = [hidden] if len(every) == 1 else list(hidden.split([len(t) for t in every]))
        for (state, tokens, start), states in zip(work, outputs, strict=True):
            state.tokens[start : start + len(tokens)] = tokens
            state.hidden[start : start + len(tokens)] = states
            self.counters.trunk_positions += len(tokens)
        self.counters.trunk_calls += 1
        return outputs

    def _trunk_positions(
        self, work: list[tuple[_Session, torch.Tensor, int]]
    ) -> list[torch.Tensor]:
        """The sessions' positions through the trunk in one fixed-shape step
        (`self.graphs`), a row per position, padded to a recorded size: each session's
        hidden states [T, D]."""
        rows = []
        for state, tokens, start in work:
            state.trunk.check_append(start, len(tokens))
            slot = state.trunk.slot
            rows += [(token, slot, start + i) for i, token in enumerate(tokens.tolist())]
        pool = self._trunk_pool
        make = partial(trunk_step, self.model.trunk, pool)
        output = self.graphs.run(("trunk",), make, rows, pool.capacity)
        hidden = output[: len(rows)].clone()  # the graph's buffer: a replay overwrites it
        for state, tokens, _start in work:
            state.trunk.advance(len(tokens))
        return list(hidden.split([len(tokens) for _state, tokens, _start in work]))

    def _draft_heads_step(self, groups: list[list[Drafting]]) -> list[torch.Tensor]:
        """Each draft head over one position of its sessions (`groups`, one per head) ->
        each group's logits [n, V]. A shared LM head multiplies every group's rows in one
        product (`HeadStack.forward_runs`): with 8 sessions drafting with 4 different heads,
        the 49,152 × 576 matrix was read 4 times a step."""
        runs = [
            HeadRun(
                first=members[0].head[0],
                count=1,
                hidden=torch.cat([entry.hiddens[-1] for entry in members]),
                segments=[Segment(e.state.draft.cache, e.call.start + e.step, 1) for e in members],
                rows=slice(None),
            )
            for members in groups
        ]
        return [logits[0] for logits in self.model.heads.forward_runs(runs)]

    def _draft_head_positions(self, members: list[Drafting]) -> torch.Tensor:
        """One draft head over one position of each of `members` (sessions drafting with
        it) in one fixed-shape step (`self.graphs`): their logits [n, V]."""
        index, head = members[0].head
        rows = []
        for entry in members:
            cache, position = entry.state.draft.cache, entry.call.start + entry.step
            cache.check_append(position, 1)
            rows.append((cache.slot, position))
        pool = self._draft_pool
        make = partial(heads_step, head, pool.keys, pool.values)
        hidden = torch.cat([entry.hiddens[-1] for entry in members])
        output = self.graphs.run(("draft", index), make, rows, pool.capacity, hidden)
        logits = output[0, : len(members)].clone()
        for entry in members:
            entry.state.draft.cache.advance(1)
        return logits

    def uncertainty(self, call: UncertaintyCall) -> UncertaintyResult:
        """p_correct of an answer by the checkpoint's uncertainty head, the witness taken
        from this service's heads (`hydra_model.uncertainty`)."""
        if self.uncertainty_head is None:
            raise InvalidArgument(
                "uncertainty: this trunk service hosts no uncertainty head (its checkpoint "
                "has none; build one with --uncertainty-head and train it with "
                "train-heads --uncertainty)"
            )
        vocab_size = self.model.config.vocab_size
        for name, tokens in (
            ("prompt", call.prompt),
            ("check", call.check),
            ("answer_token", torch.tensor([call.answer_token])),
            ("verdict", torch.tensor(call.verdict)),
        ):
            check_token_ids(name, tokens, vocab_size)
            check_capacity(len(tokens), self.model.context_length)
        device = self.model.device
        witness = find_witness(self.model, call.prompt.to(device), call.answer_token)
        hidden = check_hidden(self.model, call.check.to(device), witness.hidden)
        self.counters.trunk_positions += len(call.prompt) + len(call.check)
        return UncertaintyResult(
            p_correct(self.uncertainty_head, hidden, call.verdict),
            self.model.head_names[witness.index],
        )

    def _check_draft(self, call: DraftCall) -> None:
        vocab_size = self.model.config.vocab_size
        check_token_id("pending_token", call.pending, vocab_size)
        for index, token in enumerate(call.outside_drafts):
            check_token_id(f"outside_drafts[{index}]", token, vocab_size)
        check_sampling(call.sampling, vocab_size)
        if call.draft_head is not None and call.draft_head not in self.drafters:
            raise InvalidArgument(
                f"draft_head: {call.draft_head!r} is not a drafter of this service; "
                f"drafters: {self.drafters}"
            )
        if call.draft_model and self.draft_model is None:
            raise InvalidArgument(
                "draft_model: this trunk service hosts no draft model (start it with "
                "--draft-model DIR)"
            )
        check_capacity(call.start + call.positions, self.max_session_tokens)

    def draft(self, call: DraftCall) -> DraftResult:
        """Feeds the pending token (position `start`) and then each new draft token
        through the trunk and the draft head: γ trunk steps, γ draft tokens at positions
        start+1..start+γ. Without a draft head only the trunk runs, once, over the
        pending token and the call's outside drafts."""
        return self.draft_batch([call])[0]

    def draft_batch(self, calls: list[DraftCall]) -> list[DraftResult]:
        """Several sessions' draft calls together: `begin_drafts`, then `draft_step`
        until every head draft and plain step is done, so each session gets what it
        would alone."""
        started = self.begin_drafts(calls)
        drafting = [entry for entry in started if isinstance(entry, Drafting)]
        while not all(entry.done for entry in drafting):
            self.draft_step(drafting)
        return [entry.result() if isinstance(entry, Drafting) else entry for entry in started]

    def begin_drafts(self, calls: list[DraftCall]) -> list[Drafting | DraftResult]:
        """Checks the calls and starts them: a draft-model call runs whole (its result);
        a head draft or plain step becomes a `Drafting` that `draft_step` advances one
        position at a time, its draft head caught up to its start. Its session is held
        (never reclaimed as idle) until it is done or `abandon`ed."""
        states = self._open_sessions(calls, self._check_draft)
        started: list[Drafting | DraftResult] = []
        for call, state in zip(calls, states, strict=True):
            if call.draft_model:
                started.append(self._draft_with_model(state, call))
                continue
            head = None
            if call.draft_head is not None:
                index = self.model.head_index(call.draft_head)
                head = (index, self._catch_up_draft_head(state, index, call.start))
            self.sessions.hold(call.session)
            started.append(Drafting(call, state, head, call.pending, _Draws(call)))
        return started

    def draft_step(self, drafting: list[Drafting]) -> None:
        """One position of every unfinished `Drafting`: one trunk forward over all of
        them (each at its own position), then each draft head's layers over its
        sessions, and a shared LM head once over all their rows. Sessions may join and
        leave between steps. One whose session was released meanwhile fails alone
        (`Drafting.error`), its caches untouched."""
        active = []
        for entry in drafting:
            if entry.done:
                continue
            if not self.sessions.holds(entry.call.session, entry.state):
                entry.error = UnknownSessionError(
                    f"session {entry.call.session!r} was released while drafting"
                )
                continue
            active.append(entry)
        if not active:
            return
        work = [(e.state, torch.tensor(e.step_tokens()), e.call.start + e.step) for e in active]
        for entry, hidden in zip(active, self._trunk_steps(work), strict=True):
            entry.hiddens.append(hidden)
        by_head: dict[int, list[Drafting]] = {}
        for entry in active:
            if entry.head is not None:
                by_head.setdefault(entry.head[0], []).append(entry)
        groups = list(by_head.values())
        if self.graphs is not None:
            step_logits = [self._draft_head_positions(members) for members in groups]
        else:
            step_logits = self._draft_heads_step(groups)
        for members, logits in zip(groups, step_logits, strict=True):
            # The draws run on the host, as the loop's maths does: one wait for the device
            # a step, where drawing on a GPU would wait at each of its checks.
            (logits,) = to_host([logits])
            self.counters.draft_head_calls += 1
            for row, entry in enumerate(members):
                position = entry.call.start + entry.step
                entry.state.draft.record(torch.tensor([entry.token]), position)
                entry.token = entry.draws.draw(logits[row : row + 1], position + 1)
        for entry in active:
            entry.step += 1
            if entry.done:
                self.sessions.let_go(entry.call.session, entry.state)

    def abandon(self, drafting: list[Drafting]) -> None:
        """Gives up draftings whose step failed: their sessions are let go."""
        for entry in drafting:
            self.sessions.let_go(entry.call.session, entry.state)

    def _draft_with_model(self, state: _Session, call: DraftCall) -> DraftResult:
        """γ draft tokens from the draft model (its cache first catches up on the kept
        tokens it has not seen), then one trunk forward over the pending token and the
        drafts: hidden states of positions start..start+γ for the jury."""
        drafter = state.draft_model
        held = drafter.valid_up_to(state.tokens, call.start)
        feed = torch.cat([state.tokens[held : call.start], torch.tensor([call.pending])])
        position, draws = held, _Draws(call)
        for step in range(call.gamma):
            logits = self.draft_model.next_token_logits(
                feed.to(self.model.device), drafter.cache, position
            )
            drafter.record(feed, position)
            self.counters.draft_model_calls += 1
            self.counters.draft_model_positions += len(feed)
            position += len(feed)
            (logits,) = to_host([logits])  # (drawn on the host, as a head's drafts are)
            feed = torch.tensor([draws.draw(logits, call.start + step + 1)])
        tokens = torch.tensor([call.pending, *draws.tokens])  # (moved by the forward)
        hidden = self._trunk_step(state, tokens, call.start)
        return draws.result(HiddenStates(len(tokens), hidden), trunk_steps=len(tokens))

    def _catch_up_draft_head(self, state: _Session, index: int, start: int) -> HeadStack:
        """The session's draft head, its cache brought to `start` from the kept hidden
        states (a different head than last time starts from scratch)."""
        head = self.model.heads.select(index)
        if state.draft_head != index:
            state.draft.cache.truncate(0)
            state.draft_head = index
        held = state.draft.valid_up_to(state.tokens, start)
        if held < start:
            head.fill_ragged(
                state.hidden[held:start], [Segment(state.draft.cache, held, start - held)]
            )
            state.draft.record(state.tokens[held:start], held)
            self.counters.draft_head_calls += 1
        return head


@dataclass
class Drafting:
    """A head draft or plain step in progress (`TrunkWorker.begin_drafts`): the call, its
    session, its draft head (index, stack; None for a plain step), the token fed at the
    next step, the draws and trunk outputs so far."""

    call: DraftCall
    state: _Session
    head: tuple[int, HeadStack] | None
    token: int
    draws: _Draws
    hiddens: list[torch.Tensor] = field(default_factory=list)
    step: int = 0
    error: Exception | None = None  # its session was released while drafting

    @property
    def done(self) -> bool:
        return self.error is not None or self.step >= self.call.gamma

    def step_tokens(self) -> list[int]:
        """The tokens the next step feeds the trunk: the token fed next, and at the first
        step the call's outside drafts after it."""
        return self.call.trunk_tokens if self.step == 0 else [self.token]

    def result(self) -> DraftResult:
        if self.error is not None:
            raise self.error
        if self.head is None:  # a plain step or a one-pass check: its trunk outputs only
            rows = len(self.hiddens[0])
            hidden = HiddenStates(rows, self.hiddens[0])
            return DraftResult(NO_TOKENS, None, None, hidden, trunk_steps=rows)
        hidden = torch.cat(self.hiddens)
        gamma = self.call.gamma
        return self.draws.result(
            HiddenStates(gamma, hidden), trunk_steps=gamma, head_evaluations=gamma
        )


class _Draws:
    """The draft tokens of one call, drawn one at a time from a drafter's logits: the
    argmax (greedy), or a draw from the tempered, filtered distribution keyed by
    (seed, position, "draft")."""

    def __init__(self, call: DraftCall) -> None:
        self.call = call
        self.tokens: list[int] = []
        self.logprobs: list[torch.Tensor] = []
        self.decisions: list[torch.Tensor] = []

    def draw(self, logits: torch.Tensor, position: int) -> int:
        """The token at `position` from next-token logits [1, V]."""
        sampling = self.call.sampling
        token, step_logprobs = draw_token(
            draft_logprobs(logits, sampling.temperature),
            sampling,
            self.call.seed,
            position,
            "draft",
        )
        self.tokens.append(token)
        self.logprobs.append(step_logprobs)
        if self.call.with_decision:
            self.decisions.append(draft_logprobs(logits, 1.0))
        return token

    def result(self, hidden: HiddenStates, **work: int) -> DraftResult:
        return DraftResult(
            torch.tensor(self.tokens),
            torch.cat(self.logprobs),
            torch.cat(self.decisions) if self.call.with_decision else None,
            hidden,
            **work,
        )
