"""The Product-of-Experts target distribution and the draft distribution, in log space.

Terms
- verifier: a head of the jury, i.e. any head but the request's draft head.
- temperature T: logits are divided by T before the softmax. T = 0 means greedy; greedy
  decoding takes the argmax of the T = 1 distributions, so T = 0 is computed as T = 1.
- beta β: the verifiers' inverse temperature; each verifier's log-probabilities are
  multiplied by β before they are added.
- target P: the normalised product, P(x) ∝ Π_h softmax(z_h / T)(x)^β
  = exp(Σ_h β · log_softmax(z_h / T)(x)) / Z, the product over the verifiers.
- partial log-product: Σ_h β · (z_h / T − max z_h / T) over the verifiers one jury shard
  hosts. Each term is the juror's log-probabilities up to its normaliser, a constant of
  the row, and constants of a row leave P unchanged: the target's normalisation removes
  them. Unnormalised; partials of disjoint head sets add up to the jury's log-product.

Why shifted logits and not log-softmaxes: a juror's log-softmax takes an exp of every
entry of the vocabulary and a pass more, the shift a subtraction; and the shift keeps what
the log-softmax kept: every term ≤ 0 with its maximum at 0, so that logits of ±1e4 with a
large β and many heads stay finite and the likely tokens sit near 0, where float32 is
finest. Sampling filters (`poe.filters`) are applied after this module, to the draft and
the target alike.

Every log-softmax and exp here runs in the native kernels where they take the tensors
(`poe.row_kernels`).

Shapes: H heads, N positions, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from hydra_jury.poe._checks import as_float32, check_float, check_same_shape
from hydra_jury.poe.maxima import first_argmax
from hydra_jury.poe.row_kernels import row_kernels


def effective_temperature(temperature: float) -> float:
    """The temperature the distributions are computed at: T, or 1 for greedy (T = 0)."""
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
    return 1.0 if temperature == 0 else float(temperature)


def partial_log_product(
    verifier_logits: torch.Tensor, temperature: float, beta: float
) -> torch.Tensor:
    """One shard's share of the PoE log-product.

    verifier_logits: [H, N, V], the logits of this shard's verifiers (the draft head
    excluded). H = 0 is allowed: a shard whose only head is the draft head contributes
    a partial of zeros.
    Returns [N, V] float32: Σ_h β · (verifier_logits[h] / T less its row's maximum).
    """
    return partial_log_product_and_votes(verifier_logits, temperature, beta)[0]


def partial_log_product_and_votes(
    verifier_logits: torch.Tensor, temperature: float, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`partial_log_product`, and each verifier's vote: the first argmax of its logits
    ([H, N] long). A jury's call needs both; the kernels give them, the division by T
    included, in one call (the terms added one juror after the other, as here)."""
    check_float("verifier_logits", verifier_logits, dims=3)
    if not math.isfinite(beta) or beta <= 0:
        raise ValueError(f"beta must be finite and > 0, got {beta}")
    scale = effective_temperature(temperature)
    logits = as_float32(verifier_logits)
    ops = row_kernels(logits)
    if ops is not None:
        total, votes = ops.jury_rows(logits, scale)  # [N, V], [H, N]
    else:
        scaled = logits if scale == 1 else logits / scale
        terms = scaled - scaled.amax(dim=-1, keepdim=True)
        total = terms[0] if len(terms) else logits.new_zeros(logits.shape[1:])
        for term in terms[1:]:
            total = total + term
        votes = first_argmax(logits)
    # Multiplying by 1 changes no bit: skipped, as it is a pass.
    return (total if beta == 1 else beta * total), votes


def combine_partials(partials: Sequence[torch.Tensor]) -> torch.Tensor:
    """Adds the shards' partial log-products: [N, V] each → [N, V] float32.

    Float addition is not associative: add the partials in a fixed order (for example
    by the shards' lowest head index) so that the same request gives the same bits.
    """
    if len(partials) == 0:
        raise ValueError("combine_partials needs at least one partial log-product")
    for index, partial in enumerate(partials):
        check_float(f"partials[{index}]", partial, dims=2)
        check_same_shape("partials[0]", partials[0], **{f"partials[{index}]": partial})
    total = partials[0].float()
    for partial in partials[1:]:
        total = total + partial.float()
    return total


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dimension, by the kernels where they take x (a row with
    a NaN gives NaNs, one of only -inf NaNs, as PyTorch's does)."""
    ops = row_kernels(x)
    return ops.vocab_log_softmax(x) if ops is not None else F.log_softmax(x, dim=-1)


def normalise_logprobs(log_product: torch.Tensor) -> torch.Tensor:
    """log_product: [N, V], unnormalised log-probabilities → [N, V] float32 log P."""
    check_float("log_product", log_product, dims=2)
    return log_softmax(log_product.float())


def probabilities(logprobs: torch.Tensor) -> torch.Tensor:
    """exp(logprobs), with every probability below the dtype's smallest normal number
    (e^−87.3 ≈ 1.2e−38 in float32) read as 0. A product of several heads puts a fifth of
    a 49,152-token row there, and on x86 an exp whose result is subnormal takes a slow
    microcode path: the row's exp took 7× as long inside a 4-head decoding round (2.5×
    alone). Such a token is never a row's argmax and had less than a 1e−38 chance per
    draw. Every path that turns the target or a draft into probabilities calls this, so
    non-speculative and speculative decoding read one distribution."""
    ops = row_kernels(logprobs)
    if ops is not None:
        return ops.vocab_probabilities(logprobs)
    smallest_normal = math.log(torch.finfo(logprobs.dtype).tiny)
    return F.threshold(logprobs, smallest_normal, -math.inf).exp()


def target_logprobs(verifier_logits: torch.Tensor, temperature: float, beta: float) -> torch.Tensor:
    """log P for all verifiers at once: verifier_logits [H ≥ 1, N, V] → [N, V] float32."""
    if verifier_logits.dim() == 3 and verifier_logits.shape[0] == 0:
        raise ValueError("target_logprobs needs at least one verifier head")
    return normalise_logprobs(partial_log_product(verifier_logits, temperature, beta))


def draft_logprobs(draft_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log q: draft_logits [N, V] → [N, V] float32 log_softmax(draft_logits / T)."""
    check_float("draft_logits", draft_logits, dims=2)
    return log_softmax(draft_logits.float() / effective_temperature(temperature))
