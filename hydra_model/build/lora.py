"""Merging a PEFT-format LoRA adapter into a copy of a head's layers.

An adapter directory holds `adapter_config.json` (r, lora_alpha, target_modules, ...) and
`adapter_model.safetensors` with, per adapted linear layer, `...<module>.lora_A.weight`
[r, in] and `...<module>.lora_B.weight` [out, r]. Merging adds
`scale · B @ A` to the weight, with scale = lora_alpha / r (lora_alpha / sqrt(r) with
rsLoRA).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hydra_jury.hydra_model.build.sources import SourceError

_LORA_NAME = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn\.|mlp\.)?(\w+)\.lora_([AB])"
    r"(?:\.default)?\.weight$"
)
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ADAPTABLE_MODULES = (*_ATTENTION, "gate_proj", "up_proj", "down_proj")


def lora_deltas(
    adapter_dir: str | Path, trunk_layers: int, num_layers: int
) -> dict[str, torch.Tensor]:
    """Checkpoint weight name (`layers.28.q_proj.weight`) -> delta to add, float32."""
    adapter_dir = Path(adapter_dir)
    config_path = adapter_dir / "adapter_config.json"
    weights_path = adapter_dir / "adapter_model.safetensors"
    for path in (config_path, weights_path):
        if not path.is_file():
            raise SourceError(f"{path}: missing (expected a PEFT LoRA adapter directory)")
    config = json.loads(config_path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise SourceError(f"{config_path}: peft_type {config['peft_type']!r} is not LoRA")
    for key in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save", "fan_in_fan_out"):
        if config.get(key):
            raise SourceError(f"{config_path}: {key} is not supported")
    if config.get("bias", "none") != "none":
        raise SourceError(f"{config_path}: bias={config['bias']!r} is not supported")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank

    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in load_file(str(weights_path)).items():
        match = _LORA_NAME.match(name)
        if not match or match[2] not in ADAPTABLE_MODULES:
            raise SourceError(
                f"{weights_path}: cannot merge tensor {name}; only LoRA on the "
                f"attention and MLP projections of decoder layers is supported"
            )
        layer = int(match[1])
        if layer < trunk_layers:
            raise SourceError(
                f"{weights_path}: adapts layer {layer}, which is in the shared trunk "
                f"(layers 0..{trunk_layers - 1}); a head adapter may only touch layers "
                f"{trunk_layers}..{num_layers - 1}"
            )
        if layer >= num_layers:
            raise SourceError(
                f"{weights_path}: adapts layer {layer} but the model has {num_layers} layers"
            )
        pairs.setdefault((layer, match[2]), {})[match[3]] = tensor.float()

    deltas = {}
    for (layer, module), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise SourceError(f"{weights_path}: layer {layer} {module} lacks lora_A or lora_B")
        deltas[f"layers.{layer}.{module}.weight"] = scale * (pair["B"] @ pair["A"])  # [out, in]
    return deltas


def save_adapter(
    adapter_dir: str | Path,
    rank: int,
    alpha: float,
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """Writes a PEFT-format adapter: `pairs[(layer, module)] = (A [r, in], B [out, r])`,
    merged later by `lora_deltas` (or by PEFT itself)."""
    adapter_dir = Path(adapter_dir)
    adapter_dir.mkdir(parents=True, exist_ok=True)
    modules = sorted({module for _, module in pairs})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": modules}
    (adapter_dir / "adapter_config.json").write_text(json.dumps({**config, "bias": "none"}))
    tensors = {}
    for (layer, module), (a, b) in pairs.items():
        place = "self_attn" if module in _ATTENTION else "mlp"
        prefix = f"base_model.model.model.layers.{layer}.{place}.{module}"
        tensors[f"{prefix}.lora_A.weight"] = a.detach().contiguous()
        tensors[f"{prefix}.lora_B.weight"] = b.detach().contiguous()
    save_file(tensors, str(adapter_dir / "adapter_model.safetensors"))
