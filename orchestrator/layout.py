"""What the services together must be: one model.

The first replica of each component (the trunk service, each jury shard) defines the
layout (`check_layout`): every service loads the same checkpoint (sha256 of its
`hydra.json`) in the same dtype, and the shards host disjoint heads that together cover
every head. Each replica that joins later must match it (`Layout.check_replica`). Pure
checks over the services' `Info` answers: no gRPC here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from hydra_jury.orchestrator.backend import ModelInfo


class LayoutError(ValueError):
    """Services that do not form one model: the message says what is wrong."""


class DescribedReplica(Protocol):
    """A replica's `Info` answer and the name that messages give it."""

    name: str  # "jury shard 0 at HOST:PORT"
    info: Any  # its TrunkInfoResponse or JuryInfoResponse


@dataclass(frozen=True)
class Layout:
    """The model the first replicas form, and what a replica joining later must match:
    the dtype and, for a shard, its heads."""

    model: ModelInfo
    dtype: str
    shard_heads: dict[str, tuple[str, ...]]  # shard component ("jury0", ...) -> its heads

    def check_replica(self, component: str, replica: DescribedReplica) -> None:
        """A replica of `component` that joined later: the same checkpoint, dtype and (a
        shard) heads."""
        model = replica.info.model
        if model.fingerprint != self.model.fingerprint:
            raise LayoutError(
                f"{replica.name} serves checkpoint {model.fingerprint[:12]}, not "
                f"{self.model.fingerprint[:12]}"
            )
        if model.dtype != self.dtype:
            raise LayoutError(f"{replica.name} computes in {model.dtype}, not {self.dtype}")
        heads = self.shard_heads.get(component)
        if heads is not None and tuple(replica.info.hosted_heads) != heads:
            raise LayoutError(
                f"{replica.name} hosts heads {list(replica.info.hosted_heads)}, but its shard "
                f"serves {list(heads)}"
            )


def check_layout(trunk: DescribedReplica, shards: dict[str, DescribedReplica]) -> Layout:
    """The layout of the first trunk replica and the first replica of each shard (by
    component name, in shard order); raises `LayoutError` when they are not one model."""
    model = trunk.info.model
    for shard in shards.values():
        if shard.info.model.fingerprint != model.fingerprint:
            raise LayoutError(
                f"{shard.name} serves checkpoint {shard.info.model.fingerprint[:12]}"
                f" but the {trunk.name} serves {model.fingerprint[:12]}: "
                f"all services must load the same checkpoint"
            )
        if shard.info.model.dtype != model.dtype:
            raise LayoutError(
                f"{shard.name} computes in {shard.info.model.dtype} but the "
                f"{trunk.name} in {model.dtype}: start them with the same --dtype"
            )
    owners: dict[str, str] = {}
    for shard in shards.values():
        for head in shard.info.hosted_heads:
            if head in owners:
                raise LayoutError(
                    f"head {head!r} is hosted by both the {owners[head]} and "
                    f"the {shard.name}: shards must host disjoint heads"
                )
            owners[head] = shard.name
    missing = [head for head in model.heads if head not in owners]
    if missing:
        raise LayoutError(
            f"no jury shard hosts heads {missing}; together the shards must "
            f"host every llm head {list(model.heads)}"
        )
    limits = [trunk.info.limits.max_session_tokens]
    limits += [shard.info.limits.max_session_tokens for shard in shards.values()]
    info = ModelInfo(
        fingerprint=model.fingerprint,
        architecture=model.architecture,
        head_names=tuple(model.heads),
        drafter_heads=tuple(trunk.info.drafter_heads),
        vocab_size=model.vocab_size,
        context_length=min(model.context_length, *limits),
        eos_token_ids=tuple(model.eos_token_ids),
        draft_model=trunk.info.draft_model,
        uncertainty_head=trunk.info.uncertainty_head,
    )
    heads = {component: tuple(shard.info.hosted_heads) for component, shard in shards.items()}
    return Layout(info, model.dtype, heads)
