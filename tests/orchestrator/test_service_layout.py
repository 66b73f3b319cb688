"""The layout check over the services' Info answers, without servers: one checkpoint and
dtype everywhere, shards hosting disjoint heads that cover every head, and each replica
joining later matching the first."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from hydra_jury.orchestrator.layout import LayoutError, check_layout
from hydra_jury.protos.hydrajury.v1 import internal_pb2

HEADS = ["head0", "head1", "head2", "head3"]


@dataclass
class Replica:
    name: str
    info: Any


def description(fingerprint: str = "a" * 64, dtype: str = "float32"):
    return internal_pb2.ModelDescription(
        fingerprint=fingerprint,
        architecture="llama",
        vocab_size=32,
        hidden_size=64,
        context_length=128,
        heads=HEADS,
        eos_token_ids=[2],
        dtype=dtype,
    )


def trunk(max_session_tokens: int = 100, **model: str) -> Replica:
    info = internal_pb2.TrunkInfoResponse(
        model=description(**model),
        drafter_heads=["head0", "head1"],
        limits=internal_pb2.ServiceLimits(max_session_tokens=max_session_tokens),
        draft_model="tiny draft",
        uncertainty_head=True,
    )
    return Replica("trunk service at t:1", info)


def shard(index: int, heads: list[str], max_session_tokens: int = 100, **model: str) -> Replica:
    info = internal_pb2.JuryInfoResponse(
        model=description(**model),
        hosted_heads=heads,
        limits=internal_pb2.ServiceLimits(max_session_tokens=max_session_tokens),
    )
    return Replica(f"jury shard {index} at j:{index}", info)


def test_the_first_replicas_give_the_model_and_the_shards_heads():
    layout = check_layout(
        trunk(max_session_tokens=90),
        {"jury0": shard(0, ["head0", "head2"], 80), "jury1": shard(1, ["head1", "head3"])},
    )
    model = layout.model
    assert model.head_names == tuple(HEADS) and model.drafter_heads == ("head0", "head1")
    assert model.context_length == 80  # the least of the model's and every service's
    assert (model.vocab_size, model.eos_token_ids, model.architecture) == (32, (2,), "llama")
    assert model.draft_model == "tiny draft" and model.uncertainty_head
    assert layout.dtype == "float32"
    assert layout.shard_heads == {"jury0": ("head0", "head2"), "jury1": ("head1", "head3")}


@pytest.mark.parametrize(
    ("shards", "message"),
    [
        (
            [["head0", "head1"], ["head1", "head2", "head3"]],
            "head 'head1' is hosted by both the jury shard 0 at j:0 and the jury shard 1 "
            "at j:1: shards must host disjoint heads",
        ),
        (
            [["head0", "head1"]],
            r"no jury shard hosts heads \['head2', 'head3'\]; together the shards must host "
            r"every llm head \['head0', 'head1', 'head2', 'head3'\]",
        ),
    ],
    ids=["overlapping", "missing"],
)
def test_shards_must_host_every_head_once(shards, message):
    with pytest.raises(LayoutError, match=message):
        check_layout(trunk(), {f"jury{i}": shard(i, heads) for i, heads in enumerate(shards)})


def test_every_service_loads_the_same_checkpoint_in_the_same_dtype():
    with pytest.raises(LayoutError, match="all services must load the same checkpoint"):
        check_layout(trunk(), {"jury0": shard(0, HEADS, fingerprint="b" * 64)})
    with pytest.raises(
        LayoutError,
        match="jury shard 0 at j:0 computes in bfloat16 but the trunk service at t:1 in "
        "float32: start them with the same --dtype",
    ):
        check_layout(trunk(), {"jury0": shard(0, HEADS, dtype="bfloat16")})


def test_a_replica_joining_later_matches_the_first():
    layout = check_layout(
        trunk(), {"jury0": shard(0, ["head0", "head1"]), "jury1": shard(1, ["head2", "head3"])}
    )
    layout.check_replica("trunk", trunk())  # a trunk's heads are not a shard's
    layout.check_replica("jury1", shard(1, ["head2", "head3"], max_session_tokens=50))
    with pytest.raises(LayoutError, match="serves checkpoint bbbbbbbbbbbb, not aaaaaaaaaaaa"):
        layout.check_replica("trunk", trunk(fingerprint="b" * 64))
    with pytest.raises(LayoutError, match="jury shard 1 at j:1 computes in float16, not float32"):
        layout.check_replica("jury1", shard(1, ["head2", "head3"], dtype="float16"))
    with pytest.raises(
        LayoutError,
        match=r"hosts heads \['head2'\], but its shard serves \['head2', 'head3'\]",
    ):
        layout.check_replica("jury1", shard(1, ["head2"]))
