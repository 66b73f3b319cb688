"""The Hydra model runtime: a shared trunk and several heads over one decoder.

- `config`: the decoder description (Llama family, Qwen2, OLMo-2)
- `layers`, `rope`, `kv_cache`: decoder layers stacked over heads, rotary embeddings,
  preallocated caches
- `trunk`, `heads`: the `Trunk` and the `HeadStack`
- `checkpoint`, `model`: the checkpoint format and a loaded `HydraModel`
- `draft_model`: a separate small causal LM that drafts (`DraftModel`)
- `build/`: offline tooling (checkpoint builder, sources, LoRA merge, demo, describe)
"""

from hydra_jury.hydra_model.checkpoint import CheckpointError
from hydra_jury.hydra_model.draft_model import DraftCache, DraftModel
from hydra_jury.hydra_model.heads import HeadRun, HeadStack
from hydra_jury.hydra_model.kv_cache import CacheError, KVCache, KVCachePool
from hydra_jury.hydra_model.layers import Segment
from hydra_jury.hydra_model.model import HydraModel
from hydra_jury.hydra_model.trunk import Trunk

__all__ = [
    "CacheError",
    "CheckpointError",
    "DraftCache",
    "DraftModel",
    "HeadRun",
    "HeadStack",
    "HydraModel",
    "KVCache",
    "KVCachePool",
    "Segment",
    "Trunk",
]
