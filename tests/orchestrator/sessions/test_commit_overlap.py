"""Rounds are committed while the next ones compute, each still reaches the caller only
after its own commit, and rounds computed while a commit is in flight, or within the
commit interval, go with the next commit."""

from __future__ import annotations

import asyncio

from hydra_jury.orchestrator.engine import Engine
from hydra_jury.orchestrator.local_backend import LocalBackend
from hydra_jury.orchestrator.request import GenerationRequest
from hydra_jury.orchestrator.sessions.memory_store import MemoryStore
from hydra_jury.orchestrator.sessions.runner import SessionRunner
from hydra_jury.orchestrator.sessions.store import StoreSettings
from hydra_jury.workers.calls import DraftCall, DraftResult
from hydra_jury.workers.sessions import SessionLimits


class LoggedCommits(MemoryStore):
    """The memory store, each commit `delay_s` late (a slow round trip to Redis), with
    when each commit began and ended and how many rounds it carried in `events`."""

    def __init__(self, events: list, delay_s: float, settings: StoreSettings) -> None:
        super().__init__(settings)
        self.events, self.delay_s = events, delay_s

    async def commit(self, record, **options) -> None:
        carried = len(options.get("rounds", ()))
        self.events.append(("commit begins", carried))
        await asyncio.sleep(self.delay_s)
        await super().commit(record, **options)
        self.events.append(("commit ends", carried))


class LoggedDrafts(LocalBackend):
    def __init__(self, events: list, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.events = events

    def draft(self, call: DraftCall) -> DraftResult:
        self.events.append(("draft", call.start))
        return super().draft(call)


def generate(jury_model, tokenizer, store: LoggedCommits, request: GenerationRequest):
    """Runs `request` on a new session of `store`: the token ids of each round as the
    caller got them, and the rounds the store holds at the end. Each time a round
    arrives, the store must already hold its tokens."""
    backend = LoggedDrafts(store.events, jury_model, limits=SessionLimits(2, 128))
    runner = SessionRunner(Engine(backend, tokenizer), store)

    async def scenario() -> tuple[list[list[int]], list]:
        session_id = await runner.create_session(None)
        received: list[list[int]] = []
        try:
            async for committed in runner.generate(request, session_id=session_id):
                received.append([token.token_id for token in committed.round.tokens])
                stored = await store.load(session_id)
                generated = stored.tokens[stored.generation.context_length :]
                sent = [token for tokens in received for token in tokens]
                assert generated[: len(sent)] == sent  # in the store before the caller sees it
                store.events.append(("sent", len(received)))
            return received, await store.rounds(session_id)
        finally:
            await runner.close()

    return asyncio.run(scenario())


def test_rounds_compute_while_a_commit_is_in_flight_and_go_with_the_next(jury_model, tokenizer):
    events: list = []
    store = LoggedCommits(events, delay_s=0.05, settings=StoreSettings(commit_interval_s=0))
    request = GenerationRequest(
        prompt="hi", max_new_tokens=12, temperature=0.0, ignore_eos=True, gamma=2, drafter="head"
    )
    received, stored_rounds = generate(jury_model, tokenizer, store, request)
    assert sum(len(tokens) for tokens in received) == 12
    # Every round is stored, in order, whatever commit carried it.
    assert [[token["token_id"] for token in round_] for round_ in stored_rounds] == received
    # The first commit writes the turn's context; the rounds' commits follow.
    begins = [i for i, (kind, _n) in enumerate(events) if kind == "commit begins"][1:]
    ends = [i for i, (kind, _n) in enumerate(events) if kind == "commit ends"][1:]
    carried = [n for kind, n in events if kind == "commit ends"][1:]
    assert len(begins) == len(ends) >= 2 and sum(carried) == len(received)
    # A commit takes 50 ms, longer than a round of the tiny model: the model went on
    # drafting while the first round's commit was in flight (the round right after it
    # may have begun before the commit's task did), and the rounds computed meanwhile
    # went together.
    drafts = [i for i, (kind, _n) in enumerate(events) if kind == "draft"]
    assert any(begins[0] < i < ends[0] for i in drafts), events
    assert carried[0] == 1 and len(ends) < len(received) and max(carried) > 1
    # Each round was sent after the end of the commit that carried it, in order.
    sends = [i for i, (kind, _n) in enumerate(events) if kind == "sent"]
    commit_of_round = [c for c, n in enumerate(carried) for _ in range(n)]
    assert all(ends[c] < send for c, send in zip(commit_of_round, sends, strict=True))


def test_rounds_within_the_commit_interval_go_with_the_next_commit(jury_model, tokenizer):
    """With an interval longer than the whole request, the first round is committed at
    once and every other one with the last: two commits for 12 rounds, and the caller
    still gets every round, in order."""
    events: list = []
    store = LoggedCommits(events, delay_s=0, settings=StoreSettings(commit_interval_s=10))
    request = GenerationRequest(
        prompt="hi", max_new_tokens=12, temperature=0.0, ignore_eos=True, rule="verifier_only"
    )
    received, stored_rounds = generate(jury_model, tokenizer, store, request)
    assert len(received) == 12 and all(len(tokens) == 1 for tokens in received)
    assert [[token["token_id"] for token in round_] for round_ in stored_rounds] == received
    assert [n for kind, n in events if kind == "commit ends"][1:] == [1, 11]
