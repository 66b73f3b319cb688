"""Concurrent sessions through the split stack: the services batch their calls (one
forward over several sessions), and every session still gets the tokens it gets alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.grpc_stack import Stack
from tests.orchestrator.test_grpc_stack import to_pb

SESSIONS = 8
# Room for every running session (a finished one's slot goes to a new session at once);
# the grace before a running session idle between rounds may lose its slot is far longer
# than a round here.
SESSION_ROOM = {"max_sessions": 64, "reclaim_after_s": 0.5}
PROMPTS = [
    "the cat",
    "a dog ran",
    "hello there",
    "once upon a time",
    "blue",
    "the quick brown fox",
    "we went to",
    "x y z",
]


@pytest.fixture(scope="module")
def stack(jury_checkpoint, redis_url):
    stack = Stack(
        str(jury_checkpoint),
        [["head0", "head1"], ["head2", "head3"]],
        redis_url,
        **SESSION_ROOM,
    )
    stack.start_services().start_orchestrator()
    yield stack
    stack.close()


@pytest.mark.parametrize(
    "options",
    [
        {"rule": "verifier_only"},
        {"rule": "exact", "drafter": "head", "gamma": 3},
        {"rule": "exact", "drafter": "ngram", "gamma": 4},
    ],
    ids=["non-speculative", "head-drafts", "ngram-drafts"],
)
def test_greedy_sessions_running_together_give_their_tokens_alone(stack, options):
    generation = stack.generation()
    requests = [  # the seed draws the draft head (and so the jury)
        to_pb(prompt, max_new_tokens=16, ignore_eos=True, temperature=0.0, seed=seed, **options)
        for seed, prompt in enumerate(PROMPTS[:SESSIONS])
    ]
    alone = [list(generation.Generate(request, timeout=30).token_ids) for request in requests]
    largest = {name: batcher.largest for name, batcher in batchers(stack).items()}
    with ThreadPoolExecutor(SESSIONS) as pool:
        together = list(
            pool.map(lambda r: list(generation.Generate(r, timeout=60).token_ids), requests)
        )
    assert together == alone
    # They did run together: some forward of every shard held several sessions.
    grown = {name: batcher.largest for name, batcher in batchers(stack).items()}
    assert grown["jury0.Score"] > 1 and grown["jury1.Score"] > 1, (largest, grown)


def batchers(stack: Stack) -> dict:
    return {
        f"{name}.{rpc}": batcher
        for name in ("trunk", "jury0", "jury1")
        for rpc, batcher in stack.servers[name].servicer.batchers.items()
    }
