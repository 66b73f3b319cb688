"""Integration: the demo checkpoint built from the SmolLM2 GGUF greedy-decodes exactly what
`transformers` decodes from the same GGUF, and the demo's draft model is that model cut
short. In one file, so one process parses the GGUF once for all of them
(`sources._gguf_read_once` keeps the last file's reader: 5 s a parse on 2 cores)."""

from __future__ import annotations

import pytest
import torch

from hydra_jury.hydra_model import HydraModel
from hydra_jury.hydra_model.build.demo import (
    DRAFT_LAYERS,
    demo_gguf_path,
    ensure_demo_base,
    ensure_demo_draft,
)
from hydra_jury.hydra_model.build.sources import gguf_model

pytestmark = pytest.mark.slow
NEW_TOKENS = 24
TOLERANCE = 1e-4  # the draft model's logits against transformers'


@pytest.fixture(scope="module")
def demo_checkpoint(tmp_path_factory):
    return ensure_demo_base(
        tmp_path_factory.mktemp("demo") / "smollm2-hydra", log=lambda line: None
    )


def test_demo_checkpoint_layout(demo_checkpoint):
    model = HydraModel.load(demo_checkpoint)
    assert model.manifest.trunk_layers == 26 and model.config.num_layers == 30
    assert model.head_names == ["head0", "head1", "head2", "head3"]
    assert model.heads.shares_lm_head  # tied embedding, stored once


def test_greedy_decoding_matches_transformers_on_the_gguf(demo_checkpoint):
    model = HydraModel.load(demo_checkpoint)
    tokenizer = model.load_tokenizer()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    reference = gguf_model(demo_gguf_path()).eval()
    with torch.no_grad():
        expected = reference.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False
        )[0, len(prompt) :].tolist()

    capacity = len(prompt) + NEW_TOKENS
    trunk_cache, head_cache = model.trunk_cache(capacity), model.head_cache(1, capacity)
    head = model.heads.select(0)
    tokens, start, generated = torch.tensor(prompt), 0, []
    while len(generated) < len(expected):
        logits = head.forward(model.trunk.forward(tokens, trunk_cache, start), head_cache, start)
        start += len(tokens)
        generated.append(int(logits[0, -1].argmax()))
        tokens = torch.tensor(generated[-1:])
    assert generated == expected
    assert "Paris" in tokenizer.decode(generated)


def test_smollm2_draft_is_the_gguf_model_cut_short(tmp_path):
    layers = 8
    out = ensure_demo_draft(tmp_path / "draft", layers, log=lambda line: None)
    model = HydraModel.load(out)
    assert model.config.num_layers == layers < DRAFT_LAYERS == 30
    assert model.heads.shares_lm_head  # tied embedding, stored once
    gguf = demo_gguf_path()
    reference = gguf_model(gguf, num_hidden_layers=layers).eval()
    tokens = torch.tensor(model.load_tokenizer()("The capital of France is")["input_ids"])
    hidden = model.trunk.forward(tokens, model.trunk_cache(64), 0)
    got = model.heads.select(0).forward(hidden, model.head_cache(1, 64), 0)[0]
    with torch.no_grad():
        expected = reference(tokens[None]).logits[0]
    assert (got - expected).abs().max() <= TOLERANCE
