"""Orchestrator configuration: a YAML file, overridden by command-line flags.

checkpoint: var/models/smollm2-hydra   # for the tokenizer; must match the services
listen: 127.0.0.1:50050
trunk: 127.0.0.1:50051
jury: [127.0.0.1:50052, 127.0.0.1:50053]
metrics_port: 9100                     # omit to serve no metrics
max_concurrency: 32
connect_timeout_s: 30
grace_s: 5
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml


class ConfigFileError(ValueError):
    """A configuration that cannot be used; the message names the key."""


@dataclass
class OrchestratorConfig:
    checkpoint: str = ""
    trunk: str = ""
    jury: list[str] = field(default_factory=list)
    listen: str = "127.0.0.1:50050"
    metrics_port: int | None = None
    metrics_address: str = "127.0.0.1"
    max_concurrency: int = 32
    connect_timeout_s: float = 30.0
    grace_s: float = 5.0

    @classmethod
    def load(cls, path: str | Path | None, overrides: dict[str, Any]) -> OrchestratorConfig:
        values: dict[str, Any] = {}
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
        if len(set(self.jury)) != len(self.jury):
            raise ConfigFileError(f"a jury shard address is listed twice: {self.jury}")
        if self.max_concurrency < 1:
            raise ConfigFileError("max_concurrency must be at least 1")
