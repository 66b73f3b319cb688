"""Discovery and placement: the real `kubernetes` client following EndpointSlices served
by a fake API server, and sessions placed on replicas — spread over them, kept on them
across turns, moved (with the same output) when one leaves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hydra_jury.orchestrator.discovery import KubernetesDiscovery, StaticDiscovery, ready_addresses
from hydra_jury.orchestrator.sessions.store import StoreSettings
from tests.grpc_stack import Stack, wait_for
from tests.orchestrator.fake_kubernetes import FakeKubernetes
from tests.orchestrator.sessions.test_sessions_api import GREEDY, chat, user


@pytest.fixture
def fake():
    fake = FakeKubernetes()
    yield fake
    fake.close()


def test_discovery_follows_endpoint_slices(fake):
    fake.set_endpoint("trunk", 5001)
    discovery = KubernetesDiscovery(
        {"trunk": "trunk", "jury0": "shard-a"}, "hydra", api_client=fake.api_client()
    )
    try:
        assert wait_for(lambda: discovery.ready("trunk") == ["127.0.0.1:5001"])
        assert discovery.ready("jury0") == []
        with pytest.raises(TimeoutError, match=r"jury0 \(shard-a\)"):
            discovery.wait_ready(0.2)
        fake.set_endpoint("shard-a", 6001)
        fake.set_endpoint("trunk", 5002)
        assert wait_for(lambda: discovery.ready("trunk") == ["127.0.0.1:5001", "127.0.0.1:5002"])
        discovery.wait_ready(5)
        fake.set_endpoint("trunk", 5001, ready=False)  # not ready: not used
        fake.delete_endpoint("shard-a", 6001)
        assert wait_for(lambda: discovery.ready("trunk") == ["127.0.0.1:5002"])
        assert wait_for(lambda: discovery.ready("jury0") == [])
    finally:
        discovery.close()


def test_ready_addresses_reads_slices_as_the_api_says():
    def port(name, number):
        return SimpleNamespace(name=name, port=number)

    def endpoint(address, ready):
        conditions = None if ready is None else SimpleNamespace(ready=ready)
        return SimpleNamespace(addresses=[address], conditions=conditions)

    ipv6 = SimpleNamespace(
        address_type="IPv6",
        ports=[port("metrics", 9100), port("grpc", 50051)],
        endpoints=[
            endpoint("fd00::1", True),
            endpoint("fd00::2", None),
            endpoint("fd00::3", False),
        ],
    )
    assert ready_addresses(ipv6, "grpc") == ["[fd00::1]:50051", "[fd00::2]:50051"]
    unnamed = SimpleNamespace(
        address_type="IPv4", ports=[port(None, 7)], endpoints=[endpoint("10.0.0.1", True)]
    )
    assert ready_addresses(unnamed, "grpc") == ["10.0.0.1:7"]
    ambiguous = SimpleNamespace(
        address_type="IPv4", ports=[port("a", 1), port("b", 2)], endpoints=[]
    )
    assert ready_addresses(ambiguous, "grpc") == []
    assert StaticDiscovery("t:1", ["j:2", "j:3"]).targets == {
        "trunk": "t:1",
        "jury0": "j:2",
        "jury1": "j:3",
    }
    replicated = StaticDiscovery("t:1+t:2", ["j:2+j:4", "j:3"])
    assert replicated.ready("trunk") == ["t:1", "t:2"]
    assert replicated.ready("jury0") == ["j:2", "j:4"]
    assert replicated.ready("jury1") == ["j:3"]


def test_sessions_are_placed_kept_and_moved(fake, jury_checkpoint, redis_url):
    stack = Stack(str(jury_checkpoint), [], redis_url)
    stack.sessions = StoreSettings(ttl_s=60, lease_s=2)
    try:
        trunks = {name: stack.start_replica(name) for name in ("trunk-a", "trunk-b", "trunk-c")}
        shards = {
            name: stack.start_replica(name, ["head0", "head1", "head2", "head3"])
            for name in ("jury-a", "jury-b")
        }
        for port in trunks.values():
            fake.set_endpoint("trunk", port)
        for port in shards.values():
            fake.set_endpoint("shard", port)
        discovery = KubernetesDiscovery(
            {"trunk": "trunk", "jury0": "shard"}, "hydra", api_client=fake.api_client()
        )
        assert wait_for(
            lambda: len(discovery.ready("trunk")) == 3 and len(discovery.ready("jury0")) == 2
        )
        stack.start_orchestrator(discovery=discovery)
        generation = stack.generation()
        first = generation.Generate(chat([user("one")], **GREEDY), timeout=30)
        second = generation.Generate(chat([user("two")], **GREEDY), timeout=30)
        # Spread: the two sessions sit on different trunk replicas and jury replicas.
        assert sorted(stack.active_sessions(n) for n in trunks) == [0, 1, 1]
        assert sorted(stack.active_sessions(n) for n in shards) == [1, 1]
        by_port = {f"127.0.0.1:{port}": name for name, port in trunks.items()}
        home = by_port[stack.load_record(first.session_id).replicas["trunk"].split("@")[0]]
        # Kept: the next turn goes back to the same replicas and reuses their caches.
        again = generation.Generate(
            chat([user("more")], session_id=first.session_id, **GREEDY), timeout=30
        )
        assert again.stats.reused_tokens > 0
        assert sorted(stack.active_sessions(n) for n in trunks) == [0, 1, 1]
        # Moved: its trunk replica leaves; the next turn re-prefills elsewhere, same output.
        fake.delete_endpoint("trunk", trunks[home])
        stack.stop_server(home)
        assert wait_for(lambda: f"127.0.0.1:{trunks[home]}" not in discovery.ready("trunk"))
        conversation = [
            user("one"),
            ("assistant", first.text),
            user("more"),
            ("assistant", again.text),
            user("last"),
        ]
        moved = generation.Generate(
            chat([user("last")], session_id=first.session_id, **GREEDY), timeout=30
        )
        fresh = generation.Generate(chat(conversation, **GREEDY), timeout=30)
        assert moved.stats.reused_tokens == 0
        assert list(moved.token_ids) == list(fresh.token_ids)
        # A replica that is down but still listed ready: the call fails over at once.
        other = by_port[stack.load_record(second.session_id).replicas["trunk"].split("@")[0]]
        assert other != home
        stack.stop_server(other)
        moved_again = generation.Generate(
            chat([user("still")], session_id=second.session_id, **GREEDY), timeout=30
        )
        fresh_again = generation.Generate(
            chat([user("two"), ("assistant", second.text), user("still")], **GREEDY), timeout=30
        )
        assert list(moved_again.token_ids) == list(fresh_again.token_ids)
    finally:
        stack.close()
