"""Pipelined rounds (`--pipeline-rounds`): the split stack's orchestrator sends the next
round's draft to the trunk while the jury scores this round, and discards it when this
round rejects a draft token or stops. Two orchestrators over the same services, one
pipelined and one not, must give the same tokens, records and work counts for every
seeded request: drafts are keyed by position, so a draft sent ahead is the one the next
round would make, and a discarded one never stays in the trunk's cache (the position
rule). Its distribution is tested in `test_engine_distribution` (the chi-square test
through the services)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from urllib.request import urlopen

import grpc
import pytest

from hydra_jury.orchestrator.__main__ import build_parser
from hydra_jury.orchestrator.auto import AutoState, Choice
from hydra_jury.orchestrator.config import ConfigFileError, OrchestratorConfig
from hydra_jury.orchestrator.draft_ahead import AheadPolicy
from hydra_jury.orchestrator.request import DrafterKind
from tests.grpc_stack import Stack, wait_for
from tests.orchestrator.sessions.test_sessions_api import chat, user
from tests.orchestrator.test_concurrent_sessions import PROMPTS, SESSION_ROOM
from tests.orchestrator.test_grpc_stack import to_pb

REQUIRED = {"checkpoint": "c", "trunk": "t", "jury": "j", "redis_url": "redis://h:1/0"}
CASES = {
    "greedy-gamma-1": {"rule": "exact", "gamma": 1, "temperature": 0.0},
    "greedy-gamma-3": {"rule": "exact", "gamma": 3, "temperature": 0.0},
    "sampled-gamma-2": {"rule": "exact", "gamma": 2, "temperature": 0.8, "top_k": 12},
    "cascade-gamma-2": {"rule": "cascade_diff", "gamma": 2, "temperature": 1.0, "lenience": 0.1},
    "lenient-gamma-2": {"rule": "lenient", "gamma": 2, "temperature": 0.0, "lenience": 0.3},
}
SEEDS = range(4)
# The work a response reports: equal with and without pipelining (a discarded draft is
# counted apart, in drafts_ahead).
WORK = ("rounds", "drafted", "accepted", "emitted", "trunk_steps", "head_evaluations")


@pytest.fixture
def always_ahead(monkeypatch):
    """Every round that can send its successor's draft ahead does, whatever its request
    measured (`AheadPolicy` decides from timings; the orchestrators run in this
    process): the counts below are then exact."""
    monkeypatch.setattr(AheadPolicy, "pays", lambda policy: True)


@pytest.fixture(scope="module")
def stack(jury_checkpoint, redis_url):
    stack = Stack(
        str(jury_checkpoint), [["head0", "head1"], ["head2", "head3"]], redis_url, **SESSION_ROOM
    )
    stack.start_services().start_orchestrator()
    stack.start_orchestrator("pipelined", pipeline_rounds=True, metrics_port=0)
    yield stack
    stack.close()


def drafted_with_head(options: dict, seed: int) -> dict:
    return dict(
        drafter="head", draft_head="head3", jury=["head0", "head1", "head2"], seed=seed, **options
    )


@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
def test_pipelined_rounds_give_the_tokens_and_work_of_plain_rounds(stack, case, always_ahead):
    plain, pipelined = stack.generation(), stack.generation("pipelined")
    sent = used = 0
    for seed in SEEDS:
        request = to_pb(
            PROMPTS[seed], max_new_tokens=12, ignore_eos=True, **drafted_with_head(case, seed)
        )
        expected = plain.Generate(request, timeout=30)
        got = pipelined.Generate(request, timeout=30)
        assert list(got.token_ids) == list(expected.token_ids)
        assert [t.kind for t in got.tokens] == [t.kind for t in expected.tokens]
        assert [t.entropy for t in got.tokens] == [t.entropy for t in expected.tokens]
        for counter in WORK:
            assert getattr(got.stats, counter) == getattr(expected.stats, counter), counter
        assert expected.stats.drafts_ahead == 0
        assert (got.stats.drafts_ahead, got.stats.drafts_ahead_used) == drafts_ahead(
            [token.kind for token in got.tokens], case["gamma"], 12
        )
        sent, used = sent + got.stats.drafts_ahead, used + got.stats.drafts_ahead_used
    assert 0 < used < sent  # some drafts sent ahead were used, and some discarded


def drafts_ahead(kinds: list[str], gamma: int, max_new_tokens: int) -> tuple[int, int]:
    """The drafts a pipelined run sends ahead and uses when every round sends, from its
    tokens' kinds: a round drafts min(γ, tokens left) and ends at a replacement or with
    all kept; it sends the next round's draft when tokens are left after a full round,
    and the next round uses it when it kept them all."""
    sent = used = emitted = 0
    last_sent_and_kept = False
    while emitted < len(kinds):
        left = max_new_tokens - emitted
        round_gamma = min(gamma, left)
        kept = 0
        while kept < round_gamma and kinds[emitted + kept] == "draft":
            kept += 1
        used += last_sent_and_kept
        sends = left > round_gamma
        sent += sends
        last_sent_and_kept = sends and kept == round_gamma
        emitted += kept if kept == round_gamma else kept + 1
    return sent, used


def test_greedy_pipelined_speculation_gives_the_non_speculative_tokens(stack):
    pipelined = stack.generation("pipelined")
    for seed, prompt in enumerate(PROMPTS[:4]):
        options = dict(max_new_tokens=16, ignore_eos=True, temperature=0.0)
        jury = ["head0", "head1", "head2"]
        plain_step = pipelined.Generate(
            to_pb(prompt, rule="verifier_only", jury=jury, seed=seed, **options), timeout=30
        )
        speculative = pipelined.Generate(
            to_pb(prompt, rule="exact", **drafted_with_head({"gamma": 3, **options}, seed)),
            timeout=30,
        )
        assert list(speculative.token_ids) == list(plain_step.token_ids)
        # A plain step sends the next one's trunk step once its token is drawn: every
        # round but the last, and every one is used (no draft to reject).
        stats = plain_step.stats
        assert stats.drafts_ahead == stats.drafts_ahead_used == stats.rounds - 1


def test_the_automatic_modes_plain_steps_are_pipelined(stack, monkeypatch):
    """A plain step of the automatic mode chooses the next round at once and, when that
    is a plain step too, sends its trunk step ahead: with every choice a plain step,
    every round but the last sends one and every one is used, and the tokens are
    non-speculative sampling's."""
    monkeypatch.setattr(AutoState, "choose", lambda *args: Choice(DrafterKind.NONE, 0))
    pipelined = stack.generation("pipelined")
    for seed, prompt in enumerate(PROMPTS[:3]):
        options = dict(max_new_tokens=12, ignore_eos=True, temperature=0.8, seed=seed)
        plain_step = pipelined.Generate(to_pb(prompt, rule="verifier_only", **options), timeout=30)
        auto = pipelined.Generate(to_pb(prompt, drafter="auto", **options), timeout=30)
        assert list(auto.token_ids) == list(plain_step.token_ids)
        stats = auto.stats
        assert dict(stats.rounds_by_drafter) == {"none": 12}
        assert stats.drafts_ahead == stats.drafts_ahead_used == stats.rounds - 1


def test_prompt_lookup_rounds_are_pipelined_too(stack, monkeypatch):
    """Every round of the automatic mode chooses the next as soon as its tokens are
    decided, and sends its trunk call ahead when it is a plain step or a one-pass check
    of prompt-lookup drafts (known by then), whatever this round was. With drafts chosen
    whenever lookup offers some, every round but the first uses a call sent ahead, and
    the tokens are non-speculative sampling's."""

    def drafts_when_offered(self, costs, ngram_drafts, *args) -> Choice:
        return Choice(DrafterKind.NGRAM, 1) if ngram_drafts else Choice(DrafterKind.NONE, 0)

    monkeypatch.setattr(AutoState, "choose", drafts_when_offered)
    pipelined = stack.generation("pipelined")
    after_drafts = 0
    for seed, prompt in enumerate(PROMPTS[:4]):
        options = dict(max_new_tokens=24, ignore_eos=True, temperature=0.8, seed=seed)
        plain_step = pipelined.Generate(to_pb(prompt, rule="verifier_only", **options), timeout=30)
        auto = pipelined.Generate(to_pb(prompt, drafter="auto", **options), timeout=30)
        assert list(auto.token_ids) == list(plain_step.token_ids)
        stats, rounds = auto.stats, dict(auto.stats.rounds_by_drafter)
        assert stats.drafts_ahead == stats.drafts_ahead_used == stats.rounds - 1
        after_drafts += rounds.get("ngram", 0) > 1 and rounds.get("none", 0) > 1
    assert after_drafts  # some request mixed rounds with drafts and plain steps


def test_sessions_running_together_give_their_tokens_alone(stack):
    pipelined = stack.generation("pipelined")
    requests = [
        to_pb(prompt, max_new_tokens=16, ignore_eos=True, **drafted_with_head(case, seed))
        for seed, (prompt, case) in enumerate(zip(PROMPTS, [*CASES.values()] * 2, strict=False))
    ]
    alone = [list(pipelined.Generate(request, timeout=30).token_ids) for request in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(
            pool.map(lambda r: list(pipelined.Generate(r, timeout=60).token_ids), requests)
        )
    assert together == alone


def test_a_session_s_next_turn_never_sees_a_discarded_draft(stack, always_ahead):
    """A stop sequence ends the first turn in a round that kept its draft token and had
    sent the next round's draft ahead: that draft's position stays in the trunk's cache
    past the committed tokens. The session's next turns continue from the committed
    tokens (the position rule), as the same conversation does on the orchestrator that
    does not pipeline."""
    options = drafted_with_head(CASES["greedy-gamma-1"], 5)
    stop = stop_in_a_round_that_sent_ahead(stack, options)
    trunk = stack.servers["trunk"].servicer.worker
    turns = {}
    for name in ("orchestrator", "pipelined"):
        generation, session, tokens = stack.generation(name), "", []
        for text in ("hello there", "and now?", "one more"):
            turn = generation.Generate(
                chat([user(text)], session_id=session, max_new_tokens=12, stop=[stop], **options),
                timeout=30,
            )
            if session == "":
                assert turn.finish_reason == "stop"
                held = trunk.sessions.peek(stack.load_record(turn.session_id).cache_id)
                processed = turn.prompt_tokens + len(turn.token_ids) - 1
                assert held.trunk.length == processed + (name == "pipelined")
            else:
                assert turn.stats.reused_tokens > 0
            session = turn.session_id
            tokens.append(list(turn.token_ids))
        turns[name] = tokens
    assert turns["pipelined"] == turns["orchestrator"]


def stop_in_a_round_that_sent_ahead(stack: Stack, options: dict) -> str:
    """A stop sequence for the first turn ("hello there") with `options` (γ = 1): the
    text of a kept draft token, not the last, whose first occurrence in the answer it is."""
    probe = stack.generation("pipelined").Generate(
        chat([user("hello there")], max_new_tokens=12, **options), timeout=30
    )
    texts = [token.text for token in probe.tokens]
    whole = "".join(texts)
    for index, token in enumerate(probe.tokens[:-1]):
        first_at = len("".join(texts[:index]))
        if token.kind == "draft" and token.text.strip() and whole.find(token.text) == first_at:
            return token.text
    raise AssertionError(f"no stop sequence for this seed in {texts}")


def test_a_deadline_passing_with_a_draft_in_flight_frees_the_session(stack, always_ahead):
    """Each call waits 20 ms (an injected hop delay), so the deadline passes mid-round,
    with a draft sent ahead in flight or just back: the request fails with
    DEADLINE_EXCEEDED, its caches are released once that draft is back, and the next
    request gets its tokens."""
    if "slow" not in stack.servers:
        stack.start_orchestrator("slow", pipeline_rounds=True, hop_delay_s=0.02)
    slow = stack.generation("slow")
    options = drafted_with_head(CASES["greedy-gamma-1"], 2)
    request = to_pb("the cat", max_new_tokens=64, ignore_eos=True, **options)
    with pytest.raises(grpc.RpcError) as raised:
        slow.Generate(request, timeout=0.5)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    trunk = stack.servers["trunk"].servicer.worker
    assert wait_for(lambda: trunk.sessions.running == 0, timeout=5)
    short = to_pb("the cat", max_new_tokens=4, ignore_eos=True, **options)
    expected = stack.generation().Generate(short, timeout=30)
    assert list(slow.Generate(short, timeout=30).token_ids) == list(expected.token_ids)


def test_the_drafts_sent_ahead_are_counted_in_the_metrics(stack):
    options = drafted_with_head(CASES["greedy-gamma-1"], 1)
    request = to_pb("the cat", max_new_tokens=12, ignore_eos=True, **options)
    response = stack.generation("pipelined").Generate(request, timeout=30)
    port = stack.metrics_ports["pipelined"]
    text = urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("hydrajury_drafts_ahead")
    }
    assert values["hydrajury_drafts_ahead_total"] >= response.stats.drafts_ahead > 0
    assert values["hydrajury_drafts_ahead_used_total"] >= response.stats.drafts_ahead_used


def test_pipelining_is_a_flag_and_a_setting_and_checked():
    assert build_parser().parse_args(["--pipeline-rounds"]).pipeline_rounds is True
    assert build_parser().parse_args(["--no-pipeline-rounds"]).pipeline_rounds is False
    assert OrchestratorConfig.load(None, {**REQUIRED, "pipeline_rounds": True}).pipeline_rounds
    assert OrchestratorConfig.load(None, REQUIRED).pipeline_rounds is False
    with pytest.raises(ConfigFileError, match="pipeline_rounds must be true or false"):
        OrchestratorConfig.load(None, {**REQUIRED, "pipeline_rounds": "yes please"})
