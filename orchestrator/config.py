"""Orchestrator configuration: a YAML file, overridden by command-line flags.

checkpoint: var/models/smollm2-hydra   # for the tokenizer; must match the services
listen: 127.0.0.1:50050
http_listen: 127.0.0.1:8080            # the OpenAI-compatible HTTP API too; omit: off
served_model_name: smollm2-demo        # its model name; omit: the checkpoint folder's name
trunk: 127.0.0.1:50051                 # kubernetes discovery: the trunk's Service name
jury: [127.0.0.1:50052, 127.0.0.1:50053]  # ... and each shard's Service name
discovery: static                      # or kubernetes: follow the Services' EndpointSlices
namespace: hydra                       # kubernetes: default, the pod's own namespace
metrics_port: 9100                     # omit to serve no metrics
max_concurrency: 32
connect_timeout_s: 30
inject_hop_delay_ms: 0                 # benchmarks only: each call to a service waits this long
pipeline_rounds: true                  # draft the next round while the jury scores this one
grace_s: 5
threads: 1                             # the loop's CPU threads; omit: $OMP_NUM_THREADS, else 1
redis_url: redis://127.0.0.1:6379/0    # or $HYDRA_JURY_REDIS_URL; rediss:// for TLS
redis_key_prefix: "hydra-jury:"
session_ttl_s: 3600                    # an idle session is deleted after this long
session_lease_s: 30                    # a silent owner loses its session after this long
session_commit_interval_s: 0.02        # rounds within this long of a commit go with the next
limit_new_tokens: 2048                 # each limit_NAME: --limit-NAME (orchestrator/limits.py)
tls_cert: /tls/public/tls.crt          # the public port's TLS (all three: mTLS); omit: plaintext
tls_key: /tls/public/tls.key
tls_ca: /tls/public/ca.crt             # require client certificates signed by this CA
health_listen: 0.0.0.0:50059           # grpc.health.v1 alone, plaintext, for probes
internal_tls_cert: /tls/internal/tls.crt  # the client certificate for the services' mTLS
internal_tls_key: /tls/internal/tls.key
internal_tls_ca: /tls/internal/ca.crt  # set: every channel to the services is TLS
internal_tls_server_name: hydra-jury-internal  # the name their certificates carry
api_keys: /keys/api-keys                # require API keys (serving/api_keys.py); omit: open
auth_health: false                     # true: health checks and reflection need a key too
max_concurrent_per_key: 4              # defaults for keys whose line sets no limit
tokens_per_minute_per_key: 6000
log_format: json                       # or text (the default): see --log-format
otlp_endpoint: http://otel-collector:4317  # export traces (else $OTEL_EXPORTER_OTLP_ENDPOINT)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from hydra_jury.orchestrator.discovery import (
    Discovery,
    KubernetesDiscovery,
    StaticDiscovery,
    component_names,
)
from hydra_jury.orchestrator.limits import RequestLimits, limits_from
from hydra_jury.orchestrator.sessions.redis_store import KEY_PREFIX
from hydra_jury.orchestrator.sessions.store import StoreSettings, store_settings_from
from hydra_jury.serving.auth import ApiKeyAuth, auth_from
from hydra_jury.serving.flags import GRACE_S, METRICS_ADDRESS
from hydra_jury.serving.logs import LOG_FORMATS
from hydra_jury.serving.tls import ClientTls, ServerTls, TlsFlags

REDIS_URL_VARIABLE = "HYDRA_JURY_REDIS_URL"  # below the config file and the flags
DISCOVERY_MODES = ("static", "kubernetes")
MAX_HOP_DELAY_MS = 1000
# The client side of the hops to the trunk and the shards.
INTERNAL_TLS_FLAGS = TlsFlags("--internal-tls")


class ConfigFileError(ValueError):
    """A configuration that cannot be used; the message names the key."""


@dataclass
class OrchestratorConfig:
    checkpoint: str = ""
    trunk: str = ""
    jury: list[str] = field(default_factory=list)
    discovery: str = "static"
    namespace: str | None = None
    listen: str = "127.0.0.1:50050"
    http_listen: str | None = None  # None: no HTTP API
    served_model_name: str | None = None  # None: the checkpoint folder's name
    metrics_port: int | None = None
    metrics_address: str = METRICS_ADDRESS
    max_concurrency: int = 32
    connect_timeout_s: float = 30.0
    # Benchmarks only: every call to a service (a network hop there and back) is delayed
    # this long, half before it is sent and half after its answer, as if the services
    # ran on other machines (`GrpcBackend`).
    inject_hop_delay_ms: float = 0.0
    # Speculative head rounds send the next round's draft while the jury scores
    # (`orchestrator.rounds`, `GrpcBackend.draft_ahead`).
    pipeline_rounds: bool = False
    grace_s: float = GRACE_S
    threads: int | None = None  # None: $OMP_NUM_THREADS where set, else 1
    redis_url: str = ""
    redis_key_prefix: str = KEY_PREFIX
    session_ttl_s: float = StoreSettings.ttl_s
    session_lease_s: float = StoreSettings.lease_s
    session_commit_interval_s: float = StoreSettings.commit_interval_s
    limit_message_bytes: int = RequestLimits.message_bytes
    limit_prompt_tokens: int = RequestLimits.prompt_tokens
    limit_new_tokens: int = RequestLimits.new_tokens
    limit_stop_sequences: int = RequestLimits.stop_sequences
    limit_stop_chars: int = RequestLimits.stop_chars
    limit_beams: int = RequestLimits.beams
    limit_stream_s: float = RequestLimits.stream_s
    limit_sessions_per_key: int = RequestLimits.sessions_per_key
    limit_choices: int = RequestLimits.choices
    tls_cert: str | None = None  # None: the public port is plaintext
    tls_key: str | None = None
    tls_ca: str | None = None  # None: no client certificate asked for
    health_listen: str | None = None
    internal_tls_cert: str | None = None
    internal_tls_key: str | None = None
    internal_tls_ca: str | None = None  # None: plaintext to the services
    internal_tls_server_name: str | None = None  # None: each address's host
    api_keys: str | None = None  # None: the Generation API is open to any client
    auth_health: bool = False
    max_concurrent_per_key: int | None = None  # None: no limit
    tokens_per_minute_per_key: int | None = None
    log_format: str = LOG_FORMATS[0]
    otlp_endpoint: str | None = None  # None: the OTEL_EXPORTER_OTLP_* variables, else off

    @classmethod
    def load(cls, path: str | Path | None, overrides: dict[str, Any]) -> OrchestratorConfig:
        values: dict[str, Any] = {}
        if os.environ.get(REDIS_URL_VARIABLE):
            values["redis_url"] = os.environ[REDIS_URL_VARIABLE]
        if path is not None:
            try:
                loaded = yaml.safe_load(Path(path).read_text()) or {}
            except (OSError, yaml.YAMLError) as error:
                raise ConfigFileError(f"{path}: cannot be read ({error})") from None
            if not isinstance(loaded, dict):
                raise ConfigFileError(f"{path}: expected a mapping of settings")
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(loaded) - known)
            if unknown:
                raise ConfigFileError(f"{path}: unknown settings {unknown}; known: {sorted(known)}")
            values.update(loaded)
        values.update({k: v for k, v in overrides.items() if v is not None})
        if isinstance(values.get("jury"), str):
            values["jury"] = [a for a in values["jury"].split(",") if a]
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        if not self.checkpoint:
            raise ConfigFileError("checkpoint is not set (--checkpoint or `checkpoint:`)")
        if not self.trunk:
            raise ConfigFileError("trunk address is not set (--trunk or `trunk:`)")
        if not self.jury:
            raise ConfigFileError("no jury shard addresses (--jury or `jury:`)")
        if self.discovery not in DISCOVERY_MODES:
            raise ConfigFileError(
                f"discovery must be one of {', '.join(DISCOVERY_MODES)}, got {self.discovery!r}"
            )
        if len(set(self.jury)) != len(self.jury):
            raise ConfigFileError(f"a jury shard address is listed twice: {self.jury}")
        if self.log_format not in LOG_FORMATS:
            raise ConfigFileError(
                f"log_format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}"
            )
        if self.max_concurrency < 1:
            raise ConfigFileError("max_concurrency must be at least 1")
        whole = isinstance(self.threads, int) and not isinstance(self.threads, bool)
        if self.threads is not None and (not whole or self.threads < 1):
            raise ConfigFileError(
                f"threads must be a whole number of at least 1, got {self.threads!r}"
            )
        if not 0 <= self.inject_hop_delay_ms <= MAX_HOP_DELAY_MS:
            raise ConfigFileError(
                f"inject_hop_delay_ms must be in 0..{MAX_HOP_DELAY_MS}, "
                f"got {self.inject_hop_delay_ms}"
            )
        if not isinstance(self.pipeline_rounds, bool):
            raise ConfigFileError(
                f"pipeline_rounds must be true or false, got {self.pipeline_rounds!r}"
            )
        if not self.redis_url:
            raise ConfigFileError(
                f"redis_url is not set (--redis-url, `redis_url:` or ${REDIS_URL_VARIABLE}): "
                "the orchestrator keeps its sessions in Redis"
            )
        try:
            self.store_settings()
            self.request_limits()
        except ValueError as error:
            raise ConfigFileError(str(error)) from None

    def make_discovery(self) -> Discovery:
        if self.discovery == "static":
            return StaticDiscovery(self.trunk, self.jury)
        services = dict(zip(component_names(len(self.jury)), [self.trunk, *self.jury], strict=True))
        return KubernetesDiscovery(services, self.namespace)

    def server_tls(self) -> ServerTls | None:
        """The public port's TLS, its files read and checked."""
        return ServerTls.from_settings(self)

    def internal_tls(self) -> ClientTls | None:
        """The client side of the hops to the services, its files read and checked."""
        return ClientTls.from_settings(self, INTERNAL_TLS_FLAGS)

    def request_limits(self) -> RequestLimits:
        return limits_from(self)

    def auth(self) -> ApiKeyAuth | None:
        """The API keys the Generation API requires, the key file read and checked."""
        return auth_from(self)

    def store_settings(self) -> StoreSettings:
        return store_settings_from(self)
