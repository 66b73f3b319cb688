"""The ragged forward: several sessions' tokens in one batch (mixed lengths, mixed start
positions, rollbacks, sessions joining and leaving between steps) give the logits of
running each session alone, to 1e-5; a bad batch is refused before any cache moves."""

from __future__ import annotations

import pytest
import torch

from hydra_jury.hydra_model import CacheError, Segment

TOLERANCE = dict(atol=1e-5, rtol=1e-5)


class Sessions:
    """Per-session trunk and head caches from pools, run alone or batched."""

    def __init__(self, model, slots: int = 4, capacity: int = 64) -> None:
        self.model = model
        self.trunk_pool = model.trunk_pool(slots, capacity)
        self.head_pool = model.head_pool(model.heads.size, slots, capacity)
        self.caches: dict[str, tuple] = {}

    def open(self, name: str) -> None:
        self.caches[name] = (self.trunk_pool.acquire(), self.head_pool.acquire())

    def alone(self, name: str, tokens: list[int]) -> torch.Tensor:
        trunk, heads = self.caches[name]
        start = trunk.length
        hidden = self.model.trunk.forward(torch.tensor(tokens), trunk, start)
        return self.model.heads.forward(hidden, heads, start)  # [S, T, V]

    def batched(self, step: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        names = list(step)
        tokens = torch.tensor([token for name in names for token in step[name]])
        trunk_segments = [
            Segment(self.caches[n][0], self.caches[n][0].length, len(step[n])) for n in names
        ]
        head_segments = [
            Segment(self.caches[n][1], self.caches[n][1].length, len(step[n])) for n in names
        ]
        hidden = self.model.trunk.forward_ragged(tokens, trunk_segments)
        logits = self.model.heads.forward_ragged(hidden, head_segments)  # [S, N, V]
        out, offset = {}, 0
        for name in names:
            out[name] = logits[:, offset : offset + len(step[name])]
            offset += len(step[name])
        return out

    def truncate(self, name: str, length: int) -> None:
        for cache in self.caches[name]:
            cache.truncate(length)


def check(alone: Sessions, batched: Sessions, step: dict[str, list[int]]) -> None:
    expected = {name: alone.alone(name, tokens) for name, tokens in step.items()}
    got = batched.batched(step)
    for name in step:
        torch.testing.assert_close(got[name], expected[name], **TOLERANCE)


@pytest.fixture
def pair(jury_model):
    return Sessions(jury_model), Sessions(jury_model)


def test_mixed_lengths_and_starts_equal_each_session_alone(pair):
    alone, batched = pair
    for sessions in pair:
        for name in "abc":
            sessions.open(name)
    # First prompts of different lengths (all from position 0), then steps from three
    # different positions with different numbers of tokens (a decode step, a one-pass
    # verification of 4 positions, a chunk of a later turn).
    check(alone, batched, {"a": [5, 6, 7], "b": [9], "c": [3, 1, 4, 1, 5, 9, 2]})
    check(alone, batched, {"a": [8], "b": [10, 11, 12, 13], "c": [6, 5]})
    check(alone, batched, {"c": [7], "a": [2, 2]})  # order in the batch is free


def test_a_rollback_in_the_middle_of_a_batch(pair):
    alone, batched = pair
    for sessions in pair:
        sessions.open("a"), sessions.open("b")
    check(alone, batched, {"a": [5, 6, 7, 8, 9], "b": [1, 2, 3]})
    for sessions in pair:
        sessions.truncate("a", 2)  # three drafts rejected: positions 2.. rewritten
    check(alone, batched, {"a": [4, 4], "b": [7]})


def test_sessions_join_and_leave_between_steps(pair):
    alone, batched = pair
    for sessions in pair:
        sessions.open("a")
    check(alone, batched, {"a": [5, 6]})
    for sessions in pair:
        sessions.open("b")
    check(alone, batched, {"a": [7], "b": [1, 2, 3]})
    check(alone, batched, {"b": [4]})  # a left the batch (and may come back)
    check(alone, batched, {"a": [8], "b": [5]})


def test_a_bad_batch_moves_no_cache(jury_model):
    sessions = Sessions(jury_model)
    sessions.open("a"), sessions.open("b")
    sessions.batched({"a": [5, 6], "b": [7]})
    trunk_a, trunk_b = sessions.caches["a"][0], sessions.caches["b"][0]
    with pytest.raises(CacheError, match="append at position 5 but the cache holds 1"):
        jury_model.trunk.forward_ragged(
            torch.tensor([1, 2]), [Segment(trunk_a, 2, 1), Segment(trunk_b, 5, 1)]
        )
    with pytest.raises(ValueError, match="appears twice"):
        jury_model.trunk.forward_ragged(
            torch.tensor([1, 2]), [Segment(trunk_a, 2, 1), Segment(trunk_a, 2, 1)]
        )
    with pytest.raises(ValueError, match="the segments hold 2 tokens, x has 3"):
        jury_model.trunk.forward_ragged(
            torch.tensor([1, 2, 3]), [Segment(trunk_a, 2, 1), Segment(trunk_b, 1, 1)]
        )
    assert (trunk_a.length, trunk_b.length) == (2, 1)


def test_selected_rows_are_those_rows_of_the_whole_output(jury_model):
    """`rows` keeps the LM head to the rows a caller reads (each prompt's last, in a
    prefill): the same logits and hidden states as those rows of the whole output."""
    segments = [Segment(None, 0, 3), Segment(None, 0, 5)]
    hidden = jury_model.trunk.forward_ragged(torch.tensor([5, 6, 7, 1, 2, 3, 4, 9]), segments)
    logits, states = jury_model.heads.forward_ragged(hidden, segments, return_hidden=True)
    last = torch.tensor([2, 7])
    picked, picked_states = jury_model.heads.forward_ragged(
        hidden, segments, return_hidden=True, rows=last
    )
    assert picked.shape == (jury_model.heads.size, 2, jury_model.config.vocab_size)
    torch.testing.assert_close(picked, logits[:, last], **TOLERANCE)
    torch.testing.assert_close(picked_states, states[:, last], **TOLERANCE)
