"""Beam search over the PoE target: the bookkeeping on hand-made distributions, the
engine against an exhaustive search and against a cache-free reference on a tiny model,
the same result over gRPC, and the options it conflicts with."""

from __future__ import annotations

import math

import grpc
import pytest
import torch

from hydra_jury.orchestrator.engine import Engine
from hydra_jury.orchestrator.local_backend import LocalBackend
from hydra_jury.orchestrator.request import GenerationRequest, RequestError
from hydra_jury.poe.beam import Beam, BeamSearch
from hydra_jury.protos.hydrajury.v1 import generation_pb2
from hydra_jury.workers.sessions import SessionLimits
from tests.grpc_stack import Stack
from tests.models import next_token_logits

EOS = 2  # the tiny tokenizer's end-of-sequence id


@pytest.fixture(scope="module")
def beam_engine(jury_model) -> Engine:
    """Room for 32 beams (a cache slot each)."""
    backend = LocalBackend(jury_model, limits=SessionLimits(33, 64))
    return Engine(backend, jury_model.load_tokenizer())


def target_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """[V] float64 log-probabilities of the PoE target over every head (β = 1, T = 1),
    from a cache-free forward."""
    logits = next_token_logits(model, tokens)
    return torch.log_softmax(torch.log_softmax(logits, -1).sum(0), -1)


def beams(prompt: str, **options) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, temperature=0.0, seed=0, **options)


def test_the_bookkeeping_on_hand_made_distributions():
    """Two beams, four tokens, token 3 ends a sequence."""
    log = math.log
    search = BeamSearch(2, 1.0, False, max_new_tokens=3, eos_token_ids=frozenset({3}))
    search.step(torch.tensor([[log(0.5), log(0.3), log(0.1), log(0.1)]]))
    assert [beam.tokens for beam in search.live] == [(0,), (1,)]
    # Ranked: (0,3) 0.5·0.6, (1,0) 0.3·0.9, (0,0) 0.5·0.2, ...: the end-of-sequence
    # extension ranks first, so it is kept; the next two live on.
    search.step(torch.tensor([[0.2, 0.1, 0.1, 0.6], [0.9, 0.05, 0.03, 0.02]]).log())
    assert [h.tokens for h in search.finished] == [(0, 3)]
    assert search.finished[0].score == pytest.approx(log(0.3) / 2)
    assert [beam.tokens for beam in search.live] == [(1, 0), (0, 0)]
    assert not search.done
    search.step(torch.full((2, 4), log(0.25)))
    assert search.done and not search.live  # the token limit: live beams are finished
    assert [h.tokens for h in search.best()] == [(0, 3), (1, 0, 0)]  # the best two of three
    assert search.best()[1].score == pytest.approx(log(0.27 * 0.25) / 3)


def test_a_wide_step_ranks_equal_sums_by_beam_then_token():
    """4 beams over 4,096 tokens, where the step finds its 2·num_beams extensions without
    sorting all 16,384: equal sums (beams 0 and 1 tie, and so do many tokens of the row)
    rank by the earlier beam, then the lower token, as one stable sort of them all does."""
    generator = torch.Generator().manual_seed(0)
    row = ((torch.randn(4096, generator=generator) * 4).round() / 2).log_softmax(-1)
    eos = int(row.argmax())  # the end of a sequence ranks among the first
    search = BeamSearch(4, 1.0, False, max_new_tokens=5, eos_token_ids=frozenset({eos}))
    search.live = [Beam((10,), 0.0), Beam((11,), 0.0), Beam((12,), -0.5), Beam((13,), -1.0)]
    sums = torch.tensor([beam.logprob for beam in search.live], dtype=torch.float64)
    totals = (sums[:, None] + row.double()).flatten()
    ranked = torch.sort(totals, descending=True, stable=True).indices.tolist()
    live, finished = [], []
    for rank, flat in enumerate(ranked):
        parent, token = divmod(flat, 4096)
        tokens = (*search.live[parent].tokens, token)
        if token == eos:
            finished += [tokens] if rank < 4 else []
        elif len(live) < 4:
            live.append(tokens)
    search.step(row.expand(4, -1))
    assert [beam.tokens for beam in search.live] == live
    assert [hypothesis.tokens for hypothesis in search.finished] == finished
    assert finished == [(10, eos), (11, eos)]  # beams 0 and 1 tie: the earlier first
    assert len({totals[ranked[i]].item() for i in range(8)}) < 8  # ties among the first


@pytest.mark.parametrize("early_stopping", [True, False])
def test_early_stopping_stops_at_num_beams_hypotheses(early_stopping):
    """Two hypotheses are finished after the second step while a live beam could still
    beat the worse one: early stopping ends the search there, the default goes on."""
    log, tiny = math.log, 1e-9
    search = BeamSearch(2, 1.0, early_stopping, max_new_tokens=5, eos_token_ids=frozenset({3}))
    search.step(torch.tensor([[0.45, 0.25, tiny, 0.30]]).log())
    assert [beam.tokens for beam in search.live] == [(0,), (1,)]
    assert [h.tokens for h in search.finished] == [(3,)]  # ranked second: kept
    search.step(torch.tensor([[tiny, tiny, 0.2, 0.8], [tiny, tiny, 0.9, 0.1]]).log())
    assert [h.tokens for h in search.best()] == [(0, 3), (3,)]
    assert [beam.tokens for beam in search.live] == [(1, 2), (0, 2)]
    # The worse hypothesis scores log 0.30; the best live beam log 0.225 / 2 already.
    assert log(0.30) < log(0.45 * 0.5) / 2
    assert search.done == early_stopping


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.5])
def test_enough_beams_find_the_exhaustive_best(beam_engine, jury_model, length_penalty):
    """With 32 beams over a 32-token vocabulary and 2 new tokens, beam search keeps every
    candidate that can win: its best hypothesis is the best of every sequence of at most
    two tokens (ended by an end-of-sequence token or the limit), found by brute force."""
    prompt = "the ca"
    context = beam_engine.tokenizer.encode(prompt, add_special_tokens=False)
    first = target_logprobs(jury_model, context)
    candidates = []
    for x1 in range(len(first)):
        if x1 == EOS:
            candidates.append(((x1,), float(first[x1])))
            continue
        second = target_logprobs(jury_model, [*context, x1])
        candidates += [((x1, x2), float(first[x1] + second[x2])) for x2 in range(len(second))]
    scored = [(tokens, total / len(tokens) ** length_penalty) for tokens, total in candidates]
    expected_tokens, expected_score = max(scored, key=lambda item: item[1])
    output = beam_engine.generate(
        beams(prompt, num_beams=32, max_new_tokens=2, length_penalty=length_penalty)
    )
    assert tuple(output.token_ids) == expected_tokens
    assert output.beam_score == pytest.approx(expected_score, abs=1e-4)
    assert output.stats["rounds_by_drafter"] == {"beam": 1}
    assert {record.kind for record in output.tokens} == {"beam"}


def reference_beam_search(model, context: list[int], request: GenerationRequest):
    """The same bookkeeping fed by cache-free forwards of every beam from scratch."""
    search = BeamSearch(
        request.num_beams,
        request.length_penalty,
        request.early_stopping,
        request.max_new_tokens,
        frozenset() if request.ignore_eos else frozenset({EOS}),
    )
    while not search.done:
        rows = [target_logprobs(model, context + list(beam.tokens)) for beam in search.live]
        search.step(torch.stack(rows))
    return search.best()


@pytest.mark.parametrize(
    "options",
    [
        {"num_beams": 3, "max_new_tokens": 8},
        {"num_beams": 4, "max_new_tokens": 8, "early_stopping": True},
        {"num_beams": 2, "max_new_tokens": 10, "length_penalty": -0.5},
        {"num_beams": 5, "max_new_tokens": 6, "ignore_eos": True},
    ],
    ids=["3-beams", "early-stopping", "short-favoured", "ignore-eos"],
)
def test_the_engine_equals_a_cache_free_reference(beam_engine, jury_model, options):
    """Forked, pruned and batched caches give what running every beam from scratch
    gives: the same hypotheses, in the same order, with the same scores."""
    prompt = "hello there"
    request = beams(prompt, return_beams=True, **options)
    context = beam_engine.tokenizer.encode(prompt, add_special_tokens=False)
    expected = reference_beam_search(jury_model, context, request)
    output = beam_engine.generate(request)
    assert [tuple(beam["token_ids"]) for beam in output.beams] == [h.tokens for h in expected]
    for beam, hypothesis in zip(output.beams, expected, strict=True):
        assert beam["score"] == pytest.approx(hypothesis.score, abs=1e-4)
    assert output.token_ids == list(expected[0].tokens)
    assert output.beam_score == output.beams[0]["score"]
    # Every beam slot but the request's own is freed.
    assert len(beam_engine.backend.trunk.sessions) == 0


def test_beam_search_is_deterministic_and_batched(beam_engine):
    request = beams("abcab", num_beams=4, max_new_tokens=12, ignore_eos=True)
    first, again = beam_engine.generate(request), beam_engine.generate(request)
    assert first.token_ids == again.token_ids and first.beam_score == again.beam_score
    # One trunk call per step over every live beam (plus the prompt's prefill and the
    # final settling of the request's own caches): not one per beam.
    calls = beam_engine.backend.trunk.counters.trunk_calls
    beam_engine.generate(request)
    assert beam_engine.backend.trunk.counters.trunk_calls - calls <= 12 + 2


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"rule": "cascade_diff"}, "conflicts with rule 'cascade_diff'"),
        ({"drafter": "ngram"}, "conflicts with drafter 'ngram'"),
        ({"gamma": 4}, "conflicts with gamma"),
        ({"top_k": 5, "top_p": 0.9}, "conflicts with top_k, top_p"),
        ({"contrastive_alpha": 0.1, "contrastive_amateur": "head3"}, "contrastive decoding"),
        ({"stop": ["."]}, "conflicts with stop sequences"),
        ({"num_beams": 0}, "num_beams must be a positive integer, got 0"),
        ({"num_beams": 1, "length_penalty": 2.0}, "set num_beams > 1"),
        ({"length_penalty": float("nan")}, "length_penalty must be finite"),
    ],
)
def test_conflicting_options_are_refused(beam_engine, options, message):
    request = GenerationRequest(**{"prompt": "hi", "num_beams": 3, **options})
    with pytest.raises(RequestError, match=message):
        beam_engine.start(request)


@pytest.fixture(scope="module")
def stack(jury_checkpoint, redis_url):
    stack = Stack(str(jury_checkpoint), [["head0", "head1"], ["head2", "head3"]], redis_url)
    stack.max_sessions = 6
    stack.start_services().start_orchestrator()
    yield stack
    stack.close()


def test_grpc_gives_the_in_process_beams(stack, beam_engine):
    options = {"num_beams": 3, "max_new_tokens": 8, "return_beams": True}
    expected = beam_engine.generate(beams("hello there", **options))
    message = generation_pb2.GenerateRequest(
        prompt="hello there",
        options=generation_pb2.DecodingOptions(temperature=0.0, seed=0, **options),
    )
    generation = stack.generation()
    response = generation.Generate(message, timeout=30)
    assert list(response.token_ids) == expected.token_ids
    assert response.beam_score == pytest.approx(expected.beam_score, abs=1e-5)
    assert [list(beam.token_ids) for beam in response.beams] == [
        beam["token_ids"] for beam in expected.beams
    ]
    streamed = list(generation.GenerateStream(message, timeout=30))
    assert len(streamed) == 1 and streamed[0].drafter == "beam"
    assert [t.token_id for t in streamed[0].tokens] == expected.token_ids
    assert streamed[0].beam_score == pytest.approx(expected.beam_score, abs=1e-5)
    assert len(streamed[0].beams) == len(expected.beams)


def test_grpc_refuses_conflicting_beam_options(stack):
    message = generation_pb2.GenerateRequest(
        prompt="hi", options=generation_pb2.DecodingOptions(num_beams=2, drafter="head")
    )
    with pytest.raises(grpc.RpcError) as raised:
        stack.generation().Generate(message, timeout=10)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "num_beams=2 conflicts with drafter 'head'" in raised.value.details()
