"""A round is committed while the next one computes, and still reaches the caller only
after its own commit."""

from __future__ import annotations

import asyncio

from hydra_jury.orchestrator.engine import Engine
from hydra_jury.orchestrator.local_backend import LocalBackend
from hydra_jury.orchestrator.request import GenerationRequest
from hydra_jury.orchestrator.sessions.memory_store import MemoryStore
from hydra_jury.orchestrator.sessions.runner import SessionRunner
from hydra_jury.workers.calls import DraftCall, DraftResult
from hydra_jury.workers.sessions import SessionLimits


class SlowCommits(MemoryStore):
    """The memory store, each commit 50 ms late (a slow round trip to Redis), with when
    each commit began and ended in `events`."""

    def __init__(self, events: list[tuple[str, int]]) -> None:
        super().__init__()
        self.events = events

    async def commit(self, record, **options) -> None:
        self.events.append(("commit begins", len(record.tokens)))
        await asyncio.sleep(0.05)
        await super().commit(record, **options)
        self.events.append(("commit ends", len(record.tokens)))


class LoggedDrafts(LocalBackend):
    def __init__(self, events: list[tuple[str, int]], *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.events = events

    def draft(self, call: DraftCall) -> DraftResult:
        self.events.append(("draft", call.start))
        return super().draft(call)


def test_rounds_compute_while_the_previous_commits_and_are_sent_after_theirs(jury_model, tokenizer):
    events: list[tuple[str, int]] = []
    store = SlowCommits(events)
    backend = LoggedDrafts(events, jury_model, limits=SessionLimits(2, 128))
    runner = SessionRunner(Engine(backend, tokenizer), store)
    request = GenerationRequest(
        prompt="hi", max_new_tokens=12, temperature=0.0, ignore_eos=True, gamma=2, drafter="head"
    )

    async def scenario() -> tuple[int, list[int]]:
        session_id = await runner.create_session(None)
        sent: list[int] = []
        try:
            async for committed in runner.generate(request, session_id=session_id):
                sent += [token.token_id for token in committed.round.tokens]
                stored = await store.load(session_id)
                # in the store before the caller sees it
                assert stored.tokens[len(stored.tokens) - len(sent) :] == sent
                events.append(("sent", len(sent)))
            return len(sent), (await store.load(session_id)).tokens
        finally:
            await runner.close()

    count, tokens = asyncio.run(scenario())
    assert count == 12 and len(tokens) > 12
    # The first commit writes the turn's context; one commit per round follows.
    begins = [i for i, (kind, _n) in enumerate(events) if kind == "commit begins"][1:]
    ends = [i for i, (kind, _n) in enumerate(events) if kind == "commit ends"][1:]
    assert len(begins) == len(ends) >= 4
    # Round j's commit (50 ms) ends after round j + 1 began drafting (j + 2 drafts).
    drafts = [i for i, (kind, _n) in enumerate(events) if kind == "draft"]
    for j, ended in enumerate(ends[:-1]):
        assert sum(i < ended for i in drafts) == j + 2, events
    # Each round was sent after its commit ended, in order.
    sends = [i for i, (kind, _n) in enumerate(events) if kind == "sent"]
    assert len(sends) == len(ends)
    assert all(end < send for end, send in zip(ends, sends, strict=True))
