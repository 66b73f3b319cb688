"""Protobuf at the edge: public API messages to engine objects and back."""

from __future__ import annotations

from hydra_jury.orchestrator.output import GenerationOutput, RoundOutput, TokenRecord
from hydra_jury.orchestrator.request import GenerationRequest, RequestError
from hydra_jury.protos.hydrajury.v1 import generation_pb2

_OPTIONAL_FIELDS = (
    "max_new_tokens",
    "gamma",
    "beta",
    "temperature",
    "top_p",
    "seed",
    "num_beams",
    "length_penalty",
)
_PLAIN_FIELDS = (
    "ignore_eos",
    "lenience",
    "top_k",
    "min_p",
    "epsilon",
    "contrastive_alpha",
    "early_stopping",
    "return_beams",
    "uncertainty",
    "logprobs",
    "top_logprobs",
)


def request_from_pb(message: generation_pb2.GenerateRequest) -> GenerationRequest:
    which = message.WhichOneof("input")
    if which is None:
        raise RequestError("give exactly one of prompt and messages")
    options = message.options
    values: dict = {name: getattr(options, name) for name in _PLAIN_FIELDS}
    values.update(
        {name: getattr(options, name) for name in _OPTIONAL_FIELDS if options.HasField(name)}
    )
    values["stop"] = list(options.stop)
    values["rule"] = options.rule or "exact"
    values["draft_head"] = options.draft_head or None
    values["jury"] = list(options.jury) or None
    values["contrastive_amateur"] = options.contrastive_amateur or None
    values["drafter"] = options.drafter or "auto"
    if which == "prompt":
        values["prompt"] = message.prompt
    else:
        values["messages"] = [
            {"role": m.role, "content": m.content} for m in message.messages.messages
        ]
    return GenerationRequest(**values)


def request_to_pb(
    request: GenerationRequest, session_id: str = ""
) -> generation_pb2.GenerateRequest:
    """The inverse of `request_from_pb` (for clients such as the CLI)."""
    options = generation_pb2.DecodingOptions(
        stop=request.stop,
        rule=request.rule,
        draft_head=request.draft_head or "",
        jury=request.jury or [],
        contrastive_amateur=request.contrastive_amateur or "",
        drafter=request.drafter,
        **{name: getattr(request, name) for name in _PLAIN_FIELDS},
    )
    for name in _OPTIONAL_FIELDS:
        value = getattr(request, name)
        if value is not None:
            setattr(options, name, value)
    message = generation_pb2.GenerateRequest(options=options, session_id=session_id)
    if request.messages is not None:
        message.messages.messages.extend(
            generation_pb2.ChatMessage(role=m["role"], content=m["content"])
            for m in request.messages
        )
    else:
        message.prompt = request.prompt or ""
    return message


def token_to_pb(record: TokenRecord) -> generation_pb2.TokenInfo:
    fields = {
        name: value for name, value in vars(record).items() if value is not None and name != "votes"
    }
    return generation_pb2.TokenInfo(**fields, votes=record.votes or {})


def stats_to_pb(stats: dict) -> generation_pb2.RequestStats:
    names = generation_pb2.RequestStats.DESCRIPTOR.fields_by_name
    return generation_pb2.RequestStats(**{k: v for k, v in stats.items() if k in names})


def output_to_pb(output: GenerationOutput) -> generation_pb2.GenerateResponse:
    return generation_pb2.GenerateResponse(
        text=output.text,
        token_ids=output.token_ids,
        tokens=[token_to_pb(t) for t in output.tokens],
        finish_reason=output.finish_reason,
        stats=stats_to_pb(output.stats),
        seed=output.seed,
        draft_head=output.draft_head or "",
        jury=output.jury,
        prompt_tokens=output.prompt_tokens,
        session_id=output.session,
        request_id=output.request_id,
        beam_score=output.beam_score,
        beams=[beam_to_pb(beam) for beam in output.beams],
        p_correct=output.p_correct,
        witness_head=output.witness_head,
    )


def beam_to_pb(beam: dict) -> generation_pb2.Beam:
    return generation_pb2.Beam(**beam)


def round_to_pb(
    output: RoundOutput, summary: GenerationOutput | None
) -> generation_pb2.GenerateStreamResponse:
    """One stream message; the last round carries the request's summary."""
    message = generation_pb2.GenerateStreamResponse(
        round=output.index,
        tokens=[token_to_pb(t) for t in output.tokens],
        text=output.text,
        finish_reason=output.finish_reason or "",
        drafted=output.drafted,
        accepted=output.accepted,
        drafter=output.drafter,
    )
    if summary is not None:
        message.stats.CopyFrom(stats_to_pb(summary.stats))
        message.seed = summary.seed
        message.draft_head = summary.draft_head or ""
        message.jury.extend(summary.jury)
        message.session_id = summary.session
        if summary.beam_score is not None:
            message.beam_score = summary.beam_score
        message.beams.extend(beam_to_pb(beam) for beam in summary.beams)
        if summary.p_correct is not None:
            message.p_correct = summary.p_correct
            message.witness_head = summary.witness_head
    return message
