"""The fixed-shape decode step (`forward_static`, what a CUDA graph replays) computes what
the ragged forward computes, for every family; on a CPU `DecodeGraph` runs it eagerly.
tests/gpu replays it from a real CUDA graph."""

from __future__ import annotations

import pytest
import torch

from hydra_jury.hydra_model import HydraModel, Segment
from hydra_jury.hydra_model.graphs import (
    DecodeGraph,
    attended_span,
    on_device,
    padded_rows,
    padded_tensor,
)
from hydra_jury.hydra_model.kv_cache import SlotBatch
from tests.conftest import FAMILY_VARIANTS

TOLERANCE = 1e-4  # float32; the two paths differ only in summation order
PROMPT_LENGTH, STEPS = 5, 12


def greedy_logits(
    model: HydraModel,
    head: int,
    *,
    static: bool,
    graph: bool | None = None,
    prompt_length: int = PROMPT_LENGTH,
    capacity: int = PROMPT_LENGTH + STEPS + 3,  # positions past the last stay masked
):
    """The logits [S, V] of STEPS greedy steps of trunk and head `head` after a prompt,
    by the ragged forward or by `DecodeGraph`, and the trunk cache they leave."""
    heads = model.heads.select(head)
    trunk_cache, head_cache = model.trunk_cache(capacity), model.head_cache(1, capacity)
    prompt = torch.arange(1, prompt_length + 1, device=model.device) % model.config.vocab_size
    logits = heads.forward(model.trunk.forward(prompt, trunk_cache, 0), head_cache, 0)[:, -1]
    decoder = DecodeGraph(model.trunk, heads, trunk_cache, head_cache, graph=graph)
    steps = []
    for start in range(prompt_length, prompt_length + STEPS):
        token = logits[0].argmax(-1, keepdim=True)
        if static:
            logits = decoder.step(token, start)[:, -1].clone()
        else:
            hidden = model.trunk.forward(token, trunk_cache, start)
            logits = heads.forward(hidden, head_cache, start)[:, -1]
        steps.append(logits)
    return torch.stack(steps), trunk_cache


@pytest.mark.parametrize("variant", list(FAMILY_VARIANTS))
def test_the_static_step_gives_the_ragged_forwards_logits(variant, hydra_checkpoints):
    model = HydraModel.load(hydra_checkpoints[variant])
    for head in range(model.heads.size):
        ragged, ragged_cache = greedy_logits(model, head, static=False)
        static, static_cache = greedy_logits(model, head, static=True)
        torch.testing.assert_close(static, ragged, rtol=0, atol=TOLERANCE)
        assert static_cache.length == ragged_cache.length == PROMPT_LENGTH + STEPS
        written = slice(0, static_cache.length)
        static_keys, ragged_keys = static_cache.keys[..., written, :], ragged_cache.keys
        torch.testing.assert_close(static_keys, ragged_keys[..., written, :], atol=1e-5, rtol=0)


def test_the_wide_native_shapes_too(wide_jury_checkpoint):
    """Heads 32 wide: the ragged forward takes the native kernels' one-call decode."""
    model = HydraModel.load(wide_jury_checkpoint)
    ragged, _ = greedy_logits(model, 1, static=False)
    static, _ = greedy_logits(model, 1, static=True)
    torch.testing.assert_close(static, ragged, rtol=0, atol=TOLERANCE)


def test_a_step_checks_its_position_like_a_forward(jury_model):
    heads = jury_model.heads.select(0)
    trunk_cache, head_cache = jury_model.trunk_cache(4), jury_model.head_cache(1, 4)
    decoder = DecodeGraph(jury_model.trunk, heads, trunk_cache, head_cache)
    token = torch.tensor([3])
    with pytest.raises(Exception, match="append at position 2 but the cache holds 0"):
        decoder.step(token, 2)
    for start in range(4):
        decoder.step(token, start)
    with pytest.raises(Exception, match="exceeds the cache capacity of 4"):
        decoder.step(token, 4)
    assert trunk_cache.length == head_cache.length == 4


def test_graphs_are_refused_off_cuda(jury_model):
    caches = jury_model.trunk_cache(4), jury_model.head_cache(1, 4)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device; this model is on cpu"):
        DecodeGraph(jury_model.trunk, jury_model.heads.select(0), *caches, graph=True)
    assert not DecodeGraph(jury_model.trunk, jury_model.heads.select(0), *caches).use_graph


@pytest.mark.parametrize("variant", ["llama", "olmo2"])
def test_a_padded_batch_of_sessions_gives_each_its_own_step(variant, hydra_checkpoints):
    """Three sessions at different positions in one fixed-shape step, padded to four rows
    (the first repeated), against one ragged forward of the same three."""
    model = HydraModel.load(hydra_checkpoints[variant])
    heads = model.heads
    capacity, lengths = 16, [5, 2, 9]
    pools = {
        path: (model.trunk_pool(4, capacity), model.head_pool(heads.size, 4, capacity))
        for path in ("ragged", "static")
    }
    caches = {
        path: [(trunk.acquire(), head.acquire()) for _ in lengths]
        for path, (trunk, head) in pools.items()
    }
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, model.config.vocab_size, (n,), generator=generator) for n in lengths
    ]
    for path in pools:
        caches[path] = caches[path][1:] + caches[path][:1]  # slots out of order
        for prompt, (trunk_cache, head_cache) in zip(prompts, caches[path], strict=True):
            heads.forward(model.trunk.forward(prompt, trunk_cache, 0), head_cache, 0)
    tokens = torch.tensor([3, 1, 4])
    segments = [Segment(t, n, 1) for (t, _), n in zip(caches["ragged"], lengths, strict=True)]
    hidden = model.trunk.forward_ragged(tokens, segments)
    segments = [Segment(h, n, 1) for (_, h), n in zip(caches["ragged"], lengths, strict=True)]
    ragged = heads.forward_ragged(hidden, segments)
    trunk_pool, head_pool = pools["static"]
    rows = [(t.slot, n) for (t, _), n in zip(caches["static"], lengths, strict=True)]
    slots, positions = on_device(padded_rows(rows), model.device)
    padded_tokens = padded_tensor(tokens)
    assert slots.tolist() == [rows[0][0], rows[1][0], rows[2][0], rows[0][0]]
    trunk_batch = SlotBatch(trunk_pool.keys, trunk_pool.values, slots, positions)
    static_hidden = model.trunk.forward_static(padded_tokens, trunk_batch)
    head_batch = SlotBatch(head_pool.keys, head_pool.values, slots, positions)
    static = heads.forward_static(static_hidden, head_batch)[:, :3]
    torch.testing.assert_close(static_hidden[:3], hidden, rtol=0, atol=1e-5)
    torch.testing.assert_close(static, ragged, rtol=0, atol=TOLERANCE)
    for (ragged_trunk, _), (static_trunk, _), n in zip(
        caches["ragged"], caches["static"], lengths, strict=True
    ):
        torch.testing.assert_close(
            static_trunk.keys[..., : n + 1, :],
            ragged_trunk.keys[..., : n + 1, :],
            atol=1e-5,
            rtol=0,
        )


def test_a_sessions_several_rows_attend_causally_among_themselves(jury_model):
    """A speculative round's score: three rows of one session at consecutive positions and
    one row of another, in one fixed-shape step, against the ragged forward."""
    heads = jury_model.heads
    prompts = [torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6])]
    new = [torch.tensor([7, 8, 9]), torch.tensor([10])]
    pools = {path: jury_model.head_pool(heads.size, 2, 12) for path in ("ragged", "static")}
    logits = {}
    for path, pool in pools.items():
        caches = [pool.acquire() for _ in prompts]
        for prompt, cache in zip(prompts, caches, strict=True):
            heads.forward(jury_model.trunk.embedding[prompt], cache, 0)
        hidden = jury_model.trunk.embedding[torch.cat(new)]
        if path == "ragged":
            segments = [
                Segment(c, len(p), len(t)) for c, p, t in zip(caches, prompts, new, strict=True)
            ]
            logits[path] = heads.forward_ragged(hidden, segments)
        else:
            rows = [
                (caches[0].slot, 4),
                (caches[0].slot, 5),
                (caches[0].slot, 6),
                (caches[1].slot, 2),
            ]
            slots, positions = on_device(padded_rows(rows), jury_model.device)
            batch = SlotBatch(pool.keys, pool.values, slots, positions)
            logits[path] = heads.forward_static(padded_tensor(hidden), batch)[:, :4]
    torch.testing.assert_close(logits["static"], logits["ragged"], rtol=0, atol=TOLERANCE)


def test_steps_attend_a_span_that_follows_the_sessions_length(jury_model):
    """A cache of 200 positions: the steps attend 64 positions, then 128 once the
    session passes position 63 (`attended_span`), and give the ragged forward's logits."""
    assert [attended_span(n, 200) for n in (1, 64, 65, 129, 200)] == [64, 64, 128, 200, 200]
    assert attended_span(5, 16) == 16
    long = {"prompt_length": 58, "capacity": 200}
    ragged, _ = greedy_logits(jury_model, 0, static=False, **long)
    static, cache = greedy_logits(jury_model, 0, static=True, **long)
    assert cache.length == 58 + STEPS > 64
    torch.testing.assert_close(static, ragged, rtol=0, atol=TOLERANCE)
