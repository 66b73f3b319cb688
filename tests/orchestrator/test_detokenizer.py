"""Incremental detokenization gives the text of a whole-sequence decode, a window at a
time, holding back split multi-byte characters."""

from __future__ import annotations

import random

import pytest

from hydra_jury.orchestrator.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A byte-level tokenizer with no merges: one token per UTF-8 byte, so a character
    outside ASCII takes several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE({symbol: i for i, symbol in enumerate(alphabet)}, []))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core)


def test_a_split_character_is_held_back_until_complete(byte_tokenizer):
    tokens = byte_tokenizer.encode("é", add_special_tokens=False)
    assert len(tokens) == 2
    detokenizer = IncrementalDetokenizer(byte_tokenizer)
    assert detokenizer.push(tokens[:1]) == ""
    assert detokenizer.push(tokens[1:]) == "é"


@pytest.mark.parametrize("seed", range(5))
def test_pushes_add_up_to_the_whole_decode(byte_tokenizer, seed):
    text = "Grüße, 世界! naïve café — ok 🙂 end"
    tokens = byte_tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(seed)
    detokenizer, pieces, at = IncrementalDetokenizer(byte_tokenizer), [], 0
    while at < len(tokens):
        size = rng.randint(1, 4)
        pieces.append(detokenizer.push(tokens[at : at + size]))
        at += size
    assert "".join(pieces) + detokenizer.flush() == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_flush_gives_an_incomplete_character_as_a_whole_decode_would(byte_tokenizer):
    tokens = byte_tokenizer.encode("aé", add_special_tokens=False)[:-1]
    detokenizer = IncrementalDetokenizer(byte_tokenizer)
    assert detokenizer.push(tokens[:1]) == "a"
    assert detokenizer.push(tokens[1:]) == ""
    assert detokenizer.flush() == byte_tokenizer.decode(tokens)[1:] == "\ufffd"
