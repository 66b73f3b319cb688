"""Prometheus metrics every server shares, and those of the trunk and jury services'
continuous batching, collected raw (rates and means are derived in queries).

Batching, per batched RPC (`rpc` = Prefill, Draft, Score):
- batch_calls{rpc}: calls per batched forward (the batch size per step)
- batch_tokens{rpc}: positions per batched forward (tokens per step)
- batch_seconds{rpc}: a batch's time on the model thread
- queue_wait_seconds{rpc}: a call's wait in the queue before its batch began
- queue_length{rpc}: calls waiting now (gauge)
- refused_calls_total{rpc, reason}: "queue_full", "waited_too_long" (admission control),
  "sessions_running" (every slot held by a running generation), "session_length" (past
  the tokens per session)

Sessions:
- service_sessions: sessions the service holds (gauge)
- service_running_sessions: of which a generation is using (gauge; the others are
  finished, kept for a next turn)
- reclaimed_sessions_total{reason}: slots freed for a new session, "finished" (its
  generation had ended) or "idle" (running but idle past --reclaim-after-s), and
  sessions "evicted" (idle past --idle-timeout-s)
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from hydra_jury.workers.sessions import SessionTable

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
CALL_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def serve_metrics(registry: CollectorRegistry, port: int, address: str = "127.0.0.1") -> int:
    """Exposes `registry` at /metrics over HTTP; port 0 picks a free one. Returns the
    port."""
    server, _thread = start_http_server(port, addr=address, registry=registry)
    return server.server_port


class BatchObserver:
    """What one batched RPC reports to its service's metrics."""

    def __init__(self, metrics: ServiceMetrics, rpc: str) -> None:
        self.rpc = rpc
        self._calls = metrics.batch_calls.labels(rpc)
        self._tokens = metrics.batch_tokens.labels(rpc)
        self._seconds = metrics.batch_seconds.labels(rpc)
        self._wait = metrics.queue_wait.labels(rpc)
        self._refused = metrics.refused
        self._queue_length = metrics.queue_length.labels(rpc)

    def watch_queue(self, length: Callable[[], int]) -> None:
        self._queue_length.set_function(length)

    def batch(self, calls: int, tokens: int, waits_s: list[float], seconds: float) -> None:
        self._calls.observe(calls)
        self._tokens.observe(tokens)
        self._seconds.observe(seconds)
        for wait in waits_s:
            self._wait.observe(wait)

    def refused(self, reason: str) -> None:
        self._refused.labels(self.rpc, reason).inc()


class SessionMetrics:
    """A session table's occupancy and reclaimed slots (`workers.sessions`): a trunk or
    jury service's, or the single-process server's (its trunk's table, which opens and
    frees each session with its jury's)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.held = Gauge("hydrajury_service_sessions", "Sessions held", registry=registry)
        self.running = Gauge(
            "hydrajury_service_running_sessions",
            "Sessions held for a running generation",
            registry=registry,
        )
        self.reclaimed = Counter(
            "hydrajury_reclaimed_sessions",
            "Sessions whose caches were dropped for a new session or evicted as idle",
            ["reason"],
            registry=registry,
        )

    def watch(self, table: SessionTable) -> None:
        self.held.set_function(lambda: len(table))
        self.running.set_function(lambda: table.running)
        table.on_reclaim = lambda reason: self.reclaimed.labels(reason).inc()


class ServiceMetrics:
    """The metrics of a trunk or jury service (served with `--metrics-port`)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.batch_calls = Histogram(
            "hydrajury_batch_calls",
            "Calls per batched forward",
            ["rpc"],
            buckets=CALL_BUCKETS,
            registry=r,
        )
        self.batch_tokens = Histogram(
            "hydrajury_batch_tokens",
            "Positions per batched forward",
            ["rpc"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.batch_seconds = Histogram(
            "hydrajury_batch_seconds",
            "A batch's time on the model thread",
            ["rpc"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "hydrajury_queue_wait_seconds",
            "A call's wait in the queue before its batch began",
            ["rpc"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_length = Gauge(
            "hydrajury_queue_length", "Calls waiting for the model", ["rpc"], registry=r
        )
        self.refused = Counter(
            "hydrajury_refused_calls",
            "Calls refused by admission control or for want of capacity",
            ["rpc", "reason"],
            registry=r,
        )
        self.sessions = SessionMetrics(r)

    def observer(self, rpc: str) -> BatchObserver:
        return BatchObserver(self, rpc)
