"""Tiny random models for tests: Hugging Face decoders saved to disk with a tokenizer, and
Hydra checkpoints built from them. One helper each, shared through fixtures."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# A character-level vocabulary: small enough for exact distribution tests.
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
# Capitals last: A-D only fit a vocabulary of 40 (the multiple-choice letters).
CHARACTERS = list("abcdefghijklmnopqrstuvwxyz .,!?ABCD")
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}<|user|>"
    "{% else %}<|assistant|>{% endif %}{{ message['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def save_tokenizer(directory: Path, vocab_size: int) -> None:
    """A character-level tokenizer whose vocabulary fits `vocab_size`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = (SPECIAL_TOKENS + CHARACTERS)[:vocab_size]
    vocab = {symbol: i for i, symbol in enumerate(symbols)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(directory))


TINY = dict(
    vocab_size=40,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def hf_config(family: str, **overrides):
    from transformers import LlamaConfig, MistralConfig, Olmo2Config, Qwen2Config

    classes = {
        "llama": LlamaConfig,
        "mistral": MistralConfig,
        "qwen2": Qwen2Config,
        "olmo2": Olmo2Config,
    }
    values = {**TINY, **overrides}
    return classes[family](**values)


def save_hf_model(
    directory: Path, family: str, seed: int = 0, logit_scale: float = 1.0, **overrides
) -> Path:
    """A random `transformers` model of `family` saved (safetensors) with a tokenizer.
    `logit_scale` multiplies the LM head, for peaked (less uniform) distributions."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = hf_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random norms and biases too, so a misplaced one cannot go unnoticed.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(1 + 0.2 * torch.randn_like(parameter))
            elif name.endswith("bias"):
                parameter.copy_(0.1 * torch.randn_like(parameter))
            elif name == "lm_head.weight":
                parameter.mul_(logit_scale)
    model.eval()
    model.save_pretrained(str(directory))
    save_tokenizer(directory, config.vocab_size)
    return directory


def load_hf_model(directory: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()


def fine_tune_top_layers(base: Path, out: Path, trunk_layers: int, seed: int, scale: float = 0.5):
    """A 'full fine-tune' of `base`: the same trunk layers, perturbed top layers, final
    norm and (untied) LM head. Saved to `out` with the tokenizer; returns the model."""
    model = load_hf_model(base)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
            top = layer is not None and layer >= trunk_layers
            if top or name in ("model.norm.weight", "lm_head.weight"):
                parameter.add_(scale * parameter.std() * torch.randn_like(parameter))
    model.save_pretrained(str(out))
    save_tokenizer(out, model.config.vocab_size)
    return model


def build_hydra(
    source: Path, out: Path, *, trunk_layers: int = 2, heads: int = 3, **options
) -> Path:
    from hydra_jury.hydra_model.build.builder import BuildOptions, build_checkpoint

    build_checkpoint(
        BuildOptions(
            source=str(source), out=str(out), trunk_layers=trunk_layers, heads=heads, **options
        ),
        log=lambda line: None,
    )
    return out


def edit_manifest(directory: Path, **changes) -> None:
    path = directory / "hydra.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def build_jury_checkpoint(root: Path, trunk_layers: int, **overrides) -> Path:
    """A Llama-family Hydra checkpoint with a 32-token vocabulary and 4 heads that really
    differ: heads 0-2 come from three different fine-tunes of the top layers and LM head,
    head 3 is a copy of the base. `overrides` change the tiny decoder (`TINY`)."""
    base = save_hf_model(
        root / "base", "llama", seed=2, logit_scale=10.0, vocab_size=32, **overrides
    )
    tunes = []
    for index in range(3):
        fine_tune_top_layers(base, root / f"tune{index}", trunk_layers, seed=20 + index)
        tunes.append(str(root / f"tune{index}"))
    return build_hydra(base, root / "hydra", trunk_layers=trunk_layers, heads=4, head_from=tunes)


def build_draft_checkpoint(jury_checkpoint: Path) -> Path:
    """A draft model for a `build_jury_checkpoint` checkpoint: the base model its heads
    were tuned from, whole (every layer: a trunk of all but one and one head)."""
    base = jury_checkpoint.parent / "base"
    layers = load_hf_model(base).config.num_hidden_layers
    return build_hydra(base, jury_checkpoint.parent / "draft", trunk_layers=layers - 1, heads=1)


def draft_model_logits(draft, tokens: list[int]) -> torch.Tensor:
    """[V] float64 next-token logits of a `DraftModel` after `tokens`, with fresh caches."""
    from hydra_jury.hydra_model import DraftCache

    model = draft.model
    cache = DraftCache(model.trunk_cache(len(tokens)), model.head_cache(1, len(tokens)))
    return draft.forward(torch.tensor(tokens), cache, 0)[-1].double()


def next_token_logits(model, tokens: list[int]) -> torch.Tensor:
    """[H, V] float64 logits of every head of a loaded `HydraModel` for the token after
    `tokens`: a full forward pass with fresh caches, independent of the workers."""
    capacity = len(tokens)
    hidden = model.trunk.forward(torch.tensor(tokens), model.trunk_cache(capacity), 0)
    logits = model.heads.forward(hidden, model.head_cache(model.heads.size, capacity), 0)
    return logits[:, -1].double()
