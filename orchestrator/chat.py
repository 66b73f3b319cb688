"""`hydra-jury chat`: a multi-turn conversation on one session of a running server.

Each line read is a user message; its answer is streamed with GenerateStream on the
session, whose record (in the server's Redis) holds the conversation, so a turn sends
only its new message and the server reuses the caches of the earlier turns. The
client (`orchestrator.client`) opens the session with the first turn and resumes a turn
broken by a server going away, on the same or another server.

Lines starting with "/" are commands:
- /reset: close the session (CloseSession frees its caches); the next line starts anew
- /metrics: the last answer token by token, and its request statistics
- /session: the session's id
- /quit (or end of input): leave, the session left open for `--session` to continue

A gRPC error during a turn is printed and the chat goes on; Ctrl-C during an answer
cancels that answer only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import TextIO

import grpc

from hydra_jury.orchestrator.client import GenerationClient, ResumeError
from hydra_jury.orchestrator.convert import request_to_pb
from hydra_jury.orchestrator.request import GenerationRequest
from hydra_jury.protos.hydrajury.v1 import generation_pb2

COMMANDS = ("/reset", "/metrics", "/session", "/quit")


class Chat:
    """The conversation loop over a Generation client and three text streams.

    `options` carries the decoding options of every turn (its input is ignored);
    `system` opens a new session's conversation; `session_id` continues a session."""

    def __init__(
        self,
        client: GenerationClient,
        options: GenerationRequest,
        *,
        stdin: TextIO,
        stdout: TextIO,
        stderr: TextIO,
        system: str | None = None,
        session_id: str = "",
        timeout_s: float = 600.0,
    ) -> None:
        self.client, self.options, self.system = client, options, system
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.session_id = session_id  # "" until the first turn of a new session answers
        self.timeout_s = timeout_s
        # The last finished answer, for /metrics.
        self.last_tokens: list[generation_pb2.TokenInfo] = []
        self.last_stats: generation_pb2.RequestStats | None = None

    def run(self) -> int:
        """Reads lines until /quit or end of input; the exit code (always 0: a failed
        turn is reported and the chat goes on)."""
        try:
            for line in self._lines():
                if line.startswith("/"):
                    if not self._command(line):
                        break
                elif line:
                    self._turn(line)
        except KeyboardInterrupt:  # Ctrl-C at the prompt: leave as /quit does
            self.stdout.write("\n")
        if self.session_id:
            self._note(f"session: {self.session_id}")
        return 0

    def _lines(self) -> Iterator[str]:
        # The prompt is for a person at a terminal, not for piped input.
        interactive = self.stdin.isatty()
        while True:
            if interactive:
                self.stdout.write("> ")
                self.stdout.flush()
            line = self.stdin.readline()
            if not line:
                return
            yield line.strip()

    def _note(self, text: str) -> None:
        print(text, file=self.stderr, flush=True)

    def _command(self, line: str) -> bool:
        """Runs a command; False to end the chat."""
        if line == "/quit":
            return False
        if line == "/reset":
            self._reset()
        elif line == "/metrics":
            self._print_metrics()
        elif line == "/session":
            print(self.session_id or "(none yet: the next message starts one)", file=self.stdout)
        else:
            self._note(f"unknown command {line}; commands: {' '.join(COMMANDS)}")
        return True

    def _turn(self, text: str) -> None:
        """Sends one user message on the session and streams the answer."""
        messages = [{"role": "user", "content": text}]
        if not self.session_id and self.system:
            messages.insert(0, {"role": "system", "content": self.system})
        request = request_to_pb(replace(self.options, messages=messages), self.session_id)
        tokens: list[generation_pb2.TokenInfo] = []
        stats = None
        try:
            # Closing the stream cancels the call in flight (Ctrl-C).
            with contextlib.closing(self.client.generate_stream(request, self.timeout_s)) as rounds:
                for message in rounds:
                    # Taken from the first message: a turn broken later still continues
                    # the conversation its first rounds were committed to.
                    self.session_id = self.session_id or message.session_id
                    self.stdout.write(message.text)
                    self.stdout.flush()
                    tokens.extend(message.tokens)
                    if message.finish_reason:
                        stats = message.stats
        except KeyboardInterrupt:
            self.stdout.write("\n")
            self._note("(answer cancelled)")
            return
        except grpc.RpcError as error:
            if tokens:
                self.stdout.write("\n")
            self._note(f"error: {error.code().name}: {error.details()}")
            if error.code() == grpc.StatusCode.NOT_FOUND and self.session_id:
                # Closed elsewhere or expired: the conversation cannot go on.
                self.session_id = ""
                self._note("the session is gone; the next message starts a new one")
            return
        except ResumeError as error:
            self._note(f"error: {error}")
            return
        self.stdout.write("\n")
        self.stdout.flush()
        self.last_tokens, self.last_stats = tokens, stats

    def _reset(self) -> None:
        if self.session_id:
            try:
                self.client.close_session(self.session_id, self.timeout_s)
            except grpc.RpcError as error:
                # NOT_FOUND: already gone; anything else: it expires by itself.
                self._note(f"error: {error.code().name}: {error.details()}")
        self.session_id = ""
        self.last_tokens, self.last_stats = [], None
        self._note("session closed; the next message starts a new one")

    def _print_metrics(self) -> None:
        if self.last_stats is None:
            self._note("no answer yet")
            return
        for line in metrics_lines(self.last_tokens, self.last_stats):
            print(line, file=self.stdout)
        self.stdout.flush()


def metrics_lines(
    tokens: list[generation_pb2.TokenInfo], stats: generation_pb2.RequestStats
) -> list[str]:
    """An answer's tokens, one line each (position, kind, text, entropy, stability
    radius, and for a replacement the draft token it replaced), then its statistics.
    "-" where the rule computed no target (drafter_only)."""
    lines = [f"{'pos':>6}  {'kind':<11}  {'token':<16}  {'entropy':>7}  {'radius':>6}"]
    for token in tokens:
        entropy = f"{token.entropy:7.3f}" if token.HasField("entropy") else f"{'-':>7}"
        radius = (
            f"{token.stability_radius:6d}" if token.HasField("stability_radius") else f"{'-':>6}"
        )
        line = f"{token.position:6d}  {token.kind:<11}  {token.text!r:<16}  {entropy}  {radius}"
        if token.HasField("rejected_token"):
            line += f"  rejected {token.rejected_text!r} ({token.rejected_token})"
        lines.append(line)
    lines.append(
        f"rounds {stats.rounds}, acceptance rate {stats.acceptance_rate:.3f}, "
        f"mean accepted length {stats.mean_accepted_length:.2f}, "
        f"prefilled {stats.prefilled_tokens} tokens, reused {stats.reused_tokens}"
    )
    return lines
