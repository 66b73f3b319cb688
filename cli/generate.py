"""The client commands: `generate` (in this process or through a server) and `chat` (turn
after turn on one session of a server)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys

import grpc
from google.protobuf.json_format import MessageToJson

from hydra_jury.cli.channel import (
    add_server_tls_flags,
    client_tls,
    tls_flags_given,
    unreachable,
)
from hydra_jury.cli.decoding import add_decoding_flags, decoding_request
from hydra_jury.cli.draft import resolved_draft_model
from hydra_jury.hydra_model import DraftModel, HydraModel
from hydra_jury.orchestrator.chat import Chat
from hydra_jury.orchestrator.client import GenerationClient, ResumeError
from hydra_jury.orchestrator.convert import request_to_pb
from hydra_jury.orchestrator.engine import Engine
from hydra_jury.orchestrator.local_backend import LocalBackend
from hydra_jury.orchestrator.request import GenerationRequest
from hydra_jury.orchestrator.sessions.memory_store import MemoryStore
from hydra_jury.orchestrator.sessions.runner import SessionRunner
from hydra_jury.serving.flags import add_draft_model_flag, add_model_flags
from hydra_jury.serving.model_thread import ModelThread, start_model_thread
from hydra_jury.workers.sessions import SessionLimits

CONNECT_TIMEOUT_S = 10.0  # `chat`: how long a server may take to answer at all
TIMEOUT_S = 600.0  # the deadline of an answer from a server
# `generate --local` holds one request in this process: a few sessions (a beam search
# takes one per beam), not the caches a server reserves for its SessionLimits().
LOCAL_LIMITS = SessionLimits(max_sessions=4, max_session_tokens=2048)
API_KEY_VARIABLE = "HYDRA_JURY_API_KEY"  # below --api-key


def add_commands(commands: argparse._SubParsersAction) -> None:
    _add_generate(commands)
    _add_chat(commands)


def _add_address_flag(
    parser: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup, required: bool = False
) -> None:
    parser.add_argument(
        "--address",
        required=required,
        metavar="HOST:PORT[,...]",
        help="a server's Generation API, or several sharing one Redis: a generation broken "
        "by a server going away is resumed on the next",
    )


def _client(args: argparse.Namespace) -> GenerationClient:
    return GenerationClient(
        args.address, api_key=_api_key(args), tls=client_tls(args), timeout_s=args.timeout_s
    )


def _add_timeout_flag(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--timeout-s", type=float, default=TIMEOUT_S, help=f"{what} (%(default)g)")


def _add_api_key_flag(parser: argparse.ArgumentParser) -> None:
    # No default shown: it would print the variable's key in --help.
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"the API key of a server started with --api-keys (default ${API_KEY_VARIABLE}, "
        "which, unlike the flag, other users of the machine cannot see in its process list)",
    )


def _api_key(args: argparse.Namespace) -> str | None:
    return args.api_key or os.environ.get(API_KEY_VARIABLE) or None


def _add_generate(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "generate",
        help="generate text by speculative PoE decoding",
        description="Generate text and stream it as each round commits it: in this process "
        "(--local, with --checkpoint) or through a running server (--address), on a new "
        "session or, with --session, as the next turn of one.",
    )
    parser.add_argument("prompt", help="the prompt (a user message unless --no-chat)")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--local", action="store_true", help="run the engine in-process")
    _add_address_flag(where)
    parser.add_argument("--checkpoint", metavar="DIR", help="the checkpoint (with --local)")
    add_draft_model_flag(parser, "with --local: ")
    _add_timeout_flag(parser, "with --address: the answer's deadline")
    parser.add_argument(
        "--session",
        metavar="ID",
        help="continue this session: the prompt is its next turn (--address)",
    )
    parser.add_argument(
        "--request-id",
        metavar="ID",
        help="idempotency key: sending the request again resumes or replays it (--address)",
    )
    parser.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="format the prompt with the chat template (default) or send it as raw text",
    )
    parser.add_argument("--system", help="a system message (chat mode, new sessions)")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the whole output (ids, text, metrics, stats) as JSON",
    )
    add_decoding_flags(parser)
    add_model_flags(parser)
    add_server_tls_flags(parser)
    _add_api_key_flag(parser)
    parser.set_defaults(handler=_run_generate)


def _check_session_flags(args: argparse.Namespace) -> None:
    if args.system and args.session:
        raise ValueError("--system opens a new session; a continued session keeps its own")


def _run_generate(args: argparse.Namespace) -> int:
    _check_session_flags(args)
    messages = None
    if args.chat:
        messages = [{"role": "user", "content": args.prompt}]
        if args.system:
            messages.insert(0, {"role": "system", "content": args.system})
    request = decoding_request(args, prompt=None if args.chat else args.prompt, messages=messages)
    if args.address:
        return _generate_remote(args, request)
    if args.session or args.request_id:
        raise ValueError(
            "--session and --request-id need --address: the sessions of --local end with it"
        )
    if tls := tls_flags_given(args):
        raise ValueError(f"{', '.join(tls)}: for a server's port (--address)")
    if args.api_key:
        raise ValueError("--api-key is for a server's API (--address)")
    if not args.checkpoint:
        raise ValueError("--local needs --checkpoint DIR")
    return _generate_local(args, request)


def _generate_local(args: argparse.Namespace, request: GenerationRequest) -> int:
    """Runs the request on a session of this process (an in-memory store): the same
    runner as the servers, so the same tokens. The model is loaded, and every round runs,
    on one model thread, as in `serve`: torch's parallel work on two threads of the
    process (the load on the main thread, the rounds on the runner's) kept two OpenMP
    teams, more threads than cores, and libgomp then wakes its threads for every
    parallel region (`serving.model_thread`): int8 decoding ran at 63 tokens/s here
    against 180 for the engine alone (2-core Intel Xeon)."""

    def build(thread: ModelThread) -> tuple[ModelThread, HydraModel, LocalBackend]:
        model = HydraModel.load(args.checkpoint, dtype=args.dtype, device=args.device)
        draft_model = None
        if args.draft_model:
            draft_model = DraftModel.load(
                resolved_draft_model(args.draft_model), dtype=args.dtype, device=args.device
            )
        backend = LocalBackend(model, draft_model=draft_model, limits=LOCAL_LIMITS, thread=thread)
        return thread, model, backend

    async def generate() -> None:
        thread, model, backend = await start_model_thread("model", build)
        runner = SessionRunner(Engine(backend, model.load_tokenizer()), MemoryStore())
        summary = None
        try:
            async with contextlib.aclosing(runner.generate(request)) as rounds:
                async for committed in rounds:
                    summary = committed.summary or summary
                    if not args.json:
                        print(committed.round.text, end="", flush=True)
        finally:
            await runner.close()
            await asyncio.to_thread(thread.shutdown)
        if args.json:
            print(json.dumps(summary.to_dict(), indent=2))
        else:
            print()
            if summary is not None and summary.p_correct is not None:
                _print_p_correct(summary.p_correct, summary.witness_head)

    asyncio.run(generate())
    return 0


def _print_p_correct(p_correct: float, witness_head: str) -> None:
    # On stderr, so that stdout stays the answer alone.
    print(f"p_correct: {p_correct:.4f} (witness head {witness_head})", file=sys.stderr)


def _generate_remote(args: argparse.Namespace, request: GenerationRequest) -> int:
    message = request_to_pb(request, session_id=args.session or "")
    message.request_id = args.request_id or ""
    with _client(args) as client:
        try:
            if args.json:
                print(MessageToJson(client.generate(message), indent=2))
                return 0
            session_id, judged = "", None
            for streamed in client.generate_stream(message):
                session_id = streamed.session_id
                print(streamed.text, end="", flush=True)
                if streamed.HasField("p_correct"):
                    judged = (streamed.p_correct, streamed.witness_head)
            print()
            if judged is not None:
                _print_p_correct(*judged)
            # On stderr, so that stdout stays the answer alone.
            print(f"session: {session_id}", file=sys.stderr)
        except grpc.RpcError as error:
            hint = "" if error.code() != grpc.StatusCode.UNAVAILABLE else unreachable(client.tls)
            print(
                f"hydra-jury generate: error: {error.code().name}: {error.details()}{hint}",
                file=sys.stderr,
            )
            return 2
        except ResumeError as error:
            print(f"hydra-jury generate: error: {error}", file=sys.stderr)
            return 2
    return 0


def _add_chat(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "chat",
        help="chat with a running server, turn after turn on one session",
        description="Read messages line by line and stream each answer. The conversation "
        "lives in a session on the server, so each turn sends only its new message. "
        "Commands: /reset (close the session, start a new one), /metrics (the last "
        "answer token by token, with its statistics), /session (its id), /quit.",
    )
    _add_address_flag(parser, required=True)
    parser.add_argument("--system", help="the system message of a new session")
    parser.add_argument("--session", metavar="ID", help="continue this session")
    _add_timeout_flag(parser, "deadline of each answer")
    add_decoding_flags(parser)
    add_server_tls_flags(parser)
    _add_api_key_flag(parser)
    parser.set_defaults(handler=_run_chat)


def _run_chat(args: argparse.Namespace) -> int:
    _check_session_flags(args)
    with _client(args) as client:
        # Every later failure is one turn's; a server that cannot be reached at all ends
        # the chat before the first line.
        if not client.wait_ready(CONNECT_TIMEOUT_S):
            raise ConnectionError(
                f"cannot reach {args.address} within {CONNECT_TIMEOUT_S:g} s"
                f"{unreachable(client.tls)}"
            )
        chat = Chat(
            client,
            decoding_request(args),
            stdin=sys.stdin,
            stdout=sys.stdout,
            stderr=sys.stderr,
            system=args.system,
            session_id=args.session or "",
            timeout_s=args.timeout_s,
        )
        return chat.run()
