"""Every product of activations with a weight, the attention of a decode step, and every
embedding lookup: one place that chooses between the native kernels and PyTorch's own.

The kernels (`kernels/native.py`) take a few rows — a decode step, a speculative round,
a jury's positions of several sessions — at the memory bandwidth, and give each row the
same result whatever rows come with it. PyTorch's products take the rest: prefills (many
rows, compute-bound, where BLAS is at its best), training (gradients), other dtypes, and
machines without the kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hydra_jury.hydra_model.kv_cache import KVCache
from hydra_jury.hydra_model.quantization import QuantizedWeight, int8_activations
from hydra_jury.kernels.native import native

Weight = torch.Tensor | QuantizedWeight
# Up to this many rows go to the kernels: a decode step, the verify of a speculative
# round, a batch of sessions' rounds — each row then comes out the same whatever rows are
# batched with it, so a session's tokens are the same alone and batched, and a jury
# shard's rows are those of the whole jury. Beyond, a product is a prefill, where BLAS is
# at its best (2-core Xeon, SmolLM2's layers in float32: 16 rows 33 ms on the kernels
# against 40 on BLAS, 64 rows 117 against 83; docs/benchmarks.md).
KERNEL_MAX_ROWS = 64
# Up to this many rows, a quantized weight taking int8 activations multiplies them by the
# kernels in chunks of KERNEL_MAX_ROWS (`_in_chunks`); beyond, by PyTorch's BLAS.
CHUNKED_MAX_ROWS = 3 * KERNEL_MAX_ROWS
# PyTorch's CPU BLAS multiplies 4 to 15 rows by a large matrix with small-row kernels
# that are slowest there (SmolLM2's 49,152 x 576 LM head: 8 rows 13.6 ms, 16 rows 9.7 ms
# on the 2-core development machine), and from 16 rows on each row comes out the same
# whatever its neighbours; without the kernels such products are padded to 16 rows.
PADDED_ROW_COUNTS = range(4, 16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [S, T, N], weight: [S, N]. Statistics in float32 whatever the compute dtype. (Here
    beside `product`, whose PyTorch path normalises its input with it.) By the kernels
    where they take it: the bits of a product's own norm, in one call (PyTorch's took
    about 100 µs on a decode step's path, where its operations start with cold caches)."""
    ops = native() if _norm_fits(x, weight) else None
    if ops is not None:
        return ops.rms_norm(x, weight, eps)
    if x.dtype == torch.float32 and weight.shape[0] == 1:
        # One op instead of three on the decode path (the same float32 result).
        return F.rms_norm(x, (x.shape[-1],), weight[0], eps)
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    return normed * weight[:, None, :]


def product(
    x: torch.Tensor,
    weight: Weight,
    *,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    glu: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [S, R, inputs] (S may be an expanded dimension of one) times weight
    [S, outputs, inputs] transposed -> [S, R, outputs] in x's dtype.

    What a decoder layer does around its products comes with them, so that a decode step
    is a few native calls per layer: with `glu`, x is [gate, up] and the input is
    silu(gate) * up; with `norm` [S, inputs], the input is RMS-normalised (statistics in
    float32) and scaled by it; `residual` [S, R, outputs] is added to the result. A
    quantized weight with `int8_activations` quantizes that input to int8 first."""
    width = x.shape[2] // 2 if glu else x.shape[2]
    quantized = isinstance(weight, QuantizedWeight)
    rows = x.shape[1]
    if (
        quantized
        and weight.int8_activations
        and KERNEL_MAX_ROWS < rows <= CHUNKED_MAX_ROWS
        and _kernel_fits(x[:, :1], weight, width)
    ):
        return _in_chunks(x, weight, norm, eps, glu, residual)
    ops = native() if _kernel_fits(x, weight, width) else None
    quantized_input = quantized and weight.int8_activations
    if ops is not None:
        scale = minimum = None
        group = 0
        if quantized:
            data, scale, minimum, group = (
                weight.data,
                weight.scale,
                weight.minimum,
                weight.group_size,
            )
        else:
            data = weight
        return ops.rows_times(
            x, data, scale, minimum, group, norm, eps, glu, residual, quantized_input
        )
    if glu:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    if norm is not None:
        x = rms_norm(x, norm, eps)
    if quantized_input:
        x = int8_activations(x)
    if quantized:
        weight = weight.dequantize(x.dtype)
    if rows in PADDED_ROW_COUNTS and x.shape[0] == 1 and x.device.type == "cpu":
        padding = x.new_zeros(1, PADDED_ROW_COUNTS.stop - rows, x.shape[2])
        y = torch.bmm(torch.cat([x, padding], dim=1), weight.mT)[:, :rows]
    else:
        y = torch.bmm(x, weight.mT)
    return y if residual is None else y + residual


def _in_chunks(
    x: torch.Tensor,
    weight: QuantizedWeight,
    norm: torch.Tensor | None,
    eps: float,
    glu: bool,
    residual: torch.Tensor | None,
) -> torch.Tensor:
    """`product` of more rows than the kernels take at once, for a quantized weight
    taking int8 activations: by the kernels, `KERNEL_MAX_ROWS` rows at a time. PyTorch's
    path dequantizes the whole weight for every call. SmolLM2's trunk and head0 over a
    prompt, in chunks against PyTorch's path, 5 pairs taken turn about (2-core AMD EPYC,
    Zen 3; medians of the time ratios): int8 0.55, 0.75, 0.86 and 0.90 for 65, 128, 192
    and 256 tokens, 1.04 and 1.14 for 384 and 512; int4 0.46, 0.80, 0.87, then 1.07 for
    256 (hence `CHUNKED_MAX_ROWS`). With float activations the kernels' many-row products
    are slower than BLAS from 128 rows on. Each row is the bits a decode step gives it."""
    chunks = []
    for start in range(0, x.shape[1], KERNEL_MAX_ROWS):
        rows = slice(start, start + KERNEL_MAX_ROWS)
        added = None if residual is None else residual[:, rows]
        chunks.append(product(x[:, rows], weight, norm=norm, eps=eps, glu=glu, residual=added))
    return torch.cat(chunks, dim=1)


def cached_attention(
    qkv: torch.Tensor,
    cache: KVCache,
    layer: int,
    start: int,
    rotation: tuple[torch.Tensor, torch.Tensor],
    heads: int,
    kv_heads: int,
) -> torch.Tensor | None:
    """One session's attention by the native kernel: qkv [S, T, (heads + 2 kv_heads) *
    head_dim] not yet rotated, `rotation` the cos and sin of its positions
    (`RotaryTable.rotation`) -> [S, T, heads * head_dim], the new keys and values
    written into `layer` of the cache at start... None when the kernel cannot take it
    (then the caller uses PyTorch's attention)."""
    ops = native() if _attention_fits(qkv, cache) else None
    if ops is None:
        return None
    cos, sin = rotation
    return ops.attend(qkv, cache.keys, cache.values, layer, start, cos, sin, heads, kv_heads)


def decoded_layers(
    x: torch.Tensor,
    entries: list[torch.Tensor | None],
    group: int,
    quantized_input: bool,
    eps: float,
    caches: list[KVCache],
    starts: list[int],
    rotations: list[tuple[torch.Tensor, torch.Tensor]],
    heads: int,
    kv_heads: int,
) -> torch.Tensor | None:
    """Every layer of a pre-norm stack without biases over the new positions of one or
    more sessions (x: their rows one session after the other; per session its cache, its
    start and the rotation of its positions), in one native call (`LayerStack`;
    `entries`: 14 per layer, `_Layer.native_entries`; `quantized_input`: the weights'
    `int8_activations`). None when the kernels cannot take it."""
    ops = native() if all(_attention_fits(x, cache) for cache in caches) else None
    if ops is None:
        return None
    return ops.decode_layers(
        x,
        entries,
        group,
        quantized_input,
        eps,
        [cache.keys for cache in caches],
        [cache.values for cache in caches],
        starts,
        [cos for cos, _ in rotations],
        [sin for _, sin in rotations],
        heads,
        kv_heads,
    )


def embed(weight: Weight, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `tokens` of an embedding [V, D] -> [len(tokens), D]."""
    if isinstance(weight, QuantizedWeight):
        return weight.rows(tokens, dtype)
    return weight[tokens]


def _kernel_fits(x: torch.Tensor, weight: Weight, width: int) -> bool:
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.shape[1] <= KERNEL_MAX_ROWS
        and width % 32 == 0
        and x.stride(2) == 1
        and (x.shape[0] == weight.shape[0] or x.stride(0) == 0)
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and (isinstance(weight, QuantizedWeight) or weight.is_contiguous())
    )


def _norm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.device.type == "cpu"
        and x.dim() == 3
        and weight.dim() == 2
        and x.shape[0] in (1, weight.shape[0])
        and x.shape[2] == weight.shape[1]
        and x.stride(2) == 1
        and weight.is_contiguous()
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


def _attention_fits(x: torch.Tensor, cache: KVCache) -> bool:
    """Whether the native attention takes these rows and this cache."""
    head_dim = cache.keys.shape[-1]
    return (
        x.dtype == torch.float32
        and cache.keys.dtype == torch.float32
        and x.device.type == "cpu"
        and x.shape[1] <= KERNEL_MAX_ROWS
        and x.stride(2) == 1
        and head_dim % 32 == 0
        and head_dim <= 256
        and not torch.is_grad_enabled()
    )
