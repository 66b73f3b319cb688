"""Hard limits on what one request to the public Generation API may ask for.

`RequestLimits` holds them, each a flag of both Generation servers (`orchestrator.flags`):
the field NAME is set by `--limit-NAME` (`limit_flag`), and in the orchestrator's config
file by the key `limit_NAME`. Where each is enforced, and how a request past it fails:
- message_bytes: by gRPC on the public port, before the request is decoded
  (RESOURCE_EXHAUSTED);
- prompt_tokens, new_tokens, stop_sequences, stop_chars, beams: by `prepare_request`,
  before any compute (INVALID_ARGUMENT naming the option, the limit and its flag);
- stream_s: by the session runner, between rounds: the generation stops after committing
  its last round (DEADLINE_EXCEEDED) and a request with the same ids resumes it;
- sessions_per_key: by the session runner when an API key opens a session, counted by
  the session store (RESOURCE_EXHAUSTED; a server without keys has no such limit).
- choices: by the HTTP API (`orchestrator.http_api`), before anything runs
  (INVALID_ARGUMENT, HTTP 400).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from hydra_jury.workers.errors import CapacityError


def limit_setting(name: str) -> str:
    """The setting (parsed flag, config key) of the limit `name`: "limit_NAME"."""
    return f"limit_{name}"


def limit_flag(name: str) -> str:
    """The flag that sets the limit `name`: "new_tokens" → "--limit-new-tokens"."""
    return "--" + limit_setting(name).replace("_", "-")


def _limit(default: int | float, help_text: str) -> Any:
    """A limit's field: its default and what it bounds (the flag's help)."""
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class RequestLimits:
    # gRPC's own default. The internal services keep a far larger limit: their messages
    # carry hidden states and distributions over the vocabulary.
    message_bytes: int = _limit(
        4 * 1024 * 1024, "the largest request message the public port accepts, in bytes"
    )
    prompt_tokens: int = _limit(
        4096, "tokens of the context a request runs on: the conversation so far and its input"
    )
    new_tokens: int = _limit(2048, "the largest max_new_tokens a request may ask for")
    stop_sequences: int = _limit(16, "stop sequences of one request")
    stop_chars: int = _limit(256, "characters of each stop sequence")
    beams: int = _limit(32, "num_beams of one request (each beam holds a cache slot)")
    stream_s: float = _limit(
        600.0,
        "seconds one generation may run; a longer one stops after a committed round, and "
        "the same request (same session_id and request_id) continues it",
    )
    sessions_per_key: int = _limit(64, "sessions one API key may hold open at once")
    choices: int = _limit(8, "n of one HTTP API request: its choices, each a generation of its own")

    def __post_init__(self) -> None:
        for setting in fields(self):
            value = getattr(self, setting.name)
            if not value > 0:
                raise ValueError(f"{limit_flag(setting.name)} must be positive, got {value}")

    def refusal(self, name: str, what: str) -> str:
        """A refusal's detail: "WHAT is over this server's limit of N (--limit-NAME)"."""
        value = getattr(self, name)
        shown = f"{value:g}" if isinstance(value, float) else str(value)
        return f"{what} is over this server's limit of {shown} ({limit_flag(name)})"

    def check_sessions_per_key(self, key_name: str, held: int) -> None:
        """Before the API key `key_name`, holding `held` open sessions, opens one more:
        `CapacityError` (RESOURCE_EXHAUSTED) once it holds the limit."""
        if held >= self.sessions_per_key:
            raise CapacityError(
                f"API key {key_name!r} holds {held} open sessions, this server's limit of "
                f"{self.sessions_per_key} ({limit_flag('sessions_per_key')}): close one "
                "(CloseSession) or let one expire first"
            )


DEFAULT_LIMITS = RequestLimits()  # a server's, when no flag or key sets one


def limits_from(settings: object) -> RequestLimits:
    """The limits a server's settings hold, each as the attribute `limit_NAME` (the
    parsed flags, or the orchestrator's configuration)."""
    return RequestLimits(
        **{
            limit.name: getattr(settings, limit_setting(limit.name))
            for limit in fields(RequestLimits)
        }
    )
