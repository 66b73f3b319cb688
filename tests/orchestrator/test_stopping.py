"""Stop conditions (`orchestrator.stopping`) on a character-level tokenizer: where a round
is cut, why the generation ends, and what text is handed out."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from hydra_jury.orchestrator.detokenizer import IncrementalDetokenizer
from hydra_jury.orchestrator.output import FinishReason, Progress
from hydra_jury.orchestrator.request import GenerationRequest
from hydra_jury.orchestrator.stopping import StopConditions, stop_prefix_length
from tests.models import save_tokenizer

EOS = 2  # "</s>" in tests.models' vocabulary


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(directory, 40)
    return AutoTokenizer.from_pretrained(str(directory))


def conditions(tokenizer, **options) -> StopConditions:
    request = GenerationRequest(prompt="hi", **{"max_new_tokens": 50, **options})
    return StopConditions(request, {EOS}, IncrementalDetokenizer(tokenizer), Progress())


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def commit(stopping: StopConditions, tokens: list[int]) -> tuple[list[int], FinishReason | None]:
    """What the engine does with a round's tokens: push, append, then hand out text."""
    kept, finish = stopping.push(tokens)
    stopping.progress.generated += kept
    stopping.progress.finish_reason = finish
    return kept, finish


def test_a_stop_sequence_across_rounds_cuts_the_text_and_the_round(tokenizer):
    stopping = conditions(tokenizer, stop=["cd"])
    assert commit(stopping, ids(tokenizer, "abc")) == (ids(tokenizer, "abc"), None)
    assert stopping.delta() == "ab"  # "c" may begin the stop sequence: held back
    kept, finish = commit(stopping, ids(tokenizer, "de"))
    assert (kept, finish) == (ids(tokenizer, "d"), FinishReason.STOP)
    assert stopping.progress.text == "ab"
    assert stopping.delta() == ""


def test_a_held_back_tail_is_sent_once_it_cannot_begin_a_stop(tokenizer):
    stopping = conditions(tokenizer, stop=["cat"])
    commit(stopping, ids(tokenizer, "a ca"))
    assert stopping.delta() == "a "
    commit(stopping, ids(tokenizer, "b"))
    assert stopping.delta() == "cab"


def test_end_of_sequence_cuts_after_it_and_the_limit_ends_the_generation(tokenizer):
    stopping = conditions(tokenizer)
    tokens = [*ids(tokenizer, "ab"), EOS, *ids(tokenizer, "c")]
    assert commit(stopping, tokens) == (tokens[:3], FinishReason.EOS)
    assert stopping.delta() == "ab"

    ignoring = conditions(tokenizer, ignore_eos=True, max_new_tokens=5)
    assert commit(ignoring, tokens) == (tokens, None)
    assert commit(ignoring, ids(tokenizer, "d")) == (ids(tokenizer, "d"), FinishReason.LENGTH)
    assert ignoring.delta() == "abcd"


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("the ca", ["cat"], 2),
        ("the cat", ["cat"], 0),  # a whole stop is not a proper prefix
        ("xa", ["ab", "abc"], 1),
        ("", ["ab"], 0),
        ("abc", [], 0),
    ],
)
def test_stop_prefix_length(text, stops, expected):
    assert stop_prefix_length(text, stops) == expected
