"""The `hydra-jury` command line."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from hydra_jury.hydra_model.checkpoint import DTYPES
from hydra_jury.orchestrator.config import REDIS_URL_VARIABLE
from hydra_jury.serving.errors import EXPECTED_FAILURES, failure_line
from hydra_jury.workers.sessions import SessionLimits

if TYPE_CHECKING:  # the command modules import torch: only when a command runs
    from hydra_jury.orchestrator.request import GenerationRequest

CONNECT_TIMEOUT_S = 10.0  # `chat`: how long a server may take to answer at all
# `generate --local` holds one request in this process: a few sessions (a beam search
# takes one per beam), not the caches a server reserves for its SessionLimits().
LOCAL_LIMITS = SessionLimits(max_sessions=4, max_session_tokens=2048)


def _add_build(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "build",
        help="build a Hydra checkpoint from a Hugging Face model or GGUF file",
        description="Split a decoder into a shared trunk and several heads and write a Hydra "
        "checkpoint. Head i takes, in order: the i-th --head-from checkpoint's top "
        "layers, then the next --lora adapter merged into the base top layers, "
        "then plain copies of the base top layers.",
    )
    parser.add_argument(
        "--from",
        dest="source",
        required=True,
        metavar="SRC",
        help="Hugging Face model directory (safetensors) or a .gguf file",
    )
    parser.add_argument(
        "--trunk-layers",
        type=int,
        required=True,
        metavar="K",
        help="layers 0..K-1 form the shared trunk; the rest are per head",
    )
    parser.add_argument(
        "--layers",
        type=int,
        metavar="N",
        help="keep only the first N layers of SRC (an early-exit model, e.g. a draft model)",
    )
    parser.add_argument(
        "--heads", type=int, required=True, metavar="N", help="number of heads of role llm"
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="checkpoint directory")
    parser.add_argument(
        "--head-from",
        action="append",
        default=[],
        metavar="DIR",
        help="a full fine-tune of the same architecture (repeatable)",
    )
    parser.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="ADAPTER_DIR",
        help="a PEFT LoRA adapter merged into a head (repeatable)",
    )
    parser.add_argument(
        "--uncertainty-head", action="store_true", help="add one extra head of role uncertainty"
    )
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--force", action="store_true", help="overwrite an existing --out")
    parser.set_defaults(handler=_run_build)


def _run_build(args: argparse.Namespace) -> int:
    from hydra_jury.hydra_model.build.builder import BuildOptions, build_checkpoint

    options = BuildOptions(
        source=args.source,
        out=args.out,
        trunk_layers=args.trunk_layers,
        heads=args.heads,
        head_from=args.head_from,
        lora=args.lora,
        uncertainty_head=args.uncertainty_head,
        dtype=args.dtype,
        force=args.force,
        layers=args.layers,
    )
    build_checkpoint(options, log=lambda line: print(line, file=sys.stderr, flush=True))
    return 0


def _add_train_heads(commands: argparse._SubParsersAction) -> None:
    from hydra_jury.hydra_model.build.corpus import CORPUS_FORMAT
    from hydra_jury.hydra_model.build.train import DEFAULT_LEARNING_RATE, TrainOptions

    defaults = TrainOptions(checkpoint="", data="", out="")
    parser = commands.add_parser(
        "train-heads",
        help="fine-tune each head on its own shard of a corpus",
        description="Fine-tune each llm head of a Hydra checkpoint on its own shard of a "
        "JSON-lines corpus (head i of n trains on texts i, i+n, ...), the trunk frozen "
        "and its hidden states computed once. Writes a new checkpoint; run the same "
        "command again to resume an interrupted run from its last saved step.",
    )
    parser.add_argument("--checkpoint", required=True, metavar="DIR", help="Hydra checkpoint")
    parser.add_argument(
        "--data", metavar="FILE", help=f"corpus: {CORPUS_FORMAT} (not with --uncertainty)"
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="the trained checkpoint")
    parser.add_argument(
        "--lora",
        type=int,
        metavar="RANK",
        help="train LoRA adapters of this rank (merged on save) instead of every weight",
    )
    parser.add_argument("--steps", type=int, default=defaults.steps, metavar="N")
    parser.add_argument(
        "--lr",
        type=float,
        metavar="RATE",
        help=f"AdamW learning rate (default {DEFAULT_LEARNING_RATE['full']:g}, "
        f"with --lora {DEFAULT_LEARNING_RATE['lora']:g})",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=defaults.batch_size,
        metavar="N",
        help="windows per head and step",
    )
    parser.add_argument(
        "--seq-len", type=int, default=defaults.seq_len, metavar="N", help="tokens per window"
    )
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--save-every",
        type=int,
        default=defaults.save_every,
        metavar="N",
        help="save the run's state every N steps (resumable)",
    )
    parser.add_argument(
        "--force", action="store_true", help="discard an existing --out (or unfinished run)"
    )
    parser.add_argument(
        "--uncertainty",
        action="store_true",
        help="train the uncertainty head instead, on multiple-choice questions the "
        "project writes and the model answers; reports calibration on a held-out quarter",
    )
    parser.add_argument(
        "--questions",
        type=int,
        default=defaults.questions,
        metavar="N",
        help="with --uncertainty: questions to write, answer and grade",
    )
    parser.set_defaults(handler=_run_train_heads)


def _run_train_heads(args: argparse.Namespace) -> int:
    from hydra_jury.hydra_model.build.train import ProgressBar, TrainOptions, train_heads
    from hydra_jury.hydra_model.build.train_uncertainty import train_uncertainty

    if args.uncertainty == bool(args.data):
        raise ValueError("give --data (train the llm heads) or --uncertainty, not both")
    options = TrainOptions(
        checkpoint=args.checkpoint,
        data=args.data or "",
        out=args.out,
        steps=args.steps,
        lora_rank=args.lora,
        learning_rate=args.lr,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        seed=args.seed,
        save_every=args.save_every,
        force=args.force,
        questions=args.questions,
    )
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if args.uncertainty:
        judged = train_uncertainty(options, log=log, on_step=ProgressBar())
        print(
            f"held out ({judged.questions} questions, a quarter held out; the model answered "
            f"{judged.correct_rate:.1%} correctly):"
        )
        print(f"  untrained head: {judged.before.line()}")
        print(f"  trained head:   {judged.after.line()}")
        print(f"  constant rate:  Brier {judged.constant_brier:.4f}")
        return 0
    result = train_heads(options, log=log, on_step=ProgressBar())
    first, last = result.losses[0], result.losses[-1]
    for name, before, after in zip(result.heads, first, last, strict=True):
        print(f"{name}: loss {before:.3f} at step 1, {after:.3f} at step {len(result.losses)}")
    return 0


def _add_inspect(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("inspect", help="describe a Hydra checkpoint")
    parser.add_argument("checkpoint", metavar="DIR")
    parser.set_defaults(handler=_run_inspect)


def _run_inspect(args: argparse.Namespace) -> int:
    from hydra_jury.hydra_model.build.describe import describe_checkpoint

    print(describe_checkpoint(args.checkpoint))
    return 0


def _add_decoding_flags(parser: argparse.ArgumentParser) -> None:
    """The decoding options of a request (`generate` and `chat`)."""
    from hydra_jury.poe import RULES
    from hydra_jury.workers.calls import MAX_GAMMA

    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop sequence (repeatable)"
    )
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument(
        "--gamma",
        type=int,
        help=f"draft length, 1..{MAX_GAMMA} (default 4; with --drafter auto the most per "
        "round, default 8)",
    )
    parser.add_argument("--rule", default="exact", choices=RULES)
    parser.add_argument("--lenience", type=float, default=0.0)
    parser.add_argument(
        "--beta", type=float, default=1.0, help="inverse temperature of the verifiers"
    )
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument(
        "--epsilon", type=float, default=0.0, help="drop tokens below this probability"
    )
    parser.add_argument(
        "--contrastive-amateur",
        metavar="HEAD",
        help="contrastive decoding (with --rule verifier_only): this head is the amateur",
    )
    parser.add_argument(
        "--contrastive-alpha",
        type=float,
        default=0.0,
        help="contrastive decoding's plausibility cutoff, in (0, 1]",
    )
    parser.add_argument(
        "--seed", type=int, help="default: random (on a continued session: the session's)"
    )
    parser.add_argument(
        "--drafter",
        default="auto",
        choices=["auto", "head", "ngram", "model"],
        help="auto (default): chosen per round from measured costs and acceptance; head: a "
        "head on the trunk drafts; ngram: prompt lookup in the context, checked by the "
        "trunk and the whole jury in one pass; model: the trunk's draft model "
        "(--draft-model), checked in one pass",
    )
    parser.add_argument("--draft-head", help="default: drawn from the drafters by the seed")
    parser.add_argument("--jury", help="comma-separated heads (default: all but the drafter)")
    parser.add_argument(
        "--num-beams",
        type=int,
        default=1,
        help="beam search over the PoE target with this many beams (default 1: off); "
        "deterministic, not speculative",
    )
    parser.add_argument(
        "--length-penalty",
        type=float,
        default=1.0,
        help="beam search: hypotheses score sum log P / length ** this (default 1)",
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


def _decoding_request(
    args: argparse.Namespace,
    *,
    prompt: str | None = None,
    messages: list[dict[str, str]] | None = None,
) -> GenerationRequest:
    """The request the decoding flags of `_add_decoding_flags` describe."""
    from hydra_jury.orchestrator.request import GenerationRequest

    return GenerationRequest(
        prompt=prompt,
        messages=messages,
        max_new_tokens=args.max_new_tokens,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        gamma=args.gamma,
        rule=args.rule,
        lenience=args.lenience,
        beta=args.beta,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        epsilon=args.epsilon,
        contrastive_alpha=args.contrastive_alpha,
        contrastive_amateur=args.contrastive_amateur,
        seed=args.seed,
        drafter=args.drafter,
        draft_head=args.draft_head,
        jury=args.jury.split(",") if args.jury else None,
        num_beams=args.num_beams,
        length_penalty=args.length_penalty,
        early_stopping=args.early_stopping,
        return_beams=args.return_beams,
        uncertainty=args.uncertainty,
    )


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
    where.add_argument("--address", metavar="HOST:PORT", help="a server's Generation API")
    parser.add_argument("--checkpoint", metavar="DIR", help="the checkpoint (with --local)")
    _add_draft_model_flag(parser, "with --local: ")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="deadline (--address)")
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
    _add_decoding_flags(parser)
    parser.add_argument("--dtype", choices=list(DTYPES), help="default: the checkpoint's")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.set_defaults(handler=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    if args.system and args.session:
        raise ValueError("--system opens a new session; a continued session keeps its own")
    messages = None
    if args.chat:
        messages = [{"role": "user", "content": args.prompt}]
        if args.system:
            messages.insert(0, {"role": "system", "content": args.system})
    request = _decoding_request(args, prompt=None if args.chat else args.prompt, messages=messages)
    if args.address:
        return _generate_remote(args, request)
    if args.session or args.request_id:
        raise ValueError(
            "--session and --request-id need --address: the sessions of --local end with it"
        )
    if not args.checkpoint:
        raise ValueError("--local needs --checkpoint DIR")
    return _generate_local(args, request)


def _generate_local(args: argparse.Namespace, request: GenerationRequest) -> int:
    """Runs the request on a session of this process (an in-memory store): the same
    runner as the servers, so the same tokens."""
    import asyncio
    import contextlib
    import json

    from hydra_jury.hydra_model import DraftModel, HydraModel
    from hydra_jury.orchestrator.engine import Engine
    from hydra_jury.orchestrator.local_backend import LocalBackend
    from hydra_jury.orchestrator.sessions.memory_store import MemoryStore
    from hydra_jury.orchestrator.sessions.runner import SessionRunner

    model = HydraModel.load(args.checkpoint, dtype=args.dtype, device=args.device)
    draft_model = None
    if args.draft_model:
        draft_model = DraftModel.load(
            _resolved_draft_model(args.draft_model), dtype=args.dtype, device=args.device
        )
    backend = LocalBackend(model, draft_model=draft_model, limits=LOCAL_LIMITS)
    runner = SessionRunner(Engine(backend, model.load_tokenizer()), MemoryStore())

    async def generate() -> None:
        summary = None
        try:
            async with contextlib.aclosing(runner.generate(request)) as rounds:
                async for committed in rounds:
                    summary = committed.summary or summary
                    if not args.json:
                        print(committed.round.text, end="", flush=True)
        finally:
            await runner.close()
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
    import grpc
    from google.protobuf.json_format import MessageToJson

    from hydra_jury.orchestrator.convert import request_to_pb
    from hydra_jury.protos.hydrajury.v1 import generation_pb2_grpc

    message = request_to_pb(request, session_id=args.session or "")
    message.request_id = args.request_id or ""
    with grpc.insecure_channel(args.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            if args.json:
                response = stub.Generate(message, timeout=args.timeout_s)
                print(MessageToJson(response, indent=2))
                return 0
            session_id, judged = "", None
            for streamed in stub.GenerateStream(message, timeout=args.timeout_s):
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
            print(
                f"hydra-jury generate: error: {error.code().name}: {error.details()}",
                file=sys.stderr,
            )
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
    parser.add_argument("--address", required=True, metavar="HOST:PORT")
    parser.add_argument("--system", help="the system message of a new session")
    parser.add_argument("--session", metavar="ID", help="continue this session")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="deadline of each answer")
    _add_decoding_flags(parser)
    parser.set_defaults(handler=_run_chat)


def _run_chat(args: argparse.Namespace) -> int:
    import grpc

    from hydra_jury.orchestrator.chat import Chat
    from hydra_jury.protos.hydrajury.v1 import generation_pb2_grpc

    if args.system and args.session:
        raise ValueError("--system opens a new session; a continued session keeps its own")
    with grpc.insecure_channel(args.address) as channel:
        # Every later failure is one turn's; a server that cannot be reached at all ends
        # the chat before the first line.
        try:
            grpc.channel_ready_future(channel).result(timeout=CONNECT_TIMEOUT_S)
        except grpc.FutureTimeoutError:
            raise ConnectionError(
                f"cannot reach {args.address} within {CONNECT_TIMEOUT_S:g} s"
            ) from None
        chat = Chat(
            generation_pb2_grpc.GenerationStub(channel),
            _decoding_request(args),
            stdin=sys.stdin,
            stdout=sys.stdout,
            stderr=sys.stderr,
            system=args.system,
            session_id=args.session or "",
            timeout_s=args.timeout_s,
        )
        return chat.run()


# The server commands own their flags: `main` hands everything after the name over.
# The worker services are found by name: the CLI is the one place that starts every
# component, and the orchestrator package never imports a service package.
SERVER_COMMANDS = {
    "trunk": (
        "serve the trunk and drafter heads (gRPC)",
        "hydra_jury.trunk_service.server:TRUNK_SERVICE",
    ),
    "jury": (
        "serve a shard of verifier heads (gRPC)",
        "hydra_jury.jury_service.server:JURY_SERVICE",
    ),
    "orchestrator": (
        "serve the public Generation API (gRPC)",
        "hydra_jury.orchestrator.__main__:main",
    ),
}


def _add_services(commands: argparse._SubParsersAction) -> None:
    for name, (help_text, _entry) in SERVER_COMMANDS.items():
        commands.add_parser(name, help=help_text, add_help=False)
    parser = commands.add_parser(
        "up",
        help="run the local stack: trunk, jury shards and orchestrator",
        description="Start a trunk service, jury shards splitting the heads and the "
        "orchestrator as separate processes on loopback; Ctrl-C stops them all. They share "
        "the host: the trunk's OpenMP threads spin briefly between parallel regions "
        "(GOMP_SPINCOUNT=30000), the others wait passively (OMP_WAIT_POLICY=PASSIVE), "
        "unless the environment sets either (OMP_WAIT_POLICY=PASSIVE: every process "
        "passive, faster for many concurrent sessions). On one machine `serve` is faster.",
    )
    parser.add_argument("--checkpoint", default="var/models/smollm2-hydra", metavar="DIR")
    parser.add_argument("--shards", type=int, default=2, help="jury shards (default 2)")
    parser.add_argument(
        "--port", type=int, default=50050, help="orchestrator port; the services use the next ones"
    )
    parser.add_argument("--metrics-port", type=int, default=9100)
    parser.add_argument(
        "--shard-threads",
        type=int,
        help="CPU threads per jury shard (default: torch's, every core; on a 2-core host one "
        "thread each measured slower)",
    )
    parser.add_argument(
        "--redis-url",
        help=f"keep the sessions in this Redis (default ${REDIS_URL_VARIABLE}, else a private "
        "redis-server, stopped with the stack)",
    )
    _add_draft_model_flag(parser, "on the trunk service: ")
    parser.set_defaults(handler=_run_up)


def _add_draft_model_flag(parser: argparse.ArgumentParser, where: str = "") -> None:
    parser.add_argument(
        "--draft-model",
        metavar="PATH",
        help=f"{where}a small causal LM with the checkpoint's tokenizer, for drafter 'model': "
        "a Hydra checkpoint (its trunk and first head), a Hugging Face model directory or "
        "a .gguf file (converted once into $HYDRA_JURY_CACHE or ~/.cache/hydra-jury)",
    )


def _resolved_draft_model(source: str) -> str:
    """The Hydra checkpoint of the draft model `source` (converted once and cached when
    it is a Hugging Face directory or GGUF file)."""
    from hydra_jury.hydra_model.build.draft import default_draft_cache, resolve_draft_model

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    return str(resolve_draft_model(source, default_draft_cache(), log=log))


def _with_resolved_draft_model(argv: list[str]) -> list[str]:
    """A service's arguments with the value of --draft-model resolved to a checkpoint
    (the service itself only loads Hydra checkpoints)."""
    resolved = list(argv)
    for index, argument in enumerate(argv):
        if argument == "--draft-model" and index + 1 < len(argv):
            resolved[index + 1] = _resolved_draft_model(argv[index + 1])
        elif argument.startswith("--draft-model="):
            resolved[index] = "--draft-model=" + _resolved_draft_model(argument.split("=", 1)[1])
    return resolved


def _add_serve(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "serve",
        help="serve the public Generation API from one process (the whole model here)",
        description="Serve hydrajury.v1.Generation (the same API as the orchestrator of the "
        "split stack) over the in-process backend: trunk, every head and the loop in this "
        "process. The default for one machine; `up` runs the split stack.",
    )
    parser.add_argument("--checkpoint", required=True, metavar="DIR", help="Hydra checkpoint")
    parser.add_argument(
        "--listen",
        default="127.0.0.1:50050",
        metavar="HOST:PORT",
        help="address to serve on (port 0 picks a free one; default 127.0.0.1:50050)",
    )
    parser.add_argument("--metrics-port", type=int, help="Prometheus /metrics HTTP port")
    parser.add_argument("--metrics-address", default="127.0.0.1")
    parser.add_argument("--max-concurrency", type=int, default=32, help="requests at once")
    parser.add_argument("--max-sessions", type=int, default=16, help="sessions held at once")
    parser.add_argument(
        "--max-session-tokens", type=int, default=4096, help="positions one session may reach"
    )
    parser.add_argument("--dtype", choices=list(DTYPES), help="default: the checkpoint's")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--threads", type=int, help="CPU threads for model compute")
    parser.add_argument("--grace-s", type=float, default=5.0, help="graceful shutdown time")
    _add_draft_model_flag(parser)
    _add_session_store_flags(parser)
    parser.set_defaults(handler=_run_serve)


def _add_session_store_flags(parser: argparse.ArgumentParser) -> None:
    from hydra_jury.orchestrator.sessions.store import StoreSettings

    defaults = StoreSettings()
    parser.add_argument(
        "--redis-url",
        help="where sessions live: redis://[:PASSWORD@]HOST:PORT/DB, rediss:// for TLS "
        f"(default ${REDIS_URL_VARIABLE}, else a private redis-server stopped with the "
        "server, its sessions with it)",
    )
    parser.add_argument(
        "--redis-key-prefix", default="hydra-jury:", help="prefix of every key (%(default)s)"
    )
    parser.add_argument(
        "--session-ttl-s",
        type=float,
        default=defaults.ttl_s,
        help="idle sessions expire after this long (%(default)g)",
    )
    parser.add_argument(
        "--session-lease-s",
        type=float,
        default=defaults.lease_s,
        help="a generation that stops committing loses its session after this (%(default)g)",
    )


def _run_serve(args: argparse.Namespace) -> int:
    import asyncio
    import contextlib
    import logging
    import os

    from hydra_jury.orchestrator.server import serve_embedded
    from hydra_jury.orchestrator.sessions.redis_server import LocalRedis
    from hydra_jury.orchestrator.sessions.redis_store import RedisStore
    from hydra_jury.orchestrator.sessions.store import StoreSettings
    from hydra_jury.serving.model_thread import set_compute_threads

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # Checked before anything starts: a bad setting is one line, not a half-started server.
    settings = StoreSettings(ttl_s=args.session_ttl_s, lease_s=args.session_lease_s)
    set_compute_threads(args.threads)
    limits = SessionLimits(args.max_sessions, args.max_session_tokens)
    draft_model = _resolved_draft_model(args.draft_model) if args.draft_model else None

    async def serve(store: RedisStore) -> None:
        running = await serve_embedded(
            checkpoint=args.checkpoint,
            store=store,
            address=args.listen,
            limits=limits,
            dtype=args.dtype,
            device=args.device,
            draft_model=draft_model,
            metrics_port=args.metrics_port,
            metrics_address=args.metrics_address,
            max_concurrency=args.max_concurrency,
        )
        await running.serve_until_signal(
            "hydra-jury server", args.listen, args.grace_s, f", sessions in {store.where}"
        )

    with contextlib.ExitStack() as stack:
        url = args.redis_url or os.environ.get(REDIS_URL_VARIABLE)
        if not url:
            url = stack.enter_context(LocalRedis()).url
            logging.getLogger("hydra_jury").info(
                "started a private redis-server at %s; its sessions end with this server", url
            )
        store = RedisStore(url, prefix=args.redis_key_prefix, settings=settings)
        asyncio.run(serve(store))
    return 0


def _run_up(args: argparse.Namespace) -> int:
    from hydra_jury.orchestrator.launcher import LocalStack
    from hydra_jury.orchestrator.sessions.redis_store import redacted

    stack = LocalStack(
        args.checkpoint,
        shards=args.shards,
        port=args.port,
        metrics_port=args.metrics_port,
        shard_threads=args.shard_threads,
        redis_url=args.redis_url or os.environ.get(REDIS_URL_VARIABLE),
        draft_model=_resolved_draft_model(args.draft_model) if args.draft_model else None,
    )
    try:
        address = stack.start()
        print(
            f"hydra-jury stack ready: Generation API at {address}, sessions in Redis at "
            f"{redacted(stack.sessions_url)}",
            file=sys.stderr,
        )
        return stack.wait()
    finally:
        stack.stop()


def _run_server(name: str, argv: list[str]) -> int:
    import importlib

    module, attribute = SERVER_COMMANDS[name][1].split(":")
    entry = getattr(importlib.import_module(module), attribute)
    prog = f"hydra-jury {name}"
    if callable(entry):
        return entry(argv, prog=prog)
    from hydra_jury.serving.worker_service import service_main

    if entry.hosts_draft_model:
        try:
            argv = _with_resolved_draft_model(argv)
        except EXPECTED_FAILURES as error:
            print(failure_line(prog, error), file=sys.stderr)
            return 2
    return service_main(entry, argv, prog=prog)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hydra-jury",
        description="Serve Hydra language models by speculative Product-of-Experts decoding.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_build(commands)
    _add_train_heads(commands)
    _add_inspect(commands)
    _add_generate(commands)
    _add_chat(commands)
    _add_serve(commands)
    _add_services(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SERVER_COMMANDS:
        return _run_server(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except EXPECTED_FAILURES as error:
        print(failure_line(f"hydra-jury {args.command}", error), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
