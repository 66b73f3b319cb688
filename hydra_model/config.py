"""Decoder configuration shared by every component of a Hydra model.

`DecoderConfig` is the project's own description of a decoder (Llama family, Qwen2,
OLMo-2). It is read from a Hugging Face `config.json` (old `rope_theta`/`rope_scaling`
keys and the newer `rope_parameters` both) and stored in `hydra.json`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# model_type in a Hugging Face config -> our family name.
FAMILIES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "olmo2": "olmo2",
}
ROPE_TYPES = ("default", "llama3", "linear")


class ConfigError(ValueError):
    """A model configuration this runtime cannot serve."""


@dataclass(frozen=True)
class DecoderConfig:
    family: str  # "llama" | "qwen2" | "olmo2"
    model_type: str  # as in the source config ("llama", "mistral", ...)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # {"rope_type": ..., ...}
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v (and o for llama) projection biases
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # OLMo-2: RMSNorm over the whole q and k projections
    post_norms: bool = False  # OLMo-2: norms after attention and MLP instead of before
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["eos_token_ids"] = list(self.eos_token_ids)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DecoderConfig:
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown decoder config keys: {sorted(unknown)}")
        values = dict(data)
        values["eos_token_ids"] = tuple(values.get("eos_token_ids", ()))
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        if self.family not in set(FAMILIES.values()):
            raise ConfigError(f"unknown decoder family {self.family!r}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        rope_type = self.rope_scaling.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"rope scaling type {rope_type!r} is not supported (supported: {ROPE_TYPES})"
            )

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DecoderConfig:
        """Reads a Hugging Face `config.json` dictionary."""
        model_type = hf.get("model_type")
        if model_type not in FAMILIES:
            raise ConfigError(
                f"unknown architecture model_type={model_type!r}; supported: {sorted(FAMILIES)}"
            )
        family = FAMILIES[model_type]
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
        heads = hf["num_attention_heads"]
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or hf.get("rope_theta", 10000.0)
        rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
        rope.pop("type", None)
        scaling = {"rope_type": rope_type, **rope} if rope_type != "default" else {}
        if rope_type == "llama3":
            scaling.setdefault(
                "original_max_position_embeddings", hf.get("max_position_embeddings")
            )
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        # Qwen2 always has q/k/v biases; its config has no flag for them.
        attention_bias = family == "qwen2" or bool(hf.get("attention_bias"))
        config = cls(
            family=family,
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            # Qwen2 has q/k/v biases but none on the output projection.
            o_proj_bias=attention_bias and family != "qwen2",
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=family == "olmo2",
            post_norms=family == "olmo2",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
        config.validate()
        return config
