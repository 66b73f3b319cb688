"""When a generation ends, in the manner of TGI's `StoppingCriteria`: an end-of-sequence
token, a stop sequence in the text, or the token limit.

The text is kept here with the stop conditions because a stop sequence acts on text, not
tokens: it can end inside a token, it cuts the text where it begins, and until the
generation ends a tail of the text that could begin one is held back from the deltas
sent to the client.
"""

from __future__ import annotations

from collections.abc import Collection

from hydra_jury.orchestrator.detokenizer import IncrementalDetokenizer
from hydra_jury.orchestrator.output import FinishReason, Progress
from hydra_jury.orchestrator.request import GenerationRequest


class StopConditions:
    """The stop conditions of one request; it writes the text and what was sent of it
    into the generation's `progress`."""

    def __init__(
        self,
        request: GenerationRequest,
        eos_token_ids: Collection[int],
        detokenizer: IncrementalDetokenizer,
        progress: Progress,
    ) -> None:
        self.eos = frozenset(() if request.ignore_eos else eos_token_ids)
        self.stops = list(request.stop)
        self.max_new_tokens = request.max_new_tokens
        self.detokenizer = detokenizer
        self.progress = progress

    def push(self, tokens: list[int]) -> tuple[list[int], FinishReason | None]:
        """Appends the round's text, token by token while a stop condition can cut the
        round; returns the tokens up to the cut and why the generation ends (None: it
        goes on). The tokens are not yet in `progress.generated`."""
        kept, finish = self._cut(tokens)
        if finish is None and len(self.progress.generated) + len(kept) >= self.max_new_tokens:
            finish = FinishReason.LENGTH
        return kept, finish

    def _cut(self, tokens: list[int]) -> tuple[list[int], FinishReason | None]:
        progress = self.progress
        if not self.stops and self.eos.isdisjoint(tokens):
            progress.text += self.detokenizer.push(tokens)
            return tokens, None
        longest_stop = max((len(stop) for stop in self.stops), default=0)
        for index, token in enumerate(tokens):
            checked_from = max(0, len(progress.text) - longest_stop + 1)
            progress.text += self.detokenizer.push([token])
            if token in self.eos:
                return tokens[: index + 1], FinishReason.EOS
            hits = [i for stop in self.stops if (i := progress.text.find(stop, checked_from)) >= 0]
            if hits:
                progress.text = progress.text[: min(hits)]
                return tokens[: index + 1], FinishReason.STOP
        return tokens, None

    def delta(self) -> str:
        """The text not yet handed out. Until the generation finishes, a tail that could
        be the start of a stop sequence is held back, so no text is sent that a later
        stop would cut."""
        progress = self.progress
        if progress.finish_reason is not None:
            if progress.finish_reason != FinishReason.STOP:
                progress.text += self.detokenizer.flush()
            end = len(progress.text)
        else:
            end = len(progress.text) - stop_prefix_length(progress.text, self.stops)
        delta = progress.text[progress.sent : end]
        progress.sent = max(progress.sent, end)
        return delta


def stop_prefix_length(text: str, stops: list[str]) -> int:
    """The length of the longest tail of `text` that is a proper prefix of a stop
    sequence: "the ca" with stop "cat" → 2."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest
