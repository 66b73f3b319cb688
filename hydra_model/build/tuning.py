"""The heads' weights as `train-heads` trains them, and the `HeadStack` that evaluates them.

- full: every tensor of a head's layers and its final norm takes gradients.
- LoRA (rank r): each attention and MLP projection W of a head's layers becomes
  W + (α/r)·B·A with A [r, in] and B [out, r] trained and W frozen (α = r). B starts at
  zero, so before the first step every head is its base. Norms stay frozen, as in a PEFT
  adapter, so that the adapter alone (`save_adapter`) describes the change.

The LM head is never trained. In the checkpoints here it is the tied embedding or one
shared matrix (49152 × 576 for SmolLM2): training it would store a copy per head, give
every step the largest gradient of the model, and for a tied one change the trunk's
input embedding, which every head shares. A head's layers and final norm already decide
what its LM head reads.

The stack is rebuilt from these tensors at every step with the loader's own
`LayerStack.from_tensors`, so training runs the runtime's forward, not a second model.
"""

from __future__ import annotations

import math

import torch

from hydra_jury.hydra_model.build.lora import ADAPTABLE_MODULES
from hydra_jury.hydra_model.checkpoint import split_layers
from hydra_jury.hydra_model.heads import HeadStack
from hydra_jury.hydra_model.layers import LayerStack
from hydra_jury.hydra_model.model import HydraModel

LM_HEAD = "lm_head.weight"


class TunedHeads:
    """Trainable tensors for every head of `model`, named `<head>/<tensor>`.

    `base[h]` holds head h's tensors as stored (`layers.{i}.q_proj.weight`, ...,
    `norm.weight`, and `lm_head.weight` for a head with its own), in float32."""

    def __init__(
        self,
        model: HydraModel,
        base: list[dict[str, torch.Tensor]],
        lora_rank: int | None,
        seed: int,
    ) -> None:
        self.model = model
        self.base = base
        self.lora_rank = lora_rank
        self.parameters: dict[str, torch.Tensor] = {}
        generator = torch.Generator().manual_seed(seed)
        for name, tensors in zip(model.head_names, base, strict=True):
            if lora_rank is None:
                for tensor_name, tensor in tensors.items():
                    if tensor_name != LM_HEAD:
                        self.parameters[f"{name}/{tensor_name}"] = tensor.clone()
                continue
            for layer, module in self.adapted(tensors):
                out_size, in_size = tensors[f"layers.{layer}.{module}.weight"].shape
                # PEFT's start: A uniform in ±1/sqrt(in) (Kaiming, a = sqrt 5), B zero.
                bound = 1 / math.sqrt(in_size)
                a = (torch.rand(lora_rank, in_size, generator=generator) * 2 - 1) * bound
                self.parameters[f"{name}/layers.{layer}.{module}.lora_A"] = a
                self.parameters[f"{name}/layers.{layer}.{module}.lora_B"] = torch.zeros(
                    out_size, lora_rank
                )
        for tensor in self.parameters.values():
            tensor.requires_grad_(True)

    @property
    def lora_alpha(self) -> float:
        return float(self.lora_rank or 0)

    def adapted(self, tensors: dict[str, torch.Tensor]) -> list[tuple[int, str]]:
        """(layer, module) of every projection LoRA adapts, in layer order."""
        first, last = self.model.manifest.trunk_layers, self.model.config.num_layers
        return [
            (layer, module)
            for layer in range(first, last)
            for module in ADAPTABLE_MODULES
            if f"layers.{layer}.{module}.weight" in tensors
        ]

    def head_parameters(self, index: int) -> list[torch.Tensor]:
        prefix = f"{self.model.head_names[index]}/"
        return [t for name, t in self.parameters.items() if name.startswith(prefix)]

    def adapter(self, index: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        """LoRA: head `index`'s (A, B) per (layer, module)."""
        name = self.model.head_names[index]
        return {
            (layer, module): (
                self.parameters[f"{name}/layers.{layer}.{module}.lora_A"],
                self.parameters[f"{name}/layers.{layer}.{module}.lora_B"],
            )
            for layer, module in self.adapted(self.base[index])
        }

    def current(self, index: int) -> dict[str, torch.Tensor]:
        """Head `index`'s tensors as they stand (LoRA merged), still in the graph."""
        tensors = dict(self.base[index])
        if self.lora_rank is None:
            name = self.model.head_names[index]
            tensors.update({k: self.parameters[f"{name}/{k}"] for k in tensors if k != LM_HEAD})
            return tensors
        scale = self.lora_alpha / self.lora_rank
        for (layer, module), (a, b) in self.adapter(index).items():
            weight = f"layers.{layer}.{module}.weight"
            # As `lora_deltas` merges: W + scale · (B @ A), so the saved head is the
            # trained one to the last bit.
            tensors[weight] = tensors[weight] + scale * (b @ a)
        return tensors

    def head_stack(self) -> HeadStack:
        """Every head with its current weights, over the model's frozen LM head."""
        model = self.model
        first, last = model.manifest.trunk_layers, model.config.num_layers
        current = [self.current(i) for i in range(len(self.base))]
        members = [split_layers(tensors, range(first, last)) for tensors in current]
        layers = LayerStack.from_tensors(model.config, first, members)
        norm = torch.stack([tensors["norm.weight"] for tensors in current])
        heads = model.heads
        return HeadStack(list(heads.names), layers, norm, heads.lm_head, heads.rope)
