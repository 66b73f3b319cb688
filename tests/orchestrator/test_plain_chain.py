"""Non-speculative decoding in the single-process server runs each request's plain steps
as a chain on the model thread (`serving.plain_chain`): the tokens are those of steps
made in turn, whatever the reader's pace, and a generation that ends early (a stop
sequence, its deadline) stops its chain and leaves no step of it in flight."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from hydra_jury.orchestrator.engine import Engine
from hydra_jury.orchestrator.local_backend import LocalBackend
from hydra_jury.orchestrator.request import GenerationRequest
from hydra_jury.serving.batcher import BatchLimits
from hydra_jury.serving.errors import DeadlineExceeded
from hydra_jury.serving.model_thread import ModelThread
from hydra_jury.serving.plain_chain import MAX_UNTAKEN, PlainChain
from hydra_jury.workers.sessions import SessionLimits

LIMITS = SessionLimits(2, 128)


@pytest.fixture
def served(jury_model, tokenizer) -> Iterator[tuple[Engine, list[PlainChain]]]:
    """An engine over `serve`'s backend (batched calls on a model thread), and the
    chains its requests send."""
    backend = LocalBackend(
        jury_model, limits=LIMITS, thread=ModelThread("test-model"), batching=BatchLimits()
    )
    chains: list[PlainChain] = []
    send = backend.plain_chain
    backend.plain_chain = lambda chain: chains.append(chain) or send(chain)
    yield Engine(backend, tokenizer), chains
    backend.close()


def request(**options) -> GenerationRequest:
    values = {"prompt": "the cat sat on", "max_new_tokens": 24, "ignore_eos": True, "seed": 5}
    return GenerationRequest(rule="verifier_only", **{**values, **options})


@pytest.mark.parametrize(
    "options",
    [
        {"temperature": 0.0},
        {"temperature": 0.9, "top_p": 0.9},
        {"temperature": 0.8, "contrastive_amateur": "head3", "contrastive_alpha": 0.1},
    ],
    ids=["greedy", "sampled", "contrastive"],
)
def test_chained_steps_give_the_tokens_of_steps_made_in_turn(
    served, jury_model, tokenizer, options
):
    engine, chains = served
    alone = Engine(LocalBackend(jury_model, limits=LIMITS), tokenizer)  # no model thread
    expected = alone.generate(request(**options))
    output = engine.generate(request(**options))
    assert output.token_ids == expected.token_ids
    # One chain, sent after the first step, ran every later step.
    assert len(chains) == 1
    assert output.stats["drafts_ahead_used"] == output.stats["rounds"] - 1
    assert chains[0].ended.done()


def test_a_slow_reader_stops_the_chain_and_the_next_round_starts_another(served):
    engine, chains = served
    expected = engine.generate(request(temperature=0.9)).token_ids
    chains.clear()
    generation = engine.start(request(temperature=0.9))
    for _ in generation:
        time.sleep(0.05)  # far longer than a step of the tiny model
    assert generation.result().token_ids == expected
    # The model thread ran at most MAX_UNTAKEN steps the reader had not taken, and then
    # one more, which ended its chain; the next round made its step and sent another.
    ran = [steps_run(chain) for chain in chains]
    assert all(steps <= MAX_UNTAKEN + 1 for steps in ran), ran
    assert sum(ran) + len(chains) == 24  # each chain after a step of the round's own


def steps_run(chain: PlainChain) -> int:
    steps = 0
    while chain.step(steps).result(timeout=1) is not None:
        steps += 1
    return steps


def test_a_stop_sequence_stops_the_chain_and_nothing_stays_in_flight(served, jury_model, tokenizer):
    engine, chains = served
    alone = Engine(LocalBackend(jury_model, limits=LIMITS), tokenizer)
    full = alone.generate(request(temperature=0.0))
    stop = full.text[len(full.text) // 3 :][:3]  # cuts the text a third of the way in
    expected = alone.generate(request(temperature=0.0, stop=[stop]))
    assert expected.finish_reason == "stop"
    output = engine.generate(request(temperature=0.0, stop=[stop]))
    assert (output.token_ids, output.text) == (expected.token_ids, expected.text)
    assert len(chains) == 1 and chains[0].ended.done()
    backend = engine.backend
    assert backend.batchers.batchers["Draft"].pending == 0
    assert len(backend.trunk.sessions) == 0 and len(backend.jury.sessions) == 0


def test_a_deadline_reaches_a_chained_generation(served, monkeypatch):
    engine, chains = served
    publish = PlainChain.publish

    def slow(self, *args):
        time.sleep(0.02)
        return publish(self, *args)

    monkeypatch.setattr(PlainChain, "publish", slow)
    began = time.monotonic()
    with (
        engine.backend.call_scope(began + 0.2),
        pytest.raises(DeadlineExceeded, match="deadline"),
    ):
        engine.generate(request(max_new_tokens=100, temperature=0.0))
    assert time.monotonic() - began < 1.0  # not the 100 steps' 2 s
    assert len(chains) == 1 and chains[0].ended.done()
    assert len(engine.backend.trunk.sessions) == 0
