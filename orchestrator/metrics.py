"""Prometheus metrics of the orchestrator, collected raw; rates are derived in queries.

Counters and histograms (names prefixed `hydrajury_`):
- requests_total{rpc} (a gRPC method, or an HTTP API path), errors_total{code}
- tokens_emitted_total, draft_tokens_total, accepted_tokens_total,
  rejections_total, draft_position_reached_total{position},
  draft_position_accepted_total{position}
- time_to_first_token_seconds, time_per_output_token_seconds
- round_phase_seconds{phase="draft"|"score"|"accept"}
- drafts_ahead_total, drafts_ahead_used_total (pipelined rounds: drafts sent before the
  verdict of the round before, and of which the next round used; the rest were wasted)
- active_sessions (gauge)
- per head, the signal of a drifted or poisoned head against the rest of its jury:
  head_draft_tokens_total{head} and head_accepted_tokens_total{head} (draft tokens a
  draft head proposed, and of which kept), juror_votes_total{head} and
  juror_dissents_total{head} (emitted tokens a juror voted on, and of which its argmax
  was another token)
- ready_replicas{component} (gauge: ready replicas of the trunk, jury0, ... that
  discovery sees; the split stack only), session_store_up (gauge: 1 when the last check
  of the session store succeeded, else 0)
- per API key, by its name (a server with --api-keys): key_requests_total{key,rpc},
  key_refusals_total{key,reason="concurrency"|"tokens_per_minute"},
  key_tokens_total{key} (generated tokens); unauthenticated_total{reason="missing"|
  "malformed"|"unknown"} (calls refused before any key is known; also in errors_total)

Derived: acceptance rate = accepted_tokens_total / draft_tokens_total; acceptance at
draft position i = draft_position_accepted_total / draft_position_reached_total; a
head's acceptance = head_accepted_tokens_total / head_draft_tokens_total, a juror's
dissent = juror_dissents_total / juror_votes_total (the chart's alerts compare each with
the rest of the heads').
"""

from __future__ import annotations

from collections import Counter as Tally
from typing import TYPE_CHECKING

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hydra_jury.orchestrator.output import RoundOutput
from hydra_jury.poe import reached_positions
from hydra_jury.serving.metrics import LATENCY_BUCKETS, serve_metrics

if TYPE_CHECKING:
    from hydra_jury.orchestrator.discovery import Discovery


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
        self.drafts_ahead = Counter(
            "hydrajury_drafts_ahead", "Drafts sent ahead of the last round's verdict", registry=r
        )
        self.drafts_ahead_used = Counter(
            "hydrajury_drafts_ahead_used", "Drafts sent ahead that a round used", registry=r
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
        self.head_drafted = Counter(
            "hydrajury_head_draft_tokens",
            "Draft tokens proposed by each draft head",
            ["head"],
            registry=r,
        )
        self.head_accepted = Counter(
            "hydrajury_head_accepted_tokens",
            "Draft tokens kept, by draft head",
            ["head"],
            registry=r,
        )
        self.juror_votes = Counter(
            "hydrajury_juror_votes", "Emitted tokens each juror voted on", ["head"], registry=r
        )
        self.juror_dissents = Counter(
            "hydrajury_juror_dissents",
            "Emitted tokens a juror's argmax differed from",
            ["head"],
            registry=r,
        )
        self.ready_replicas = Gauge(
            "hydrajury_ready_replicas",
            "Ready replicas of each component, as discovery sees them",
            ["component"],
            registry=r,
        )
        self.session_store_up = Gauge(
            "hydrajury_session_store_up",
            "Whether the last check of the session store succeeded",
            registry=r,
        )
        self.key_requests = Counter(
            "hydrajury_key_requests", "Requests by API key name and RPC", ["key", "rpc"], registry=r
        )
        self.key_refusals = Counter(
            "hydrajury_key_refusals",
            "Requests refused at an API key's limit: concurrency, tokens_per_minute",
            ["key", "reason"],
            registry=r,
        )
        self.key_tokens = Counter(
            "hydrajury_key_tokens", "Tokens generated by API key name", ["key"], registry=r
        )
        self.unauthenticated = Counter(
            "hydrajury_unauthenticated",
            "Calls refused for their API key: missing, malformed, unknown",
            ["reason"],
            registry=r,
        )

    def serve(self, port: int, address: str = "127.0.0.1") -> int:
        """Exposes /metrics over HTTP; port 0 picks a free one. Returns the port."""
        return serve_metrics(self.registry, port, address)

    def watch_replicas(self, discovery: Discovery) -> None:
        """Reads each component's ready replicas from `discovery` at every scrape."""
        for component in discovery.targets:
            self.ready_replicas.labels(component).set_function(
                lambda component=component: len(discovery.ready(component))
            )

    def observe_unauthenticated(self, reason: str) -> None:
        """A call refused for want of a valid API key (`reason`: missing, malformed,
        unknown), over either API; an UNAUTHENTICATED error too."""
        self.errors.labels(grpc.StatusCode.UNAUTHENTICATED.name).inc()
        self.unauthenticated.labels(reason).inc()

    def observe_round(self, output: RoundOutput) -> None:
        drafted, accepted = output.drafted, output.accepted
        self.tokens.inc(len(output.tokens))
        self.drafter_rounds.labels(output.drafter).inc()
        self.drafted.inc(drafted)
        self.accepted.inc(accepted)
        if accepted < drafted:
            self.rejections.inc()
        self.drafts_ahead.inc(output.sent_ahead)
        self.drafts_ahead_used.inc(output.used_ahead)
        for position in range(reached_positions(drafted, accepted)):
            self.position_reached.labels(str(position)).inc()
        for position in range(accepted):
            self.position_accepted.labels(str(position)).inc()
        self._observe_heads(output)
        for phase in ("draft", "score", "accept"):
            seconds = output.timings.get(f"{phase}_s")
            if seconds is not None:
                self.round_phase.labels(phase).observe(seconds)

    def _observe_heads(self, output: RoundOutput) -> None:
        """The round's drafts by its draft head, and each juror's votes on its tokens."""
        if output.draft_head is not None and output.drafted:
            self.head_drafted.labels(output.draft_head).inc(output.drafted)
            self.head_accepted.labels(output.draft_head).inc(output.accepted)
        votes, dissents = Tally(), Tally()
        for record in output.tokens:
            for juror, vote in (record.votes or {}).items():
                votes[juror] += 1
                dissents[juror] += vote != record.token_id
        for juror, count in votes.items():
            self.juror_votes.labels(juror).inc(count)
            self.juror_dissents.labels(juror).inc(dissents[juror])
