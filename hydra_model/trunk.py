"""The shared trunk: token embedding and decoder layers [0, K)."""

from __future__ import annotations

import torch

from hydra_jury.hydra_model.kv_cache import KVCache, SlotBatch
from hydra_jury.hydra_model.layers import LayerStack, Segment
from hydra_jury.hydra_model.products import Weight, embed
from hydra_jury.hydra_model.quantization import tensors_of
from hydra_jury.hydra_model.rope import RotaryTable


class Trunk:
    def __init__(self, embedding: Weight, layers: LayerStack, rope: RotaryTable) -> None:
        self.embedding = embedding  # [V, D]
        self.layers = layers  # a stack of one
        self.rope = rope

    @property
    def num_layers(self) -> int:
        return len(self.layers.layers)

    def tensors(self) -> list[torch.Tensor]:
        return [*tensors_of(self.embedding), *self.layers.tensors()]

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
        """tokens: [T] at positions start..start+T-1 -> hidden states [T, D] (input of the
        first head layer). Appends T positions to the cache."""
        return self.forward_ragged(tokens, [Segment(cache, start, len(tokens))])

    @torch.inference_mode()
    def forward_ragged(self, tokens: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        """tokens: [N], the segments' tokens one after the other -> hidden states [N, D]."""
        x = embed(self.embedding, tokens, self.rope.cos.dtype)[None]  # [1, N, D]
        return self.layers.forward_ragged(x, segments, self.rope)[0]

    @torch.inference_mode()
    def forward_static(self, tokens: torch.Tensor, batch: SlotBatch) -> torch.Tensor:
        """tokens: [B], the tokens of the B positions of `batch` -> hidden states [B, D], at
        shapes that depend on B alone (`LayerStack.forward_static`)."""
        x = embed(self.embedding, tokens, self.rope.cos.dtype)[None]
        return self.layers.forward_static(x, batch, self.rope)[0]
