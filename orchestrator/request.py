"""Generation requests: the options a client sets, checked before any compute.

`GenerationRequest` is what a client sends; `prepare_request` checks every option
against the model and resolves the defaults (seed, draft head, jury), giving a
`PreparedRequest` the loop runs. Every problem is a `RequestError` naming the option.
Head names are checked here for the public client, and again by the workers for
their own callers; the numeric limits are the workers' (`workers.calls`), and a
server's hard limits on a request's size are its `RequestLimits` (`orchestrator.limits`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

from hydra_jury.hydra_model.uncertainty import verdict_tokens
from hydra_jury.orchestrator.backend import ModelInfo
from hydra_jury.orchestrator.limits import RequestLimits
from hydra_jury.poe import RULES, Rule, SamplingParams, choice, random_seed, validate_rule
from hydra_jury.poe.contrastive import validate_alpha
from hydra_jury.poe.randomness import MAX_SEED
from hydra_jury.workers.calls import MAX_BETA, MAX_GAMMA
from hydra_jury.workers.errors import InvalidArgument


class RequestError(InvalidArgument):
    """An invalid request option; the message names it."""


class DrafterKind(StrEnum):
    """Who drafts: what a request's `drafter` option names (`DRAFTERS`), and who drafted
    each round (`RoundOutput.drafter`)."""

    AUTO = "auto"  # chosen per round from measured costs and acceptance (`orchestrator.auto`)
    HEAD = "head"  # a head on the trunk drafts, one trunk step per draft token
    NGRAM = "ngram"  # prompt lookup; the draft is checked in one trunk + jury pass
    MODEL = "model"  # the trunk service's draft model; checked in one pass, like ngram
    NONE = "none"  # a round of no draft: a plain step
    BEAM = "beam"  # a beam search, as one round


DEFAULT_GAMMA = 4  # draft length of the head, n-gram and model drafters when unset
MAX_TOP_LOGPROBS = 20  # the most likely tokens a request may ask for at each position
AUTO_GAMMA = 8  # the most the automatic mode drafts in a round when gamma is unset


# What a request may name as its drafter.
DRAFTERS = (DrafterKind.AUTO, DrafterKind.HEAD, DrafterKind.NGRAM, DrafterKind.MODEL)


@dataclass
class GenerationRequest:
    prompt: str | None = None  # plain text, used as is
    messages: list[dict[str, str]] | None = None  # chat, formatted by the chat template
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    gamma: int | None = None  # draft length [4]; the automatic mode's most [8]
    rule: str = "exact"
    lenience: float = 0.0
    beta: float = 1.0  # verifier inverse temperature
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    epsilon: float = 0.0
    seed: int | None = None  # random when absent
    draft_head: str | None = None  # drawn from the drafters by the seed when absent
    jury: list[str] | None = None  # default: every llm head but the drafter
    # Contrastive decoding (non-speculative): the jury as expert, this head as amateur.
    contrastive_alpha: float = 0.0  # plausibility cutoff α in (0, 1]; 0 = off
    contrastive_amateur: str | None = None
    drafter: str = "auto"
    # Beam search over the PoE target (num_beams > 1; not speculative, draws nothing).
    num_beams: int = 1
    length_penalty: float = 1.0  # scores are sum log P / length ** length_penalty
    early_stopping: bool = False  # stop once num_beams hypotheses are finished
    return_beams: bool = False  # also return every finished hypothesis
    # Multiple choice: the uncertainty head judges the finished answer (`p_correct`).
    uncertainty: bool = False
    # Each token's log-probability under the target, and this many most likely tokens.
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            epsilon=self.epsilon,
        )


@dataclass(frozen=True)
class PreparedRequest:
    request: GenerationRequest
    rule: Rule
    prompt_tokens: list[int]
    seed: int
    draft_head: str | None  # None for verifier_only
    jury: list[str]  # empty for drafter_only
    sampling: SamplingParams
    amateur: str | None = None  # contrastive decoding's amateur head
    drafter: DrafterKind = DrafterKind.HEAD
    gamma: int = DEFAULT_GAMMA  # resolved: the draft length (auto: the most per round)

    @property
    def scoring_heads(self) -> tuple[str, ...]:
        """The heads the jury evaluates for this request: the jurors and the amateur."""
        return (*self.jury, *([self.amateur] if self.amateur else []))


def prompt_tokens(request: GenerationRequest, tokenizer) -> list[int]:
    if (request.prompt is None) == (request.messages is None):
        raise RequestError("give exactly one of prompt and messages")
    if request.messages is not None:
        if not request.messages:
            raise RequestError("messages is empty")
        for message in request.messages:
            if not isinstance(message, dict) or not {"role", "content"} <= set(message):
                raise RequestError(f"each message needs a role and a content: {message!r}")
        if not tokenizer.chat_template:
            raise RequestError("the checkpoint's tokenizer has no chat template; send a prompt")
        encoded = tokenizer.apply_chat_template(
            request.messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(encoded["input_ids"])
    if not request.prompt:
        raise RequestError("prompt is empty")
    return list(tokenizer.encode(request.prompt, add_special_tokens=False))


def prepare_request(
    request: GenerationRequest,
    info: ModelInfo,
    tokenizer,
    context: list[int] | None = None,
    limits: RequestLimits | None = None,
) -> PreparedRequest:
    """Checks and resolves `request`; its context is `context` when given (a session's
    conversation so far, for a text session's next turn), else its input encoded.
    `limits`: a server's hard limits (None: only the model's, for in-process use)."""
    rule = _check_numbers(request, info)
    if limits is not None:
        _check_limits(request, limits)
    if request.uncertainty:
        _check_uncertainty(info, tokenizer)
    _check_logprobs(request, rule)
    if request.num_beams > 1:
        _check_beam_search(request, rule)
        rule = Rule.VERIFIER_ONLY  # one target row per beam and step: no speculation
    tokens = prompt_tokens(request, tokenizer) if context is None else list(context)
    if not tokens:
        raise RequestError("the prompt encodes to no tokens")
    if limits is not None and len(tokens) > limits.prompt_tokens:
        raise RequestError(
            limits.refusal("prompt_tokens", f"the context of {len(tokens)} tokens")
            + ": send a shorter prompt or start a new session"
        )
    if len(tokens) > info.context_length:
        raise RequestError(
            f"the prompt has {len(tokens)} tokens, over the context limit of {info.context_length}"
        )
    if len(tokens) + request.max_new_tokens > info.context_length:
        raise RequestError(
            f"max_new_tokens={request.max_new_tokens} with a prompt of {len(tokens)} tokens "
            f"exceeds the context limit of {info.context_length}; at most "
            f"{info.context_length - len(tokens)} new tokens fit"
        )
    seed = random_seed() if request.seed is None else request.seed
    drafter = _drafter(request, rule, info)
    draft_head = None
    if drafter not in (DrafterKind.NGRAM, DrafterKind.MODEL):
        draft_head = _draft_head(request, rule, info, seed)
    amateur = _amateur(request, rule, info)
    # Outside a head's own rounds no head drafts: every head is a juror. The automatic
    # mode keeps that jury in its head rounds too (greedy only), so its target never
    # changes with the drafter it picks.
    jury = _jury(request, rule, info, draft_head if drafter == DrafterKind.HEAD else None, amateur)
    gamma = request.gamma or (AUTO_GAMMA if drafter == DrafterKind.AUTO else DEFAULT_GAMMA)
    return PreparedRequest(
        request, rule, tokens, seed, draft_head, jury, request.sampling, amateur, drafter, gamma
    )


def _check_uncertainty(info: ModelInfo, tokenizer) -> None:
    if not info.uncertainty_head:
        raise RequestError(
            "uncertainty: the model has no uncertainty head (build one with "
            "--uncertainty-head and train it with train-heads --uncertainty)"
        )
    try:
        verdict_tokens(tokenizer)
    except ValueError as error:
        raise RequestError(f"uncertainty: {error}") from None


def _drafter(request: GenerationRequest, rule: Rule, info: ModelInfo) -> DrafterKind:
    if request.drafter not in DRAFTERS:
        raise RequestError(
            f"unknown drafter {request.drafter!r}; choose one of {', '.join(DRAFTERS)}"
        )
    drafter = DrafterKind(request.drafter)
    if drafter == DrafterKind.HEAD:
        return drafter
    if drafter == DrafterKind.AUTO:
        # The baselines have no choice to make: drafter_only drafts with its head,
        # verifier_only does not draft.
        return DrafterKind.HEAD if rule in (Rule.DRAFTER_ONLY, Rule.VERIFIER_ONLY) else drafter
    if rule in (Rule.DRAFTER_ONLY, Rule.VERIFIER_ONLY):
        raise RequestError(
            f"drafter {str(drafter)!r} conflicts with rule {str(rule)!r}: that rule "
            "uses no outside drafter; use drafter 'head'"
        )
    if request.draft_head is not None:
        raise RequestError(
            f"drafter {str(drafter)!r} drafts without a head: leave draft_head unset"
        )
    if drafter == DrafterKind.MODEL and not info.draft_model:
        raise RequestError(
            "drafter 'model': the trunk hosts no draft model (start it with --draft-model DIR)"
        )
    return drafter


def _check_numbers(request: GenerationRequest, info: ModelInfo) -> Rule:
    """Checks every numeric option and the rule; returns the rule."""
    if not isinstance(request.max_new_tokens, int) or request.max_new_tokens < 1:
        raise RequestError(
            f"max_new_tokens must be a positive integer, got {request.max_new_tokens!r}"
        )
    if request.gamma is not None and (
        not isinstance(request.gamma, int) or not 1 <= request.gamma <= MAX_GAMMA
    ):
        raise RequestError(
            f"gamma (draft length) must be an integer in 1..{MAX_GAMMA}, got {request.gamma!r}"
        )
    if request.rule not in RULES:
        raise RequestError(f"unknown rule {request.rule!r}; choose one of {', '.join(RULES)}")
    try:
        rule = validate_rule(request.rule, request.lenience)
        request.sampling.validate(info.vocab_size)
    except ValueError as error:
        raise RequestError(str(error)) from None
    if not (math.isfinite(request.beta) and 0 < request.beta <= MAX_BETA):
        raise RequestError(f"beta must be in (0, {MAX_BETA:g}], got {request.beta!r}")
    if request.seed is not None and not (
        isinstance(request.seed, int) and 0 <= request.seed < MAX_SEED
    ):
        raise RequestError(f"seed must be an integer in [0, 2**63), got {request.seed!r}")
    if any(not isinstance(s, str) or not s for s in request.stop):
        raise RequestError("stop sequences must be non-empty strings")
    if not isinstance(request.num_beams, int) or request.num_beams < 1:
        raise RequestError(f"num_beams must be a positive integer, got {request.num_beams!r}")
    if not math.isfinite(request.length_penalty):
        raise RequestError(f"length_penalty must be finite, got {request.length_penalty!r}")
    if request.num_beams == 1 and (
        request.length_penalty != 1.0 or request.early_stopping or request.return_beams
    ):
        raise RequestError(
            "length_penalty, early_stopping and return_beams apply to beam search: set "
            "num_beams > 1"
        )
    return rule


def _check_logprobs(request: GenerationRequest, rule: Rule) -> None:
    """Log-probabilities are read from each token's target: a rule or mode that computes
    none for the tokens it emits cannot give them."""
    top = request.top_logprobs
    if not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise RequestError(f"top_logprobs must be an integer in 0..{MAX_TOP_LOGPROBS}, got {top!r}")
    if top and not request.logprobs:
        raise RequestError("top_logprobs needs logprobs")
    if not request.logprobs:
        return
    if rule == Rule.DRAFTER_ONLY:
        raise RequestError(
            "logprobs: rule drafter_only computes no target, so its tokens have no "
            "log-probabilities"
        )
    if request.num_beams > 1:
        raise RequestError(
            "logprobs: beam search scores whole hypotheses (see beams and beam_score), "
            "not one target per token"
        )


def _check_limits(request: GenerationRequest, limits: RequestLimits) -> None:
    """The server's limits on the request's own options (checked after their types)."""
    if request.max_new_tokens > limits.new_tokens:
        raise RequestError(limits.refusal("new_tokens", f"max_new_tokens={request.max_new_tokens}"))
    if len(request.stop) > limits.stop_sequences:
        raise RequestError(limits.refusal("stop_sequences", f"{len(request.stop)} stop sequences"))
    for index, stop in enumerate(request.stop):
        if len(stop) > limits.stop_chars:
            raise RequestError(
                limits.refusal("stop_chars", f"stop sequence {index} of {len(stop)} characters")
            )
    if request.num_beams > limits.beams:
        raise RequestError(limits.refusal("beams", f"num_beams={request.num_beams}"))


def _check_beam_search(request: GenerationRequest, rule: Rule) -> None:
    """Beam search neither speculates nor samples: options of either conflict with it."""
    conflicts = {
        f"rule {str(rule)!r}": rule not in (Rule.EXACT, Rule.VERIFIER_ONLY),
        f"drafter {request.drafter!r}": request.drafter != DrafterKind.AUTO,
        "gamma": request.gamma is not None,
        "draft_head": request.draft_head is not None,
        "top_k": request.top_k != 0,
        "top_p": request.top_p != 1.0,
        "min_p": request.min_p != 0.0,
        "epsilon": request.epsilon != 0.0,
        "contrastive decoding": request.contrastive_amateur is not None
        or request.contrastive_alpha != 0.0,
        "stop sequences": bool(request.stop),
    }
    named = [name for name, conflicting in conflicts.items() if conflicting]
    if named:
        raise RequestError(
            f"num_beams={request.num_beams} conflicts with {', '.join(named)}: beam search "
            "scores every continuation with the PoE target, without speculating or sampling"
        )


def _draft_head(request: GenerationRequest, rule: Rule, info: ModelInfo, seed: int) -> str | None:
    if rule == Rule.VERIFIER_ONLY:
        if request.draft_head is not None:
            raise RequestError("rule verifier_only does not draft; leave draft_head unset")
        return None
    if request.draft_head is None:
        return info.drafter_heads[choice(seed, len(info.drafter_heads), "draft_head")]
    if request.draft_head not in info.drafter_heads:
        raise RequestError(
            f"unknown draft head {request.draft_head!r}; drafters: {', '.join(info.drafter_heads)}"
        )
    return request.draft_head


def _amateur(request: GenerationRequest, rule: Rule, info: ModelInfo) -> str | None:
    """Contrastive decoding's amateur head, or None when it is off."""
    amateur, alpha = request.contrastive_amateur, request.contrastive_alpha
    if amateur is None and not alpha:
        return None
    if amateur is None or not alpha:
        raise RequestError(
            "contrastive decoding needs both contrastive_alpha and contrastive_amateur"
        )
    try:
        validate_alpha(alpha)
    except ValueError as error:
        raise RequestError(str(error)) from None
    if amateur not in info.head_names:
        raise RequestError(
            f"unknown contrastive_amateur {amateur!r}; heads: {', '.join(info.head_names)}"
        )
    if rule != Rule.VERIFIER_ONLY:
        raise RequestError(
            f"contrastive decoding is not speculative: it conflicts with rule {str(rule)!r}; "
            "use rule verifier_only"
        )
    return amateur


def _jury(
    request: GenerationRequest,
    rule: Rule,
    info: ModelInfo,
    draft_head: str | None,
    amateur: str | None,
) -> list[str]:
    if rule == Rule.DRAFTER_ONLY:
        return []
    if amateur is not None and request.jury is not None and amateur in request.jury:
        raise RequestError(f"the contrastive_amateur {amateur!r} cannot also sit in the jury")
    if request.jury is None:
        jury = [h for h in info.head_names if h not in (draft_head, amateur)]
    else:
        unknown = [h for h in request.jury if h not in info.head_names]
        if unknown:
            raise RequestError(f"unknown jury heads {unknown}; heads: {', '.join(info.head_names)}")
        if draft_head in request.jury:
            raise RequestError(f"the draft head {draft_head!r} cannot sit in its own jury")
        if len(set(request.jury)) != len(request.jury):
            raise RequestError(f"jury lists a head twice: {request.jury}")
        jury = [h for h in info.head_names if h in request.jury]  # checkpoint order
    if not jury:
        raise RequestError("the jury is empty: it needs at least one head besides the drafter")
    return jury
