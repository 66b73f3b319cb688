"""Heads: decoder layers [K, L), final norm and LM head, several evaluated as one stack."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hydra_jury.hydra_model.kv_cache import KVCache, SlotBatch
from hydra_jury.hydra_model.layers import LayerStack, Segment
from hydra_jury.hydra_model.products import Weight, product, rms_norm
from hydra_jury.hydra_model.quantization import tensors_of
from hydra_jury.hydra_model.rope import RotaryTable


def shared_lm_head(rows: torch.Tensor, lm_head: Weight) -> torch.Tensor:
    """Logits of `rows` [M, D] under a shared LM head [V, D] -> [M, V]."""
    return product(rows[None], lm_head[None])[0]


@dataclass(frozen=True)
class HeadRun:
    """Some heads of a stack over one ragged batch of their own: the members
    `first..first + count - 1` read `hidden` [N, D], the trunk outputs of `segments` one
    after the other (each segment's cache a view of those members, `KVCache.members`),
    and give logits at `rows` (indices into N, or a slice of it; None: the caches are
    filled, no logits).
    Heads evaluated on demand each start from where their own cache ends, so the heads
    of one call may need runs of their own (`workers.jury`)."""

    first: int
    count: int
    hidden: torch.Tensor
    segments: list[Segment]
    rows: torch.Tensor | slice | None

    @property
    def members(self) -> slice:
        return slice(self.first, self.first + self.count)


class HeadStack:
    """S heads over the same hidden states, one batched computation.

    `lm_head` is either one [V, D] matrix all heads share (tied embedding or a shared LM
    head: one matmul for every head) or a stack [S, V, D] (one batched matmul).
    """

    def __init__(
        self,
        names: list[str],
        layers: LayerStack,
        norm: torch.Tensor,
        lm_head: Weight,
        rope: RotaryTable,
    ) -> None:
        if len(names) != layers.size or norm.shape[0] != layers.size:
            raise ValueError("head names, layers and norms disagree on the number of heads")
        self.names = names
        self.layers = layers
        self.norm = norm  # [S, D]
        self.lm_head = lm_head  # [V, D] shared, or [S, V, D]
        self.rope = rope
        self._member_layers: dict[tuple[int, int], LayerStack] = {}  # views, made once

    @property
    def size(self) -> int:
        return len(self.names)

    @property
    def shares_lm_head(self) -> bool:
        return len(self.lm_head.shape) == 2

    def tensors(self) -> list[torch.Tensor]:
        return [*self.layers.tensors(), self.norm, *tensors_of(self.lm_head)]

    def select(self, index: int, count: int = 1) -> HeadStack:
        """A stack of the `count` heads from `index` on, sharing this stack's weights (no
        copy)."""
        if not (index >= 0 and count >= 1 and index + count <= self.size):
            raise IndexError(f"heads {index}..{index + count - 1} out of range for {self.size}")
        members = slice(index, index + count)
        lm_head = self.lm_head if self.shares_lm_head else self.lm_head[members]
        return HeadStack(
            self.names[members], self.layers.select(members), self.norm[members], lm_head, self.rope
        )

    @torch.inference_mode()
    def forward(
        self, hidden: torch.Tensor, cache: KVCache, start: int, return_hidden: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """hidden: trunk output [T, D] at positions start..start+T-1.

        Returns logits [S, T, V] in float32, and with `return_hidden` also each head's last
        hidden state before the final norm, [S, T, D]. Appends T positions to the cache."""
        segments = [Segment(cache, start, len(hidden))]
        return self.forward_ragged(hidden, segments, return_hidden=return_hidden)

    @torch.inference_mode()
    def forward_ragged(
        self,
        hidden: torch.Tensor,
        segments: list[Segment],
        return_hidden: bool = False,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """hidden: trunk outputs [N, D] of the segments' tokens one after the other ->
        logits [S, N, V] (and the hidden states [S, N, D], as `forward`). With `rows`
        (indices into N), only those rows come out, [S, len(rows), ...]: the LM head is
        most of a small head's work, and a prompt's next token needs only its last row."""
        x = self._layers_ragged(hidden, segments)
        if rows is not None:
            x = x[:, rows]
        logits = self._logits(x)
        return (logits, x) if return_hidden else logits

    @torch.inference_mode()
    def forward_static(
        self, hidden: torch.Tensor, batch: SlotBatch, members: slice = slice(None)
    ) -> torch.Tensor:
        """hidden: the trunk outputs [B, D] of the B positions of `batch` -> the logits
        [count, B, V] float32 of the heads `members` (default: all; `batch`'s keys and
        values are theirs), at shapes that depend on B alone (`LayerStack.forward_static`)."""
        if members == slice(None):
            layers = self.layers
        else:
            layers = self._layers_of(members.start, members.stop - members.start)
        x = hidden[None].expand(layers.size, -1, -1)
        return self._logits(layers.forward_static(x, batch, self.rope), members)

    @torch.inference_mode()
    def forward_runs(self, runs: list[HeadRun]) -> list[torch.Tensor | None]:
        """Each run's heads over its batch -> its logits [count, len(rows), V] float32
        (None for a run without rows). A shared LM head multiplies every run's rows in
        one product: it is read once, whatever the runs."""
        wanted: list[torch.Tensor | None] = []
        for run in runs:
            x = run.hidden[None].expand(run.count, -1, -1)  # [count, N, D], no copy
            x = self._layers_of(run.first, run.count).forward_ragged(x, run.segments, self.rope)
            wanted.append(None if run.rows is None else x[:, run.rows])
        if not self.shares_lm_head:
            return [
                None if x is None else self._logits(x, run.members)
                for run, x in zip(runs, wanted, strict=True)
            ]
        eps = self.layers.config.rms_norm_eps
        normed = [
            None if x is None else rms_norm(x, self.norm[run.members], eps)
            for run, x in zip(runs, wanted, strict=True)
        ]
        present = [x.flatten(0, 1) for x in normed if x is not None]
        if not present:
            return normed
        if len(present) == 1:  # (a decode step's usual case: no copy, no split)
            pieces = iter([shared_lm_head(present[0], self.lm_head).float()])
        else:
            products = shared_lm_head(torch.cat(present), self.lm_head).float()
            pieces = iter(products.split([len(x) for x in present]))
        return [None if x is None else next(pieces).unflatten(0, x.shape[:2]) for x in normed]

    def _layers_of(self, first: int, count: int) -> LayerStack:
        key = (first, count)
        if key not in self._member_layers:
            self._member_layers[key] = self.select(first, count).layers
        return self._member_layers[key]

    def forward_training(
        self, hidden: torch.Tensor, lengths: list[int], last_only: bool = False
    ) -> torch.Tensor:
        """hidden: [S, N, D], each head its own trunk outputs of whole sequences of
        `lengths` tokens (one after the other) -> logits [S, N, V] in float32, or with
        `last_only` [S, len(lengths), V] at each sequence's last token. No cache and no
        inference mode, so gradients reach the weights (`train-heads`)."""
        segments = [Segment(None, 0, length) for length in lengths]
        x = self.layers.forward_ragged(hidden, segments, self.rope)
        if last_only:
            x = x[:, torch.tensor(lengths).cumsum(0) - 1]
        return self._logits(x)

    def _logits(self, x: torch.Tensor, members: slice = slice(None)) -> torch.Tensor:
        """Final norm and LM head of the heads `members` (default: all): last hidden
        states [S, N, D] -> [S, N, V] float32."""
        normed = rms_norm(x, self.norm[members], self.layers.config.rms_norm_eps)
        if self.shares_lm_head:
            logits = shared_lm_head(normed.flatten(0, 1), self.lm_head)  # [S * N, V]
            logits = logits.unflatten(0, normed.shape[:2])  # [S, N, V]
        else:
            logits = product(normed, self.lm_head[members])
        return logits.float()

    @torch.inference_mode()
    def fill_ragged(self, hidden: torch.Tensor, segments: list[Segment]) -> None:
        """The segments' positions into the caches only, as `forward_ragged` without the
        final norm and LM head: a prefill needs no logits, and the LM head is most of a
        small head's work (576 × 49152 per position and head for SmolLM2)."""
        self._layers_ragged(hidden, segments)

    def _layers_ragged(self, hidden: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        x = hidden[None].expand(self.size, -1, -1)  # [S, N, D], no copy
        return self.layers.forward_ragged(x, segments, self.rope)
