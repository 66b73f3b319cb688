"""The runtime's batched decode step, without services: one step of B sessions (one
token each, contexts of different lengths) through the trunk and the 4-head stack, as
one ragged forward, against B single-session forwards; and the ragged forward's
attention (one call per session's cache slot, the runtime's) against one padded
attention call over the batch (keys and values gathered into a [B, ..., longest]
tensor with a mask). Float32 and bfloat16.

    python bench/bench_batching.py --checkpoint var/models/smollm2-hydra

The padded variant is written here only, as the alternative the runtime was measured
against; both must give the hidden states of the single forwards (checked: relative error of
the whole below 1e-5 in float32, 2e-2 in bfloat16).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from hydra_jury.hydra_model import HydraModel, Segment
from hydra_jury.hydra_model.layers import LayerStack, _linear
from hydra_jury.hydra_model.products import rms_norm
from hydra_jury.hydra_model.rope import rotate

CONTEXTS = (96, 160, 224, 288, 352, 416, 480, 544)  # cycled over the sessions


def padded_attention(
    stack: LayerStack, layer, index, x, plans, norm=None, residual=None
) -> torch.Tensor:
    """`LayerStack._attention` with one attention call over the batch: each segment's
    keys and values (after writing its own into its cache) copied into a padded tensor,
    positions past a segment's end masked."""
    config = stack.config
    qkv = _linear(x, layer.qkv_weight, layer.qkv_bias, norm=norm, eps=config.rms_norm_eps)
    q, k, v = qkv.split([config.q_size, config.kv_size, config.kv_size], dim=-1)
    if layer.q_norm is not None:
        q = rms_norm(q, layer.q_norm, config.rms_norm_eps)
        k = rms_norm(k, layer.k_norm, config.rms_norm_eps)
    segments = [plan.segment for plan in plans]
    hd, heads, stacked = config.head_dim, x.shape[0], len(segments)
    longest = max(segment.start + segment.length for segment in segments)
    width = max(segment.length for segment in segments)
    kv_heads = config.num_key_value_heads
    keys = x.new_zeros(stacked, heads, kv_heads, longest, hd)
    values = torch.zeros_like(keys)
    queries = x.new_zeros(stacked, heads, config.num_attention_heads, width, hd)
    mask = torch.zeros(stacked, 1, width, longest, dtype=torch.bool)
    for b, plan in enumerate(plans):
        rows, segment = plan.rows, plan.segment
        n, start = segment.length, segment.start
        qb = rotate(q[:, rows].reshape(heads, n, -1, hd), plan.rotation).transpose(1, 2)
        kb = rotate(k[:, rows].reshape(heads, n, -1, hd), plan.rotation).transpose(1, 2)
        vb = v[:, rows].reshape(heads, n, -1, hd).transpose(1, 2)
        cached_k, cached_v = segment.cache.write(index, start, kb, vb)
        keys[b, :, :, : start + n] = cached_k
        values[b, :, :, : start + n] = cached_v
        queries[b, :, :, :n] = qb
        positions = torch.arange(start, start + n)
        mask[b, 0, :n, : start + n] = torch.arange(start + n)[None, :] <= positions[:, None]
        mask[b, 0, n:, 0] = True  # padding queries see one key (their rows are dropped)
    flat = stacked * heads
    out = F.scaled_dot_product_attention(
        queries.reshape(flat, -1, width, hd),
        keys.reshape(flat, kv_heads, longest, hd),
        values.reshape(flat, kv_heads, longest, hd),
        attn_mask=mask.repeat_interleave(heads, 0),
        enable_gqa=config.num_attention_heads != kv_heads,
    ).reshape(stacked, heads, -1, width, hd)
    rows = [
        out[b, :, :, : segment.length].transpose(1, 2).reshape(heads, segment.length, -1)
        for b, segment in enumerate(segments)
    ]
    return _linear(torch.cat(rows, dim=1), layer.o_weight, layer.o_bias, residual=residual)


@contextmanager
def attention(kind: str):
    """The runtime's attention ("ragged") or the padded one, for the block's duration."""
    if kind == "ragged":
        yield
        return
    original = LayerStack._attention

    def patched(self, layer, index, x, plans, norm=None, residual=None):
        return padded_attention(self, layer, index, x, plans, norm, residual)

    LayerStack._attention = patched
    try:
        yield
    finally:
        LayerStack._attention = original


class Sessions:
    """B sessions with cache slots holding contexts of different lengths."""

    def __init__(self, model: HydraModel, count: int) -> None:
        capacity = max(CONTEXTS) + 8
        self.model = model
        self.trunk = model.trunk_pool(count, capacity)
        self.heads = model.head_pool(model.heads.size, count, capacity)
        self.slots = [(self.trunk.acquire(), self.heads.acquire()) for _ in range(count)]
        generator = torch.Generator().manual_seed(0)
        self.lengths = [CONTEXTS[i % len(CONTEXTS)] for i in range(count)]
        for (trunk_cache, head_cache), length in zip(self.slots, self.lengths, strict=True):
            tokens = torch.randint(0, model.config.vocab_size, (length,), generator=generator)
            hidden = model.trunk.forward(tokens, trunk_cache, 0)
            model.heads.fill_ragged(hidden, [Segment(head_cache, 0, length)])

    def step(self, tokens: torch.Tensor, batched: bool) -> torch.Tensor:
        """One token per session at its context's end (caches rolled back after):
        the heads' last hidden states [4, B, D]."""
        model, out = self.model, []
        groups = (
            [list(range(len(self.slots)))] if batched else [[i] for i in range(len(self.slots))]
        )
        for group in groups:
            trunk_segments = [Segment(self.slots[i][0], self.lengths[i], 1) for i in group]
            head_segments = [Segment(self.slots[i][1], self.lengths[i], 1) for i in group]
            hidden = model.trunk.forward_ragged(tokens[group], trunk_segments)
            _logits, states = model.heads.forward_ragged(hidden, head_segments, return_hidden=True)
            out.append(states)
        for (trunk_cache, head_cache), length in zip(self.slots, self.lengths, strict=True):
            trunk_cache.truncate(length)
            head_cache.truncate(length)
        return torch.cat(out, dim=1)


def timed(function: Callable[..., torch.Tensor], repeats: int, *args) -> tuple[float, torch.Tensor]:
    result = function(*args)  # warm-up
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        result = function(*args)
        times.append(time.perf_counter() - began)
    return statistics.median(times), result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="var/models/smollm2-hydra")
    parser.add_argument("--sessions", default="1,2,4,8,16")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(
        f"{os.cpu_count()} cores, {torch.get_num_threads()} torch threads, {args.checkpoint}: "
        "one decode step (trunk + 4 heads, one token per session, contexts "
        f"{CONTEXTS[0]}..{CONTEXTS[-1]}), median of {args.repeats}"
    )
    print(
        "| dtype | sessions | B single forwards (ms) | one ragged forward (ms) | "
        "per session (ms) | padded attention (ms) | ragged / padded |"
    )
    print("|---|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        model = HydraModel.load(args.checkpoint, dtype=dtype)
        for count in (int(c) for c in args.sessions.split(",")):
            sessions = Sessions(model, count)
            tokens = torch.randint(0, model.config.vocab_size, (count,))
            with torch.inference_mode():
                alone, expected = timed(sessions.step, args.repeats, tokens, False)
                ragged, together = timed(sessions.step, args.repeats, tokens, True)
                with attention("padded"):
                    padded, gathered = timed(sessions.step, args.repeats, tokens, True)
            tolerance = 1e-5 if dtype == "float32" else 2e-2  # relative, of the whole
            for name, result in (("ragged", together), ("padded", gathered)):
                error = (result.float() - expected.float()).norm() / expected.float().norm()
                assert error < tolerance, f"{name}: relative error {error:.1e}"
            print(
                f"| {dtype} | {count} | {1000 * alone:.1f} | {1000 * ragged:.1f} | "
                f"{1000 * ragged / count:.1f} | {1000 * padded:.1f} | {ragged / padded:.2f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
