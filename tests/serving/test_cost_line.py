"""A batch's time shared among its calls (`serving.cost_line.batch_shares`), and a round's
cost to the server from its share (`orchestrator.backend.ModelShare`)."""

from __future__ import annotations

import pytest

from hydra_jury.orchestrator.backend import ModelShare
from hydra_jury.serving.cost_line import LinearCost, batch_shares


def test_a_lone_call_bears_its_whole_batch():
    assert batch_shares(0.03, [5], (0.02, 0.001)) == [0.03]
    assert batch_shares(0.03, [5], None) == [0.03]


def test_without_a_line_the_shares_follow_the_positions():
    assert batch_shares(0.06, [1, 2, 3], None) == pytest.approx([0.01, 0.02, 0.03])


def test_with_a_line_the_fixed_cost_is_divided_and_each_position_costs_in_full():
    # fixed 0.04 s, 0.002 s a position: 4 calls of 1 position and one of 3 model
    # 0.054 s; measured 0.054 s, so the shares are the modelled ones.
    shares = batch_shares(0.054, [1, 1, 1, 1, 3], (0.04, 0.002))
    assert shares[:4] == pytest.approx([0.008 + 0.002] * 4)
    assert shares[4] == pytest.approx(0.008 + 0.006)  # 2 more positions: 2 x 0.002 more
    # A slower batch than modelled scales every share; they add up to its time.
    slower = batch_shares(0.108, [1, 1, 1, 1, 3], (0.04, 0.002))
    assert slower == pytest.approx([2 * share for share in shares])
    assert sum(slower) == pytest.approx(0.108)


def test_a_line_follows_its_batches():
    cost = LinearCost(decay=1.0)
    for positions in (8, 16, 8, 16):
        cost.observe(positions, 0.03 + 0.002 * positions)
    fixed, per_position = cost.line()
    assert fixed == pytest.approx(0.03) and per_position == pytest.approx(0.002)


def test_a_rounds_cost_is_its_share_plus_its_own_work():
    assert ModelShare().cost(0.05) == 0.05  # no batched call: its time
    # Alone (the share is the wait): the wall time, hops and all.
    assert ModelShare(waited=0.04, share=0.04).cost(0.05, cpu=0.002) == pytest.approx(0.05)
    # Among many (a tenth of its wait its own): its share, its CPU time, and a tenth of
    # the rest of its time outside the model calls (0.010 s, 0.002 s of it CPU).
    shared = ModelShare(waited=0.04, share=0.004).cost(0.05, cpu=0.002)
    assert shared == pytest.approx(0.004 + 0.002 + 0.008 * 0.1)
