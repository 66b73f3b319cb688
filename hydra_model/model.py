"""A loaded Hydra model: trunk, heads, tokenizer, and the caches they need."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from hydra_jury.hydra_model.checkpoint import (
    DTYPES,
    HEAD_SHAPE_NOTE,
    TRUNK_FILE,
    CheckpointError,
    HeadSpec,
    Manifest,
    checkpoint_fingerprint,
    read_manifest,
    read_tensors,
    split_layers,
)
from hydra_jury.hydra_model.heads import HeadStack
from hydra_jury.hydra_model.kv_cache import KVCache, KVCachePool
from hydra_jury.hydra_model.layers import LayerStack
from hydra_jury.hydra_model.products import Weight
from hydra_jury.hydra_model.quantization import QuantizationError
from hydra_jury.hydra_model.quantization import stack as stack_weights
from hydra_jury.hydra_model.rope import RotaryTable
from hydra_jury.hydra_model.trunk import Trunk
from hydra_jury.hydra_model.weight_pages import place_on_huge_pages


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {list(DTYPES)}")
    return DTYPES[name]


def default_dtype(device: torch.device, stored: str) -> str:
    """The compute dtype when none is asked for: bfloat16 on a GPU (its matrix units'
    rate, half the bytes per weight read, float32's range), the checkpoint's own on a
    CPU (where the native kernels take float32 and quantized weights)."""
    return "bfloat16" if device.type == "cuda" else stored


def resolve_device(name: str | torch.device) -> torch.device:
    """A device that exists here, or ValueError saying why not (before any tensor is
    made, whose own error would name neither the flag nor the fix)."""
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {str(name)!r}: expected cpu, cuda or cuda:N")
    if device.type == "cpu":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: this PyTorch ({torch.__version__}) sees no CUDA device")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(f"device {name!r}: this machine has {count} CUDA device(s)")
    # Tensors name their GPU ("cuda:0"); a bare "cuda" would compare unequal to them.
    index = torch.cuda.current_device() if device.index is None else device.index
    return torch.device("cuda", index)


@dataclass
class HydraModel:
    manifest: Manifest
    directory: Path
    trunk: Trunk | None
    heads: HeadStack  # the loaded `llm` heads, in checkpoint order
    dtype: torch.dtype
    device: torch.device
    fingerprint: str  # sha256 of hydra.json, read once at load: same checkpoint, same id

    @property
    def config(self):
        return self.manifest.decoder

    @property
    def context_length(self) -> int:
        return self.config.max_position_embeddings

    @property
    def head_names(self) -> list[str]:
        return list(self.heads.names)

    def head_index(self, name: str) -> int:
        if name not in self.heads.names:
            raise KeyError(f"unknown head {name!r}; loaded heads: {self.heads.names}")
        return self.heads.names.index(name)

    @classmethod
    def load(
        cls,
        directory: str | Path,
        *,
        dtype: str | None = None,
        device: str = "cpu",
        heads: list[str] | None = None,
        role: str = "llm",
        load_trunk: bool = True,
    ) -> HydraModel:
        """Loads and validates a checkpoint. `heads` picks a subset (default: every head of
        `role`); `load_trunk=False` skips the trunk (a jury shard needs none)."""
        directory = Path(directory)
        manifest = read_manifest(directory)
        torch_device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype or default_dtype(torch_device, manifest.dtype))
        config = manifest.decoder
        by_name = {h.name: h for h in manifest.heads}
        if heads is None:
            chosen = [h for h in manifest.heads if h.role == role]
        else:
            unknown = [name for name in heads if name not in by_name]
            if unknown:
                raise CheckpointError(
                    f"{directory}: unknown heads {unknown}; the checkpoint has {list(by_name)}"
                )
            chosen = [by_name[name] for name in heads]
        if not chosen:
            raise CheckpointError(f"{directory}: no heads to load")
        rope = RotaryTable(config, config.max_position_embeddings, torch_dtype, torch_device)

        def read(path: Path, expected, note: str = "") -> dict[str, Weight]:
            scheme = manifest.quantization
            if scheme is None:
                return read_tensors(
                    path, expected, device=str(torch_device), dtype=torch_dtype, note=note
                )
            stored = read_tensors(
                path,
                scheme.stored_shapes(expected),
                device=str(torch_device),
                dtype=torch_dtype,
                note=note,
                exact=scheme.exact_names(expected),
            )
            try:
                return scheme.assemble(stored, str(path))
            except QuantizationError as error:
                raise CheckpointError(str(error)) from None

        needs_embedding = load_trunk or any(h.lm_head == "embedding" for h in chosen)
        needs_shared = any(h.lm_head == "shared" for h in chosen)
        trunk_tensors = (
            read(directory / TRUNK_FILE, manifest.trunk_shapes())
            if needs_embedding or needs_shared
            else {}
        )
        trunk = None
        if load_trunk:
            layers = LayerStack.from_tensors(
                config, 0, [split_layers(trunk_tensors, range(manifest.trunk_layers))]
            )
            trunk = Trunk(trunk_tensors["embed_tokens.weight"], layers, rope)
        head_stack = _load_heads(directory, manifest, chosen, trunk_tensors, rope, read)
        place_on_huge_pages([*(trunk.tensors() if trunk else []), *head_stack.tensors()])
        fingerprint = checkpoint_fingerprint(directory)
        return cls(manifest, directory, trunk, head_stack, torch_dtype, torch_device, fingerprint)

    def load_tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.directory))

    def trunk_pool(self, num_slots: int, capacity: int) -> KVCachePool:
        return self._pool(1, self.manifest.trunk_layers, num_slots, capacity)

    def head_pool(self, stack: int, num_slots: int, capacity: int) -> KVCachePool:
        return self._pool(
            stack, self.config.num_layers - self.manifest.trunk_layers, num_slots, capacity
        )

    def hidden_store(self, num_slots: int, capacity: int) -> torch.Tensor:
        """[num_slots, capacity, D]: a trunk output per position of each session slot (the
        trunk worker's drafters and the jury's heads catch up from them)."""
        shape = (num_slots, capacity, self.config.hidden_size)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def trunk_cache(self, capacity: int) -> KVCache:
        """A cache for one session (its own one-slot pool)."""
        return self.trunk_pool(1, capacity).acquire()

    def head_cache(self, stack: int, capacity: int) -> KVCache:
        return self.head_pool(stack, 1, capacity).acquire()

    def _pool(self, stack: int, layers: int, num_slots: int, capacity: int) -> KVCachePool:
        config = self.config
        if capacity > config.max_position_embeddings:
            raise ValueError(
                f"cache capacity {capacity} exceeds the model's context length "
                f"{config.max_position_embeddings}"
            )
        return KVCachePool(
            num_slots=num_slots,
            stack=stack,
            layers=layers,
            kv_heads=config.num_key_value_heads,
            capacity=capacity,
            head_dim=config.head_dim,
            dtype=self.dtype,
            device=self.device,
        )


def _load_heads(
    directory: Path,
    manifest: Manifest,
    chosen: list[HeadSpec],
    trunk_tensors: dict[str, torch.Tensor],
    rope: RotaryTable,
    read,
) -> HeadStack:
    config = manifest.decoder
    head_layers = range(manifest.trunk_layers, config.num_layers)
    members, norms, lm_heads = [], [], []
    for head in chosen:
        tensors = read(directory / head.file, manifest.head_shapes(head), HEAD_SHAPE_NOTE)
        members.append(split_layers(tensors, head_layers))
        norms.append(tensors["norm.weight"])
        lm_heads.append(
            {
                "embedding": lambda: trunk_tensors["embed_tokens.weight"],
                "shared": lambda: trunk_tensors["lm_head.weight"],
                "own": lambda t=tensors: t["lm_head.weight"],
            }[head.lm_head]()
        )
    layers = LayerStack.from_tensors(config, manifest.trunk_layers, members)
    places = {h.lm_head for h in chosen}
    # One shared matrix when every head reads the same one; a stack otherwise.
    lm_head = lm_heads[0] if len(places) == 1 and "own" not in places else stack_weights(lm_heads)
    return HeadStack([h.name for h in chosen], layers, torch.stack(norms), lm_head, rope)
