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

import torch

NGRAM_MIN = 1
NGRAM_MAX = 3


class NgramIndex:
    """Where each token of a growing sequence occurs, so that a prompt-lookup draft costs
    the occurrences of the sequence's last token, not a scan of the whole sequence (which
    a round of the automatic mode pays under the interpreter lock, every round of every
    session). Feed it one sequence, longer each time (a request's committed tokens); a
    sequence that is shorter than, or ends its first part differently from, what was
    indexed is indexed anew."""

    def __init__(self) -> None:
        self._positions: dict[int, list[int]] = {}
        self._length = 0  # how many tokens are indexed
        self._last: int | None = None  # the last of them

    def _sync(self, tokens: Sequence[int]) -> None:
        held = self._length
        if held > len(tokens) or (held and tokens[held - 1] != self._last):
            self._positions, held = {}, 0
        for position in range(held, len(tokens)):
            self._positions.setdefault(tokens[position], []).append(position)
        self._length = len(tokens)
        self._last = tokens[-1] if tokens else None

    def occurs(self, tokens: Sequence[int], token: int) -> bool:
        """Whether `token` occurs in `tokens`: whether, once it is appended, a draft of at
        least one token is on offer."""
        self._sync(tokens)
        return token in self._positions

    def draft(
        self, tokens: Sequence[int], gamma: int, *, min_n: int = NGRAM_MIN, max_n: int = NGRAM_MAX
    ) -> list[int]:
        """Up to `gamma` tokens that followed the latest earlier occurrence of the
        longest suffix (of `max_n` down to `min_n` tokens) of `tokens`; [] when none
        occurs.

        [5, 6, 7, 9, 5, 6] with γ=3: the suffix [5, 6] occurred at 0, followed by [7, 9, 5].
        """
        return self.lookup(tokens, gamma, min_n=min_n, max_n=max_n)[0]

    def lookup(
        self, tokens: Sequence[int], gamma: int, *, min_n: int = NGRAM_MIN, max_n: int = NGRAM_MAX
    ) -> tuple[list[int], int]:
        """`draft`, and the length of the suffix its tokens continue (0: no draft). A
        longer match drafts far better: on the demo's model-written answers the first
        token of a draft was kept after 11% of one-token matches, 37% of two-token and
        47% of three-token ones."""
        length = len(tokens)
        if gamma < 1 or length < 2:
            return [], 0
        self._sync(tokens)
        # The ends of earlier occurrences are earlier positions of the last token, the
        # latest first; one of n tokens ending at `end` must start at 0 or later.
        ends = self._positions[tokens[-1]][-2::-1]
        for n in range(min(max_n, length - 1), min_n - 1, -1):
            suffix = tokens[length - n :]
            for end in ends:
                if end >= n - 1 and tokens[end - n + 1 : end + 1] == suffix:
                    return list(tokens[end + 1 : end + 1 + gamma]), n
        return [], 0


def ngram_draft(
    tokens: Sequence[int], gamma: int, *, min_n: int = NGRAM_MIN, max_n: int = NGRAM_MAX
) -> list[int]:
    """`NgramIndex.draft` of a sequence seen once."""
    return NgramIndex().draft(list(tokens), gamma, min_n=min_n, max_n=max_n)


def point_mass_logprobs(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The log-probabilities [len(tokens), V] of point masses on `tokens`: 0 at the
    token, -inf elsewhere."""
    logprobs = torch.full((len(tokens), vocab_size), float("-inf"))
    logprobs[torch.arange(len(tokens)), tokens] = 0.0
    return logprobs
