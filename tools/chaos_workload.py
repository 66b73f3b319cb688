"""The sessions `tools.chaos` runs during each fault: seeded multi-turn chat sessions,
streamed through `GenerationClient` (which resumes them), each turn's received rounds
checked against the session's record in Redis.

A round the client received was committed first (docs/sessions.md), so every token of it
must sit at its position in the record's committed tokens; a round that does not (or
whose session is gone) is a committed round lost."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from hydra_jury.orchestrator.client import GenerationClient, ResumeError, RetryPolicy
from hydra_jury.orchestrator.sessions.record import SessionRecord
from hydra_jury.orchestrator.sessions.redis_store import RedisStore
from hydra_jury.protos.hydrajury.v1 import generation_pb2
from hydra_jury.serving.errors import ServiceUnavailable

OPTIONS = {"temperature": 0.9, "top_k": 12, "gamma": 4, "ignore_eos": True}
TIMEOUT_S = 60.0
# Backoff long enough to outlast a restart of a few seconds (the client's deadline bounds it).
RETRY = RetryPolicy(attempts=10, backoff_s=0.2, max_backoff_s=2.0)


@dataclass
class Turn:
    session: int
    turn: int
    rounds: list[list[tuple[int, int]]] = field(default_factory=list)  # (position, id)
    began: float = 0.0
    ended: float = 0.0
    error: str = ""  # the status code's name; "" when it completed
    resumed: int = 0  # attempts the client sent again
    lost: int = 0  # received rounds the record did not hold right after the turn

    @property
    def token_ids(self) -> list[int]:
        return [token for round_ in self.rounds for _, token in round_]


@dataclass
class SessionRun:
    index: int
    session_id: str = ""
    turns: list[Turn] = field(default_factory=list)


def request(index: int, turn: int, session_id: str, new_tokens: int):
    """Turn `turn` of session `index`: the same text and seed in every run."""
    return generation_pb2.GenerateRequest(
        messages=generation_pb2.ChatMessages(
            messages=[generation_pb2.ChatMessage(role="user", content=f"turn {turn} of {index}")]
        ),
        session_id=session_id,
        options=generation_pb2.DecodingOptions(
            seed=1000 * index + turn, max_new_tokens=new_tokens, **OPTIONS
        ),
    )


def run_session(
    addresses: list[str],
    redis_url: str,
    index: int,
    turns: int,
    new_tokens: int,
    deadline: float,
) -> SessionRun:
    """One session's turns, until one fails or `deadline` passes, each checked against
    the record right after it (before the next turn rewrites the record's tokens)."""
    run = SessionRun(index)
    with GenerationClient(addresses, timeout_s=TIMEOUT_S, retry=RETRY) as client:
        try:
            run.session_id = client.create_session()
        except grpc.RpcError as error:
            run.turns.append(Turn(index, 0, error=error.code().name))
            return run
        for number in range(turns):
            if time.monotonic() > deadline:
                break
            turn = Turn(index, number, began=time.monotonic())
            run.turns.append(turn)
            before = client.resumed
            try:
                for message in client.generate_stream(
                    request(index, number, run.session_id, new_tokens)
                ):
                    turn.rounds.append([(t.position, t.token_id) for t in message.tokens])
            except grpc.RpcError as error:
                turn.error = error.code().name
            except ResumeError:
                turn.error = "RESUME_GAP"
            turn.ended, turn.resumed = time.monotonic(), client.resumed - before
            turn.lost = rounds_lost(turn.rounds, load_record(redis_url, run.session_id))
            if turn.error:
                break
    return run


def load_record(redis_url: str, session_id: str, timeout_s: float = 20.0) -> SessionRecord | None:
    """The session's record as Redis holds it now (None: gone), waiting out a Redis
    that is being restarted."""

    async def load() -> SessionRecord | None:
        store = RedisStore(redis_url)
        try:
            return await store.load(session_id)
        finally:
            await store.close()

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return asyncio.run(load())
        except ServiceUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def rounds_lost(rounds: list[list[tuple[int, int]]], record: SessionRecord | None) -> int:
    """Of `rounds`, those whose tokens the record does not hold at their positions."""
    if record is None:
        return len(rounds)
    return sum(
        any(
            position >= len(record.tokens) or record.tokens[position] != token
            for position, token in round_
        )
        for round_ in rounds
    )
