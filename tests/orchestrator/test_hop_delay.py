"""The injected hop delay (`--inject-hop-delay-ms`, for benchmarks): every call from the
orchestrator to a service waits that long, the tokens are unchanged, and a delay out of
range is refused."""

from __future__ import annotations

import time

import pytest

from hydra_jury.orchestrator.__main__ import build_parser
from hydra_jury.orchestrator.config import ConfigFileError, OrchestratorConfig
from tests.grpc_stack import Stack
from tests.orchestrator.test_grpc_stack import to_pb

DELAY_S = 0.05
REQUIRED = {"checkpoint": "c", "trunk": "t", "jury": "j", "redis_url": "redis://h:1/0"}


def test_every_call_to_a_service_pays_the_delay_and_the_tokens_are_unchanged(
    jury_checkpoint, redis_url
):
    stack = Stack(str(jury_checkpoint), [["head0", "head1"], ["head2", "head3"]], redis_url)
    stack.start_services().start_orchestrator()
    stack.start_orchestrator("delayed", hop_delay_s=DELAY_S)
    try:
        request = to_pb("the cat", max_new_tokens=6, ignore_eos=True, rule="verifier_only", seed=3)
        plain = stack.generation().Generate(request, timeout=30)
        began = time.perf_counter()
        delayed = stack.generation("delayed").Generate(request, timeout=30)
        elapsed = time.perf_counter() - began
        assert list(delayed.token_ids) == list(plain.token_ids)
        # The prefill (trunk, then both shards at once) and each round (a draft, then
        # the shards' scores at once): two calls each, one delay per call.
        calls = 2 + 2 * delayed.stats.rounds
        assert elapsed >= calls * DELAY_S
    finally:
        stack.close()


def test_the_delay_is_a_flag_and_a_setting_and_checked():
    args = build_parser().parse_args(["--inject-hop-delay-ms", "2"])
    config = OrchestratorConfig.load(None, {**REQUIRED, "inject_hop_delay_ms": 2.0})
    assert args.inject_hop_delay_ms == 2.0 and config.inject_hop_delay_ms == 2.0
    assert OrchestratorConfig.load(None, REQUIRED).inject_hop_delay_ms == 0
    for bad in (-1.0, 1001.0):
        with pytest.raises(ConfigFileError, match=r"inject_hop_delay_ms must be in 0\.\.1000"):
            OrchestratorConfig.load(None, {**REQUIRED, "inject_hop_delay_ms": bad})
