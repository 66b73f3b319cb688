"""A session's record: what every cache of the session should hold, and who may write it.

Terms
- committed tokens: the conversation's context and generated tokens so far (the last is
  the pending token, not yet processed by any cache).
- processed: how many leading committed tokens every cache is known to hold. Caches may
  hold more (a round's draft tokens); those positions are scratch.
- cache id: the name of the session's caches on the services. It changes when a request
  takes the session over from an owner whose lease ran out, so a stale owner that is
  still running can never write into the caches the new owner reads.
- generation: the latest request on the session (its request id, the digest of its
  options, where its context ends, and its `Progress`), finished or not.
- version: incremented by every write; a write names the version it read (fencing).
- key name: the API key that created the session ("" on a server without keys). Each
  key has its own session ids (`scoped_id`): another key naming the same id reaches its
  own session or none, never learning that this one exists.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from hydra_jury.orchestrator.output import Progress
from hydra_jury.workers.errors import InvalidArgument

SESSION_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces


def new_session_id() -> str:
    """128 random bits, as hex."""
    return secrets.token_hex(16)


def scoped_id(session_id: str, key_name: str = "") -> str:
    """Where the stores file a session: its id within its key's own ids (a key name and
    a session id never hold "/", so no two scoped ids coincide)."""
    return f"{key_name}/{session_id}" if key_name else session_id


def new_cache_id(session_id: str, key_name: str = "") -> str:
    """The name of a session's caches on the services: its scoped id (two keys' sessions
    of one id never share caches) and random bits (a new one on every takeover)."""
    return f"{scoped_id(session_id, key_name)}~{secrets.token_hex(4)}"


def check_session_id(session_id: str) -> str:
    if not SESSION_ID.fullmatch(session_id):
        raise InvalidArgument(
            f"session_id {session_id[:40]!r} is not valid: use 1-128 letters, digits "
            "or the characters - _ . :"
        )
    return session_id


def check_request_id(request_id: str) -> str:
    if not REQUEST_ID.fullmatch(request_id):
        raise InvalidArgument("request_id must be 1-128 printable ASCII characters without spaces")
    return request_id


@dataclass
class GenerationRecord:
    request_id: str
    digest: str  # of the request's options and input: a reused request id must match
    context_length: int  # committed tokens that are context; the rest were generated
    progress: Progress = field(default_factory=Progress)

    @property
    def finished(self) -> bool:
        return self.progress.finish_reason is not None

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GenerationRecord:
        return cls(**{**values, "progress": Progress.from_dict(values["progress"])})


@dataclass
class SessionRecord:
    session_id: str
    cache_id: str
    key_name: str = ""  # the API key whose session this is ("" without keys)
    version: int = 0
    owner: str = ""  # the generation holding the lease ("" = none)
    lease_until_ms: int = 0  # store clock
    created_ms: int = 0
    updated_ms: int = 0
    kind: str = ""  # "chat" (messages) or "text" (prompts); "" before the first turn
    messages: list[dict[str, str]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    processed: int = 0
    options: dict[str, Any] = field(default_factory=dict)  # the latest request's
    seed: int | None = None
    draft_head: str | None = None
    jury: list[str] = field(default_factory=list)
    replicas: dict[str, str] = field(default_factory=dict)  # component -> address@epoch
    generation: GenerationRecord | None = None
    result: dict[str, Any] | None = None  # the latest finished generation's output

    @property
    def scoped_id(self) -> str:
        return scoped_id(self.session_id, self.key_name)

    # The store keeps these beside the JSON document, where its scripts can read them.
    STORE_FIELDS = ("version", "owner", "lease_until_ms", "created_ms", "updated_ms")

    def document(self) -> str:
        """Everything but the store's fields, the tokens and the result, as JSON. Written
        on every round's commit, so nothing is copied first (`asdict` of the whole record
        deep-copied the tokens and the previous turn's result only to drop them: 2.5 ms
        a round with a 300-token result, now 0.02 ms)."""
        left_out = {*self.STORE_FIELDS, "tokens", "result"}
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in left_out}
        # The generation record and its progress are written as their fields (`vars`),
        # without the copy `asdict` makes of them.
        return json.dumps(values, separators=(",", ":"), default=vars)

    @classmethod
    def from_document(cls, document: str | bytes, **store_fields: Any) -> SessionRecord:
        """The record of a `document()`; a ValueError naming what is wrong for anything
        else (a corrupt or foreign value in the store), never an error of the decoding
        code itself (found by tests/test_fuzz.py)."""
        values = json.loads(document)
        try:
            if values.get("generation") is not None:
                values["generation"] = GenerationRecord.from_dict(values["generation"])
            return cls(**values, **store_fields)
        except (AttributeError, TypeError, KeyError) as error:
            raise ValueError(f"not a session record document: {error!r}") from error


def pack_tokens(tokens: list[int]) -> bytes:
    """Token ids as little-endian int32: 4 bytes each."""
    return np.asarray(tokens, dtype="<i4").tobytes()


def unpack_tokens(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype="<i4").tolist()


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    left, right = np.asarray(a[:n]), np.asarray(b[:n])
    differ = np.flatnonzero(left != right)
    return int(differ[0]) if len(differ) else n
