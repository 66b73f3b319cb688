"""Drafting without a model: prompt lookup (n-gram) drafts and their point-mass
distributions.

Prompt lookup: the draft continues the latest earlier occurrence of the last k tokens
(k from `max_n` down to `min_n`, the longest match first) with the tokens that followed
it there. It costs no model call and pays where the output copies from the context
(rewriting, quoting, editing code). Its draft distribution is a point mass on each
proposed token, so exact acceptance is min(1, P(d)) = P(d) and the residual is P
without d, renormalised — what `poe.rules` computes from a one-hot q.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

NGRAM_MIN = 1
NGRAM_MAX = 3


def ngram_draft(
    tokens: Sequence[int], gamma: int, *, min_n: int = NGRAM_MIN, max_n: int = NGRAM_MAX
) -> list[int]:
    """Up to `gamma` tokens that followed the latest earlier occurrence of the longest
    suffix (of `max_n` down to `min_n` tokens) of `tokens`; [] when none occurs.

    [5, 6, 7, 9, 5, 6] with γ=3: the suffix [5, 6] occurred at 0, followed by [7, 9, 5].
    """
    if gamma < 1 or len(tokens) < 2:
        return []
    array = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, len(array) - 1), min_n - 1, -1):
        suffix = array[-n:]
        # Windows that start early enough to have a token after them and are not the
        # suffix itself: starts 0 .. len - n - 1.
        windows = sliding_window_view(array[:-1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if len(starts):
            follow = int(starts[-1]) + n
            return array[follow : follow + gamma].tolist()
    return []


def point_mass_logprobs(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The log-probabilities [len(tokens), V] of point masses on `tokens`: 0 at the
    token, -inf elsewhere."""
    logprobs = torch.full((len(tokens), vocab_size), float("-inf"))
    logprobs[torch.arange(len(tokens)), tokens] = 0.0
    return logprobs
