"""Training text for `train-heads`: a JSON-lines corpus, one shard per head, packed into
windows of tokens.

- corpus: a UTF-8 file with one JSON object per line, `{"text": "..."}` (other fields are
  ignored, blank lines skipped).
- shard: head i of n trains on texts i, i + n, i + 2n, ... (round robin), so each shard
  samples the whole file whatever order it was written in.
- window: a shard's texts are tokenized, each followed by an end-of-sequence token (unless
  it ends with one), joined, and cut into windows of `seq_len` tokens; a tail shorter
  than a window is dropped.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch

CORPUS_FORMAT = 'one JSON object per line, {"text": "..."}'


class CorpusError(ValueError):
    """A corpus that cannot be read or is too small; the message names the file and line."""


def read_corpus(path: str | Path) -> list[str]:
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"{path}: no such file (expected a JSON-lines corpus: {CORPUS_FORMAT})")
    texts = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise CorpusError(f"{path}:{number}: not valid JSON ({error.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise CorpusError(
                    f'{path}:{number}: expected an object with a string field "text", '
                    f"got {line.strip()[:60]!r}"
                )
            texts.append(record["text"])
    if not texts:
        raise CorpusError(f"{path}: holds no texts ({CORPUS_FORMAT})")
    return texts


def write_corpus(path: str | Path, texts: Sequence[str]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"text": text}, ensure_ascii=False) + "\n" for text in texts]
    # Whole or not at all: an interrupted write must not leave a shorter corpus behind.
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(lines), encoding="utf-8")
    os.replace(partial, path)


def file_digest(path: str | Path) -> str:
    """sha256 of the file: a resumed run must read the very corpus it started on."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def shard_of(index: int, shards: int) -> int:
    """The shard of the `index`-th text."""
    return index % shards


def shard_texts(texts: Sequence[str], shards: int) -> list[list[str]]:
    split: list[list[str]] = [[] for _ in range(shards)]
    for index, text in enumerate(texts):
        split[shard_of(index, shards)].append(text)
    return split


def pack_windows(texts: Sequence[str], tokenizer, seq_len: int, eos_id: int) -> torch.Tensor:
    """The texts as windows [W, seq_len] of token ids (W may be 0)."""
    stream: list[int] = []
    for text in texts:
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        if not ids or ids[-1] != eos_id:
            ids.append(eos_id)
        stream += ids
    count = len(stream) // seq_len
    return torch.tensor(stream[: count * seq_len], dtype=torch.long).view(count, seq_len)
