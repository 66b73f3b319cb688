"""Prometheus metrics of the orchestrator, collected raw; rates are derived in queries.

Counters and histograms (names prefixed `hydrajury_`):
- requests_total{rpc}, errors_total{code}
- tokens_emitted_total, draft_tokens_total, accepted_tokens_total,
  rejections_total, draft_position_reached_total{position},
  draft_position_accepted_total{position}
- time_to_first_token_seconds, time_per_output_token_seconds
- round_phase_seconds{phase="draft"|"score"|"accept"}
- active_sessions (gauge)

Derived: acceptance rate = accepted_tokens_total / draft_tokens_total; acceptance at
draft position i = draft_position_accepted_total / draft_position_reached_total.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hydra_jury.orchestrator.output import RoundOutput
from hydra_jury.poe import reached_positions
from hydra_jury.serving.metrics import LATENCY_BUCKETS, serve_metrics


class OrchestratorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("hydrajury_requests", "Requests by RPC", ["rpc"], registry=r)
        self.errors = Counter(
            "hydrajury_errors", "Failed requests by status code", ["code"], registry=r
        )
        self.tokens = Counter("hydrajury_tokens_emitted", "Tokens emitted", registry=r)
        self.drafter_rounds = Counter(
            "hydrajury_drafter_rounds", "Rounds by who drafted", ["drafter"], registry=r
        )
        self.session_events = Counter(
            "hydrajury_session_events",
            "Session events: created, continued, resumed, replayed, taken_over, fenced, "
            "closed, expired",
            ["event"],
            registry=r,
        )
        self.reused_tokens = Counter(
            "hydrajury_reused_context_tokens", "Context tokens a session's caches held", registry=r
        )
        self.prefilled_tokens = Counter(
            "hydrajury_prefilled_context_tokens", "Context tokens prefilled", registry=r
        )
        self.drafted = Counter("hydrajury_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter("hydrajury_accepted_tokens", "Draft tokens kept", registry=r)
        self.rejections = Counter(
            "hydrajury_rejections", "Rounds ending in a rejection", registry=r
        )
        self.position_reached = Counter(
            "hydrajury_draft_position_reached", "Draft positions verified", ["position"], registry=r
        )
        self.position_accepted = Counter(
            "hydrajury_draft_position_accepted", "Draft positions kept", ["position"], registry=r
        )
        self.ttft = Histogram(
            "hydrajury_time_to_first_token_seconds",
            "Request start to first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "hydrajury_time_per_output_token_seconds",
            "Time per output token after the first",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.round_phase = Histogram(
            "hydrajury_round_phase_seconds",
            "Round latency by phase",
            ["phase"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.active_sessions = Gauge(
            "hydrajury_active_sessions", "Generations in progress", registry=r
        )

    def serve(self, port: int, address: str = "127.0.0.1") -> int:
        """Exposes /metrics over HTTP; port 0 picks a free one. Returns the port."""
        return serve_metrics(self.registry, port, address)

    def observe_round(self, output: RoundOutput) -> None:
        drafted, accepted = output.drafted, output.accepted
        self.tokens.inc(len(output.tokens))
        self.drafter_rounds.labels(output.drafter).inc()
        self.drafted.inc(drafted)
        self.accepted.inc(accepted)
        if accepted < drafted:
            self.rejections.inc()
        for position in range(reached_positions(drafted, accepted)):
            self.position_reached.labels(str(position)).inc()
        for position in range(accepted):
            self.position_accepted.labels(str(position)).inc()
        for phase in ("draft", "score", "accept"):
            seconds = output.timings.get(f"{phase}_s")
            if seconds is not None:
                self.round_phase.labels(phase).observe(seconds)
