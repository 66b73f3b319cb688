"""The decoding options of a request as flags (`generate` and `chat`): one flag for each
field of `GenerationRequest` but the prompt and messages, named after the field and
defaulting to its default."""

from __future__ import annotations

import argparse

from hydra_jury.cli.args import from_flags
from hydra_jury.orchestrator.request import (
    AUTO_GAMMA,
    DEFAULT_GAMMA,
    DRAFTERS,
    MAX_TOP_LOGPROBS,
    GenerationRequest,
)
from hydra_jury.poe import RULES
from hydra_jury.serving.worker_service import head_list
from hydra_jury.workers.calls import MAX_GAMMA


def _heads(text: str) -> list[str] | None:
    """--jury: comma-separated heads; empty, the default jury."""
    return head_list(text) or None


def add_decoding_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-new-tokens", type=int, default=GenerationRequest.max_new_tokens, help="(%(default)s)"
    )
    parser.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop sequence (repeatable)"
    )
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument(
        "--gamma",
        type=int,
        help=f"draft length, 1..{MAX_GAMMA} (default {DEFAULT_GAMMA}; with --drafter auto the "
        f"most per round, default {AUTO_GAMMA})",
    )
    parser.add_argument(
        "--rule", default=GenerationRequest.rule, choices=RULES, help="(%(default)s)"
    )
    parser.add_argument(
        "--lenience", type=float, default=GenerationRequest.lenience, help="(%(default)g)"
    )
    parser.add_argument(
        "--beta",
        type=float,
        default=GenerationRequest.beta,
        help="inverse temperature of the verifiers (%(default)g)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=GenerationRequest.temperature,
        help="0 = greedy (%(default)g)",
    )
    parser.add_argument("--top-k", type=int, default=GenerationRequest.top_k, help="(%(default)s)")
    parser.add_argument(
        "--top-p", type=float, default=GenerationRequest.top_p, help="(%(default)g)"
    )
    parser.add_argument(
        "--min-p", type=float, default=GenerationRequest.min_p, help="(%(default)g)"
    )
    parser.add_argument(
        "--epsilon",
        type=float,
        default=GenerationRequest.epsilon,
        help="drop tokens below this probability (%(default)g)",
    )
    parser.add_argument(
        "--contrastive-amateur",
        metavar="HEAD",
        help="contrastive decoding (with --rule verifier_only): this head is the amateur",
    )
    parser.add_argument(
        "--contrastive-alpha",
        type=float,
        default=GenerationRequest.contrastive_alpha,
        help="contrastive decoding's plausibility cutoff, in (0, 1] (%(default)g: off)",
    )
    parser.add_argument(
        "--seed", type=int, help="default: random (on a continued session: the session's)"
    )
    parser.add_argument(
        "--drafter",
        default=GenerationRequest.drafter,
        choices=DRAFTERS,
        help="auto: chosen per round from measured costs and acceptance; head: a head on the "
        "trunk drafts; ngram: prompt lookup in the context, checked by the trunk and the "
        "whole jury in one pass; model: the trunk's draft model (--draft-model), checked "
        "in one pass (%(default)s)",
    )
    parser.add_argument("--draft-head", help="default: drawn from the drafters by the seed")
    parser.add_argument(
        "--jury", type=_heads, help="comma-separated heads (default: all but the drafter)"
    )
    parser.add_argument(
        "--num-beams",
        type=int,
        default=GenerationRequest.num_beams,
        help="beam search over the PoE target with this many beams (%(default)s: off); "
        "deterministic, not speculative",
    )
    parser.add_argument(
        "--length-penalty",
        type=float,
        default=GenerationRequest.length_penalty,
        help="beam search: hypotheses score sum log P / length ** this (%(default)g)",
    )
    parser.add_argument(
        "--early-stopping",
        action="store_true",
        help="beam search: stop once --num-beams hypotheses are finished",
    )
    parser.add_argument(
        "--return-beams",
        action="store_true",
        help="beam search: report every finished hypothesis (with --json)",
    )
    parser.add_argument(
        "--uncertainty",
        action="store_true",
        help="multiple choice: the checkpoint's uncertainty head judges the answer and "
        "reports p_correct, the probability that it is correct",
    )
    parser.add_argument(
        "--logprobs",
        action="store_true",
        help="report each token's log-probability under the target (with --json)",
    )
    parser.add_argument(
        "--top-logprobs",
        type=int,
        default=GenerationRequest.top_logprobs,
        metavar="N",
        help=f"with --logprobs, also the N most likely tokens at each position, "
        f"0..{MAX_TOP_LOGPROBS} (%(default)s)",
    )


def decoding_request(
    args: argparse.Namespace,
    *,
    prompt: str | None = None,
    messages: list[dict[str, str]] | None = None,
) -> GenerationRequest:
    """The request the flags of `add_decoding_flags` describe."""
    return from_flags(GenerationRequest, args, prompt=prompt, messages=messages)
