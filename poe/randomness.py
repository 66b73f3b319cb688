"""Seeded randomness keyed by (seed, absolute position, purpose).

Terms
- seed: the request's seed, 0 ≤ seed < 2**63 (`random_seed` draws one when the request
  has none).
- position: the absolute position in the sequence of the token a draw decides. Draws
  for the request as a whole (the draft head) use position -1, which no token has.
- purpose: what a draw is for; each purpose is its own stream, so the acceptance test
  and the draft sample at the same position are independent.
- counter-based generator: a draw is a hash of its key, not the next state of a
  sequential generator, so it does not depend on which other draws happened before,
  on the batch it was drawn in, on the process, or on a restart.

The hash is SplitMix64's output function (Steele, Lea, Flood 2014): the key
(seed, purpose) selects a stream, and the position is the counter within the stream.
Arithmetic is on Python integers reduced modulo 2**64 (uint64 with wraparound); the top
53 bits become a float64 in [0, 1). A round draws for a few positions at a time, and
plain integers cost about a microsecond a position where numpy's operations on small
arrays cost about 5 µs each.

Because every draw that decides the token at position p is keyed by p, the token there
is a function of the committed prefix and the seed alone: a redraft of p after a
rejection reuses keys whose earlier draws never reached the output, which keeps the
sampling exact, and (numerics aside) the text does not depend on γ.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

from hydra_jury.poe._checks import check_float, check_long, check_rows
from hydra_jury.poe.row_kernels import row_kernels

PURPOSES: dict[str, int] = {
    "draft_head": 0,  # which drafter head a request uses (`choice`, position -1)
    "draft": 1,  # the draft token sampled from q
    "accept": 2,  # the uniform compared with the acceptance probability
    "residual": 3,  # the replacement sampled from the residual
    "sample": 4,  # a token sampled from P without drafting (verifier_only)
}

MAX_SEED = 2**63  # exclusive; seeds fit a signed 64-bit field (protobuf int64, Redis)
REQUEST_POSITION = -1  # the position key of per-request draws

_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's stream increment
_MIX_MULTIPLIERS = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
_UINT64 = (1 << 64) - 1


def _mix64(value: int) -> int:
    """SplitMix64's finaliser on a uint64: a bijection whose every output bit depends on
    every input bit."""
    value ^= value >> 30
    value = (value * _MIX_MULTIPLIERS[0]) & _UINT64
    value ^= value >> 27
    value = (value * _MIX_MULTIPLIERS[1]) & _UINT64
    return value ^ (value >> 31)


def _check_seed(seed: int) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise ValueError(f"seed must be an integer, got {type(seed).__name__}")
    if not 0 <= seed < MAX_SEED:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")


def _purpose_code(purpose: str) -> int:
    if purpose not in PURPOSES:
        raise ValueError(f"unknown purpose {purpose!r}; choose one of {', '.join(PURPOSES)}")
    return PURPOSES[purpose]


@functools.lru_cache(maxsize=1024)
def _stream(seed: int, code: int) -> int:
    """The stream of (seed, purpose code): the same for every draw of a request with
    that purpose, so kept for the next."""
    return _mix64((_mix64(seed) + code * _GOLDEN_GAMMA) & _UINT64)


def uniforms(seed: int, positions: torch.Tensor, purpose: str) -> torch.Tensor:
    """One uniform draw in [0, 1) per position: positions [B] long → [B] float64.

    The value for a (seed, position, purpose) is the same whatever else is in the batch.
    """
    _check_seed(seed)
    code = _purpose_code(purpose)
    check_long("positions", positions, dims=1)
    stream = _stream(int(seed), code)
    # A position's counter is its two's-complement bits (position -1 is 2**64 - 1); the
    # top 53 bits of the hash are an exact float64 integer, scaled into [0, 1).
    values = [
        (_mix64((stream + (position & _UINT64) * _GOLDEN_GAMMA) & _UINT64) >> 11) * 2.0**-53
        for position in positions.tolist()
    ]
    return torch.tensor(values, dtype=torch.float64, device=positions.device)


def categorical(
    probs: torch.Tensor, seed: int, positions: torch.Tensor, purpose: str
) -> torch.Tensor:
    """One token per row by inverse CDF: probs [B, V], positions [B] long → [B] long.

    Rows need not sum exactly to 1 (the uniform is scaled by each row's total) but must
    be non-negative, finite and not all zero. A token of probability 0 is never returned.
    """
    check_float("probs", probs, dims=2)
    check_long("positions", positions, dims=1)
    check_rows("positions", positions, probs.shape[0])
    ops = row_kernels(probs)
    if ops is not None:  # the same tokens in one call (`kernels.cpp`'s categorical_rows)
        tokens = ops.categorical_rows(probs, uniforms(seed, positions, purpose))
        code = int(tokens.min()) if len(tokens) else 0
        if code == -2:
            raise ValueError("probs must be finite and non-negative")
        if code == -1:
            raise ValueError("every row of probs needs some positive probability")
        return tokens
    cdf = torch.cumsum(probs.double(), dim=-1)  # [B, V]
    total = cdf[:, -1]  # [B]
    # A NaN or an infinity makes its row's total non-finite; one pass finds a negative.
    if not bool(torch.isfinite(total).all()) or bool(probs.min() < 0):
        raise ValueError("probs must be finite and non-negative")
    if bool((total <= 0).any()):
        raise ValueError("every row of probs needs some positive probability")
    thresholds = uniforms(seed, positions, purpose).to(probs.device) * total  # [B]
    # The first index whose cdf exceeds the threshold; a zero-probability token repeats
    # its predecessor's cdf and so can never be first.
    tokens = torch.searchsorted(cdf, thresholds[:, None], right=True).squeeze(1)  # [B]
    # u · total can round up to total, and then no cdf exceeds it (the index is V):
    # such a row takes its last token of positive probability.
    vocab_size = probs.shape[1]
    past = tokens == vocab_size
    if bool(past.any()):
        last_positive = vocab_size - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)  # [B]
        tokens = torch.where(past, last_positive, tokens)
    return tokens


def choice(seed: int, n: int, purpose: str) -> int:
    """A uniform pick among n options for the whole request (position key -1)."""
    if n < 1:
        raise ValueError(f"choice needs at least one option, got n={n}")
    draw = uniforms(seed, torch.tensor([REQUEST_POSITION]), purpose).item()
    # draw · n < n in exact arithmetic; the min guards the rounding.
    return min(int(draw * n), n - 1)


def random_seed() -> int:
    """A fresh seed from the operating system, for requests that bring none."""
    return int.from_bytes(os.urandom(8), "little") % MAX_SEED
