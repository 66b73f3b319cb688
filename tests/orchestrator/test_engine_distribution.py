"""The whole engine loop samples exactly from the rule's target distribution.

For a fixed prompt and draft head, the joint distribution of the first two generated
tokens is computed in closed form here, independently of `poe` (plain softmax products
over per-head logits from full, cache-free forward passes), and compared with the
empirical distribution of 5,000 seeded runs of the engine (1,000 concurrent runs through
the split stack for the batching test).

Tolerance: a chi-square goodness-of-fit test over the 32×32 cells, pooling cells whose
expected count is below 5, must give p > 1e-4. Under an exact sampler a run fails with
probability 1e-4 (the seeds are fixed, so the outcome is deterministic). Each test also
checks a control that must fail: the same counts against a plausible wrong target (the
draft's distribution; the PoE target for a cascade that ignored its deferral) must give
p < 1e-10.

Seed for seed: every draw that decides the token at a position is keyed by (seed,
position, purpose), and a head round has no bonus token, so a seeded request's tokens
do not depend on γ. The draft model here computes what the draft head does (head 3 is a
copy of the base, the draft model the base whole), so its rounds draw the same drafts,
and their bonus token (drawn when every draft is kept) comes after the first two. A
coupled check (prompt lookup) emits at every position the draw a plain step makes there.
Runs of another γ or drafter are therefore compared with a chi-square-tested
configuration seed for seed over 1,000 seeds, which is stronger than a chi-square test
of their own: a configuration whose distribution is off by a total variation d differs
on at least a share d of the seeds, and every d the chi-square test can see (a few
percent over 5,000 runs) shows in 1,000 seeds with certainty, a share of 0.5% with
probability 0.993.

Cost: the model is the smallest that keeps the heads different (one trunk and one head
layer), each run stops once its first two tokens are decided (its first round still
drafts γ tokens), and the runs are spread over a worker process per core
(`tests.engine_sampling`: the counts are those of one process running every seed).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from hydra_jury.hydra_model import DraftModel, HydraModel
from hydra_jury.orchestrator.draft_ahead import AheadPolicy
from tests.engine_sampling import RunSampler, worker_count
from tests.grpc_stack import Stack
from tests.models import (
    build_draft_checkpoint,
    build_jury_checkpoint,
    draft_model_logits,
    next_token_logits,
)
from tests.orchestrator.test_concurrent_sessions import SESSION_ROOM
from tests.orchestrator.test_grpc_stack import to_pb
from tests.statistics import assert_fits

pytestmark = pytest.mark.slow  # 21,000 generations: about 75 s of both of 2 cores

RUNS = 5000
SAME_RUNS = 1000  # the seeds of a seed-for-seed comparison
PROMPT = "hi"
DRAFT_HEAD = "head3"
JURY = ["head0", "head1", "head2"]
BETA = 0.5
# Through the services a run costs about 18 ms of the 2 cores (gRPC, Redis, four servers
# in one process). Compared seed for seed with in-process runs, 400 of them show a share
# of 1% that differs with probability 0.98 (a chi-square test of 1,000 saw a few percent).
CONCURRENT_RUNS = 400


# One trunk and one head layer, hidden size 32: a run costs half the forward work of the
# shared jury checkpoint, and the heads still differ. Two 32-wide query heads share one
# key/value head, and the MLP is 64 wide: shapes the native kernels take, so a decode step
# is one native call (a run costs 4-5 ms here against 6-8 with 8-wide heads, which leave
# every operation to PyTorch).
SMALL_JURY = dict(
    trunk_layers=1,
    num_hidden_layers=2,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> HydraModel:
    """A `SMALL_JURY` checkpoint."""
    return HydraModel.load(
        build_jury_checkpoint(tmp_path_factory.mktemp("small-jury"), **SMALL_JURY)
    )


@pytest.fixture(scope="module")
def draft_checkpoint(small_model) -> Path:
    """The small jury's base model, whole (two layers): its draft model."""
    return build_draft_checkpoint(small_model.directory)


@pytest.fixture(scope="module")
def small_draft(draft_checkpoint) -> DraftModel:
    return DraftModel.load(draft_checkpoint)


@pytest.fixture(scope="module")
def tokenizer(small_model):
    return small_model.load_tokenizer()


@pytest.fixture(scope="module")
def sampler(small_model, draft_checkpoint):
    """The runs spread over a worker process per core, each with the same engine."""
    runs = RunSampler(small_model.directory, draft_checkpoint, worker_count())
    yield runs
    runs.close()


def exact_target(logits: torch.Tensor, names: list[str], temperature: float) -> torch.Tensor:
    jurors = [names.index(name) for name in JURY]
    log_product = (BETA * torch.log_softmax(logits[jurors] / temperature, -1)).sum(0)
    return torch.softmax(log_product, -1)


def cascade_diff_target(
    logits: torch.Tensor, names: list[str], lenience: float
) -> tuple[torch.Tensor, bool]:
    """π = q when max q ≥ max P − λ, else P (temperature 1), q the draft head's; also
    whether it deferred."""
    target = exact_target(logits, names, 1.0)
    draft = torch.softmax(logits[names.index(DRAFT_HEAD)], -1)
    use_draft = bool(draft.max() >= target.max() - lenience)
    return (draft if use_draft else target), use_draft


def joint_distribution(model, prompt, target_fn) -> tuple[torch.Tensor, list[bool]]:
    """[V, V]: P(x1, x2) = π1(x1) · π2(x2 | x1); also whether each position's target
    deferred to the draft (`target_fn` of the position's logits [H, V])."""

    def target_after(context: list[int]):
        return target_fn(next_token_logits(model, context))

    first, deferred = target_after(prompt)
    vocab = first.shape[0]
    joint = torch.zeros(vocab, vocab, dtype=torch.float64)
    decisions = [deferred]
    for x1 in range(vocab):
        second, deferred = target_after([*prompt, x1])
        joint[x1] = first[x1] * second
        decisions.append(deferred)
    return joint, decisions


def run_options(request_options: dict, prompt: str = PROMPT) -> dict:
    """A run's request options: the draft head with the jury of the other heads, unless
    `request_options` names a drafter (then that drafter with `JURY`)."""
    drafter = (
        {"jury": JURY}
        if "drafter" in request_options
        else {"draft_head": DRAFT_HEAD, "drafter": "head"}
    )
    return dict(prompt=prompt, ignore_eos=True, beta=BETA, **drafter, **request_options)


def empirical(
    sampler: RunSampler, vocab: int, request_options: dict, prompt: str = PROMPT
) -> torch.Tensor:
    """Counts of the first two tokens of RUNS seeded runs, [V, V]."""
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    for x1, x2 in sampler.first_two(run_options(request_options, prompt), RUNS):
        counts[x1, x2] += 1
    return counts


def assert_same_runs(
    sampler: RunSampler, request_options: dict, tested: dict, prompt: str = PROMPT
) -> None:
    """The first two tokens of SAME_RUNS seeded runs with `request_options` are those of
    the chi-square-tested options `tested`, seed for seed."""
    runs = sampler.first_two(run_options(request_options, prompt), SAME_RUNS)
    expected = sampler.first_two(run_options(tested, prompt), SAME_RUNS)
    differing = [
        seed for seed, (run, want) in enumerate(zip(runs, expected, strict=True)) if run != want
    ]
    assert not differing, (
        f"{len(differing)} of {SAME_RUNS} seeds differ; seed {differing[0]}: "
        f"{runs[differing[0]]} against {expected[differing[0]]}"
    )


TOP_K_TEMPERATURE, TOP_K = 0.8, 12


def top_k_targets(names: list[str], temperature: float, top_k: int):
    """`joint_distribution`'s target functions for the exact rule, top-k filtered at
    `temperature`: the PoE target, and the control, the draft's own filtered
    distribution (the mistake of keeping every draft token)."""

    def top_k_of(probs):
        kept = torch.zeros_like(probs).scatter(0, probs.topk(top_k).indices, 1.0)
        return probs * kept / (probs * kept).sum(), False

    def target(logits):
        return top_k_of(exact_target(logits, names, temperature))

    def draft(logits):
        return top_k_of(torch.softmax(logits[names.index(DRAFT_HEAD)] / temperature, -1))

    return target, draft


EXACT = {
    "rule": "exact",
    "gamma": 4,
    "max_new_tokens": 4,
    "temperature": TOP_K_TEMPERATURE,
    "top_k": TOP_K,
}


def test_exact_rule_samples_the_poe_target(tokenizer, small_model, sampler):
    """Top-k filtered at temperature 0.8, drafted by the draft head, γ = 4: the second
    token comes from the first round when its first draft was kept, else from the next."""
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    target, draft = top_k_targets(small_model.head_names, TOP_K_TEMPERATURE, TOP_K)
    joint, _ = joint_distribution(small_model, prompt, target)
    draft_joint, _ = joint_distribution(small_model, prompt, draft)
    counts = empirical(sampler, small_model.config.vocab_size, EXACT)
    assert_fits(counts, joint, draft_joint)


@pytest.mark.parametrize(("drafter", "gamma"), [("head", 1), ("model", 3)])
def test_the_exact_rule_s_tokens_do_not_depend_on_gamma_or_the_drafter(
    tokenizer, small_model, sampler, small_draft, drafter, gamma
):
    """A round per token (γ = 1), and draft-model rounds (full distributions, checked in
    one pass; the bonus would be the fourth token): seed for seed the tokens of `EXACT`.
    The draft model's distribution is the draft head's, checked here first (a model
    round's drafts are drawn from it: were it another, its tokens could differ)."""
    options = {**EXACT, "gamma": gamma}
    if drafter == "model":
        prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
        head = next_token_logits(small_model, prompt)[small_model.head_index(DRAFT_HEAD)]
        assert torch.allclose(draft_model_logits(small_draft, prompt), head, atol=1e-5)
        options["drafter"] = "model"
    assert_same_runs(sampler, options, EXACT)


NGRAM_PROMPT = "hihih"  # repeats: the first round drafts from it
NGRAM = {
    "rule": "exact",
    "drafter": "ngram",
    "gamma": 2,
    "max_new_tokens": 4,
    "temperature": TOP_K_TEMPERATURE,
    "top_k": TOP_K,
}


def test_ngram_drafts_checked_in_one_pass_sample_the_poe_target(tokenizer, small_model, sampler):
    """Prompt-lookup drafts (point masses) with one-pass verification and the bonus token:
    the second token comes from a kept draft, a replacement or the bonus."""
    prompt = tokenizer.encode(NGRAM_PROMPT, add_special_tokens=False)
    target, _ = top_k_targets(small_model.head_names, TOP_K_TEMPERATURE, TOP_K)
    joint, _ = joint_distribution(small_model, prompt, target)
    # The mistake of keeping the draft too often: mass moved onto the drafted pair.
    drafted = prompt[-2:]  # "ih", what followed the earlier "h"
    keeps_too_often = 0.7 * joint
    keeps_too_often[drafted[0], drafted[1]] += 0.3
    counts = empirical(sampler, small_model.config.vocab_size, NGRAM, prompt=NGRAM_PROMPT)
    assert_fits(counts, joint, keeps_too_often)


def test_longer_ngram_drafts_give_the_same_tokens(sampler):
    """γ = 4: seed for seed the tokens of γ = 2 (a coupled check emits at every position
    the draw a plain step would make there, whatever was drafted)."""
    assert_same_runs(sampler, {**NGRAM, "gamma": 4}, NGRAM, prompt=NGRAM_PROMPT)


LENIENCE = 0.2
CASCADE = {
    "rule": "cascade_diff",
    "lenience": LENIENCE,
    "gamma": 4,
    "max_new_tokens": 4,
    "temperature": 1.0,
}


def test_cascade_rule_samples_its_target(tokenizer, small_model, sampler):
    """The cascade's deferral decided on the draft head's distribution, γ = 4."""
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    names = small_model.head_names

    def target(logits):
        return cascade_diff_target(logits, names, LENIENCE)

    joint, deferred = joint_distribution(small_model, prompt, target)
    # The case is informative only if some positions defer to the draft and some do not.
    assert any(deferred) and not all(deferred)
    # The mistake of ignoring the deferral: the plain PoE target.
    poe_joint, _ = joint_distribution(
        small_model, prompt, lambda logits: (exact_target(logits, names, 1.0), False)
    )
    counts = empirical(sampler, small_model.config.vocab_size, CASCADE)
    assert_fits(counts, joint, poe_joint)


@pytest.mark.parametrize(("drafter", "gamma"), [("head", 1), ("model", 2)])
def test_the_cascade_s_tokens_do_not_depend_on_gamma_or_the_drafter(sampler, drafter, gamma):
    """A round per token, and draft-model rounds (the deferral decided on the draft
    model's distribution, the draft head's here; drafts checked in one pass, the bonus
    the third token): seed for seed the tokens of `CASCADE`."""
    options = {**CASCADE, "gamma": gamma}
    if drafter == "model":
        options["drafter"] = "model"
    assert_same_runs(sampler, options, CASCADE)


def test_concurrent_requests_through_the_services_give_the_in_process_tokens(
    small_model, sampler, redis_url, monkeypatch
):
    """The exact rule's runs again (`EXACT`), through the split stack (trunk, two shards)
    with 8 requests at a time: the services batch the sessions' calls into shared
    forwards, and each run gives the in-process run's tokens, seed for seed. Every other
    run goes through a second orchestrator that pipelines rounds, at γ = 1: its second
    token's draft was sent ahead while the jury scored the first (always, whatever the
    timings: `AheadPolicy.pays`), and used when the first draft token was kept."""
    monkeypatch.setattr(AheadPolicy, "pays", lambda policy: True)
    expected = sampler.first_two(run_options(EXACT), CONCURRENT_RUNS)
    stack = Stack(
        str(small_model.directory),
        [["head0", "head1"], ["head2", "head3"]],
        redis_url,
        **SESSION_ROOM,
    )
    stack.start_services().start_orchestrator()
    stack.start_orchestrator("pipelined", pipeline_rounds=True)
    try:
        generations = [stack.generation(), stack.generation("pipelined")]

        def first_two(seed: int) -> tuple[list[int], int]:
            pipelined = seed % 2
            request = to_pb(
                PROMPT,
                max_new_tokens=2,
                seed=seed,
                ignore_eos=True,
                rule="exact",
                drafter="head",
                draft_head=DRAFT_HEAD,
                jury=JURY,
                beta=BETA,
                gamma=1 if pipelined else EXACT["gamma"],
                temperature=EXACT["temperature"],
                top_k=EXACT["top_k"],
            )
            response = generations[pipelined].Generate(request, timeout=60)
            return list(response.token_ids), response.stats.drafts_ahead_used

        with ThreadPoolExecutor(8) as pool:
            runs = list(pool.map(first_two, range(CONCURRENT_RUNS)))
        assert sum(used_ahead for _, used_ahead in runs) > 0  # drafts sent ahead were used
        scores = [stack.servers[f"jury{i}"].servicer.batchers["Score"] for i in range(2)]
        assert all(batcher.largest > 1 for batcher in scores)  # the requests were batched
    finally:
        stack.close()
    differing = [seed for seed, (tokens, _) in enumerate(runs) if tokens != expected[seed]]
    assert not differing, (
        f"{len(differing)} of {CONCURRENT_RUNS} differ from their in-process runs; seed "
        f"{differing[0]}: {runs[differing[0]][0]} against {expected[differing[0]]}"
    )
