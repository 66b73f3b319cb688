"""The draft model: a Hydra checkpoint's trunk and first head as one causal LM, checked
against `transformers`, and refused when it does not share the target's tokenizer."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hydra_jury.hydra_model import CheckpointError, DraftCache, DraftModel
from tests.models import draft_model_logits, load_hf_model


def test_the_draft_model_is_its_source_model(draft_model, jury_checkpoint):
    """Logits of every position equal the `transformers` model it was built from, in one
    pass and fed in two chunks through its caches."""
    reference = load_hf_model(jury_checkpoint.parent / "base")
    tokens = [1, 5, 9, 3, 7, 7, 2, 11]
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0]
    model = draft_model.model
    cache = DraftCache(model.trunk_cache(16), model.head_cache(1, 16))
    whole = draft_model.forward(torch.tensor(tokens), cache, 0)
    torch.testing.assert_close(whole, expected, atol=1e-4, rtol=1e-4)
    cache.truncate(3)
    rest = draft_model.forward(torch.tensor(tokens[3:]), cache, 3)
    torch.testing.assert_close(rest, expected[3:], atol=1e-4, rtol=1e-4)
    assert cache.length == len(tokens)
    # The next token's logits alone: the same caches, the last row.
    cache.truncate(2)
    last = draft_model.next_token_logits(torch.tensor(tokens[2:]), cache, 2)
    torch.testing.assert_close(last, expected[-1:], atol=1e-4, rtol=1e-4)
    assert cache.length == len(tokens)
    cache.truncate(5)
    rest = draft_model.forward(torch.tensor(tokens[5:]), cache, 5)  # the caches held
    torch.testing.assert_close(rest, expected[5:], atol=1e-4, rtol=1e-4)
    assert torch.equal(draft_model_logits(draft_model, tokens).float(), whole[-1])
    assert draft_model.vocab_size == 32
    assert "4 layers" in draft_model.description


def test_a_draft_model_must_share_the_tokenizer(
    draft_model, jury_model, hydra_checkpoints, tmp_path
):
    draft_model.check_compatible(jury_model)  # the same tokenizer: accepted
    other_vocabulary = DraftModel.load(hydra_checkpoints["llama"])  # 40 tokens, not 32
    with pytest.raises(CheckpointError, match=r"vocabulary of 40 tokens.*has 32"):
        other_vocabulary.check_compatible(jury_model)
    changed = tmp_path / "draft"
    shutil.copytree(draft_model.model.directory, changed)
    path = changed / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    first, second = list(vocab)[5:7]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # two ids swapped
    path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="tokenizer differs"):
        DraftModel.load(changed).check_compatible(jury_model)


def test_a_draft_model_is_a_trunk_and_one_head(jury_model):
    with pytest.raises(ValueError, match="exactly one head"):
        DraftModel(jury_model)  # four heads
