"""Concurrent sessions through the split stack and through the single-process server:
the services (or the server's in-process batchers) batch their calls (one forward over
several sessions), and every session still gets the tokens it gets alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from urllib.request import urlopen

import pytest

from hydra_jury.hydra_model.graphs import MODE_VARIABLE
from hydra_jury.serving.batcher import BatchLimits
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


@pytest.fixture(scope="module", params=["split", "serve", "serve-fixed-shapes"])
def stack(request, jury_checkpoint, redis_url):
    """`serve-fixed-shapes`: the workers' one-position steps at fixed shapes, padded
    batches of sessions addressed by slot (what a GPU replays from CUDA graphs), run
    eagerly here (`hydra_model.graphs`)."""
    stack = Stack(
        str(jury_checkpoint),
        [["head0", "head1"], ["head2", "head3"]],
        redis_url,
        **SESSION_ROOM,
    )
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "split":
            stack.start_services().start_orchestrator()
        else:
            if request.param == "serve-fixed-shapes":
                patch.setenv(MODE_VARIABLE, "eager")
            stack.start_embedded()
            if request.param == "serve-fixed-shapes":
                assert stack.servicer.backend.trunk.graphs is not None
    yield stack
    stack.close()


@pytest.mark.parametrize(
    "options",
    [
        {"rule": "verifier_only"},
        {"rule": "exact", "drafter": "head", "gamma": 3},
        {"rule": "exact", "drafter": "ngram", "gamma": 4},
        {"rule": "exact", "drafter": "head", "gamma": 3, "temperature": 0.8},
    ],
    ids=["non-speculative", "head-drafts", "ngram-drafts", "sampled-head-drafts"],
)
def test_sessions_running_together_give_their_tokens_alone(stack, options):
    """Greedy, and sampled with a seed per request (float32 forwards are batch-invariant,
    and every draw is keyed by seed and position)."""
    generation = stack.generation()
    options = {"temperature": 0.0, **options}
    requests = [  # the seed draws the draft head (and so the jury)
        to_pb(prompt, max_new_tokens=16, ignore_eos=True, seed=seed, **options)
        for seed, prompt in enumerate(PROMPTS[:SESSIONS])
    ]
    alone = [list(generation.Generate(request, timeout=30).token_ids) for request in requests]
    largest = {name: batcher.largest for name, batcher in batchers(stack).items()}
    with ThreadPoolExecutor(SESSIONS) as pool:
        together = list(
            pool.map(lambda r: list(generation.Generate(r, timeout=60).token_ids), requests)
        )
    assert together == alone
    # They did run together: some forward of every shard held several sessions, and
    # some trunk step (n-gram rounds run the trunk over their drafts as a prefill does;
    # the others step it with Draft).
    grown = {name: batcher.largest for name, batcher in batchers(stack).items()}
    scores = [name for name in grown if name.endswith(".Score")]
    assert all(grown[name] > 1 for name in scores), (largest, grown)
    trunk = "trunk.Prefill" if options.get("drafter") == "ngram" else "trunk.Draft"
    assert grown[trunk] > 1, (largest, grown)
    if stack.embedded and stack.servicer.backend.trunk.graphs is not None:
        # Steps of several batch sizes were taken: batches of sessions at fixed shapes.
        assert len(stack.servicer.backend.trunk.graphs) > 1


def batchers(stack: Stack) -> dict:
    """Every batcher of the stack, by "holder.RPC" (the single-process server's
    in-process batchers as those of the trunk and of one jury)."""
    if stack.embedded:
        named = stack.servicer.backend.batchers.batchers
        return {
            f"{'jury' if rpc == 'Score' else 'trunk'}.{rpc}": batcher
            for rpc, batcher in named.items()
        }
    return {
        f"{name}.{rpc}": batcher
        for name in ("trunk", "jury0", "jury1")
        for rpc, batcher in stack.servers[name].servicer.batchers.items()
    }


def test_serve_prefills_a_long_prompt_in_chunks_and_reports_its_batches(jury_checkpoint, redis_url):
    """`serve --prefill-chunk-tokens 3`: the prompt's prefill runs in batches of at most
    3 positions, and the tokens are those of a whole prefill; /metrics shows the
    batches."""
    chunked, whole = (
        Stack(str(jury_checkpoint), [], redis_url, **SESSION_ROOM).start_embedded(
            batch_limits=BatchLimits(prefill_chunk=chunk), metrics_port=0
        )
        for chunk in (3, 0)
    )
    try:
        request = to_pb(PROMPTS[3] + " " + PROMPTS[5], max_new_tokens=8, temperature=0.0)
        outputs = [stack.generation().Generate(request, timeout=30) for stack in (chunked, whole)]
        assert list(outputs[0].token_ids) == list(outputs[1].token_ids)
        prefilled = outputs[0].prompt_tokens - 1  # the last is the first round's

        def batches(stack: Stack, name: str) -> float:
            registry = stack.servicer.metrics.registry
            return registry.get_sample_value(name, {"rpc": "Prefill"}) or 0.0

        assert prefilled > 6 and batches(whole, "hydrajury_batch_calls_count") == 1
        assert batches(chunked, "hydrajury_batch_calls_count") == -(-prefilled // 3)
        assert batches(chunked, "hydrajury_batch_tokens_sum") == prefilled
        page = urlopen(f"http://127.0.0.1:{chunked.metrics_port}/metrics", timeout=10).read()
        assert b'hydrajury_batch_calls_count{rpc="Score"}' in page
        assert b'hydrajury_queue_length{rpc="Draft"}' in page
    finally:
        chunked.close()
        whole.close()
