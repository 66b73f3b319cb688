"""Per-key limits without a server: concurrent generations, tokens in a sliding minute,
their retry hints and the refusals reported."""

from __future__ import annotations

import pytest

from hydra_jury.orchestrator.key_limits import (
    CONCURRENCY,
    TOKENS_PER_MINUTE,
    KeyLimiter,
    KeyLimitExceeded,
)
from hydra_jury.serving.api_keys import ApiKey, KeyLimits, key_digest
from hydra_jury.serving.errors import status_for


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def key(name: str, **limits) -> ApiKey:
    return ApiKey(name, key_digest(name * 8), KeyLimits(**limits))


def test_concurrent_generations_per_key():
    refused = []
    limiter = KeyLimiter(on_refused=lambda key, reason: refused.append((key.name, reason)))
    alice, bob = key("alice", max_concurrent=2), key("bob", max_concurrent=1)
    with limiter.generation(alice), limiter.generation(alice), limiter.generation(bob):
        with pytest.raises(KeyLimitExceeded) as raised, limiter.generation(alice):
            pass
        assert raised.value.reason == CONCURRENCY
        assert str(raised.value) == (
            "API key 'alice' has 2 generations in progress, its limit; retry when one of them ends"
        )
        assert status_for(raised.value).name == "RESOURCE_EXHAUSTED"
    with limiter.generation(alice):  # the slots came back
        pass
    assert refused == [("alice", CONCURRENCY)]


def test_tokens_per_minute_slide_with_a_retry_hint():
    clock = Clock()
    limiter = KeyLimiter(clock=clock)
    alice = key("alice", tokens_per_minute=100)
    with limiter.generation(alice):
        limiter.spend(alice, 60)
        clock.now += 20
        limiter.spend(alice, 50)
    with pytest.raises(KeyLimitExceeded) as raised, limiter.generation(alice):
        pass
    assert raised.value.reason == TOKENS_PER_MINUTE
    # Under the limit once the first 60 tokens are a minute old: in 40 s.
    assert str(raised.value) == (
        "API key 'alice' generated 110 tokens in the last minute (its limit is 100); "
        "retry in about 40.0 s"
    )
    with limiter.generation(key("bob", tokens_per_minute=100)):
        pass  # another key's window is its own
    clock.now += 40
    with limiter.generation(alice):
        pass
    # A reloaded key file's new limit applies to the next generation.
    with limiter.generation(key("alice", tokens_per_minute=200)):
        pass


def test_a_key_without_limits_is_never_refused():
    limiter = KeyLimiter()
    free = key("free")
    with limiter.generation(free), limiter.generation(free):
        limiter.spend(free, 10**9)
    with limiter.generation(free):
        pass
