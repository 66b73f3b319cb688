"""Decoder layers evaluated as a stack of S independent copies at once.

The trunk is a stack of one; a `HeadStack` is a stack of one copy per head. Every
weight carries a leading stack dimension and every matmul is batched over it, so S heads
reading the same hidden states cost one batched computation, not a Python loop.

A forward runs over a ragged batch: the tokens of several sessions flattened into one
sequence, each session a `Segment` (its cache slot, its start position, its length).
The projections and the MLP read each weight once for every token of every session —
the point of batching, since decoding at batch 1 is memory-bound — and only attention
runs per segment, against that session's cache. One session is a batch of one segment.

Per-layer tensor names (as stored in Hydra checkpoints, without the `layers.{i}.`
prefix) are those of Hugging Face Llama/Qwen2/OLMo-2 with the module path dropped:
`q_proj.weight`, `gate_proj.weight`, `input_layernorm.weight`, ...
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from hydra_jury.hydra_model.config import DecoderConfig
from hydra_jury.hydra_model.kv_cache import KVCache, SlotBatch
from hydra_jury.hydra_model.products import (
    Weight,
    cached_attention,
    decoded_layers,
    product,
    rms_norm,
)
from hydra_jury.hydra_model.quantization import QuantizedWeight, cat_outputs, tensors_of
from hydra_jury.hydra_model.quantization import stack as stack_weights
from hydra_jury.hydra_model.rope import RotaryTable, rotate


def layer_tensor_shapes(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor one decoder layer of this config must have."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.q_size, config.kv_size
    shapes: dict[str, tuple[int, ...]] = {
        "q_proj.weight": (q, hidden),
        "k_proj.weight": (kv, hidden),
        "v_proj.weight": (kv, hidden),
        "o_proj.weight": (hidden, q),
        "gate_proj.weight": (inter, hidden),
        "up_proj.weight": (inter, hidden),
        "down_proj.weight": (hidden, inter),
        "post_attention_layernorm.weight": (hidden,),
    }
    if config.post_norms:
        shapes["post_feedforward_layernorm.weight"] = (hidden,)
    else:
        shapes["input_layernorm.weight"] = (hidden,)
    if config.qk_norm:
        shapes["q_norm.weight"] = (q,)
        shapes["k_norm.weight"] = (kv,)
    if config.attention_bias:
        shapes.update({"q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,)})
    if config.o_proj_bias:
        shapes["o_proj.bias"] = (hidden,)
    if config.mlp_bias:
        shapes.update(
            {"gate_proj.bias": (inter,), "up_proj.bias": (inter,), "down_proj.bias": (hidden,)}
        )
    return shapes


@dataclass(frozen=True)
class Segment:
    """One session's tokens in a ragged batch: `length` tokens at positions start..,
    appended to `cache`. Without a cache (training) a segment is a whole sequence from
    position 0 whose tokens attend to each other only, and nothing is kept."""

    cache: KVCache | None
    start: int
    length: int


@dataclass
class _SegmentPlan:
    """A segment's rows in the ragged batch and the rotation of its positions; the
    attention mask of a continuation, made on first use (every layer shares them)."""

    segment: Segment
    rows: slice
    rotation: tuple[torch.Tensor, torch.Tensor]
    _mask: torch.Tensor | None = None

    def mask(self) -> torch.Tensor:
        """[T, start+T]: query i sits at position start + i and sees keys 0..start + i."""
        if self._mask is None:
            start, length = self.segment.start, self.segment.length
            device = self.rotation[0].device
            key_positions = torch.arange(start + length, device=device)
            query_positions = torch.arange(start, start + length, device=device)
            self._mask = key_positions[None, :] <= query_positions[:, None]
        return self._mask


def _linear(
    x: torch.Tensor,
    weight: Weight,
    bias: torch.Tensor | None,
    *,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    glu: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [S, T, in], weight: [S, out, in], bias: [S, out] -> [S, T, out], with what
    `products.product` fuses around it (norm, gate, residual)."""
    if bias is None:
        return product(x, weight, norm=norm, eps=eps, glu=glu, residual=residual)
    y = product(x, weight, norm=norm, eps=eps, glu=glu) + bias[:, None, :]
    return y if residual is None else y + residual


class _Layer:
    """One decoder layer's stacked weights, fused where that saves a matmul. The
    projections may be quantized (`quantization`); norms and biases are float."""

    def __init__(self, config: DecoderConfig, members: Sequence[dict[str, Weight]]) -> None:
        def stack(name: str) -> Weight:
            return stack_weights([member[name] for member in members])

        def maybe(name: str) -> torch.Tensor | None:
            return stack(name) if name in members[0] else None

        # q, k and v in one matmul; gate and up in another.
        self.qkv_weight = cat_outputs(
            [stack("q_proj.weight"), stack("k_proj.weight"), stack("v_proj.weight")]
        )
        self.qkv_bias = (
            torch.cat([stack("q_proj.bias"), stack("k_proj.bias"), stack("v_proj.bias")], dim=1)
            if config.attention_bias
            else None
        )
        self.o_weight, self.o_bias = stack("o_proj.weight"), maybe("o_proj.bias")
        self.gate_up_weight = cat_outputs([stack("gate_proj.weight"), stack("up_proj.weight")])
        self.gate_up_bias = (
            torch.cat([stack("gate_proj.bias"), stack("up_proj.bias")], dim=1)
            if config.mlp_bias
            else None
        )
        self.down_weight, self.down_bias = stack("down_proj.weight"), maybe("down_proj.bias")
        if config.post_norms:
            self.attn_norm = stack("post_attention_layernorm.weight")
            self.mlp_norm = stack("post_feedforward_layernorm.weight")
        else:
            self.attn_norm = stack("input_layernorm.weight")
            self.mlp_norm = stack("post_attention_layernorm.weight")
        self.q_norm, self.k_norm = maybe("q_norm.weight"), maybe("k_norm.weight")

    def native_entries(self) -> list[torch.Tensor | None]:
        """The 14 tensors of this layer that `products.decoded_layers` takes: each
        projection as (values, scale, minimum), then the two norms."""
        entries: list[torch.Tensor | None] = []
        for weight in (self.qkv_weight, self.o_weight, self.gate_up_weight, self.down_weight):
            if isinstance(weight, QuantizedWeight):
                entries += [weight.data, weight.scale, weight.minimum]
            else:
                entries += [weight, None, None]
        return [*entries, self.attn_norm, self.mlp_norm]

    def tensors(self) -> list[torch.Tensor]:
        values = [v for v in vars(self).values() if isinstance(v, torch.Tensor | QuantizedWeight)]
        return [t for value in values for t in tensors_of(value)]

    def select(self, members: slice) -> _Layer:
        """A view of some members of the stack (no copy)."""
        view = object.__new__(_Layer)
        for name, value in vars(self).items():
            setattr(view, name, None if value is None else value[members])
        return view


# A layer's attention given its fused projection: (layer, index, qkv [S, N, q+2kv]) ->
# [S, N, q]. Over the segments' caches (`forward_ragged`) or one fixed-shape step
# (`forward_static`).
_Attend = Callable[[_Layer, int, torch.Tensor], torch.Tensor]


class LayerStack:
    """Layers [first, first + n) of the decoder, S copies evaluated together."""

    def __init__(self, config: DecoderConfig, first_layer: int, layers: list[_Layer]) -> None:
        self.config = config
        self.first_layer = first_layer
        self.layers = layers
        self._native: tuple[list[torch.Tensor | None], int] | None = None  # made on first use

    @classmethod
    def from_tensors(
        cls,
        config: DecoderConfig,
        first_layer: int,
        members: Sequence[Sequence[dict[str, torch.Tensor]]],
    ) -> LayerStack:
        """members[s][l] is the tensor dict of layer first_layer + l of stack member s."""
        num_layers = len(members[0])
        layers = [_Layer(config, [member[i] for member in members]) for i in range(num_layers)]
        return cls(config, first_layer, layers)

    @property
    def size(self) -> int:
        """S, the number of stacked copies."""
        return self.layers[0].qkv_weight.shape[0] if self.layers else 0

    def select(self, members: slice) -> LayerStack:
        return LayerStack(
            self.config, self.first_layer, [layer.select(members) for layer in self.layers]
        )

    def tensors(self) -> list[torch.Tensor]:
        return [t for layer in self.layers for t in layer.tensors()]

    def forward(
        self, x: torch.Tensor, cache: KVCache, start: int, rope: RotaryTable
    ) -> torch.Tensor:
        """x: [S, T, D] at positions start..start+T-1 -> [S, T, D]. Appends to the cache."""
        return self.forward_ragged(x, [Segment(cache, start, x.shape[1])], rope)

    def forward_ragged(
        self, x: torch.Tensor, segments: Sequence[Segment], rope: RotaryTable
    ) -> torch.Tensor:
        """x: [S, N, D], the tokens of `segments` one after the other (N = the sum of
        their lengths) -> [S, N, D]. Appends each segment's tokens to its cache."""
        if sum(segment.length for segment in segments) != x.shape[1]:
            raise ValueError(
                f"the segments hold {sum(s.length for s in segments)} tokens, x has {x.shape[1]}"
            )
        cached = [segment for segment in segments if segment.cache is not None]
        if len({id(segment.cache) for segment in cached}) != len(cached):
            raise ValueError("a session's cache appears twice in one batch")
        if any(segment.start != 0 for segment in segments if segment.cache is None):
            raise ValueError("a segment without a cache must start at position 0")
        for segment in cached:
            segment.cache.check_append(segment.start, segment.length)
        # What every layer's attention needs of each segment, taken once per forward.
        plans, offset = [], 0
        for segment in segments:
            rows = slice(offset, offset + segment.length)
            plans.append(_SegmentPlan(segment, rows, rope.rotation(segment.start, segment.length)))
            offset += segment.length
        decoded = self._decode_natively(x, plans)
        if decoded is not None:
            x = decoded
        else:
            attend = partial(self._attend_segments, plans)
            for index, layer in enumerate(self.layers):
                x = self._layer_forward(layer, index, x, attend)
        for segment in cached:
            segment.cache.advance(segment.length)
        return x

    def _decode_natively(self, x: torch.Tensor, plans: list[_SegmentPlan]) -> torch.Tensor | None:
        """The sessions' new positions through every layer in one native call, when the
        layers are plain pre-norm ones (no biases, no q/k norms) and every segment has a
        cache; else None."""
        config = self.config
        plain = not (
            config.post_norms
            or config.qk_norm
            or config.attention_bias
            or config.o_proj_bias
            or config.mlp_bias
        )
        if not plain or any(plan.segment.cache is None for plan in plans) or not self.layers:
            return None
        if self._native is None:
            weights = [layer.qkv_weight for layer in self.layers]
            groups = {w.group_size if isinstance(w, QuantizedWeight) else 0 for w in weights}
            quantized_input = any(
                isinstance(w, QuantizedWeight) and w.int8_activations for w in weights
            )
            entries = [entry for layer in self.layers for entry in layer.native_entries()]
            self._native = (entries, max(groups), quantized_input)
        entries, group, quantized_input = self._native
        return decoded_layers(
            x,
            entries,
            group,
            quantized_input,
            config.rms_norm_eps,
            [plan.segment.cache for plan in plans],
            [plan.segment.start for plan in plans],
            [plan.rotation for plan in plans],
            config.num_attention_heads,
            config.num_key_value_heads,
        )

    @torch.inference_mode()
    def forward_static(self, x: torch.Tensor, batch: SlotBatch, rope: RotaryTable) -> torch.Tensor:
        """x: [S, B, D], B new positions, each addressed by `batch` (its session's slot and
        its position, in device tensors) -> [S, B, D]. A session may bring several rows,
        at consecutive positions: every row's key and value is written before any row
        attends, so they attend causally among themselves. Every shape is fixed, whatever
        the sessions and positions: attention spans `batch.span` positions of each slot,
        masked past the row's position, and nothing is read back to the host — the step a CUDA graph
        replays (`graphs`). The caller moves the caches' lengths. A row may repeat another
        (a batch padded to a recorded size): it writes the same key and value again."""
        positions = batch.positions
        rotation = (rope.cos[positions][:, None, :], rope.sin[positions][:, None, :])  # [B, 1, hd]
        span = batch.keys.shape[4] if batch.span is None else batch.span
        visible = torch.arange(span, device=positions.device) <= positions[:, None]  # [B, span]
        attend = partial(self._attend_static, batch, rotation, visible)
        for index, layer in enumerate(self.layers):
            x = self._layer_forward(layer, index, x, attend)
        return x

    def _layer_forward(
        self, layer: _Layer, index: int, x: torch.Tensor, attend: _Attend
    ) -> torch.Tensor:
        config = self.config
        eps = config.rms_norm_eps
        if config.post_norms:
            attended = self._attention(layer, index, x, attend)
            x = x + rms_norm(attended, layer.attn_norm, eps)
            return x + rms_norm(self._mlp(layer, x), layer.mlp_norm, eps)
        # Pre-norms: each norm and residual add travels with its product.
        x = self._attention(layer, index, x, attend, norm=layer.attn_norm, residual=x)
        return self._mlp(layer, x, norm=layer.mlp_norm, residual=x)

    def _attention(
        self,
        layer: _Layer,
        index: int,
        x: torch.Tensor,
        attend: _Attend,
        norm: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        qkv = _linear(x, layer.qkv_weight, layer.qkv_bias, norm=norm, eps=eps)  # [S, N, q+2kv]
        out = attend(layer, index, qkv)  # [S, N, q]
        return _linear(out, layer.o_weight, layer.o_bias, residual=residual)

    def _split_qkv(self, layer: _Layer, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """qkv [S, N, q+2kv] -> qk [S, N, heads + kv_heads, hd] (q and k side by side, not
        yet rotated, q/k-normed where the model has those norms) and v [S, N, kv_heads, hd]."""
        config = self.config
        stack, tokens, _ = qkv.shape
        q, k, v = qkv.split([config.q_size, config.kv_size, config.kv_size], dim=-1)
        if layer.q_norm is None:
            qk = qkv[..., : config.q_size + config.kv_size]
        else:
            eps = config.rms_norm_eps
            qk = torch.cat([rms_norm(q, layer.q_norm, eps), rms_norm(k, layer.k_norm, eps)], -1)
        qk = qk.reshape(stack, tokens, -1, config.head_dim)
        return qk, v.reshape(stack, tokens, config.num_key_value_heads, config.head_dim)

    def _attend_segments(
        self, plans: list[_SegmentPlan], layer: _Layer, index: int, qkv: torch.Tensor
    ) -> torch.Tensor:
        """Each segment's attention against its own cache, by the native kernel where it
        takes them all."""
        if layer.q_norm is None:
            out = self._attend_natively(index, qkv, plans)
            if out is not None:
                return out
        qk, v = self._split_qkv(layer, qkv)
        if len(plans) == 1:
            return self._attend(index, qk, v, plans[0])
        return torch.cat([self._attend(index, qk[:, p.rows], v[:, p.rows], p) for p in plans], 1)

    def _attend_static(
        self,
        batch: SlotBatch,
        rotation: tuple[torch.Tensor, torch.Tensor],
        visible: torch.Tensor,
        layer: _Layer,
        index: int,
        qkv: torch.Tensor,
    ) -> torch.Tensor:
        """`forward_static`'s attention: each row's key and value written into its slot at
        its position, then its slot's positions up to the span attended, those past the
        row's own masked."""
        config = self.config
        stack, rows = qkv.shape[:2]
        qk, v = self._split_qkv(layer, qkv)
        qk = rotate(qk, rotation)  # [S, B, heads + kv_heads, hd]
        q, k = qk.split([config.num_attention_heads, config.num_key_value_heads], dim=2)
        slots, positions, span = batch.slots, batch.positions, visible.shape[1]
        attended = []
        for pool, new in ((batch.keys, k), (batch.values, v)):
            layer_pool = pool[:, :, index]  # [slots, S, kv, C, hd]
            layer_pool[slots, :, :, positions] = new.transpose(0, 1)  # [B, S, kv, hd]
            # [B, S, kv, span, hd] -> [S * B, kv, span, hd]: each row beside its slot's
            # positions up to the span.
            held = layer_pool[:, :, :, :span][slots]
            attended.append(held.transpose(0, 1).flatten(0, 1))
        keys, values = attended
        q = q.reshape(stack * rows, config.num_attention_heads, 1, config.head_dim)
        mask = visible.expand(stack, -1, -1).reshape(stack * rows, 1, 1, -1)
        gqa = config.num_attention_heads != config.num_key_value_heads
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)
        return out.reshape(stack, rows, config.q_size)

    def _attend_natively(
        self, index: int, qkv: torch.Tensor, plans: list[_SegmentPlan]
    ) -> torch.Tensor | None:
        """Every segment's attention by the native kernel, or None if one cannot be."""
        if any(plan.segment.cache is None for plan in plans):
            return None
        config = self.config
        outs = []
        for plan in plans:
            out = cached_attention(
                qkv[:, plan.rows],
                plan.segment.cache,
                index,
                plan.segment.start,
                plan.rotation,
                config.num_attention_heads,
                config.num_key_value_heads,
            )
            if out is None:
                return None
            outs.append(out)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def _attend(
        self, index: int, qk: torch.Tensor, v: torch.Tensor, plan: _SegmentPlan
    ) -> torch.Tensor:
        """One segment's attention over its cache: qk [S, T, heads + kv_heads, hd] (not
        yet rotated), v [S, T, kv_heads, hd] -> [S, T, q]. Writes its keys and values
        into layer `index` of the cache."""
        config = self.config
        stack, length = qk.shape[:2]
        segment, start = plan.segment, plan.segment.start
        qk = rotate(qk, plan.rotation).transpose(1, 2)  # [S, heads + kv_heads, T, hd]
        q, k = qk.split([config.num_attention_heads, config.num_key_value_heads], dim=1)
        v = v.transpose(1, 2)
        if segment.cache is None:
            keys, values = k, v  # a whole sequence: it attends to itself alone
        else:
            keys, values = segment.cache.write(index, start, k, v)  # [S, nkv, start+T, hd]
        gqa = config.num_attention_heads != config.num_key_value_heads
        if length == 1:
            out = F.scaled_dot_product_attention(q, keys, values, enable_gqa=gqa)
        elif start == 0:
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=plan.mask(), enable_gqa=gqa
            )
        return out.transpose(1, 2).reshape(stack, length, config.q_size)

    def _mlp(
        self,
        layer: _Layer,
        x: torch.Tensor,
        norm: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        gate_up = _linear(x, layer.gate_up_weight, layer.gate_up_bias, norm=norm, eps=eps)
        return _linear(gate_up, layer.down_weight, layer.down_bias, glu=True, residual=residual)
