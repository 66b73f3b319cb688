"""The decoding mathematics of hydra-jury, as pure functions on tensors (no I/O).

Modules
- target: the PoE target log-probabilities (per-shard partials, their sum) and the draft's.
- target_rows: what a round reads of its target rows (log P, P, entropy, margin, greedy
  token), computed together.
- row_kernels: which vocabulary-wide passes run in the native kernels.
- filters: sampling options and the top-k / top-p / min-p filters.
- rules: acceptance rules (exact, lenient, speculative cascades, baselines).
- verify: verification of a draft (greedy, sampled, coupled) and single-token draws.
- maxima: argmax and the two largest values along the last axis, vectorised.
- metrics: per-token metrics (entropy, stability, validity, suppression, log-probabilities)
  and request counters.
- randomness: counter-based draws keyed by (seed, position, purpose).
- contrastive: contrastive decoding scores (the jury as expert, one head as amateur).
- drafting: prompt-lookup (n-gram) drafts and point-mass draft distributions.
- beam: beam search bookkeeping (live beams, finished hypotheses, when it is done).
"""

from hydra_jury.poe.beam import BeamSearch, Hypothesis
from hydra_jury.poe.contrastive import contrastive_logprobs
from hydra_jury.poe.drafting import NgramIndex, ngram_draft, point_mass_logprobs
from hydra_jury.poe.filters import SamplingParams, filter_logprobs
from hydra_jury.poe.maxima import first_argmax, top_two_values
from hydra_jury.poe.metrics import (
    RequestStats,
    entropy,
    reached_positions,
    stability_margin,
    stability_radius,
    suppression_score,
    token_logprobs,
    top_logprobs,
    validity_radius,
)
from hydra_jury.poe.randomness import PURPOSES, categorical, choice, random_seed, uniforms
from hydra_jury.poe.rules import (
    RULES,
    Distributions,
    Rule,
    acceptance_probs,
    greedy_tokens,
    greedy_verdict,
    residual_probs,
    rule_target,
    validate_rule,
)
from hydra_jury.poe.target import (
    combine_partials,
    draft_logprobs,
    effective_temperature,
    log_softmax,
    normalise_logprobs,
    partial_log_product,
    partial_log_product_and_votes,
    probabilities,
    target_logprobs,
)
from hydra_jury.poe.target_rows import TargetRows, target_rows
from hydra_jury.poe.verify import (
    Verification,
    draw_token,
    leading_true,
    verify_coupled,
    verify_greedy,
    verify_sampled,
)

__all__ = [
    "PURPOSES",
    "RULES",
    "BeamSearch",
    "Distributions",
    "Hypothesis",
    "NgramIndex",
    "RequestStats",
    "Rule",
    "SamplingParams",
    "TargetRows",
    "Verification",
    "acceptance_probs",
    "categorical",
    "choice",
    "combine_partials",
    "contrastive_logprobs",
    "draft_logprobs",
    "draw_token",
    "effective_temperature",
    "entropy",
    "filter_logprobs",
    "first_argmax",
    "greedy_tokens",
    "greedy_verdict",
    "leading_true",
    "log_softmax",
    "ngram_draft",
    "normalise_logprobs",
    "partial_log_product",
    "partial_log_product_and_votes",
    "point_mass_logprobs",
    "probabilities",
    "random_seed",
    "reached_positions",
    "residual_probs",
    "rule_target",
    "stability_margin",
    "stability_radius",
    "suppression_score",
    "target_logprobs",
    "target_rows",
    "token_logprobs",
    "top_logprobs",
    "top_two_values",
    "uniforms",
    "validate_rule",
    "validity_radius",
    "verify_coupled",
    "verify_greedy",
    "verify_sampled",
]
