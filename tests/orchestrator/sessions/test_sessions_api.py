"""Sessions through the public API, on the split stack and the single-process server:
multi-turn with prefix reuse, ownership (busy, unknown, taken ids), idempotent and
resumable requests, CloseSession, eviction and expiry — against a real Redis."""

from __future__ import annotations

import time

import grpc
import pytest

from hydra_jury.orchestrator.sessions.record import common_prefix
from hydra_jury.orchestrator.sessions.store import StoreSettings
from hydra_jury.protos.hydrajury.v1 import generation_pb2, internal_pb2, internal_pb2_grpc
from tests.grpc_stack import Stack, retry_busy, wait_for

GREEDY = {"temperature": 0.0, "gamma": 3}
SAMPLED = {"temperature": 0.9, "gamma": 4, "top_k": 12}


@pytest.fixture(
    scope="module",
    params=[[["head0", "head1"], ["head2", "head3"]], "embedded"],
    ids=["two-shards", "single-process"],
)
def stack(request, jury_checkpoint, redis_url):
    stack = Stack(str(jury_checkpoint), [], redis_url, max_sessions=8)
    stack.sessions = StoreSettings(ttl_s=60, lease_s=2)
    if request.param == "embedded":
        stack.start_embedded()
    else:
        stack.shards = request.param
        stack.start_services().start_orchestrator()
    yield stack
    stack.close()


def chat(messages, session_id="", request_id="", **options) -> generation_pb2.GenerateRequest:
    options.setdefault("max_new_tokens", 6)
    options.setdefault("seed", 11)
    return generation_pb2.GenerateRequest(
        messages=generation_pb2.ChatMessages(
            messages=[generation_pb2.ChatMessage(role=r, content=c) for r, c in messages]
        ),
        session_id=session_id,
        request_id=request_id,
        options=generation_pb2.DecodingOptions(**options),
    )


def encoded(tokenizer, conversation: list[dict[str, str]]) -> list[int]:
    rendered = tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(rendered["input_ids"])


def user(text: str) -> tuple[str, str]:
    return ("user", text)


BEAMS = {"num_beams": 3, "temperature": 0.0}


@pytest.mark.parametrize("options", [GREEDY, SAMPLED, BEAMS], ids=["greedy", "sampled", "beams"])
def test_a_second_turn_prefills_only_the_new_tokens(stack, tokenizer, options):
    generation = stack.generation()
    first = generation.Generate(chat([user("hello there")], **options), timeout=30)
    assert first.session_id and first.stats.reused_tokens == 0
    assert first.stats.prefilled_tokens == first.prompt_tokens
    second = generation.Generate(
        chat([user("and now?")], session_id=first.session_id, **options), timeout=30
    )
    conversation = [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "and now?"},
    ]
    context = encoded(tokenizer, conversation)
    committed = encoded(tokenizer, conversation[:1]) + list(first.token_ids)
    expected_reuse = min(common_prefix(committed, context), len(committed) - 1)
    assert second.prompt_tokens == len(context)
    assert second.stats.reused_tokens == expected_reuse > 0
    assert second.stats.prefilled_tokens == len(context) - expected_reuse
    # The same tokens as a fresh session given the whole conversation.
    fresh = generation.Generate(
        chat([(m["role"], m["content"]) for m in conversation], **options), timeout=30
    )
    assert fresh.stats.reused_tokens == 0
    assert list(second.token_ids) == list(fresh.token_ids)
    assert second.text == fresh.text


@pytest.mark.parametrize(
    "options",
    [GREEDY, SAMPLED, {"rule": "verifier_only", "temperature": 0.7}],
    ids=["greedy", "sampled", "non-speculative"],
)
def test_each_turn_may_name_its_jury(stack, options):
    """The jury evaluates only the heads a turn names; a head a turn left out catches up
    when a later turn names it. Each turn gives the tokens of a fresh session given the
    whole conversation with that turn's jury."""
    generation = stack.generation()
    conversation, session = [], ""
    juries = [["head0", "head1", "head2", "head3"], ["head1"], ["head0", "head2", "head3"]]
    for text, jury in zip(("hello there", "and now?", "one more"), juries, strict=True):
        conversation.append(user(text))
        turn = generation.Generate(
            chat([user(text)], session_id=session, jury=jury, **options), timeout=30
        )
        fresh = generation.Generate(chat(conversation, jury=jury, **options), timeout=30)
        assert session == "" or turn.stats.reused_tokens > 0
        assert list(turn.token_ids) == list(fresh.token_ids) and turn.text == fresh.text
        if options.get("rule") == "verifier_only":  # one position a round, each juror once
            assert turn.stats.head_evaluations == len(turn.token_ids) * len(jury)
        session = turn.session_id
        conversation.append(("assistant", turn.text))


def test_each_turn_may_pick_its_drafter(stack):
    """A session's draft head carries over to turns that draft with a head, never to one
    that drafts by prompt lookup or does not draft."""
    generation = stack.generation()
    first = generation.Generate(chat([user("hi")], drafter="head", **GREEDY), timeout=30)
    for drafter, rule in (("ngram", "exact"), ("auto", "verifier_only"), ("head", "exact")):
        turn = generation.Generate(
            chat(
                [user("more")],
                session_id=first.session_id,
                drafter=drafter,
                rule=rule,
                temperature=0.0,
            ),
            timeout=30,
        )
        assert turn.draft_head == (first.draft_head if drafter == "head" else "")


def test_text_sessions_append_prompts(stack):
    generation = stack.generation()
    options = generation_pb2.DecodingOptions(max_new_tokens=4, seed=3, temperature=0.0)
    first = generation.Generate(
        generation_pb2.GenerateRequest(prompt="abc", options=options), timeout=30
    )
    second = generation.Generate(
        generation_pb2.GenerateRequest(prompt="de", options=options, session_id=first.session_id),
        timeout=30,
    )
    assert second.prompt_tokens == 3 + len(first.token_ids) + 2
    assert second.stats.reused_tokens == 3 + len(first.token_ids) - 1
    with pytest.raises(grpc.RpcError) as raised:
        generation.Generate(chat([user("hi")], session_id=first.session_id), timeout=30)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is a text session: send a prompt" in raised.value.details()


def test_session_ids_are_owned(stack):
    generation = stack.generation()
    made = generation.CreateSession(generation_pb2.CreateSessionRequest(), timeout=5)
    assert len(made.session_id) == 32 and int(made.session_id, 16) >= 0  # 128 random bits
    with pytest.raises(grpc.RpcError) as raised:
        generation.CreateSession(
            generation_pb2.CreateSessionRequest(session_id=made.session_id), timeout=5
        )
    assert raised.value.code() == grpc.StatusCode.ALREADY_EXISTS
    for bad, code in (
        ("not-a-session", grpc.StatusCode.NOT_FOUND),
        ("bad id!", grpc.StatusCode.INVALID_ARGUMENT),
    ):
        with pytest.raises(grpc.RpcError) as raised:
            generation.Generate(chat([user("hi")], session_id=bad), timeout=10)
        assert raised.value.code() == code, raised.value.details()


def test_a_second_request_on_a_generating_session_is_aborted(stack):
    """The hijack a review found: another client naming a generating session's id gets
    ABORTED and the first generation's output is unchanged."""
    generation = stack.generation()
    options = {"max_new_tokens": 40, "ignore_eos": True, **SAMPLED}
    reference = generation.Generate(chat([user("hi")], **options), timeout=60)
    stream = generation.GenerateStream(chat([user("hi")], **options), timeout=60)
    first = next(stream)
    with pytest.raises(grpc.RpcError) as raised:
        generation.Generate(chat([user("mine now")], session_id=first.session_id), timeout=10)
    assert raised.value.code() == grpc.StatusCode.ABORTED
    assert "busy" in raised.value.details()
    rest = list(stream)
    tokens = [t.token_id for message in (first, *rest) for t in message.tokens]
    assert tokens == list(reference.token_ids)
    assert all(m.session_id == first.session_id for m in rest)


def test_a_finished_request_is_replayed_without_compute(stack, monkeypatch):
    generation = stack.generation()
    request = chat([user("once")], request_id="req-1", **SAMPLED)
    first = generation.Generate(request, timeout=30)
    request.session_id = first.session_id
    backend = stack.servicer.backend

    def no_compute(*_args, **_kwargs):
        raise AssertionError("a replay must not compute")

    monkeypatch.setattr(backend, "draft", no_compute)
    monkeypatch.setattr(backend, "prefill", no_compute)
    again = generation.Generate(request, timeout=30)
    assert again == first
    streamed = list(generation.GenerateStream(request, timeout=30))
    assert [t.token_id for m in streamed for t in m.tokens] == list(first.token_ids)
    assert streamed[-1].finish_reason == first.finish_reason
    changed = chat([user("twice")], session_id=first.session_id, request_id="req-1")
    with pytest.raises(grpc.RpcError) as raised:
        generation.Generate(changed, timeout=30)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "already used on this session for a different request" in raised.value.details()


@pytest.mark.parametrize("options", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_broken_stream_resumes_where_it_stopped(stack, options):
    generation = stack.generation()
    options = {**options, "max_new_tokens": 30, "ignore_eos": True}
    reference = generation.Generate(chat([user("go on")], **options), timeout=60)
    session = generation.CreateSession(generation_pb2.CreateSessionRequest(), timeout=5)
    request = chat(
        [user("go on")], session_id=session.session_id, request_id="resume-me", **options
    )
    stream = generation.GenerateStream(request, timeout=60)
    seen = [next(stream), next(stream)]
    stream.cancel()
    resumed = retry_busy(lambda: generation.Generate(request, timeout=60))
    assert list(resumed.token_ids) == list(reference.token_ids)
    assert resumed.text == reference.text
    assert resumed.stats.resumed_rounds >= len(seen)
    assert [t.token_id for m in seen for t in m.tokens] == list(resumed.token_ids)[
        : sum(len(m.tokens) for m in seen)
    ]


def test_lost_caches_are_rebuilt_from_the_record(stack):
    """A service that lost the session's caches (restart, eviction): the next turn
    re-prefills everything, with the same tokens as a fresh session."""
    generation = stack.generation()
    first = generation.Generate(chat([user("remember")], **GREEDY), timeout=30)
    record = stack.load_record(first.session_id)
    if stack.embedded:
        stack.servicer.backend.trunk.release(record.cache_id)
    else:
        trunk = internal_pb2_grpc.TrunkStub(stack.channel("trunk"))
        trunk.Release(internal_pb2.ReleaseRequest(session=record.cache_id), timeout=5)
    second = generation.Generate(
        chat([user("again")], session_id=first.session_id, **GREEDY), timeout=30
    )
    fresh = generation.Generate(
        chat([user("remember"), ("assistant", first.text), user("again")], **GREEDY), timeout=30
    )
    assert list(second.token_ids) == list(fresh.token_ids)
    assert second.stats.reused_tokens == 0


def test_close_session_ends_a_stream_and_frees_every_cache(stack):
    generation = stack.generation()
    stream = generation.GenerateStream(
        chat([user("long")], max_new_tokens=100, ignore_eos=True, gamma=1), timeout=60
    )
    session_id = next(stream).session_id
    held = {n: stack.active_sessions(n) for n in stack.holders}
    generation.CloseSession(generation_pb2.CloseSessionRequest(session_id=session_id), timeout=5)
    with pytest.raises(grpc.RpcError) as raised:
        list(stream)
    assert raised.value.code() == grpc.StatusCode.ABORTED
    assert wait_for(lambda: all(stack.active_sessions(n) == held[n] - 1 for n in stack.holders))
    assert stack.load_record(session_id) is None
    with pytest.raises(grpc.RpcError) as raised:
        generation.Generate(chat([user("hi")], session_id=session_id), timeout=10)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND


def test_expired_sessions_release_their_caches(jury_checkpoint, redis_url):
    stack = Stack(str(jury_checkpoint), [["head0", "head1", "head2", "head3"]], redis_url)
    stack.sessions = StoreSettings(ttl_s=1.0, lease_s=0.5)
    stack.start_services().start_orchestrator()
    try:
        generation = stack.generation()
        done = generation.Generate(chat([user("soon gone")], **GREEDY), timeout=30)
        assert all(stack.active_sessions(n) == 1 for n in stack.holders)
        assert wait_for(
            lambda: all(stack.active_sessions(n) == 0 for n in stack.holders), timeout=10
        )
        with pytest.raises(grpc.RpcError) as raised:
            generation.Generate(chat([user("hi")], session_id=done.session_id), timeout=10)
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        stack.close()


def test_requests_fail_fast_when_redis_is_down(jury_checkpoint):
    from hydra_jury.orchestrator.sessions.redis_server import LocalRedis

    redis = LocalRedis().start()
    stack = Stack(str(jury_checkpoint), [], redis.url).start_embedded()
    try:
        redis.kill()
        began = time.monotonic()
        with pytest.raises(grpc.RpcError) as raised:
            stack.generation().Generate(chat([user("hi")]), timeout=30)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"Redis at {redis.url}" in raised.value.details()
        assert time.monotonic() - began < 10
    finally:
        stack.close()
        redis.stop()


def test_drafter_model_without_a_draft_model_is_invalid_argument(stack):
    with pytest.raises(grpc.RpcError) as raised:
        stack.generation().Generate(chat([{"role": "user", "content": "hi"}], drafter="model"))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the trunk hosts no draft model (start it with --draft-model DIR)" in (
        raised.value.details()
    )
    info = stack.generation().Info(generation_pb2.GenerationInfoRequest())
    assert info.draft_model == ""
