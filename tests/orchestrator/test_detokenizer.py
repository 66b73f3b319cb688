"""Incremental detokenization gives the text of a whole-sequence decode, a window at a
time, holding back split multi-byte characters."""

from __future__ import annotations

import random

import pytest

from hydra_jury.orchestrator.detokenizer import IncrementalDetokenizer, TokenTexts, decoder


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
@pytest.mark.parametrize("cached", [False, True], ids=["decoded", "one-token texts cached"])
def test_pushes_add_up_to_the_whole_decode(byte_tokenizer, seed, cached):
    text = "Grüße, 世界! naïve café — ok 🙂 end"
    tokens = byte_tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(seed)
    texts = TokenTexts(byte_tokenizer, skip_special_tokens=True) if cached else None
    detokenizer, pieces, at = IncrementalDetokenizer(byte_tokenizer, texts=texts), [], 0
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


def test_a_tokens_text_is_decoded_once_and_is_the_tokenizers(byte_tokenizer):
    calls = []

    class Counting:
        def decode(self, tokens, skip_special_tokens=False):
            calls.append(list(tokens))
            return byte_tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    texts = TokenTexts(Counting())
    ids = byte_tokenizer.encode("é a é", add_special_tokens=False)
    assert [texts(token) for token in ids * 2] == [byte_tokenizer.decode([t]) for t in ids * 2]
    assert sorted(map(tuple, calls)) == sorted({(token,) for token in ids})
    with pytest.raises(ValueError, match="skip special tokens"):
        IncrementalDetokenizer(byte_tokenizer, texts=TokenTexts(byte_tokenizer))


@pytest.mark.parametrize("clean_up", [False, True])
def test_the_decoder_gives_the_tokenizers_own_text(byte_tokenizer, clean_up, monkeypatch):
    """The Rust tokenizer's decode, where the decoder takes it, gives transformers' text,
    special tokens kept or skipped; a tokenizer that cleans up spaces keeps its own."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=byte_tokenizer.backend_tokenizer,
        eos_token="<|end|>",
        clean_up_tokenization_spaces=clean_up,
    )
    decode = decoder(tokenizer)
    eos = tokenizer.convert_tokens_to_ids("<|end|>")
    ids = tokenizer.encode("a , b . é ' s n't 漢字 !", add_special_tokens=False)
    rng = random.Random(0)
    expected = []
    for _ in range(200):
        start = rng.randrange(len(ids))
        window = ids[start : start + rng.randint(1, 4)]
        window.insert(rng.randrange(len(window) + 1), eos)
        skip = rng.random() < 0.5
        expected.append((window, skip, tokenizer.decode(window, skip_special_tokens=skip)))
    if not clean_up:  # the fast path: transformers' decode is not called at all
        monkeypatch.setattr(tokenizer, "decode", None)
    assert [decode(window, skip) for window, skip, _ in expected] == [
        text for _, _, text in expected
    ]
