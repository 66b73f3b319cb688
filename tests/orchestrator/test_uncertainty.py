"""The uncertainty head end to end: the witness rule and p_correct in the worker, the
same verdict in-process, through the split stack (unary and stream) and the
single-process server, the CLI, and the refusals without an uncertainty head."""

from __future__ import annotations

import grpc
import pytest
import torch

from hydra_jury.cli import main
from hydra_jury.hydra_model import HydraModel
from hydra_jury.hydra_model.build.demo_corpus import continue_prompts, greedy_product
from hydra_jury.hydra_model.layers import Segment
from hydra_jury.hydra_model.uncertainty import (
    check_hidden,
    check_hiddens,
    check_tokens,
    find_witness,
    load_uncertainty_head,
    verdict_tokens,
    witness_from,
)
from hydra_jury.orchestrator.engine import Engine
from hydra_jury.orchestrator.local_backend import LocalBackend
from hydra_jury.orchestrator.request import GenerationRequest, RequestError
from hydra_jury.protos.hydrajury.v1 import generation_pb2
from hydra_jury.workers.calls import UncertaintyCall
from hydra_jury.workers.errors import InvalidArgument
from hydra_jury.workers.sessions import SessionLimits
from hydra_jury.workers.trunk import TrunkWorker
from tests.grpc_stack import Stack
from tests.models import build_hydra, fine_tune_top_layers, next_token_logits, save_hf_model

QUESTION = "which is larger?\nA) two\nB) ten\nReply with the letter."
MESSAGES = [{"role": "user", "content": QUESTION}]
OPTIONS = dict(max_new_tokens=6, temperature=0.0, seed=0, uncertainty=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Three heads that differ (fine-tunes), an uncertainty head, the letters A-D."""
    root = tmp_path_factory.mktemp("judged")
    base = save_hf_model(root / "base", "llama", seed=5, vocab_size=40, logit_scale=10.0)
    tunes = []
    for index in range(2):
        fine_tune_top_layers(base, root / f"tune{index}", trunk_layers=2, seed=50 + index)
        tunes.append(str(root / f"tune{index}"))
    return build_hydra(
        base, root / "hydra", trunk_layers=2, heads=3, head_from=tunes, uncertainty_head=True
    )


@pytest.fixture(scope="module")
def model(checkpoint):
    return HydraModel.load(checkpoint)


@pytest.fixture(scope="module")
def engine(model):
    return Engine(LocalBackend(model, limits=SessionLimits(2, 256)), model.load_tokenizer())


def reference_p_correct(model, prompt: list[int], answer: list[int], check: list[int]):
    """The witness and p_correct computed here step by step from whole forwards."""
    probabilities = torch.softmax(next_token_logits(model, prompt), -1)[:, answer[0]]
    witness = int(probabilities.argmax())
    with torch.inference_mode():
        hidden = model.trunk.forward(torch.tensor(prompt), model.trunk_cache(len(prompt)), 0)
        _, states = model.heads.forward(
            hidden, model.head_cache(model.heads.size, len(prompt)), 0, return_hidden=True
        )
        trunk = model.trunk.forward(torch.tensor(check), model.trunk_cache(len(check)), 0)
        trunk[-1] += states[witness, -1]
        head = load_uncertainty_head(model)
        logits = head.forward(trunk, model.head_cache(1, len(check)), 0)[0, -1]
    a, b = verdict_tokens(model.load_tokenizer())
    return model.head_names[witness], float(torch.sigmoid(logits[a] - logits[b]))


def test_the_engine_reports_the_uncertainty_heads_verdict(engine, model):
    output = engine.generate(GenerationRequest(messages=MESSAGES, **OPTIONS))
    tokenizer = model.load_tokenizer()
    prompt = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    check = check_tokens(tokenizer, QUESTION, output.text)
    witness, expected = reference_p_correct(model, prompt, output.token_ids, check)
    assert output.witness_head == witness
    assert output.p_correct == pytest.approx(expected, abs=1e-5)
    assert 0 < output.p_correct < 1
    # Without the option nothing is judged.
    plain = engine.generate(
        GenerationRequest(messages=MESSAGES, **{**OPTIONS, "uncertainty": False})
    )
    assert plain.p_correct is None and plain.token_ids == output.token_ids


def test_the_witness_is_the_head_most_sure_of_the_first_token(model):
    worker = TrunkWorker(model)
    prompt = torch.tensor([5, 9, 14, 20])
    probabilities = torch.softmax(next_token_logits(model, prompt.tolist()), -1)
    check = torch.tensor([3, 7, 8, 9, 4])
    verdict = verdict_tokens(model.load_tokenizer())
    for answer in range(model.config.vocab_size):
        result = worker.uncertainty(UncertaintyCall(prompt, answer, check, verdict))
        assert result.witness_head == model.head_names[int(probabilities[:, answer].argmax())]
    assert (
        len(
            {
                worker.uncertainty(UncertaintyCall(prompt, a, check, verdict)).witness_head
                for a in range(40)
            }
        )
        > 1
    )


def test_training_finds_the_witness_and_check_input_serving_finds(model):
    """Training builds its examples in ragged batches (the witness from the prefill that
    chose each answer, `check_hiddens`); serving judges one answer at a time
    (`find_witness`, `check_hidden`): the same witness and the same input."""
    prompts = [[5, 9, 14, 20], [3, 1], [7, 7, 2]]
    checks = [torch.tensor([3, 7, 8, 9, 4]), torch.tensor([2, 6]), torch.tensor([9, 1, 1])]
    answered = continue_prompts(model, model.heads, prompts, 3, greedy_product)
    witnesses = [
        witness_from(answered.first_logits[:, i], answered.first_states[:, i], answer[0])
        for i, answer in enumerate(answered.tokens)
    ]
    inputs = check_hiddens(model, checks, [w.hidden for w in witnesses])
    for prompt, answer, check, witness, hidden in zip(
        prompts, answered.tokens, checks, witnesses, inputs, strict=True
    ):
        alone = find_witness(model, torch.tensor(prompt), answer[0])
        assert witness.index == alone.index
        assert witness.probability == pytest.approx(alone.probability, abs=1e-6)
        torch.testing.assert_close(witness.hidden, alone.hidden, atol=1e-5, rtol=1e-5)
        expected = check_hidden(model, check, alone.hidden)
        torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=1e-5)


def test_bad_uncertainty_calls_are_refused(model, jury_model):
    verdict = verdict_tokens(model.load_tokenizer())
    worker = TrunkWorker(model)
    with pytest.raises(InvalidArgument, match="check: token id 40 is outside"):
        worker.uncertainty(UncertaintyCall(torch.tensor([5]), 6, torch.tensor([1, 40]), verdict))
    with pytest.raises(InvalidArgument, match="prompt: at least one token is required"):
        UncertaintyCall(torch.tensor([], dtype=torch.long), 6, torch.tensor([1]), verdict)
    with pytest.raises(InvalidArgument, match="verdict: two different token ids"):
        UncertaintyCall(torch.tensor([5]), 6, torch.tensor([1]), (7, 7))
    call = UncertaintyCall(torch.tensor([5]), 6, torch.tensor([1]), (7, 8))
    with pytest.raises(InvalidArgument, match="hosts no uncertainty head"):
        TrunkWorker(jury_model).uncertainty(call)
    # The engine refuses the option before any compute on a model without the head.
    engine = Engine(
        LocalBackend(jury_model, limits=SessionLimits(1, 64)), jury_model.load_tokenizer()
    )
    with pytest.raises(RequestError, match="the model has no uncertainty head"):
        engine.generate(GenerationRequest(prompt="abc", uncertainty=True))


@pytest.fixture(scope="module")
def stack(checkpoint, redis_url):
    stack = Stack(str(checkpoint), [["head0"], ["head1", "head2"]], redis_url)
    stack.start_services().start_orchestrator()
    yield stack
    stack.close()


def grpc_request(**changes) -> generation_pb2.GenerateRequest:
    message = generation_pb2.GenerateRequest(
        options=generation_pb2.DecodingOptions(**{**OPTIONS, **changes})
    )
    message.messages.messages.add(role="user", content=QUESTION)
    return message


def test_the_split_stack_gives_the_in_process_verdict(stack, engine):
    expected = engine.generate(GenerationRequest(messages=MESSAGES, **OPTIONS))
    generation = stack.generation()
    assert generation.Info(generation_pb2.GenerationInfoRequest()).uncertainty_head
    response = generation.Generate(grpc_request(), timeout=30)
    assert list(response.token_ids) == expected.token_ids
    assert response.p_correct == pytest.approx(expected.p_correct, abs=1e-5)
    assert response.witness_head == expected.witness_head
    last = list(generation.GenerateStream(grpc_request(), timeout=30))[-1]
    assert last.p_correct == pytest.approx(expected.p_correct, abs=1e-5)
    assert not generation.Generate(grpc_request(uncertainty=False), timeout=30).HasField(
        "p_correct"
    )


def test_the_single_process_server_gives_the_same_verdict(checkpoint, redis_url, engine):
    expected = engine.generate(GenerationRequest(messages=MESSAGES, **OPTIONS))
    stack = Stack(str(checkpoint), [], redis_url).start_embedded()
    try:
        response = stack.generation().Generate(grpc_request(), timeout=30)
        assert response.p_correct == pytest.approx(expected.p_correct, abs=1e-5)
    finally:
        stack.close()


def test_a_stack_without_an_uncertainty_head_refuses_the_option(jury_checkpoint, redis_url):
    stack = Stack(str(jury_checkpoint), [["head0", "head1", "head2", "head3"]], redis_url)
    stack.start_services().start_orchestrator()
    try:
        generation = stack.generation()
        assert not generation.Info(generation_pb2.GenerationInfoRequest()).uncertainty_head
        message = generation_pb2.GenerateRequest(
            prompt="abc", options=generation_pb2.DecodingOptions(uncertainty=True)
        )
        with pytest.raises(grpc.RpcError) as raised:
            generation.Generate(message, timeout=30)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "the model has no uncertainty head" in raised.value.details()
    finally:
        stack.close()


def test_the_command_line_prints_p_correct(checkpoint, capsys):
    argv = ["generate", "--local", "--checkpoint", str(checkpoint), "--chat", QUESTION]
    assert main([*argv, "--max-new-tokens", "4", "--temperature", "0", "--uncertainty"]) == 0
    err = capsys.readouterr().err
    assert "p_correct: 0." in err and "(witness head head" in err


def test_segments_without_a_cache_match_a_cached_forward(model):
    """The stateless pass runs cacheless segments: the same outputs as a cached forward."""
    tokens = torch.tensor([5, 9, 14, 20, 7])
    cached = model.trunk.forward(tokens, model.trunk_cache(5), 0)
    with torch.inference_mode():
        cacheless = model.trunk.forward_ragged(tokens, [Segment(None, 0, 5)])
    torch.testing.assert_close(cacheless, cached)
