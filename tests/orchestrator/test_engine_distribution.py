"""The whole engine loop samples exactly from the rule's target distribution.

For a fixed prompt and draft head, the joint distribution of the first two generated
tokens is computed in closed form here, independently of `poe` (plain softmax products
over per-head logits from full, cache-free forward passes), and compared with the
empirical distribution of 5,000 seeded runs of the engine.

Tolerance: a chi-square goodness-of-fit test over the 32×32 cells, pooling cells whose
expected count is below 5, must give p > 1e-4. Under an exact sampler a run fails with
probability 1e-4 (the seeds are fixed, so the outcome is deterministic); a wrong target
(for instance the draft's distribution, or a residual that is off) moves tens of
percent of the mass here and gives p < 1e-30.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from hydra_model import HydraModel
from orchestrator.request import GenerationRequest

RUNS = 5000
PROMPT = "hi"
DRAFT_HEAD = "head3"
JURY = ["head0", "head1", "head2"]
BETA = 0.5


def next_token_logits(model: HydraModel, tokens: list[int]) -> torch.Tensor:
    """[H, V] logits of every head for the token after `tokens` (no cache reuse)."""
    capacity = len(tokens)
    hidden = model.trunk.forward(torch.tensor(tokens), model.trunk_cache(capacity), 0)
    logits = model.heads.forward(hidden, model.head_cache(model.heads.size, capacity), 0)
    return logits[:, -1].double()


def exact_target(logits: torch.Tensor, names: list[str], temperature: float) -> torch.Tensor:
    jurors = [names.index(name) for name in JURY]
    log_product = (BETA * torch.log_softmax(logits[jurors] / temperature, -1)).sum(0)
    return torch.softmax(log_product, -1)


def cascade_diff_target(
    logits: torch.Tensor, names: list[str], lenience: float
) -> tuple[torch.Tensor, bool]:
    """π = q when max q ≥ max P − λ, else P (temperature 1); also whether it deferred."""
    target = exact_target(logits, names, 1.0)
    draft = torch.softmax(logits[names.index(DRAFT_HEAD)], -1)
    use_draft = bool(draft.max() >= target.max() - lenience)
    return (draft if use_draft else target), use_draft


def joint_distribution(model, prompt, target_fn) -> tuple[torch.Tensor, list[bool]]:
    """[V, V]: P(x1, x2) = π1(x1) · π2(x2 | x1)."""
    first, deferred = target_fn(next_token_logits(model, prompt))
    vocab = first.shape[0]
    joint = torch.zeros(vocab, vocab, dtype=torch.float64)
    decisions = [deferred]
    for x1 in range(vocab):
        second, deferred = target_fn(next_token_logits(model, [*prompt, x1]))
        joint[x1] = first[x1] * second
        decisions.append(deferred)
    return joint, decisions


def empirical(engine, request_options: dict) -> torch.Tensor:
    vocab = engine.backend.info.vocab_size
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    for seed in range(RUNS):
        output = engine.generate(
            GenerationRequest(
                prompt=PROMPT,
                seed=seed,
                ignore_eos=True,
                draft_head=DRAFT_HEAD,
                beta=BETA,
                **request_options,
            )
        )
        x1, x2 = output.token_ids[:2]
        counts[x1, x2] += 1
    return counts


def assert_fits(counts: torch.Tensor, joint: torch.Tensor) -> None:
    expected = joint.flatten() * RUNS
    observed = counts.flatten()
    assert observed[expected == 0].sum() == 0, "sampled a token of probability zero"
    large = expected >= 5
    observed_bins = torch.cat([observed[large], observed[~large].sum()[None]])
    expected_bins = torch.cat([expected[large], expected[~large].sum()[None]])
    expected_bins *= observed_bins.sum() / expected_bins.sum()  # float rounding only
    result = chisquare(observed_bins.numpy(), expected_bins.numpy())
    assert result.pvalue > 1e-4, f"chi-square p = {result.pvalue:.2e}"


@pytest.mark.parametrize("gamma", [1, 4])
def test_exact_rule_samples_the_poe_target(engine, jury_model, tokenizer, gamma):
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    temperature, top_k = 0.8, 12
    names = jury_model.head_names

    def target(logits):
        full = exact_target(logits, names, temperature)
        kept = torch.zeros_like(full).scatter(0, full.topk(top_k).indices, 1.0)
        return full * kept / (full * kept).sum(), False

    joint, _ = joint_distribution(jury_model, prompt, target)
    counts = empirical(
        engine,
        {
            "rule": "exact",
            "gamma": gamma,
            "max_new_tokens": 4,
            "temperature": temperature,
            "top_k": top_k,
        },
    )
    assert_fits(counts, joint)


@pytest.mark.parametrize("gamma", [1, 4])
def test_cascade_rule_samples_its_target(engine, jury_model, tokenizer, gamma):
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    lenience = 0.1
    names = jury_model.head_names
    joint, deferred = joint_distribution(
        jury_model, prompt, lambda logits: cascade_diff_target(logits, names, lenience)
    )
    # The case is informative only if some positions defer to the draft and some do not.
    assert any(deferred) and not all(deferred)
    counts = empirical(
        engine,
        {
            "rule": "cascade_diff",
            "lenience": lenience,
            "gamma": gamma,
            "max_new_tokens": 4,
            "temperature": 1.0,
        },
    )
    assert_fits(counts, joint)
