"""What the trunk and jury servicers share: request checks, the model description, the
timed model thread, limits, idle eviction, and start-up from the command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from hydra_model import HydraModel
from hydra_model.checkpoint import DTYPES, read_manifest
from protos.codec import DTYPE_NAMES
from protos.hydrajury.v1 import internal_pb2
from protos.serving import GrpcServer, ModelThread, new_epoch

log = logging.getLogger("hydra_jury.service")
T = TypeVar("T")


def require_session(session: str) -> str:
    if not session:
        raise ValueError("session: a non-empty session id is required")
    return session


def model_description_to_pb(
    model: HydraModel, context_length: int
) -> internal_pb2.ModelDescription:
    config = model.config
    return internal_pb2.ModelDescription(
        fingerprint=model.fingerprint,
        architecture=config.model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        context_length=context_length,
        heads=[head.name for head in model.manifest.llm_heads],
        eos_token_ids=list(config.eos_token_ids),
        dtype=DTYPE_NAMES[model.dtype],
    )


def llm_heads_in_order(checkpoint: str | Path, names: Sequence[str] | None, option: str):
    """`names` (None: every `llm` head) checked against the checkpoint and put in its
    order, so the order of a command-line list never changes what a service does."""
    llm = [head.name for head in read_manifest(checkpoint).llm_heads]
    if names is None:
        return llm
    unknown = [name for name in names if name not in llm]
    if unknown:
        raise ValueError(f"{option}: {unknown} are not llm heads of {checkpoint}; it has {llm}")
    if not names:
        raise ValueError(f"{option}: at least one head is required")
    return [name for name in llm if name in names]


def on_host(result: Any) -> Any:
    """A worker result with every tensor (or tensor field of a dataclass) on the host."""
    if isinstance(result, torch.Tensor):
        return result.cpu()
    if result is None:
        return None
    moved = {
        field.name: getattr(result, field.name).cpu()
        for field in fields(result)
        if isinstance(getattr(result, field.name), torch.Tensor)
    }
    return replace(result, **moved)


class WorkerServicer:
    """What the trunk and jury servicers share: the worker and its model thread, the
    epoch, timed worker calls, limits and idle eviction."""

    def __init__(self, worker: Any, thread_name: str) -> None:
        self.worker = worker
        self.thread = ModelThread(thread_name)
        self.epoch = new_epoch()
        self._evictor: asyncio.Task | None = None

    async def run_timed(self, function: Callable[..., T], *args: Any) -> tuple[T, int]:
        """Runs `function(*args)` on the model thread: (its result on the host, ns)."""

        def timed() -> tuple[T, int]:
            began = time.perf_counter_ns()
            result = on_host(function(*args))
            return result, time.perf_counter_ns() - began

        return await self.thread.run(timed)

    def stamp(self, response: T, began_ns: int, forward_ns: int) -> T:
        """Fills the epoch and the timings of a model call's response."""
        response.epoch = self.epoch
        response.timings.forward_ns = forward_ns
        response.timings.total_ns = time.perf_counter_ns() - began_ns
        return response

    def limits_to_pb(self) -> internal_pb2.ServiceLimits:
        sessions = self.worker.sessions
        return internal_pb2.ServiceLimits(
            max_sessions=sessions.max_sessions,
            max_session_tokens=self.worker.max_session_tokens,
            active_sessions=len(sessions),
            idle_timeout_s=sessions.idle_timeout_s or 0.0,
        )

    async def Release(  # the RPC, the same in both services
        self, request: internal_pb2.ReleaseRequest, context: Any = None
    ) -> internal_pb2.ReleaseResponse:
        session = require_session(request.session)
        released = await self.thread.run(self.worker.release, session)
        return internal_pb2.ReleaseResponse(released=released, epoch=self.epoch)

    def start_idle_eviction(self) -> None:
        """Evicts idle sessions every so often (nothing to do without an idle timeout).
        Sessions are also evicted when a new one needs room; this frees their memory
        and keeps `active_sessions` honest."""
        timeout = self.worker.sessions.idle_timeout_s
        if timeout is None or self._evictor is not None:
            return
        interval = min(max(timeout / 4, 0.01), 30.0)
        self._evictor = asyncio.create_task(self._evict_idle_forever(interval))

    async def _evict_idle_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                evicted = await self.thread.run(self.worker.sessions.evict_idle)
            except Exception:
                log.exception("idle eviction failed")
                continue
            if evicted:
                log.info("evicted %d idle sessions", len(evicted))

    async def close(self) -> None:
        """Stops idle eviction and the model thread (after the server has stopped)."""
        if self._evictor is not None:
            self._evictor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._evictor
            self._evictor = None
        await asyncio.to_thread(self.thread.shutdown)


def worker_limits(
    max_sessions: int, max_session_tokens: int, idle_timeout_s: float | None
) -> dict[str, Any]:
    """A worker's session limits, checked; an idle timeout of 0 or None: never evicted."""
    if max_sessions < 1:
        raise ValueError(f"max sessions must be >= 1, got {max_sessions}")
    if max_session_tokens < 1:
        raise ValueError(f"max session tokens must be >= 1, got {max_session_tokens}")
    if idle_timeout_s is not None and idle_timeout_s < 0:
        raise ValueError(f"idle timeout must be >= 0 (0 = never), got {idle_timeout_s}")
    return {
        "max_sessions": max_sessions,
        "max_session_tokens": max_session_tokens,
        "idle_timeout_s": idle_timeout_s or None,
    }


async def start_server(
    servicer: WorkerServicer, add_servicer: Callable[[Any, Any], None], name: str, address: str
) -> tuple[GrpcServer, int]:
    server = GrpcServer(lambda grpc_server: add_servicer(servicer, grpc_server), [name])
    try:
        # OpenMP's thread count is per thread: the model thread takes this thread's, so
        # `torch.set_num_threads` before starting a service applies to its compute too.
        await servicer.thread.run(torch.set_num_threads, torch.get_num_threads())
        port = await server.start(address)
    except BaseException:
        await servicer.close()
        raise
    servicer.start_idle_eviction()
    return server, port


def add_service_arguments(parser: argparse.ArgumentParser, default_port: int) -> None:
    """The options every worker service takes (the heads option is each one's own)."""
    parser.add_argument("--checkpoint", required=True, metavar="DIR", help="Hydra checkpoint")
    parser.add_argument(
        "--listen",
        default=f"127.0.0.1:{default_port}",
        metavar="HOST:PORT",
        help=f"address to bind (port 0 picks a free one; default 127.0.0.1:{default_port})",
    )
    parser.add_argument("--max-sessions", type=int, default=16, help="sessions held at once")
    parser.add_argument(
        "--max-session-tokens",
        type=int,
        default=4096,
        help="positions one session may reach (at most the model's context length)",
    )
    parser.add_argument(
        "--idle-timeout-s",
        type=float,
        default=600.0,
        help="evict sessions idle this long (0 = never)",
    )
    parser.add_argument("--dtype", choices=list(DTYPES), help="default: the checkpoint's")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument(
        "--threads",
        type=int,
        help="CPU threads for model compute (default: torch's; on a host shared by several "
        "services, give each its share of the cores)",
    )
    parser.add_argument(
        "--grace-s",
        type=float,
        default=5.0,
        help="on SIGTERM/SIGINT, let in-flight calls finish this long",
    )


def head_list(text: str) -> list[str]:
    """'head0, head1' → ['head0', 'head1'] (for comma-separated head options)."""
    return [name.strip() for name in text.split(",") if name.strip()]


def run_until_signal(
    start: Callable[[], Awaitable[tuple[GrpcServer, int, WorkerServicer]]],
    *,
    name: str,
    listen: str,
    grace_s: float,
    threads: int | None = None,
    detail: Callable[[WorkerServicer], str] = lambda servicer: "",
) -> int:
    """Starts a service, prints "NAME listening on HOST:PORT[ DETAIL]" to stderr (the
    line launchers wait for), serves until SIGTERM or SIGINT, then stops gracefully.
    Returns the exit code: 0, or 2 with a one-line message when it cannot start."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    async def serve() -> int:
        try:
            if threads is not None:
                if threads < 1:
                    raise ValueError(f"--threads must be at least 1, got {threads}")
                torch.set_num_threads(threads)  # the model thread takes this count
            server, port, servicer = await start()
        except (ValueError, KeyError, OSError, RuntimeError) as error:
            message = error.args[0] if isinstance(error, KeyError) and error.args else error
            print(f"{name}: error: {message}", file=sys.stderr, flush=True)
            return 2
        host = listen.rsplit(":", 1)[0]
        print(f"{name} listening on {host}:{port}{detail(servicer)}", file=sys.stderr, flush=True)
        await server.serve_until_signal(grace_s, on_stop=servicer.close)
        log.info("%s stopped", name)
        return 0

    return asyncio.run(serve())
