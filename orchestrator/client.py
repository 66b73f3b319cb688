"""The Python client of the Generation API: how other services (and the CLI) call
hydra-jury.

`GenerationClient` calls one or more Generation servers (orchestrators sharing one
Redis, or a load balancer in front of them) with an API key, TLS and a deadline, and
resumes by itself: every generation runs on a session and under a request id (made here
when the caller names none), so when a server goes away mid-generation — UNAVAILABLE, a
broken stream, ABORTED because another server took the session over — the same request
is sent again, to the next address, and the server goes on from its last committed
round. The caller sees one stream with no token twice and none missing:
- a resent stream starts with every round committed so far in one message (the
  server's catch-up, docs/sessions.md), of which only what the caller has not seen yet
  is passed on;
- a resent unary request returns the whole output.
Attempts are bounded (`RetryPolicy`), spaced by exponential backoff with full jitter,
and all share the caller's deadline.
"""

from __future__ import annotations

import itertools
import random
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc

from hydra_jury.protos.hydrajury.v1 import generation_pb2, generation_pb2_grpc
from hydra_jury.serving.auth import with_api_key
from hydra_jury.serving.tls import ClientTls, open_channel

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 600.0
# Below this much time left a DEADLINE_EXCEEDED is the caller's deadline, not a server's
# own limit on a generation's running time (which ends it resumably).
DEADLINE_MARGIN_S = 0.5


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how fast a failed call is sent again: at most `attempts` calls in
    all, the n-th retry after a random pause of up to min(`max_backoff_s`,
    `backoff_s` * 2**n) (full jitter: clients that failed together do not come back
    together)."""

    attempts: int = 8
    backoff_s: float = 0.1
    max_backoff_s: float = 2.0

    def pause_s(self, retry: int) -> float:
        return random.uniform(0.0, min(self.max_backoff_s, self.backoff_s * 2**retry))


class ResumeError(Exception):
    """A resumed stream that does not continue the one before (a server without the
    catch-up of a resent stream): raised rather than passing on a gap."""


def retryable(error: grpc.RpcError, resending: bool, time_left_s: float) -> bool:
    """Whether sending the same request again can succeed where `error` ended it:
    - UNAVAILABLE: the server, a service behind it or Redis is down, or it drains;
    - ABORTED "taken over": another server now holds the session (this one was slow);
    - ABORTED "busy" on a resend: our own earlier attempt still holds the session;
    - DEADLINE_EXCEEDED with time left: the server's limit on a generation's running
      time, which stops it resumably."""
    code, details = error.code(), error.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE:
        return True
    if code == grpc.StatusCode.ABORTED:
        return "taken over" in details or (resending and "busy" in details)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return time_left_s > DEADLINE_MARGIN_S
    return False


class StreamJoiner:
    """Joins the attempts of one streamed generation into one stream of round deltas.

    The first message of every attempt covers the generation from its start (its first
    round, the server's catch-up of a resumed one, or the stored output of a finished
    one); its tokens and text are cut to what was not passed on yet."""

    def __init__(self) -> None:
        self.last_position: int | None = None  # of the last token passed on
        self.text = ""  # passed on so far

    def first_of_attempt(
        self, message: generation_pb2.GenerateStreamResponse
    ) -> generation_pb2.GenerateStreamResponse | None:
        """The message without what was passed on already (None: nothing new in it)."""
        if not message.text.startswith(self.text):
            raise ResumeError(
                "the resumed stream's text does not continue the text received "
                f"(round {message.round}); the server may be too old to resume streams"
            )
        new_tokens = [
            token
            for token in message.tokens
            if self.last_position is None or token.position > self.last_position
        ]
        joined = generation_pb2.GenerateStreamResponse()
        joined.CopyFrom(message)
        del joined.tokens[:]
        joined.tokens.extend(new_tokens)
        joined.text = message.text[len(self.text) :]
        if not new_tokens and not joined.text and not message.finish_reason:
            return None
        return self.passed_on(joined)

    def passed_on(
        self, message: generation_pb2.GenerateStreamResponse
    ) -> generation_pb2.GenerateStreamResponse:
        """Records a message as passed on; a gap in token positions is a `ResumeError`."""
        if message.tokens:
            first = message.tokens[0].position
            if self.last_position is not None and first != self.last_position + 1:
                raise ResumeError(
                    f"the resumed stream skips from position {self.last_position} to "
                    f"{first}; the server may be too old to resume streams"
                )
            self.last_position = message.tokens[-1].position
        self.text += message.text
        return message


class GenerationClient:
    """A client of `hydrajury.v1.Generation` at `addresses` (HOST:PORT, or several,
    comma-separated: servers sharing one Redis), tried in turn as they fail.

    `api_key`: sent as `authorization: Bearer KEY`; `tls`: the servers' CA (and a client
    certificate), else plaintext; `timeout_s`: each call's deadline, retries included.
    `resumed` counts the calls sent again. Use it as a context manager, or `close()`."""

    def __init__(
        self,
        addresses: str | Sequence[str],
        *,
        api_key: str | None = None,
        tls: ClientTls | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retry: RetryPolicy = RetryPolicy(),
    ) -> None:
        if isinstance(addresses, str):
            addresses = [part.strip() for part in addresses.split(",")]
        self.addresses = [address for address in addresses if address]
        if not self.addresses:
            raise ValueError("no address to call (HOST:PORT, or several comma-separated)")
        self.timeout_s, self.retry, self.tls = timeout_s, retry, tls
        self._channels = [open_channel(address, tls) for address in self.addresses]
        self._stubs = [
            generation_pb2_grpc.GenerationStub(with_api_key(channel, api_key))
            for channel in self._channels
        ]
        self._next = 0  # the address the next call goes to first
        self.resumed = 0

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    @property
    def address(self) -> str:
        """The address the next call goes to."""
        return self.addresses[self._next]

    def wait_ready(self, timeout_s: float) -> bool:
        """Whether any of the servers accepts a connection within `timeout_s`."""
        ready = [grpc.channel_ready_future(channel) for channel in self._channels]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for index, future in enumerate(ready):
                if future.done():
                    self._next = index
                    return True
            time.sleep(0.02)
        return False

    # --- calls ---------------------------------------------------------------------

    def info(self, timeout_s: float | None = None) -> generation_pb2.GenerationInfoResponse:
        return self._with_retries(
            lambda stub, left, _resending: stub.Info(
                generation_pb2.GenerationInfoRequest(), timeout=left
            ),
            timeout_s,
        )

    def create_session(self, session_id: str = "", timeout_s: float | None = None) -> str:
        """A new session's id: `session_id`, or one made here (so that a call sent again
        after its answer was lost finds the session it made: ALREADY_EXISTS then means
        done)."""
        session_id = session_id or uuid.uuid4().hex

        def create(stub, left: float, resending: bool) -> str:
            request = generation_pb2.CreateSessionRequest(session_id=session_id)
            try:
                return stub.CreateSession(request, timeout=left).session_id
            except grpc.RpcError as error:
                if resending and error.code() == grpc.StatusCode.ALREADY_EXISTS:
                    return session_id
                raise

        return self._with_retries(create, timeout_s)

    def close_session(self, session_id: str, timeout_s: float | None = None) -> None:
        """Closes a session (NOT_FOUND if it is gone; on a resend, gone means closed)."""

        def close(stub, left: float, resending: bool) -> None:
            request = generation_pb2.CloseSessionRequest(session_id=session_id)
            try:
                stub.CloseSession(request, timeout=left)
            except grpc.RpcError as error:
                if not (resending and error.code() == grpc.StatusCode.NOT_FOUND):
                    raise

        self._with_retries(close, timeout_s)

    def generate(
        self, request: generation_pb2.GenerateRequest, timeout_s: float | None = None
    ) -> generation_pb2.GenerateResponse:
        """The whole output of `request`, resumed on failures."""
        request = self._resumable(request, timeout_s)
        return self._with_retries(
            lambda stub, left, _resending: stub.Generate(request, timeout=left), timeout_s
        )

    def generate_stream(
        self, request: generation_pb2.GenerateRequest, timeout_s: float | None = None
    ) -> Iterator[generation_pb2.GenerateStreamResponse]:
        """One message per committed round, resumed on failures without a token twice
        or missing. Closing the iterator cancels the call in flight."""
        request = self._resumable(request, timeout_s)
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        joiner = StreamJoiner()
        for attempt in itertools.count():
            stub = self._stubs[self._next]
            call = stub.GenerateStream(request, timeout=max(0.0, deadline - time.monotonic()))
            try:
                first = True
                for message in call:
                    joined = (
                        joiner.first_of_attempt(message) if first else joiner.passed_on(message)
                    )
                    first = False
                    if joined is not None:
                        yield joined
                return
            except grpc.RpcError as error:
                self._after_failure(error, attempt, deadline)
            finally:
                call.cancel()  # a no-op once it ended; stops it when the caller leaves

    # --- retries -------------------------------------------------------------------

    def _resumable(
        self, request: generation_pb2.GenerateRequest, timeout_s: float | None
    ) -> generation_pb2.GenerateRequest:
        """`request` with a session and a request id, so that it can be sent again: a
        request that names no session would open a new one on each attempt."""
        resumable = generation_pb2.GenerateRequest()
        resumable.CopyFrom(request)
        if not resumable.session_id:
            resumable.session_id = self.create_session(timeout_s=timeout_s)
        resumable.request_id = resumable.request_id or uuid.uuid4().hex
        return resumable

    def _with_retries(
        self,
        call: Callable[[generation_pb2_grpc.GenerationStub, float, bool], T],
        timeout_s: float | None,
    ) -> T:
        """`call(stub, seconds left, whether it is a resend)`, sent again while it fails
        in a way a resend can fix."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        for attempt in itertools.count():
            try:
                left = max(0.0, deadline - time.monotonic())
                return call(self._stubs[self._next], left, attempt > 0)
            except grpc.RpcError as error:
                self._after_failure(error, attempt, deadline)
        raise AssertionError("unreachable")  # itertools.count() never ends

    def _after_failure(self, error: grpc.RpcError, attempt: int, deadline: float) -> None:
        """Re-raises `error` unless another attempt may succeed; else waits its backoff
        and moves on to the next address."""
        time_left = deadline - time.monotonic()
        if attempt + 1 >= self.retry.attempts or not retryable(error, attempt > 0, time_left):
            raise error
        time.sleep(min(self.retry.pause_s(attempt), max(0.0, time_left)))
        self._next = (self._next + 1) % len(self._stubs)
        self.resumed += 1
