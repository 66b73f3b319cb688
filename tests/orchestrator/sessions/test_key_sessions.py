"""Sessions per API key (--limit-sessions-per-key): the Generation server refuses a key's
new session past its limit with RESOURCE_EXHAUSTED naming the flag, until one is closed;
its sessions go on and other keys are not limited. (How the stores count a key's
sessions: tests/orchestrator/sessions/test_store.py.)"""

from __future__ import annotations

import time

import grpc
import pytest

from hydra_jury.orchestrator.limits import RequestLimits
from hydra_jury.protos.hydrajury.v1 import generation_pb2
from hydra_jury.serving.api_keys import KeyFile
from hydra_jury.serving.auth import ApiKeyAuth
from tests.grpc_stack import Stack
from tests.orchestrator.test_authentication import ALICE, BOB, KEY_FILE, chat, generation

Code = grpc.StatusCode


@pytest.fixture(scope="module")
def stack(jury_checkpoint, redis_url, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "api-keys"
    key_file.write_text(KEY_FILE)
    stack = Stack(str(jury_checkpoint), [], redis_url, max_session_tokens=256)
    auth = ApiKeyAuth(KeyFile(key_file))
    stack.start_embedded(auth=auth, request_limits=RequestLimits(sessions_per_key=2))
    yield stack
    stack.close()


def test_a_key_past_its_sessions_is_refused_until_it_closes_one(stack):
    alice, bob = generation(stack, ALICE), generation(stack, BOB)
    first = alice.CreateSession(generation_pb2.CreateSessionRequest(), timeout=5)
    second = alice.Generate(chat("hi"), timeout=30)  # a request opening a session counts
    for call in (
        lambda: alice.CreateSession(generation_pb2.CreateSessionRequest(), timeout=5),
        lambda: alice.Generate(chat("hi"), timeout=30),
    ):
        with pytest.raises(grpc.RpcError) as raised:
            call()
        assert raised.value.code() == Code.RESOURCE_EXHAUSTED
        assert raised.value.details() == (
            "API key 'alice' holds 2 open sessions, this server's limit of 2 "
            "(--limit-sessions-per-key): close one (CloseSession) or let one expire first"
        )
    # Its sessions go on, other keys are not limited, and a closed session frees its place.
    alice.Generate(chat("more", session_id=second.session_id), timeout=30)
    for _ in range(2):
        bob.CreateSession(generation_pb2.CreateSessionRequest(), timeout=5)
    alice.CloseSession(generation_pb2.CloseSessionRequest(session_id=first.session_id), timeout=5)
    began = time.monotonic()
    alice.CreateSession(generation_pb2.CreateSessionRequest(), timeout=5)
    assert time.monotonic() - began < 5
