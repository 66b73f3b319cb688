"""Contrastive decoding through the engine against a direct computation on the tiny model:
the jury (every head but the amateur) as the expert, one head as the amateur."""

from __future__ import annotations

import math

import pytest
import torch

from hydra_jury.orchestrator.request import GenerationRequest, RequestError
from tests.models import next_token_logits
from tests.statistics import assert_fits

AMATEUR, JURY, ALPHA, BETA = "head3", ["head0", "head1", "head2"], 0.1, 0.5


def direct_contrastive(model, tokens: list[int], temperature: float) -> torch.Tensor:
    """[V] float64 softmax of the contrastive scores, from full forward passes."""
    logits = next_token_logits(model, tokens) / temperature  # [H, V]
    names = model.head_names
    expert = (BETA * logits[[names.index(h) for h in JURY]].log_softmax(-1)).sum(0)
    expert = expert.log_softmax(-1)
    amateur = logits[names.index(AMATEUR)].log_softmax(-1)
    plausible = expert >= expert.max() + math.log(ALPHA)
    return (expert - amateur).masked_fill(~plausible, -math.inf).softmax(-1)


def contrastive(prompt: str, **options) -> GenerationRequest:
    values = {
        "rule": "verifier_only",
        "contrastive_amateur": AMATEUR,
        "contrastive_alpha": ALPHA,
        "beta": BETA,
        "ignore_eos": True,
        **options,
    }
    return GenerationRequest(prompt=prompt, **values)


@pytest.mark.numerics
def test_greedy_contrastive_decoding_matches_the_direct_computation(engine, jury_model):
    output = engine.generate(contrastive("the cat", temperature=0.0, max_new_tokens=10))
    assert output.jury == JURY
    tokens = engine.tokenizer.encode("the cat", add_special_tokens=False)
    expected, plain = [], []
    for _ in range(10):
        token = int(direct_contrastive(jury_model, tokens + expected, 1.0).argmax())
        expected.append(token)
    assert output.token_ids == expected
    # The amateur really changes the output: plain greedy PoE over the same jury differs.
    plain = engine.generate(
        GenerationRequest(
            prompt="the cat",
            rule="verifier_only",
            jury=JURY,
            beta=BETA,
            temperature=0.0,
            max_new_tokens=10,
            ignore_eos=True,
        )
    )
    assert plain.token_ids != output.token_ids


@pytest.mark.numerics
def test_sampled_contrastive_decoding_follows_its_distribution(engine, jury_model):
    """2,000 seeded single-token runs against the direct distribution (chi-square,
    p > 1e-4); the control, the plain PoE target of the same jury, must not fit."""
    runs, temperature = 2000, 0.9
    tokens = engine.tokenizer.encode("hi", add_special_tokens=False)
    expected = direct_contrastive(jury_model, tokens, temperature)
    logits = next_token_logits(jury_model, tokens) / temperature
    names = jury_model.head_names
    plain = (BETA * logits[[names.index(h) for h in JURY]].log_softmax(-1)).sum(0).softmax(-1)
    counts = torch.zeros_like(expected)
    for seed in range(runs):
        request = contrastive("hi", temperature=temperature, max_new_tokens=1, seed=seed)
        counts[engine.generate(request).token_ids[0]] += 1
    assert counts[expected == 0].sum() == 0, "sampled an implausible token"

    assert_fits(counts, expected, plain)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"contrastive_alpha": 0.0}, "needs both contrastive_alpha and contrastive_amateur"),
        ({"contrastive_amateur": None}, "needs both contrastive_alpha and contrastive_amateur"),
        ({"contrastive_alpha": 1.5}, r"contrastive_alpha must be in \(0, 1\]"),
        ({"contrastive_amateur": "head9"}, "unknown contrastive_amateur 'head9'"),
        ({"rule": "exact"}, "conflicts with rule 'exact'; use rule verifier_only"),
        ({"jury": ["head0", "head3"]}, "contrastive_amateur 'head3' cannot also sit in the jury"),
    ],
)
def test_invalid_contrastive_options(engine, options, message):
    with pytest.raises(RequestError, match=message):
        engine.prepare(contrastive("hi", max_new_tokens=4, **options))
