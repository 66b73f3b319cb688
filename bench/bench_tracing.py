"""What tracing costs: the split stack (`hydra-jury up`: trunk, two jury shards,
orchestrator) without tracing, and with every request traced (100% sampling, the
default sampler) to an OTLP/gRPC receiver on loopback, measured alternately.

    python bench/bench_tracing.py --checkpoint var/models/smollm2-hydra [--runs 5]

Every run sends the same request to each stack in turn (so both see the same machine
state) and checks they return the same tokens. Reports the median tokens/s over the runs
with the spread (min–max), the ratio traced / untraced, the goal (≥ 0.97: tracing costs
at most 3%), and the spans the receiver got per request.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from concurrent import futures

import grpc
from bench_one_host import MODES, SESSIONS, request  # this folder is on the path
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from hydra_jury.orchestrator.convert import request_to_pb
from hydra_jury.orchestrator.launcher import LocalStack
from hydra_jury.protos.hydrajury.v1 import generation_pb2_grpc

GOAL = 0.97


class SpanCounter(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC receiver that counts the spans it is sent."""

    def __init__(self) -> None:
        self.spans = 0
        self._lock = threading.Lock()

    def Export(self, request, context):
        count = sum(
            len(scope.spans) for spans in request.resource_spans for scope in spans.scope_spans
        )
        with self._lock:
            self.spans += count
        return trace_service_pb2.ExportTraceServiceResponse()


def generate(stub, mode: str, new_tokens: int) -> tuple[float, list[int]]:
    began = time.perf_counter()
    response = stub.Generate(request_to_pb(request(mode, new_tokens)), timeout=600)
    return time.perf_counter() - began, list(response.token_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="var/models/smollm2-hydra")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()

    counter = SpanCounter()
    receiver = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(counter, receiver)
    endpoint = f"http://127.0.0.1:{receiver.add_insecure_port('127.0.0.1:0')}"
    receiver.start()
    stacks = {
        "untraced": LocalStack(args.checkpoint, port=0, extra_service_args=SESSIONS),
        "traced": LocalStack(
            args.checkpoint, port=0, extra_service_args=SESSIONS, otlp_endpoint=endpoint
        ),
    }
    rates: dict[tuple[str, str], list[float]] = {}
    requests = 0
    try:
        stubs = {
            name: generation_pb2_grpc.GenerationStub(grpc.insecure_channel(stack.start()))
            for name, stack in stacks.items()
        }
        for mode in MODES:
            for stub in stubs.values():  # warm-up
                generate(stub, mode, 8)
            requests += 1
            for _ in range(args.runs):
                tokens = {}
                for name, stub in stubs.items():
                    seconds, tokens[name] = generate(stub, mode, args.new_tokens)
                    rates.setdefault((name, mode), []).append(len(tokens[name]) / seconds)
                requests += 1
                if tokens["traced"] != tokens["untraced"]:
                    raise SystemExit(f"{mode}: tracing changed the tokens")
    finally:
        for stack in stacks.values():
            stack.stop()  # the traced one flushes its spans as it exits
        receiver.stop(0)

    print(f"\n{args.checkpoint}, {args.new_tokens} new tokens, {args.runs} runs, float32")
    print(f"{'mode':<22} {'untraced tok/s':>18} {'traced tok/s':>18} {'ratio':>7}")
    for mode in MODES:
        cells, medians = [], {}
        for name in stacks:
            values = rates[name, mode]
            medians[name] = statistics.median(values)
            cells.append(f"{medians[name]:.2f} ({min(values):.1f}–{max(values):.1f})")
        ratio = medians["traced"] / medians["untraced"]
        verdict = "met" if ratio >= GOAL else "MISSED"
        print(f"{mode:<22} {cells[0]:>18} {cells[1]:>18} {ratio:>6.3f}x  goal ≥ {GOAL}: {verdict}")
    print(f"spans received: {counter.spans} for {requests} traced requests")


if __name__ == "__main__":
    main()
