"""The runtime reproduces `transformers` for every family, with and without the cache."""

from __future__ import annotations

import pytest
import torch

from hydra_jury.hydra_model import CacheError, HydraModel
from hydra_jury.hydra_model.kv_cache import bytes_per_position
from tests.conftest import FAMILY_VARIANTS
from tests.models import load_hf_model

TOLERANCE = 1e-4  # float32; differences come only from summation order


def reference_logits(source, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return load_hf_model(source)(tokens[None]).logits[0].float()  # [T, V]


def hydra_logits(model: HydraModel, tokens: torch.Tensor, head: int) -> torch.Tensor:
    capacity = len(tokens) + 8
    hidden = model.trunk.forward(tokens, model.trunk_cache(capacity), 0)
    logits = model.heads.select(head).forward(hidden, model.head_cache(1, capacity), 0)
    return logits[0]


@pytest.mark.parametrize("variant", list(FAMILY_VARIANTS))
def test_full_sequence_matches_transformers(variant, source_models, hydra_checkpoints):
    model = HydraModel.load(hydra_checkpoints[variant])
    tokens = torch.randint(
        0, model.config.vocab_size, (48,), generator=torch.Generator().manual_seed(3)
    )
    expected = reference_logits(source_models[variant], tokens)
    for head in range(model.heads.size):
        assert (hydra_logits(model, tokens, head) - expected).abs().max() <= TOLERANCE


@pytest.mark.parametrize("variant", list(FAMILY_VARIANTS))
def test_incremental_decoding_with_truncate(variant, source_models, hydra_checkpoints):
    model = HydraModel.load(hydra_checkpoints[variant])
    generator = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, model.config.vocab_size, (24,), generator=generator)
    other = torch.randint(0, model.config.vocab_size, (6,), generator=generator)
    trunk_cache, head_cache = model.trunk_cache(64), model.head_cache(1, 64)
    head = model.heads.select(1)

    def step(chunk: torch.Tensor, start: int) -> torch.Tensor:
        return head.forward(model.trunk.forward(chunk, trunk_cache, start), head_cache, start)[0]

    # A prompt in one call, then one token at a time, then a chunk of 3.
    got = [step(tokens[:10], 0)]
    got += [step(tokens[i : i + 1], i) for i in range(10, 21)]
    got.append(step(tokens[21:24], 21))
    expected = reference_logits(source_models[variant], tokens)
    assert (torch.cat(got) - expected).abs().max() <= TOLERANCE

    # Roll back to 15 and continue with different tokens: as if they had always been there.
    trunk_cache.truncate(15)
    head_cache.truncate(15)
    rewritten = torch.cat([tokens[:15], other])
    got_tail = torch.cat([step(other[:2], 15), step(other[2:], 17)])
    expected = reference_logits(source_models[variant], rewritten)[15:]
    assert (got_tail - expected).abs().max() <= TOLERANCE
    assert trunk_cache.length == head_cache.length == 21


def test_head_stack_equals_loop_over_heads(hydra_checkpoints):
    model = HydraModel.load(hydra_checkpoints["olmo2"])
    tokens = torch.arange(20) % model.config.vocab_size
    hidden = model.trunk.forward(tokens, model.trunk_cache(32), 0)
    batched, last_hidden = model.heads.forward(
        hidden, model.head_cache(model.heads.size, 32), 0, return_hidden=True
    )
    assert batched.shape == (model.heads.size, 20, model.config.vocab_size)
    assert last_hidden.shape == (model.heads.size, 20, model.config.hidden_size)
    for index in range(model.heads.size):
        single = model.heads.select(index).forward(hidden, model.head_cache(1, 32), 0)[0]
        assert (batched[index] - single).abs().max() <= 1e-5


def test_cache_rejects_out_of_order_use(hydra_checkpoints):
    model = HydraModel.load(hydra_checkpoints["llama"])
    cache = model.trunk_cache(8)
    model.trunk.forward(torch.tensor([1, 2, 3]), cache, 0)
    with pytest.raises(CacheError, match="append at position 5 but the cache holds 3"):
        model.trunk.forward(torch.tensor([4]), cache, 5)
    cache.truncate(1)
    with pytest.raises(CacheError, match="append at position 3 but the cache holds 1"):
        model.trunk.forward(torch.tensor([4]), cache, 3)
    with pytest.raises(CacheError, match="exceeds the cache capacity of 8"):
        model.trunk.forward(torch.arange(8), cache, 1)
    with pytest.raises(CacheError, match="between 0 and the current length"):
        cache.truncate(2)


def test_cache_pool_is_bounded_and_reuses_slots(hydra_checkpoints):
    model = HydraModel.load(hydra_checkpoints["llama"])
    pool = model.head_pool(stack=3, num_slots=2, capacity=16)
    config = model.config
    per_position = bytes_per_position(
        stack=3,
        layers=config.num_layers - model.manifest.trunk_layers,
        kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        dtype=model.dtype,
    )
    assert pool.nbytes == 16 * 2 * per_position
    first, second = pool.acquire(), pool.acquire()
    with pytest.raises(CacheError, match="all 2 cache slots are in use"):
        pool.acquire()
    pool.release(first)
    again = pool.acquire()
    assert again.slot == first.slot and again.length == 0
    assert second.keys.data_ptr() != again.keys.data_ptr()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_dtypes_run_close_to_float32(dtype, hydra_checkpoints):
    reference = HydraModel.load(hydra_checkpoints["llama"])
    model = HydraModel.load(hydra_checkpoints["llama"], dtype=dtype)
    assert model.heads.norm.dtype == getattr(torch, dtype)
    tokens = torch.arange(12) % model.config.vocab_size
    low = hydra_logits(model, tokens, 0)
    high = hydra_logits(reference, tokens, 0)
    assert low.dtype == torch.float32
    assert (low - high).abs().max() < 0.1
