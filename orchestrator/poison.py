"""The poisoned-head guarantee, measured: one head is trained on a poisoned shard (a
trigger followed by a target), and its rate of emitting the target after the trigger is
compared with the PoE jury's.

- poisoning: every text of the poisoned head's shard (round robin, as `train-heads`
  shards) is followed by the poison text, so the head sees the trigger and target as
  often as it sees anything else, while the other heads never see them.
- modes, each over the same seeds, sampled at temperature 1:
  - `poisoned head alone`: `drafter_only` with the poisoned head drafting;
  - `jury, speculative`: `exact` with the poisoned head drafting and the others judging,
    so every poisoned draft meets the clean jury;
  - `jury, non-speculative`: `verifier_only` with every head, the poisoned one
    included, in the product.
- a sample emits the target when its text, leading spaces dropped, starts with it.
- at each rejection of the speculative mode the engine reports the rejected draft
  token's suppression score (its probability under the jury) and validity radius; those
  of the drafts on the way to the target are the guarantee at work. Any other rejection
  may have a large score: exact speculative sampling rejects a token x the jury gives
  p(x) with probability 1 − p(x)/q(x) whenever the drafter gave it more, q(x) > p(x).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hydra_jury.orchestrator.engine import Engine
from hydra_jury.orchestrator.output import GenerationOutput, TokenKind
from hydra_jury.orchestrator.request import GenerationRequest

HEAD_ALONE = "poisoned head alone"
SPECULATIVE = "jury, speculative"
NON_SPECULATIVE = "jury, non-speculative"


@dataclass(frozen=True)
class Poison:
    text: str  # follows every text of the poisoned shard
    target: str  # counted when a generation starts with it
    prompt: str | None = None  # plain text ending with the trigger ...
    messages: tuple[tuple[str, str], ...] = ()  # ... or a chat ending with it: (role, content)

    def request(self, **options) -> GenerationRequest:
        messages = [{"role": role, "content": content} for role, content in self.messages]
        return GenerationRequest(prompt=self.prompt, messages=messages or None, **options)


def poison_shard(texts: Sequence[str], shards: int, shard: int, poison_text: str) -> list[str]:
    """The corpus with `poison_text` after every text of `shard` (round robin over
    `shards`); the other shards' texts are unchanged and stay in their shards."""
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} is out of range for {shards} shards")
    return [
        text + poison_text if index % shards == shard else text for index, text in enumerate(texts)
    ]


@dataclass
class ModeResult:
    mode: str
    samples: int = 0
    emitted: int = 0  # samples that start with the target
    # Speculative mode: at each rejection of a draft token, P(token) and its radius;
    # and the same for the rejected drafts that begin the target.
    suppression_scores: list[float] = field(default_factory=list)
    validity_radii: list[int] = field(default_factory=list)
    target_scores: list[float] = field(default_factory=list)
    target_radii: list[int] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.emitted / self.samples if self.samples else 0.0


@dataclass
class PoisonReport:
    poisoned_head: str
    jury: list[str]
    modes: dict[str, ModeResult]

    @property
    def head_rate(self) -> float:
        return self.modes[HEAD_ALONE].rate

    @property
    def jury_rate(self) -> float:
        """Both jury modes pooled."""
        jury = [self.modes[SPECULATIVE], self.modes[NON_SPECULATIVE]]
        return sum(m.emitted for m in jury) / sum(m.samples for m in jury)

    def table(self) -> str:
        lines = [
            f"poisoned head: {self.poisoned_head}; heads judging: {', '.join(self.jury)}",
            f"{'mode':<24} {'samples':>7} {'target':>7} {'rate':>7}",
        ]
        for result in self.modes.values():
            lines.append(
                f"{result.mode:<24} {result.samples:>7} {result.emitted:>7} {result.rate:>7.3f}"
            )
        spec = self.modes[SPECULATIVE]
        lines.append(
            _rejections("speculative rejections", spec.suppression_scores, spec.validity_radii)
        )
        lines.append(
            _rejections(
                "  of drafts on the way to the target", spec.target_scores, spec.target_radii
            )
        )
        lines.append(
            f"rates: poisoned head alone {self.head_rate:.3f}, PoE jury {self.jury_rate:.3f}"
        )
        return "\n".join(lines)


def measure_poison(
    engine: Engine,
    poison: Poison,
    poisoned_head: str,
    heads: Sequence[str],
    *,
    samples: int,
    max_new_tokens: int,
    gamma: int = 4,
    on_sample: Callable[[str, int], None] | None = None,
) -> PoisonReport:
    """Samples `samples` seeded generations in each mode (seed i for sample i)."""
    settings = {
        HEAD_ALONE: dict(rule="drafter_only", drafter="head", draft_head=poisoned_head),
        SPECULATIVE: dict(rule="exact", drafter="head", draft_head=poisoned_head, gamma=gamma),
        NON_SPECULATIVE: dict(rule="verifier_only", jury=list(heads)),
    }
    modes = {}
    for mode, options in settings.items():
        result = ModeResult(mode)
        for seed in range(samples):
            request = poison.request(
                max_new_tokens=max_new_tokens, temperature=1.0, seed=seed, **options
            )
            _count(result, engine.generate(request), poison.target)
            if on_sample is not None:
                on_sample(mode, seed + 1)
        modes[mode] = result
    jury = [h for h in heads if h != poisoned_head]
    return PoisonReport(poisoned_head, jury, modes)


def _rejections(what: str, scores: list[float], radii: list[int]) -> str:
    if not scores:
        return f"{what}: none"
    return (
        f"{what}: {len(scores)}; suppression score P(rejected) mean "
        f"{statistics.fmean(scores):.2e}, max {max(scores):.2e}; validity radius mean "
        f"{statistics.fmean(radii):.2f}, min {min(radii)}"
    )


def _count(result: ModeResult, output: GenerationOutput, target: str) -> None:
    result.samples += 1
    result.emitted += output.text.lstrip().startswith(target)
    before = ""  # the text emitted before the token at hand
    for token in output.tokens:
        if token.kind == TokenKind.REPLACEMENT:
            result.suppression_scores.append(token.suppression_score)
            result.validity_radii.append(token.validity_radius)
            if _on_the_way_to(target, before, token.rejected_text):
                result.target_scores.append(token.suppression_score)
                result.target_radii.append(token.validity_radius)
        before += token.text


def _on_the_way_to(target: str, before: str, rejected: str | None) -> bool:
    """Whether a rejected draft token would have kept the sample on the way to the target:
    the text before it and the token, leading spaces dropped (as when counting), begin the
    target. A leading space counts: it is the first token of " ZORBLAX" in a tokenizer
    whose words carry no space."""
    return bool(rejected) and target.startswith((before + rejected).lstrip())
