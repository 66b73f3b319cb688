"""Reading source models for the builder: a Hugging Face directory (safetensors) or a
GGUF file (dequantized through `transformers`, at build time only)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from hydra_jury.hydra_model.config import DecoderConfig

_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(?:self_attn\.|mlp\.)?(.+)$")
_TOP_LEVEL = {
    "model.embed_tokens.weight": "embed_tokens.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}


class SourceError(ValueError):
    """A source model the builder cannot read."""


def project_name(hf_name: str) -> str | None:
    """Hugging Face tensor name -> checkpoint name (None for tensors we do not use).

    `model.layers.3.self_attn.q_proj.weight` -> `layers.3.q_proj.weight`."""
    if hf_name in _TOP_LEVEL:
        return _TOP_LEVEL[hf_name]
    match = _LAYER_NAME.match(hf_name)
    return f"layers.{match[1]}.{match[2]}" if match else None


@dataclass
class SourceModel:
    path: str
    config: DecoderConfig
    names: set[str]  # checkpoint names available
    _get: Callable[[str], torch.Tensor]
    save_tokenizer: Callable[[Path], None] | None

    def tensor(self, name: str) -> torch.Tensor:
        """A tensor by checkpoint name; `lm_head.weight` falls back to the tied embedding."""
        if name == "lm_head.weight" and name not in self.names:
            if not self.config.tie_word_embeddings:
                raise SourceError(f"{self.path}: has no lm_head.weight and is not tied")
            name = "embed_tokens.weight"
        if name not in self.names:
            raise SourceError(f"{self.path}: missing tensor {name}")
        return self._get(name)

    def layer(self, index: int, expected: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """Every tensor of one decoder layer, checked against the expected shapes."""
        tensors = {}
        for name, shape in expected.items():
            tensor = self.tensor(f"layers.{index}.{name}")
            if tuple(tensor.shape) != shape:
                raise SourceError(
                    f"{self.path}: layers.{index}.{name} has shape "
                    f"{tuple(tensor.shape)}, expected {shape}"
                )
            tensors[name] = tensor
        return tensors


def load_source(path: str | Path) -> SourceModel:
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path)
    if path.is_dir():
        return _load_hf_directory(path)
    raise SourceError(f"{path}: not a Hugging Face model directory or a .gguf file")


def _load_hf_directory(path: Path) -> SourceModel:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise SourceError(f"{config_path}: missing (expected a Hugging Face model directory)")
    config = DecoderConfig.from_hf(json.loads(config_path.read_text()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SourceError(f"{path}: no *.safetensors weight files (only safetensors are read)")
    location: dict[str, tuple[Path, str]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for hf_name in handle.keys():
                name = project_name(hf_name)
                if name is not None:
                    location[name] = (file, hf_name)

    def get(name: str) -> torch.Tensor:
        file, hf_name = location[name]
        with safe_open(str(file), framework="pt") as handle:
            return handle.get_tensor(hf_name)

    has_tokenizer = (path / "tokenizer.json").is_file() or (path / "tokenizer.model").is_file()

    def save_tokenizer(out: Path) -> None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(path)).save_pretrained(str(out))

    return SourceModel(
        str(path), config, set(location), get, save_tokenizer if has_tokenizer else None
    )


# The reader of the GGUF file read last, by (path, modification time, size, options):
# kept for the next read of the same unchanged file (`_gguf_read_once`).
_last_gguf_reader: dict[tuple, object] = {}


@contextlib.contextmanager
def _gguf_read_once():
    """While `transformers` reads a GGUF file: the `gguf` package's reader of the file, and
    its tensor-name map of an architecture, are each made once. transformers parses the
    whole file (SmolLM2's 49,152-token vocabulary field by field) twice for one model,
    and builds the name map anew for each of its ~400 modules: 10 of the 15 s that
    loading SmolLM2-135M took. The last file's reader is also kept for the next read of
    it, so a build parses its GGUF once for the model and the tokenizer (6 s a parse on
    a 2-core Zen 3). Raises ImportError without the `gguf` extra."""
    import gguf

    originals = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader(path, *args, **options):
        stat = os.stat(path)
        key = (os.fspath(path), stat.st_mtime_ns, stat.st_size, args, tuple(options.items()))
        if key not in _last_gguf_reader:
            _last_gguf_reader.clear()
            _last_gguf_reader[key] = originals[0](path, *args, **options)
        return _last_gguf_reader[key]

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.cache(gguf.get_tensor_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = originals


def gguf_model(path: Path, **options):
    """`transformers`' float32 model of a GGUF file (`options` to its `from_pretrained`).
    Raises ImportError without the `gguf` extra."""
    from transformers import AutoModelForCausalLM

    with _gguf_read_once():
        return AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, **options
        )


def _load_gguf(path: Path) -> SourceModel:
    try:
        from transformers import AutoTokenizer
    except ImportError as error:  # pragma: no cover - transformers is a dependency
        raise SourceError(f"reading {path} needs transformers ({error})") from None
    try:
        model = gguf_model(path)
    except ImportError as error:
        raise SourceError(
            f"reading {path} needs the gguf and accelerate packages: "
            f"pip install 'hydra-jury[gguf]' ({error})"
        ) from None
    config = DecoderConfig.from_hf(model.config.to_dict())
    state = {project_name(k): v for k, v in model.state_dict().items()}
    state.pop(None, None)

    def save_tokenizer(out: Path) -> None:
        with _gguf_read_once():
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer.save_pretrained(str(out))

    return SourceModel(str(path), config, set(state), state.__getitem__, save_tokenizer)
