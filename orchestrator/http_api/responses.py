"""OpenAI's response objects, made from the generations' outputs: a chat completion or a
text completion whole, or streamed as chunks (one per choice and committed round), with
the usage; each choice carries the `hydra` extension (what the run was: seed, draft
head, jury, statistics, session; on request the per-token jury metrics)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from google.protobuf import json_format

from hydra_jury.orchestrator.convert import stats_to_pb
from hydra_jury.orchestrator.http_api.requests import Plan
from hydra_jury.orchestrator.output import FinishReason, GenerationOutput, RoundOutput, TokenRecord
from hydra_jury.orchestrator.sessions.runner import Committed

# OpenAI has no "eos": the model ended its answer, as at a stop sequence.
FINISH_REASONS = {
    FinishReason.EOS: "stop",
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
}


@dataclass(frozen=True)
class Envelope:
    """What every object of one response shares."""

    id: str
    created: int  # Unix seconds
    model: str
    system_fingerprint: str  # the checkpoint's: a seed repeats on the same one

    def wrap(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
            **fields,
        }


class Chat:
    """`POST /v1/chat/completions`: a message, or deltas of one."""

    path = "/v1/chat/completions"
    id_prefix, whole, chunk = "chatcmpl-", "chat.completion", "chat.completion.chunk"

    @staticmethod
    def content(text: str) -> dict[str, Any]:
        return {"message": {"role": "assistant", "content": text}}

    @staticmethod
    def delta(text: str, first: bool) -> dict[str, Any]:
        return {"delta": {"role": "assistant", "content": text} if first else {"content": text}}

    @staticmethod
    def logprobs(records: list[TokenRecord], offset: int) -> dict[str, Any]:
        return {
            "content": [
                {**_token(record.text, record.logprob), "top_logprobs": _top(record)}
                for record in records
            ]
        }


class Completion:
    """`POST /v1/completions`: text, or pieces of it."""

    path = "/v1/completions"
    id_prefix, whole, chunk = "cmpl-", "text_completion", "text_completion"

    @staticmethod
    def content(text: str) -> dict[str, Any]:
        return {"text": text}

    @staticmethod
    def delta(text: str, first: bool) -> dict[str, Any]:
        return {"text": text}

    @staticmethod
    def logprobs(records: list[TokenRecord], offset: int) -> dict[str, Any]:
        """`offset`: the characters of the choice's text before these tokens."""
        offsets = []
        for record in records:
            offsets.append(offset)
            offset += len(record.text)
        return {
            "tokens": [record.text for record in records],
            "token_logprobs": [record.logprob for record in records],
            "top_logprobs": [
                {top["text"]: top["logprob"] for top in record.top_logprobs or []}
                for record in records
            ],
            "text_offset": offsets,
        }


Format = type[Chat] | type[Completion]


def _token(text: str, logprob: float | None) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def _top(record: TokenRecord) -> list[dict[str, Any]]:
    return [_token(top["text"], top["logprob"]) for top in record.top_logprobs or []]


def token_json(record: TokenRecord) -> dict[str, Any]:
    """A token and its jury metrics, as the gRPC API's TokenInfo (unset fields left out)."""
    return {name: value for name, value in asdict(record).items() if value is not None}


def summary_json(output: GenerationOutput, plan: Plan) -> dict[str, Any]:
    """The `hydra` extension of a finished choice."""
    summary: dict[str, Any] = {
        "finish_reason": str(output.finish_reason),
        "seed": output.seed,
        "draft_head": output.draft_head,
        "jury": output.jury,
        "stats": json_format.MessageToDict(
            stats_to_pb(output.stats),
            preserving_proto_field_name=True,
            always_print_fields_with_no_presence=True,
        ),
    }
    if plan.keep_session:
        summary["session_id"] = output.session
    if output.beam_score is not None:
        summary["beam_score"] = output.beam_score
        summary["beams"] = output.beams
    if output.p_correct is not None:
        summary["p_correct"], summary["witness_head"] = output.p_correct, output.witness_head
    return summary


def usage(outputs: list[GenerationOutput]) -> dict[str, int]:
    """Tokens of the prompt (once: every choice has the same) and of every choice."""
    prompt = outputs[0].prompt_tokens
    completion = sum(len(output.token_ids) for output in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def response(
    form: Format, envelope: Envelope, plan: Plan, outputs: list[GenerationOutput]
) -> dict[str, Any]:
    """The whole response of finished choices."""
    choices = []
    for index, output in enumerate(outputs):
        hydra = summary_json(output, plan)
        if plan.metrics:
            hydra["tokens"] = [token_json(record) for record in output.tokens]
        choices.append(
            {
                "index": index,
                **form.content(output.text),
                "logprobs": form.logprobs(output.tokens, 0) if plan.logprobs else None,
                "finish_reason": FINISH_REASONS[output.finish_reason],
                "hydra": hydra,
            }
        )
    return envelope.wrap(form.whole, choices=choices, usage=usage(outputs))


class Chunks:
    """A streamed response's chunks: one per choice and committed round, then (with
    `include_usage`) the usage. With `include_usage`, every chunk has `usage: null` and
    the last one the usage and no choices, as OpenAI streams them."""

    def __init__(self, form: Format, envelope: Envelope, plan: Plan) -> None:
        self.form, self.envelope, self.plan = form, envelope, plan
        choices = len(plan.requests)
        self.offsets = [0] * choices  # characters each choice has streamed
        self.started = [False] * choices
        self.outputs: list[GenerationOutput | None] = [None] * choices

    def round(self, index: int, committed: Committed) -> dict[str, Any]:
        item, output = committed.round, committed.summary
        choice = {
            "index": index,
            **self.form.delta(item.text, not self.started[index]),
            "logprobs": self.form.logprobs(item.tokens, self.offsets[index])
            if self.plan.logprobs
            else None,
            "finish_reason": FINISH_REASONS[output.finish_reason] if output else None,
            "hydra": self._round_json(item, output),
        }
        self.started[index] = True
        self.offsets[index] += sum(len(record.text) for record in item.tokens)
        self.outputs[index] = output
        return self._chunk([choice])

    def _round_json(self, item: RoundOutput, output: GenerationOutput | None) -> dict[str, Any]:
        hydra: dict[str, Any] = {
            "round": item.index,
            "drafter": str(item.drafter),
            "drafted": item.drafted,
            "accepted": item.accepted,
        }
        if self.plan.metrics:
            hydra["tokens"] = [token_json(record) for record in item.tokens]
        if output is not None:
            hydra.update(summary_json(output, self.plan))
        return hydra

    def usage(self) -> dict[str, Any]:
        """The last chunk: no choices, the usage of every choice."""
        return self.envelope.wrap(
            self.form.chunk, choices=[], usage=usage([o for o in self.outputs if o])
        )

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        extra = {"usage": None} if self.plan.include_usage else {}
        return self.envelope.wrap(self.form.chunk, choices=choices, **extra)
