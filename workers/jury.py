"""The jury worker: a subset of the heads, evaluated on demand, with per-session caches.

It runs the second half of a round (`ScoreCall`): the heads a call names read the trunk's
hidden states of the draft positions, and the worker returns this shard's partial
log-product over the requested jurors it hosts (the caller adds the shards' partials,
`poe.combine_partials`) and each such juror's argmax vote. No gRPC here.

Heads on demand
- A call evaluates only the hosted heads it names (its jurors and its contrastive
  amateur); the others are not touched, so a jury of one costs one head.
- The worker keeps every session's trunk outputs (hidden size × positions, small beside
  the heads' caches). Each head's cache holds its own number of positions: a head that
  a later call names after it was left out catches up from the kept trunk outputs, in
  the same forward as the call's own positions.
- The position rule holds for the kept trunk outputs: a call truncates them and every
  head's cache to its start, so a cache only ever holds positions computed from the
  trunk outputs the worker holds now.
- A prefill keeps the trunk outputs and fills the caches of the heads it names (the
  request's jury), so its first round has nothing to catch up.
- Heads with the same work in a batch (same calls, same catch-up) run as one stacked
  forward; a shared LM head multiplies every head's rows in one product.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from hydra_jury.hydra_model import HeadRun, HydraModel, KVCache, Segment
from hydra_jury.hydra_model.graphs import MAX_STATIC_ROWS, StepGraphs, graph_mode, heads_step
from hydra_jury.poe import draft_logprobs, partial_log_product, partial_log_product_and_votes
from hydra_jury.workers.calls import (
    HiddenStates,
    JuryPrefillCall,
    ScoreCall,
    ScoreResult,
    to_device,
)
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
    """Work done, for tests and benchmarks: forward calls, heads run (a head run over a
    call's batch reads its layers once), positions × heads scored for calls, and
    positions × heads run to catch a head up."""

    calls: int = 0
    head_runs: int = 0
    head_positions: int = 0
    catch_up_positions: int = 0


@dataclass
class _Session:
    cache: KVCache  # every hosted head's keys/values (one pool slot)
    lengths: list[int]  # positions each hosted head's cache holds
    hidden: torch.Tensor  # [capacity, D] trunk output per position
    length: int = 0  # positions whose trunk outputs `hidden` holds


@dataclass
class _Work:
    """One call of a batch, its session moved to the call's start and its trunk outputs
    `rows` stored up to `end`: `heads` (hosted indices) to run up to `end`, logits of the
    last `scored`."""

    state: _Session
    rows: torch.Tensor
    end: int
    heads: list[int]
    scored: int


class JuryWorker:
    def __init__(self, model: HydraModel, *, limits: SessionLimits | None = None) -> None:
        limits = limits or SessionLimits()
        self.model = model
        self.hosted = model.head_names
        self.all_heads = [h.name for h in model.manifest.llm_heads]
        capacity = min(limits.max_session_tokens, model.context_length)
        self.max_session_tokens = capacity
        self.pool = model.head_pool(model.heads.size, limits.max_sessions, capacity)
        self._hidden = model.hidden_store(limits.max_sessions, capacity)
        self.sessions: SessionTable[_Session] = SessionTable(
            limits, self._new_session, self._free_session
        )
        self.counters = JuryCounters()
        mode = graph_mode(model.device)
        # A score of a few positions of a batch of sessions at fixed shapes, replayed from
        # CUDA graphs on a GPU (`hydra_model.graphs`), per run of heads.
        self.graphs = StepGraphs(mode, model.device) if mode is not None else None

    def _new_session(self) -> _Session:
        cache = self.pool.acquire()
        return _Session(cache, [0] * len(self.hosted), self._hidden[cache.slot])

    def _free_session(self, state: _Session) -> None:
        self.pool.release(state.cache)

    def release(self, session: str) -> bool:
        return self.sessions.release(session)

    def finish(self, session: str) -> bool:
        """The session's generation ended: its caches stay, reclaimable at once."""
        return self.sessions.finish(session)

    def held_positions(self, session: str) -> dict[str, int]:
        """Positions each hosted head's cache holds for `session` (empty: none held)."""
        state = self.sessions.peek(session)
        return {} if state is None else dict(zip(self.hosted, state.lengths, strict=True))

    def _hidden_of(self, hidden: HiddenStates) -> torch.Tensor:
        """The hidden states [T, D] on the model's device, their shape checked."""
        tensor = hidden.tensor()
        expected = [hidden.rows, self.model.config.hidden_size]
        if list(tensor.shape) != expected:
            raise InvalidArgument(f"hidden: shape {list(tensor.shape)} is not {expected}")
        return to_device(tensor, self.model.device, self.model.dtype)

    def _check_names(self, field: str, names: tuple[str, ...]) -> None:
        unknown = [name for name in names if name not in self.all_heads]
        if unknown:
            raise InvalidArgument(
                f"{field}: unknown heads {unknown}; the checkpoint has {self.all_heads}"
            )

    def _heads(self, names: tuple[str, ...]) -> list[int]:
        """The hosted heads among `names`, as indices in checkpoint order."""
        return [i for i, name in enumerate(self.hosted) if name in names]

    def _run(
        self, calls: list[JuryPrefillCall | ScoreCall], heads: list[list[int]], scored: bool
    ) -> list[dict[int, torch.Tensor]]:
        """Keeps each call's trunk outputs and runs its `heads` over its positions (after
        catching each up); with `scored`, each call's logits [1, T, V] by head index."""
        check_distinct_sessions(calls)
        states = [self._hidden_of(call.hidden) for call in calls]
        # Checks first: a refused call must not open a session.
        for call, rows in zip(calls, states, strict=True):
            check_capacity(call.start + len(rows), self.max_session_tokens)
        sessions = [self.sessions.get(call.session, start=call.start) for call in calls]
        for call, state in zip(calls, sessions, strict=True):
            check_start(call.start, state.length, "the jury")
        work = []
        for call, state, rows, named in zip(calls, sessions, states, heads, strict=True):
            end = call.start + len(rows)
            state.lengths = [min(length, call.start) for length in state.lengths]
            state.hidden[call.start : end] = rows
            state.length = end
            work.append(_Work(state, rows, end, named, len(rows) if scored else 0))
        placed = self._plan(work)
        self.counters.calls += bool(placed)
        runs = [run for run, _ in placed]
        outputs = self._fixed_shapes(runs) or self.model.heads.forward_runs(runs)
        logits: list[dict[int, torch.Tensor]] = [{} for _ in calls]
        for (run, entries), output in zip(placed, outputs, strict=True):
            for member, head in enumerate(range(run.first, run.first + run.count)):
                for call_index, rows in entries:
                    work[call_index].state.lengths[head] = work[call_index].end
                    if output is None:
                        continue
                    # A run of one head and one call (a decode step's usual): its output
                    # as it is, as each tensor operation costs more than its work here.
                    whole = output.shape[0] == 1 and rows == slice(0, output.shape[1])
                    mine = output if whole else output[member : member + 1, rows]
                    logits[call_index][head] = mine
        return logits

    def _fixed_shapes(self, runs: list[HeadRun]) -> list[torch.Tensor] | None:
        """Each run's logits [count, N, V] in one fixed-shape step per run (`self.graphs`),
        a row per position, padded to a recorded size, when every run scores all of its N
        positions (nothing to catch up) and holds at most MAX_STATIC_ROWS; else None."""
        if self.graphs is None or not runs:
            return None
        for run in runs:
            every_row = isinstance(run.rows, slice) and run.rows == slice(None)
            if not every_row or sum(s.length for s in run.segments) > MAX_STATIC_ROWS:
                return None
        outputs = []
        for run in runs:
            rows = []
            for segment in run.segments:
                segment.cache.check_append(segment.start, segment.length)
                slot = segment.cache.slot
                rows += [(slot, segment.start + i) for i in range(segment.length)]
            members = run.members
            keys, values = self.pool.keys[:, members], self.pool.values[:, members]
            make = partial(heads_step, self.model.heads, keys, values, members=members)
            key = ("jury", run.first, run.count)
            output = self.graphs.run(key, make, rows, self.pool.capacity, run.hidden)
            # A copy: another run's replay may reuse the memory of this one's buffers.
            outputs.append(output[:, : len(rows)].clone())
            for segment in run.segments:
                segment.cache.advance(segment.length)
        return outputs

    def _plan(self, work: list[_Work]) -> list[tuple[HeadRun, list[tuple[int, slice]]]]:
        """The head runs of a batch: consecutive hosted heads with the same work (the same
        calls, each from the same cache length) run as one stack. Each run with, per call
        it serves, (call index, slice of the run's logit rows)."""
        needs: list[tuple[tuple[int, int], ...]] = []
        for head in range(len(self.hosted)):
            needs.append(
                tuple(
                    (index, item.state.lengths[head])
                    for index, item in enumerate(work)
                    if head in item.heads
                )
            )
        placed = []
        head = 0
        while head < len(self.hosted):
            count = 1
            while head + count < len(self.hosted) and needs[head + count] == needs[head]:
                count += 1
            if needs[head]:
                placed.append(self._head_run(work, head, count, needs[head]))
            head += count
        return placed

    def _head_run(
        self, work: list[_Work], first: int, count: int, need: tuple[tuple[int, int], ...]
    ) -> tuple[HeadRun, list[tuple[int, slice]]]:
        members = slice(first, first + count)
        pieces, segments, rows, entries = [], [], [], []
        offset = scored = 0
        for index, held in need:
            item = work[index]
            length = item.end - held
            # The call's own rows, just stored, where the head has nothing to catch up.
            caught_up = length == len(item.rows)
            pieces.append(item.rows if caught_up else item.state.hidden[held : item.end])
            segments.append(Segment(item.state.cache.members(members, held), held, length))
            rows.append((offset + length - item.scored, offset + length))
            entries.append((index, slice(scored, scored + item.scored)))
            catch_up = length - item.scored
            self.counters.head_positions += count * item.scored
            self.counters.catch_up_positions += count * catch_up
            offset += length
            scored += item.scored
        self.counters.head_runs += count
        hidden = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return HeadRun(first, count, hidden, segments, _rows(rows, scored, offset)), entries

    def prefill(self, call: JuryPrefillCall) -> None:
        """Hidden states of positions start.. kept; the caches of the hosted heads among
        `call.heads` filled with them."""
        self.prefill_batch([call])

    def prefill_batch(self, calls: list[JuryPrefillCall]) -> list[None]:
        """Several sessions' prefills in one ragged forward."""
        for call in calls:
            self._check_names("heads", call.heads)
        self._run(calls, [self._heads(call.heads) for call in calls], scored=False)
        return [None] * len(calls)

    def score(self, call: ScoreCall) -> ScoreResult:
        return self.score_batch([call])[0]

    def score_batch(self, calls: list[ScoreCall]) -> list[ScoreResult]:
        """Several sessions' score calls in one ragged forward of the heads they name."""
        for call in calls:
            self._check_names("jury", call.heads)
        logits = self._run(calls, [self._heads(call.heads) for call in calls], scored=True)
        return [self._result(call, rows) for call, rows in zip(calls, logits, strict=True)]

    def _result(self, call: ScoreCall, logits: dict[int, torch.Tensor]) -> ScoreResult:
        """The partial product, votes (and amateur) of one call's logits by head."""
        members = self._heads(call.jury)
        rows, vocab = call.hidden.rows, self.model.config.vocab_size
        if len(members) == 1:  # as it is: joining would copy the vocabulary-wide rows
            juror_logits = logits[members[0]]
        elif members:
            juror_logits = torch.cat([logits[i] for i in members])
        else:
            juror_logits = torch.zeros(0, rows, vocab)  # [J, γ, V]
        log_product, votes = partial_log_product_and_votes(
            juror_logits, call.temperature, call.beta
        )
        decision = None
        if call.with_decision:
            decision = (
                log_product
                if call.temperature in (0.0, 1.0)
                else partial_log_product(juror_logits, 1.0, call.beta)
            )
        amateur = None
        if call.amateur in self.hosted:
            amateur = draft_logprobs(logits[self.hosted.index(call.amateur)][0], call.temperature)
        return ScoreResult(
            log_product,
            decision,
            votes.T,  # [γ, J]
            tuple(self.hosted[i] for i in members),
            head_evaluations=rows * len(logits),
            amateur_logprobs=amateur,
        )


def _rows(spans: list[tuple[int, int]], scored: int, total: int) -> torch.Tensor | slice | None:
    """The rows a run's logits are wanted at, from each call's (first, end): None for
    none, every row as a slice (a decode step's usual run: no copy), else their indices."""
    if not scored:
        return None
    if scored == total:
        return slice(None)
    return torch.cat([torch.arange(first, end) for first, end in spans])
