"""A draft model: a separate small causal LM that proposes tokens for the jury to check.

Any Hydra checkpoint is one: its trunk followed by its first `llm` head is a whole
decoder (embedding, every layer, final norm, LM head). A Hugging Face directory or GGUF
file becomes such a checkpoint with `hydra-jury build --heads 1` (the CLI's
`--draft-model` converts one once and caches it), so the draft model runs on the
project's runtime, with caches of its own, and needs no second model implementation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from hydra_jury.hydra_model.checkpoint import CheckpointError, read_manifest
from hydra_jury.hydra_model.kv_cache import KVCache, KVCachePool
from hydra_jury.hydra_model.layers import Segment
from hydra_jury.hydra_model.model import HydraModel

# What decides how text becomes token ids (formatting aside): the tokenizer model, its
# added tokens and the normaliser / pre-tokeniser.
TOKENIZER_KEYS = ("model", "added_tokens", "normalizer", "pre_tokenizer")


@dataclass
class DraftCache:
    """One session's caches in the draft model (trunk part and head part, always the
    same length)."""

    trunk: KVCache
    head: KVCache

    @property
    def length(self) -> int:
        return self.trunk.length

    def truncate(self, length: int) -> None:
        self.trunk.truncate(length)
        self.head.truncate(length)


class DraftModel:
    def __init__(self, model: HydraModel) -> None:
        if model.trunk is None or model.heads.size != 1:
            raise ValueError("a draft model is a trunk and exactly one head")
        self.model = model
        self.head = model.heads

    @classmethod
    def load(
        cls, directory: str | Path, *, dtype: str | None = None, device: str = "cpu"
    ) -> DraftModel:
        """The checkpoint's trunk and first `llm` head."""
        manifest = read_manifest(directory)
        if not manifest.llm_heads:
            raise CheckpointError(f"{directory}: a draft model needs a head of role llm")
        first = manifest.llm_heads[0].name
        return cls(HydraModel.load(directory, dtype=dtype, device=device, heads=[first]))

    @property
    def description(self) -> str:
        """What the trunk service reports: the directory and the size of the model."""
        config = self.model.config
        return f"{self.model.directory.name} ({config.model_type}, {config.num_layers} layers)"

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def pools(self, num_slots: int, capacity: int) -> tuple[KVCachePool, KVCachePool]:
        return self.model.trunk_pool(num_slots, capacity), self.model.head_pool(
            1, num_slots, capacity
        )

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: DraftCache, start: int) -> torch.Tensor:
        """tokens [T] at positions start.. → next-token logits [T, V] (float32)."""
        hidden = self.model.trunk.forward(tokens, cache.trunk, start)
        return self.head.forward(hidden, cache.head, start)[0]

    @torch.inference_mode()
    def next_token_logits(
        self, tokens: torch.Tensor, cache: DraftCache, start: int
    ) -> torch.Tensor:
        """`forward`'s last row [1, V] alone: the earlier positions only fill the caches,
        so the LM head (most of a small model's work per position) runs once."""
        hidden = self.model.trunk.forward(tokens, cache.trunk, start)
        if len(hidden) > 1:
            self.head.fill_ragged(hidden[:-1], [Segment(cache.head, start, len(hidden) - 1)])
        return self.head.forward(hidden[-1:], cache.head, start + len(hidden) - 1)[0]

    def check_compatible(self, target: HydraModel) -> None:
        """Raises `CheckpointError` unless the draft model reads and writes the target's
        token ids: the same vocabulary size and the same tokenizer."""
        where = f"draft model {self.model.directory}"
        if self.vocab_size != target.config.vocab_size:
            raise CheckpointError(
                f"{where}: vocabulary of {self.vocab_size} tokens, but the checkpoint's "
                f"has {target.config.vocab_size}; a draft model must share its tokenizer"
            )
        mine, theirs = _tokenizer(self.model.directory), _tokenizer(target.directory)
        if mine is not None and theirs is not None and mine != theirs:
            raise CheckpointError(
                f"{where}: its tokenizer differs from {target.directory}'s; a draft model "
                "must share the checkpoint's tokenizer"
            )


def _tokenizer(directory: Path) -> dict | None:
    path = directory / "tokenizer.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return {key: data.get(key) for key in TOKENIZER_KEYS}
