"""A request cancelled at any moment (its deadline, its client gone) gives its session's
lease back: while the lease is being taken, and while a generation winds up even when
the cancellation is repeated."""

from __future__ import annotations

import asyncio

import pytest

from hydra_jury.orchestrator.engine import Engine
from hydra_jury.orchestrator.local_backend import LocalBackend
from hydra_jury.orchestrator.request import GenerationRequest
from hydra_jury.orchestrator.sessions.memory_store import MemoryStore
from hydra_jury.orchestrator.sessions.runner import SessionRunner
from hydra_jury.workers.sessions import SessionLimits


class SlowAcquire(MemoryStore):
    """Takes the lease, then takes its time to answer (a slow round trip to Redis)."""

    async def acquire(self, session_id: str, owner: str, key_name: str = ""):
        acquired = await super().acquire(session_id, owner, key_name)
        await asyncio.sleep(0.2)
        return acquired


def request(tokens: int) -> GenerationRequest:
    return GenerationRequest(
        prompt="hi", max_new_tokens=tokens, temperature=0.0, ignore_eos=True, drafter="head"
    )


async def consume(runner: SessionRunner, session_id: str, tokens: int) -> int:
    count = 0
    async for committed in runner.generate(request(tokens), session_id=session_id):
        count += len(committed.round.tokens)
    return count


@pytest.fixture
def runner_of(jury_model, tokenizer):
    def make(store: MemoryStore) -> SessionRunner:
        backend = LocalBackend(jury_model, limits=SessionLimits(2, 128))
        return SessionRunner(Engine(backend, tokenizer), store)

    return make


def test_a_lease_taken_while_the_request_is_cancelled_is_given_back(runner_of):
    async def scenario() -> int:
        runner = runner_of(SlowAcquire())
        session_id = await runner.create_session(None)
        task = asyncio.ensure_future(consume(runner, session_id, 4))
        await asyncio.sleep(0.05)  # the lease is taken, the answer not back yet
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.3)  # the acquisition ends; its lease goes back
        try:
            return await consume(runner, session_id, 2)  # not busy
        finally:
            await runner.close()

    assert asyncio.run(scenario()) == 2


def test_a_repeated_cancellation_still_gives_the_lease_back(runner_of):
    async def scenario() -> int:
        runner = runner_of(MemoryStore())
        session_id = await runner.create_session(None)
        task = asyncio.ensure_future(consume(runner, session_id, 120))
        await asyncio.sleep(0.1)  # generating
        for _ in range(3):  # cancelled again while it winds up
            task.cancel()
            await asyncio.sleep(0)
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):  # the wind-up finishes in the background
            try:
                return await consume(runner, session_id, 2)
            except Exception as error:
                if "busy" not in str(error):
                    raise
                await asyncio.sleep(0.05)
        raise AssertionError("the session stayed busy")

    assert asyncio.run(scenario()) == 2
