"""The OpenAI request bodies the HTTP API takes, translated into
`hydrajury.v1.GenerateRequest`s, one per choice.

What becomes of each field:
- translated: `model` (the served model's name, else 404), `messages` (chat: roles
  system, user and assistant; content a string or text parts) or `prompt` (completions:
  one string), `max_tokens`/`max_completion_tokens` (max_new_tokens), `temperature`,
  `top_p`, `seed`, `stop`, `logprobs`/`top_logprobs`, `n` (choices, each a generation of
  its own, at most --limit-choices), `stream`, `stream_options.include_usage`, and `user`
  (written to the server's log with the request id, nowhere else);
- the `hydra` extension: every `DecodingOptions` field that OpenAI has no name for
  (rule, gamma, beta, drafter, jury, ...: the proto's names and JSON values, as grpcurl
  takes them), and the HTTP API's own `session_id`, `request_id`, `keep_session`,
  `metrics`;
- refused (400, code unsupported_parameter) unless null or neutral: the fields of
  features this server does not have (`CHAT_UNSUPPORTED`, `COMPLETION_UNSUPPORTED`);
- refused (400, code unknown_parameter): any other field.

Values are checked where the gRPC API checks them (`orchestrator.request`), when the
request runs; this module checks only what has no counterpart there: types, the HTTP
API's own fields, and that a value fits its proto field.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format
from pydantic import BaseModel, ConfigDict, ValidationError

from hydra_jury.orchestrator.http_api.errors import ApiError, invalid
from hydra_jury.orchestrator.limits import RequestLimits
from hydra_jury.poe.randomness import MAX_SEED
from hydra_jury.protos.hydrajury.v1 import generation_pb2

SESSION_HEADER = "X-Hydra-Session-Id"
REQUEST_HEADER = "X-Hydra-Request-Id"
ROLES = ("system", "user", "assistant")

# The DecodingOptions fields that OpenAI's own fields set: proto field → OpenAI field.
OPENAI_OPTIONS = {
    "max_new_tokens": "max_tokens",
    "stop": "stop",
    "seed": "seed",
    "temperature": "temperature",
    "top_p": "top_p",
    "logprobs": "logprobs",
    "top_logprobs": "top_logprobs",
}
# The decoding options the `hydra` extension sets: every other one.
EXTENSION_OPTIONS = tuple(
    field.name
    for field in generation_pb2.DecodingOptions.DESCRIPTOR.fields
    if field.name not in OPENAI_OPTIONS
)

_NO_TOOLS = "this server generates text, without tools or function calls"
_NO_PENALTIES = "this server has no frequency or presence penalties and no logit bias"
_NOT_STORED = "this server stores no completions (its sessions: hydra.keep_session)"
# OpenAI fields of features this server does not have: field → (the values that ask for
# nothing, why it is refused). null is always taken, as unset.
_EITHER_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "frequency_penalty": ((0,), _NO_PENALTIES),
    "presence_penalty": ((0,), _NO_PENALTIES),
    "logit_bias": (({},), _NO_PENALTIES),
}
CHAT_UNSUPPORTED = _EITHER_UNSUPPORTED | {
    "tools": (([],), _NO_TOOLS),
    "tool_choice": (("none",), _NO_TOOLS),
    "parallel_tool_calls": ((True, False), _NO_TOOLS),  # nothing to run in parallel
    "functions": (([],), _NO_TOOLS),
    "function_call": (("none",), _NO_TOOLS),
    "response_format": (({"type": "text"},), "this server has no JSON mode or schemas"),
    "modalities": ((["text"],), "this server answers in text only"),
    "audio": ((), "this server answers in text only"),
    "prediction": ((), "this server drafts with its own drafters (hydra.drafter)"),
    "reasoning_effort": ((), "this server serves no reasoning model"),
    "service_tier": (("auto", "default"), "this server has one service tier"),
    "store": ((False,), _NOT_STORED),
    "metadata": (({},), _NOT_STORED),
    "web_search_options": ((), "this server does not search the web"),
}
COMPLETION_UNSUPPORTED = _EITHER_UNSUPPORTED | {
    "echo": ((False,), "this server does not echo the prompt"),
    "suffix": ((), "this server does not insert text before a suffix"),
    "best_of": ((1,), "use n (every choice is returned) or hydra.num_beams"),
}


class _Strict(BaseModel):
    # No field is ignored, and no value converted from another type.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class HydraFields(_Strict):
    """The `hydra` extension's own fields (the rest of it are decoding options)."""

    session_id: str | None = None
    request_id: str | None = None
    keep_session: bool = False
    metrics: bool = False


class _Body(_Strict):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    hydra: dict[str, Any] | None = None


class ChatBody(_Body):
    messages: list[Any]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class CompletionBody(_Body):
    prompt: str | list[str]
    logprobs: int | None = None  # OpenAI's: the most likely tokens to report, 0..5


def parse_body(
    raw: dict[str, Any], model: type[ChatBody | CompletionBody]
) -> ChatBody | CompletionBody:
    """The body, its types checked; `ApiError` (400) naming the first field refused."""
    unsupported = CHAT_UNSUPPORTED if model is ChatBody else COMPLETION_UNSUPPORTED
    for name, (neutral, why) in unsupported.items():
        value = raw.pop(name, None)
        if value is not None and value not in neutral:
            raise invalid(f"{name} is not supported: {why}", name, "unsupported_parameter")
    try:
        return model.model_validate(raw)
    except ValidationError as error:
        raise _refusal(error) from None


def _refusal(error: ValidationError, within: str = "") -> ApiError:
    """The first problem pydantic found, naming its field (`within` the extension)."""
    first = error.errors()[0]
    param = within + ".".join(str(part) for part in first["loc"][:1])
    if first["type"] == "extra_forbidden":
        return invalid(
            f"unknown field {param!r}: this server takes OpenAI's fields it can honour and "
            "its own options in the `hydra` extension (docs/http-api.md)",
            param,
            "unknown_parameter",
        )
    if first["type"] == "missing":
        return invalid(f"{param} is required", param, "missing_required_parameter")
    return invalid(f"{param}: {first['msg']}", param)


@dataclass(frozen=True)
class Plan:
    """What one HTTP request asks for."""

    requests: list[generation_pb2.GenerateRequest]  # one per choice
    request_id: str  # the client's, or a new one: the response's id and header
    keep_session: bool  # the session stays for the next turn (n = 1)
    stream: bool
    include_usage: bool  # streaming: a last chunk with the usage
    logprobs: bool  # the choices carry log-probabilities
    metrics: bool  # the choices carry the per-token jury metrics (`hydra.tokens`)
    user: str | None


def plan_request(
    body: ChatBody | CompletionBody, headers: Mapping[str, str], limits: RequestLimits
) -> Plan:
    """The generations `body` asks for; `headers` may name a session and a request id."""
    hydra = dict(body.hydra or {})
    try:
        own = HydraFields.model_validate(
            {name: hydra.pop(name) for name in HydraFields.model_fields if name in hydra}
        )
    except ValidationError as error:
        raise _refusal(error, "hydra.") from None
    session_id = _one_of(headers, SESSION_HEADER, own.session_id, "session_id")
    request_id = _one_of(headers, REQUEST_HEADER, own.request_id, "request_id")
    keep_session = own.keep_session or session_id is not None
    _check_choices(body.n, keep_session, limits)
    if request_id is not None and not keep_session:
        raise invalid(
            "a request id resumes a request on a kept session: name the session "
            f"({SESSION_HEADER}) or keep a new one (hydra.keep_session)",
            "hydra.request_id",
        )
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options needs stream: true", "stream_options")
    request = generation_pb2.GenerateRequest(
        options=_options(body, hydra),
        session_id=session_id or "",
        request_id=request_id or "",
    )
    if isinstance(body, ChatBody):
        request.messages.messages.extend(_chat_messages(body.messages))
    else:
        request.prompt = _prompt(body.prompt)
    return Plan(
        requests=[_choice(request, index) for index in range(body.n)],
        request_id=request_id or uuid.uuid4().hex,
        keep_session=keep_session,
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        logprobs=request.options.logprobs,
        metrics=own.metrics,
        user=body.user,
    )


def _one_of(headers: Mapping[str, str], header: str, field: str | None, name: str) -> str | None:
    """A value that the header `header` and the extension's `name` may both give (an
    empty one: none): the same one, if both do."""
    given = headers.get(header) or None
    if given is not None and field is not None and given != field:
        raise invalid(f"{header} and hydra.{name} differ: give one", f"hydra.{name}")
    return given if given is not None else field


def _check_choices(n: int, keep_session: bool, limits: RequestLimits) -> None:
    if n < 1:
        raise invalid(f"n must be at least 1, got {n}", "n")
    if n > limits.choices:
        raise invalid(limits.refusal("choices", f"n={n}"), "n")
    if n > 1 and keep_session:
        raise invalid(
            "n > 1 runs each choice on a session of its own, closed with the response: a "
            "kept session (a session id, hydra.keep_session) needs n = 1",
            "n",
        )


def _options(
    body: ChatBody | CompletionBody, extension: dict[str, Any]
) -> generation_pb2.DecodingOptions:
    """The decoding options: the extension's, then OpenAI's fields."""
    for name in extension:
        if name in OPENAI_OPTIONS:
            raise invalid(
                f"hydra.{name}: set it with the OpenAI field {OPENAI_OPTIONS[name]!r}",
                f"hydra.{name}",
            )
        if name not in EXTENSION_OPTIONS:
            raise invalid(
                f"hydra.{name} is not an option: the extension takes "
                f"{', '.join(HydraFields.model_fields)} and the decoding options "
                f"{', '.join(EXTENSION_OPTIONS)}",
                f"hydra.{name}",
                "unknown_parameter",
            )
    options = generation_pb2.DecodingOptions()
    try:
        json_format.ParseDict(extension, options)
    except json_format.ParseError as error:
        raise invalid(f"hydra: {error}", "hydra") from None
    for name, (value, param) in _openai_options(body).items():
        if value is None:
            continue
        try:
            setattr(options, name, value)
        except (TypeError, ValueError):
            raise invalid(f"{param}={value!r} is out of range", param) from None
    if body.stop is not None:
        options.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    return options


def _openai_options(body: ChatBody | CompletionBody) -> dict[str, tuple[Any, str]]:
    """proto field → (the value OpenAI's fields give it, or None; the field's name)."""
    if isinstance(body, ChatBody):
        max_tokens, param = body.max_completion_tokens, "max_completion_tokens"
        if body.max_tokens is not None:
            if max_tokens is not None and max_tokens != body.max_tokens:
                raise invalid("give one of max_tokens and max_completion_tokens", param)
            max_tokens, param = body.max_tokens, "max_tokens"
        logprobs = (body.logprobs, "logprobs")
        top_logprobs = (body.top_logprobs, "top_logprobs")
    else:
        max_tokens, param = body.max_tokens, "max_tokens"
        # OpenAI's completions: `logprobs` N asks for each token's and the N likeliest.
        logprobs = (True if body.logprobs is not None else None, "logprobs")
        top_logprobs = (body.logprobs, "logprobs")
    return {
        "max_new_tokens": (max_tokens, param),
        "temperature": (body.temperature, "temperature"),
        "top_p": (body.top_p, "top_p"),
        "seed": (body.seed, "seed"),
        "logprobs": logprobs,
        "top_logprobs": top_logprobs,
    }


def _chat_messages(messages: list[Any]) -> list[generation_pb2.ChatMessage]:
    """OpenAI's messages as the gRPC API's: a role and its text. Fields a message may
    carry back from an answer (refusal, tool_calls, ...) are taken when empty."""
    converted = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise invalid(f"{where} must be an object with a role and a content", where)
        role = message.get("role")
        if role not in ROLES:
            raise invalid(
                f"{where}.role {role!r} is not supported: the roles are {', '.join(ROLES)} "
                f"({_NO_TOOLS})",
                f"{where}.role",
            )
        for name, value in message.items():
            if name not in ("role", "content") and value not in (None, "", [], {}):
                raise invalid(
                    f"{where}.{name} is not supported: a message is a role and its content",
                    f"{where}.{name}",
                    "unsupported_parameter",
                )
        content = _text(message.get("content"), f"{where}.content")
        converted.append(generation_pb2.ChatMessage(role=role, content=content))
    return converted


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or text parts (joined by newlines, as other
    servers of this API join them)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for part in content:
            if not (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
                and set(part) == {"type", "text"}
            ):
                raise invalid(
                    f"{where}: only text parts ({{'type': 'text', 'text': ...}}) are "
                    "supported: this server reads text only",
                    where,
                    "unsupported_parameter",
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise invalid(f"{where} must be a string or a list of text parts", where)


def _prompt(prompt: str | list[str]) -> str:
    if isinstance(prompt, str):
        return prompt
    if len(prompt) != 1:
        raise invalid(
            f"prompt: one prompt per request, got a list of {len(prompt)} (send a request each)",
            "prompt",
            "unsupported_parameter",
        )
    return prompt[0]


def _choice(request: generation_pb2.GenerateRequest, index: int) -> generation_pb2.GenerateRequest:
    """Choice `index`'s request: with a seed, the seed + index (modulo 2**63), so that
    choices differ and a seeded request repeats; choice 0 is the request as given."""
    choice = generation_pb2.GenerateRequest()
    choice.CopyFrom(request)
    if index and request.options.HasField("seed"):
        choice.options.seed = (request.options.seed + index) % MAX_SEED
    return choice
