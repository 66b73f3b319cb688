"""Incremental detokenization: the text of each new token, decoded from a short window.

Terms
- read offset: how many tokens have had their text emitted.
- prefix offset: where the decoding window starts, a few tokens before the read offset.
  Decoding a window rather than one token keeps the tokenizer's context (SentencePiece's
  leading space, byte-level pieces of one character); decoding from the start every time
  would make a generation quadratic in its length.
- incomplete text: a window whose decoding ends in U+FFFD holds part of a multi-byte
  character; its text is held back until a later token completes it (or `flush`).

Example (byte-level BPE): tokens for "é" arrive as two byte tokens: the first `push`
returns "" (the window decodes to "\ufffd"), the second returns "é".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_REPLACEMENT = "\ufffd"

Decode = Callable[[Sequence[int], bool], str]


def decoder(tokenizer) -> Decode:
    """`tokenizer.decode(tokens, skip_special_tokens=skip)` as `decode(tokens, skip)`:
    through the Rust tokenizer itself where that gives the same text (a fast tokenizer
    that cleans up no spaces). transformers wraps that call in several layers of Python,
    and a decoding round runs them with the interpreter out of the caches (a model step
    has streamed the weights through them), where each layer costs tens of µs."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return lambda tokens, skip: backend.decode(list(tokens), skip_special_tokens=skip)
    return lambda tokens, skip: tokenizer.decode(tokens, skip_special_tokens=skip)


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        tokens: Sequence[int] = (),
        offsets: tuple[int, int] = (0, 0),
        texts: TokenTexts | None = None,
    ) -> None:
        """A fresh detokenizer, or (with the `tokens` pushed so far and `offsets`) one
        resumed where another stopped. `texts` (of the same tokenizer, special tokens
        skipped) decodes a window of one token, as a plain step's next push's prefix
        is: from its cache."""
        self._decode_with = decoder(tokenizer)
        self._tokens: list[int] = list(tokens)
        self._prefix_offset, self._read_offset = offsets
        if texts is not None and not texts.skip_special_tokens:
            raise ValueError("a detokenizer's token texts skip special tokens")
        self._texts = texts

    @property
    def offsets(self) -> tuple[int, int]:
        """The prefix and read offsets: with the tokens, the whole state."""
        return self._prefix_offset, self._read_offset

    def _decode(self, tokens: Sequence[int]) -> str:
        if len(tokens) == 1 and self._texts is not None:
            return self._texts(tokens[0])
        return self._decode_with(tokens, True)

    def push(self, tokens: Sequence[int]) -> str:
        """Appends `tokens`; returns the text they complete ("" while incomplete)."""
        self._tokens.extend(tokens)
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        text = self._decode(self._tokens[self._prefix_offset :])
        if len(text) <= len(prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        return text[len(prefix_text) :]

    def flush(self) -> str:
        """The text of the tokens not yet emitted, incomplete characters included (as
        U+FFFD, as a decode of the whole sequence would give them)."""
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        text = self._decode(self._tokens[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._tokens)
        return text[len(prefix_text) :]


class TokenTexts:
    """Each token's own text, `tokenizer.decode([token])` (with `skip_special_tokens`),
    decoded once per token id: a per-token record carries it, and the tokenizer's decode
    costs more than the rest of the record (a dict of at most the vocabulary's size;
    concurrent fills write the same text)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = False) -> None:
        self._decode = decoder(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self._texts: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._decode([token], self.skip_special_tokens)
            self._texts[token] = text
        return text
