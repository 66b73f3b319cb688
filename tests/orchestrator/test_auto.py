"""The automatic mode: the choice from costs and acceptance, and — end to end — output
equal to non-speculative PoE whatever it chooses."""

from __future__ import annotations

import itertools

import pytest

from hydra_jury.orchestrator.auto import (
    COST_DECAY,
    EXPLORE_BACKOFF,
    EXPLORE_EVERY,
    AutoState,
    Choice,
    CostModel,
    expected_tokens,
    load_level,
)
from hydra_jury.orchestrator.engine import Engine
from hydra_jury.orchestrator.local_backend import LocalBackend
from hydra_jury.orchestrator.request import DrafterKind, GenerationRequest
from hydra_jury.serving.batcher import BatchLimits
from hydra_jury.serving.cost_line import LinearCost
from hydra_jury.serving.model_thread import ModelThread
from hydra_jury.workers.sessions import SessionLimits
from tests.orchestrator.test_engine import REPEATING


def test_a_line_is_fitted_to_round_costs():
    cost = LinearCost(decay=1.0)
    for positions in (1, 2, 3, 5, 9):
        cost.observe(positions, 0.02 + 0.003 * positions)
    fixed, slope = cost.line()
    assert fixed == pytest.approx(0.02) and slope == pytest.approx(0.003)
    one_size = LinearCost()
    one_size.observe(4, 1.0)
    assert one_size.line() is None and one_size.mean() == 1.0


def measured(verify=(0.05, 0.001), head=(0.02, 0.03), running: int = 1) -> CostModel:
    """Costs as if measured with `running` requests running (left running): a one-pass
    round 50 ms + 1 ms per position, a head round 20 ms + 30 ms per draft token."""
    costs = CostModel()
    for _ in range(running):
        costs.started()
    for positions in range(1, 9):
        costs.observe(DrafterKind.NGRAM, positions, verify[0] + verify[1] * positions)
        costs.observe("head", positions, head[0] + head[1] * positions)
    return costs


def test_expected_tokens():
    assert expected_tokens(0.0, 4, bonus=True) == 1
    assert expected_tokens(0.5, 1, bonus=True) == pytest.approx(1.5)
    assert expected_tokens(0.5, 2, bonus=False) == pytest.approx(1.5)


def test_the_choice_follows_costs_and_acceptance():
    costs, state = measured(), AutoState()
    # Cheap extra positions and a fair acceptance (0.5, the prior after a three-token
    # match): draft, but not all 6 on offer — the 5th and later would almost never be
    # reached.
    offer = {"ngram_drafts": 6, "head_cap": 0, "greedy": False, "ngram_match": 3}
    assert state.choose(costs, **offer) == Choice("ngram", 4, match=3)
    # Nothing on offer: a plain step.
    assert state.choose(costs, ngram_drafts=0, head_cap=0, greedy=False) == Choice("none", 0)
    # Drafts that keep being rejected: it stops drafting (re-decided as acceptance falls).
    expensive = measured(verify=(0.05, 0.04))
    for _ in range(30):
        state.observe(costs, Choice("ngram", 4, match=3), reached=1, kept=0)
    assert state.choose(expensive, **offer) == Choice("none", 0)
    # Head drafts only under greedy decoding, and only when they pay.
    cheap_heads = measured(head=(0.01, 0.002))
    greedy_state = AutoState()
    for _ in range(30):
        greedy_state.observe(cheap_heads, Choice("head", 4), reached=4, kept=4)
    cheap_heads.rounds = 1  # between two measuring rounds: chosen on merit
    assert greedy_state.choose(cheap_heads, 0, head_cap=8, greedy=True).drafter == "head"
    assert greedy_state.choose(cheap_heads, 0, head_cap=8, greedy=False).drafter == "none"


def test_prompt_lookup_drafts_are_judged_by_the_length_of_their_match():
    """A one-token match drafts far worse than a three-token one: its acceptance is its
    own, and where an extra verified position costs half a plain step (under load) only
    the longer match is drafted from."""
    costs, state = measured(verify=(0.05, 0.025)), AutoState()
    costs.rounds = 1  # between two measuring rounds: chosen on merit
    # The priors: 0.15 a position after a one-token match, 0.5 after three tokens.
    assert state.choose(costs, 3, head_cap=0, greedy=False, ngram_match=1) == Choice("none", 0)
    assert state.choose(costs, 3, 0, False, ngram_match=3) == Choice("ngram", 1, match=3)
    # Rounds after three-token matches that keep nothing count to those alone.
    for _ in range(10):
        state.observe(costs, Choice("ngram", 1, match=3), reached=1, kept=0)
    assert state.acceptance["ngram3"].rate < 0.05
    assert state.acceptance["ngram1"].rate == pytest.approx(0.15)
    assert costs.acceptance["ngram3"].rate < 0.1 and costs.acceptance["ngram2"].rate == 0.4
    costs.rounds = 1
    assert state.choose(costs, 3, 0, False, ngram_match=3) == Choice("none", 0)
    # Alone, where a position costs little, even a one-token match pays.
    alone = measured(verify=(0.05, 0.001))
    alone.rounds = 1
    assert state.choose(alone, 3, 0, False, ngram_match=1).drafter == "ngram"


def test_a_new_request_starts_from_the_pooled_acceptance():
    costs = measured()
    for _ in range(50):
        AutoState().observe(costs, Choice("head", 8), reached=8, kept=8)
    fresh = AutoState.starting(costs)
    assert fresh.acceptance["head"].rate > 0.95  # not the 0.7 prior
    assert fresh.acceptance["head"].reached == pytest.approx(2.0)  # at the prior's weight
    assert fresh.acceptance["ngram1"].rate == pytest.approx(0.15)  # nothing seen yet


def test_each_kind_of_round_is_measured_first_and_now_and_then():
    """One-pass rounds first (every other cost is predicted against them), then head and
    draft-model rounds; then each again once every 16 rounds of the engine's requests
    together, however it is predicted: under load, measuring costs no more than alone."""
    costs, state = CostModel(), AutoState()
    assert state.choose(costs, 3, head_cap=4, greedy=True, model_cap=4) == Choice("ngram", 3)
    assert state.choose(costs, 0, head_cap=4, greedy=True, model_cap=4) == Choice("none", 0)
    costs.observe(DrafterKind.NGRAM, 1, 0.05)
    # A plain step is one size: a one-pass round with drafts is the second.
    assert state.choose(costs, 3, head_cap=4, greedy=True, model_cap=4) == Choice("ngram", 3)
    costs.observe(DrafterKind.NGRAM, 4, 0.06)
    assert state.choose(costs, 3, head_cap=4, greedy=True, model_cap=4) == Choice("head", 4)
    costs.observe("head", 4, 0.2)
    assert state.choose(costs, 3, head_cap=4, greedy=True, model_cap=4) == Choice("model", 4)
    # Far too slow to be chosen on merit: head and draft-model rounds; one-pass rounds
    # that never keep a draft.
    costs = measured(verify=(1.0, 1.0), head=(10.0, 10.0))
    for size in (2, 4):
        costs.observe("model", size, 10.0 * size)
    state = AutoState()
    for _ in range(30):
        state.observe(costs, Choice("ngram", 3), reached=1, kept=0)
    assert costs.rounds == 30  # every request's rounds count
    costs.rounds = 1
    assert state.choose(costs, 3, head_cap=4, greedy=True, model_cap=4) == Choice("none", 0)
    other = AutoState.starting(costs)  # another request of the same engine
    for round_, expected in (
        (4, Choice("ngram", 3)),
        (5, Choice("none", 0)),  # measured in this period already, by the other request
        (8, Choice("head", 4)),
        (12, Choice("model", 4)),
        (20, Choice("none", 0)),  # not chosen on merit since: the next period is longer
    ):
        costs.rounds = round_
        assert state.choose(costs, 3, head_cap=4, greedy=True, model_cap=4) == expected
        if round_ == 4:
            assert other.choose(costs, 3, head_cap=4, greedy=True, model_cap=4) == Choice("none", 0)
    # A request with no n-gram drafts on offer leaves the measuring round to one with some
    # (32 rounds after the last).
    costs.rounds = 36
    assert state.choose(costs, 0, head_cap=0, greedy=False) == Choice("none", 0)
    assert other.choose(costs, 3, head_cap=0, greedy=False) == Choice("ngram", 3)


def test_the_engine_measures_as_often_whatever_the_number_of_requests():
    """Four requests running: the period is 4 x 16 of their rounds together (the wait after
    the first is two periods: that measurement found drafts that do not pay)."""
    costs = measured(verify=(1.0, 1.0), running=4)
    requests = [AutoState() for _ in range(4)]
    for request in requests:
        for _ in range(30):
            request.observe(costs, Choice("ngram", 3), reached=1, kept=0)  # never kept

    def rounds(count: int) -> None:
        for _ in range(count):
            for request in requests:
                request.observe(costs, Choice("none", 0), reached=0, kept=0)

    rounds(16)
    # Measuring with 1 / 4 of the drafts on offer (see the next test).
    assert requests[0].choose(costs, 8, head_cap=0, greedy=False) == Choice("ngram", 2)
    rounds(31)  # 124 rounds since
    assert [r.choose(costs, 8, head_cap=0, greedy=False) for r in requests] == [
        Choice("none", 0)
    ] * 4
    rounds(1)  # 128
    assert requests[2].choose(costs, 8, head_cap=0, greedy=False) == Choice("ngram", 2)


def test_under_load_a_measuring_round_checks_fewer_drafts():
    """A measuring round checks every draft on offer for a request alone and 1 / n of
    them (at least one) with n running: its positions join a batch every other session
    waits for. Head and draft-model rounds are measured the same way."""
    costs = measured(verify=(1.0, 1.0), head=(1.0, 1.0))  # drafts never pay
    alone = AutoState()
    for _ in range(16):
        alone.observe(costs, Choice("none", 0), reached=0, kept=0)
    assert alone.choose(costs, 6, head_cap=0, greedy=False) == Choice("ngram", 6)
    costs = measured(verify=(1.0, 1.0), head=(1.0, 1.0), running=8)
    crowd = [AutoState() for _ in range(8)]
    for _ in range(16 * 8):
        for request in crowd:
            request.observe(costs, Choice("none", 0), reached=0, kept=0)
    assert crowd[0].choose(costs, 6, head_cap=0, greedy=False) == Choice("ngram", 1)
    assert costs.measured_drafts(16) == 2 and costs.measured_drafts(3) == 1
    # Greedy, with head drafts on offer, a period later:
    for _ in range(16 * 8):
        for request in crowd:
            request.observe(costs, Choice("none", 0), reached=0, kept=0)
    assert crowd[1].choose(costs, 0, head_cap=8, greedy=True) == Choice("head", 1)


def test_a_kind_that_does_not_pay_is_measured_less_and_less_often():
    """Each measuring round not followed by a choice on merit doubles the wait, up to
    EXPLORE_BACKOFF periods; a choice on merit restores it."""
    costs = measured(verify=(1.0, 1.0))
    state = AutoState()

    def measuring_rounds(rounds: int) -> list[int]:
        """The rounds (from now) at which the one running request measures, its drafts
        never kept."""
        found = []
        for round_ in range(rounds):
            choice = state.choose(costs, 3, head_cap=0, greedy=False)
            if choice == Choice("ngram", 3):
                found.append(round_)
            state.observe(costs, choice, reached=1 if choice.drafts else 0, kept=0)
        return found

    def gaps(found: list[int]) -> list[int]:
        return [b - a for a, b in itertools.pairwise(found)]

    period = EXPLORE_EVERY  # one request running
    assert (
        gaps(measuring_rounds(1000))[:5]
        == [2 * period, 4 * period] + [EXPLORE_BACKOFF * period] * 3
    )
    # Its drafts kept for a while: chosen on merit, and measured at the full rate again.
    for _ in range(30):
        state.observe(costs, Choice("ngram", 3), reached=3, kept=3)
    assert state.choose(costs, 3, head_cap=0, greedy=False) == Choice("ngram", 3)
    for _ in range(40):  # and rejected again
        state.observe(costs, Choice("ngram", 3), reached=1, kept=0)
    assert gaps(measuring_rounds(300))[:2] == [2 * period, 4 * period]


def test_measuring_resumes_its_period_when_the_load_falls():
    """Backed off under a load of 4 requests, a kind is measured at the period again once
    one request runs alone: what was measured under the load is stale."""
    costs = measured(running=4)
    requests = [AutoState() for _ in range(4)]

    def rounds(count: int, running: list[AutoState]) -> None:
        for _ in range(count):
            for request in running:
                request.observe(costs, Choice("none", 0), reached=0, kept=0)

    rounds(16, requests)
    measured_at = []
    for _ in range(1000):
        if costs.explores(DrafterKind.NGRAM):
            measured_at.append(costs.rounds)
        if len(measured_at) == 3:
            break
        rounds(1, requests)
    period = EXPLORE_EVERY * 4
    assert [b - a for a, b in itertools.pairwise(measured_at)] == [2 * period, 4 * period]
    # Backed off to EXPLORE_BACKOFF periods of 4 requests; three of them end, and the
    # one left measures after a period of its own:
    for _ in range(3):
        costs.ended()
    rounds(EXPLORE_EVERY, requests[:1])
    assert costs.explores(DrafterKind.NGRAM)


def test_costs_are_kept_per_load():
    """Under 8 requests a round is not priced by the rounds measured alone: a load met for
    the first time measures its one-pass rounds at two sizes before it drafts from them,
    and a load met before prices by its own line at once."""
    levels = [load_level(n) for n in (1, 2, 3, 4, 5, 7, 8, 11, 15, 16, 22)]
    assert levels == [0, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]  # a count dipping by one stays
    costs, state = measured(verify=(0.05, 0.001)), AutoState()  # alone a position is cheap
    for _ in range(30):
        state.observe(costs, Choice("ngram", 3, match=3), reached=3, kept=2)
    costs.rounds = 1  # between two measuring rounds: chosen on merit
    offer = {"ngram_drafts": 6, "head_cap": 0, "greedy": False, "ngram_match": 3}
    alone = state.choose(costs, **offer)
    assert alone.drafter == "ngram" and alone.drafts > 2
    for _ in range(7):
        costs.started()
    # Nothing measured under 8 yet: a measuring round of 6 // 8 -> 1 draft.
    assert state.choose(costs, **offer) == Choice("ngram", 1, match=3)
    for _ in range(10):
        costs.observe(DrafterKind.NGRAM, 1, 0.01)  # a plain step's share of 8-row batches
    assert state.choose(costs, **offer) == Choice("ngram", 1, match=3)  # one size only
    costs.observe(DrafterKind.NGRAM, 2, 0.018)  # a position at 0.8 of a plain step
    assert state.choose(costs, **offer) == Choice("none", 0)
    for _ in range(7):
        costs.ended()
    assert state.choose(costs, **offer) == alone  # alone again: its line is still there


def test_the_engine_counts_the_requests_running(engine):
    """Every request of the engine counts to the load while its rounds run, whatever its
    mode; one given up part way (its generation closed) stops counting."""
    first = engine.start(request(REPEATING[0], rule="verifier_only"))
    assert engine.costs.active == 0  # not running until its first round is asked for
    next(iter(first))
    assert engine.costs.active == 1
    second = engine.start(request(REPEATING[1]))
    next(iter(second))
    assert engine.costs.active == 2
    for _ in second:
        pass
    assert engine.costs.active == 1
    first.close()
    assert engine.costs.active == 0


def test_the_cost_lines_remember_as_many_rounds_of_each_request_under_load():
    """With n requests running, a line forgets at COST_DECAY per round of each: the
    rounds it remembers of each request are as many as of one alone, so under load a
    slope is not fitted over the last two or three rounds of every session."""

    def after_a_change(requests: int) -> float:
        """A one-pass position's predicted cost after each request's 10 rounds at a
        new price (20 ms a position instead of 10), the plain steps' unchanged."""
        costs, states = CostModel(), [AutoState() for _ in range(requests)]
        for _ in states:
            costs.started()
        for price, rounds in ((0.01, 60), (0.02, 10)):
            for index in range(rounds * requests):
                state = states[index % requests]
                positions = 1 + index % 2  # plain steps and one-draft checks in turn
                costs.observe(DrafterKind.NGRAM, positions, 0.05 + price * (positions - 1))
                state.observe(costs, Choice("none", 0), reached=0, kept=0)
        return costs.predict(DrafterKind.NGRAM, 2) - costs.predict(DrafterKind.NGRAM, 1)

    alone = after_a_change(1)
    assert 0.01 < alone < 0.02  # half way or so: the older rounds still weigh
    assert after_a_change(8) == pytest.approx(alone, rel=0.05)
    assert COST_DECAY ** (1 / 8) > 0.99  # 8 requests: each round decays the rest less


class FixedCosts(CostModel):
    """Measured costs that stop changing: the choices then depend on acceptance only, and
    a test run is repeatable (live timings would make each run choose a little
    differently)."""

    def __init__(self, costs: CostModel) -> None:
        super().__init__()
        self.levels = costs.levels

    def observe(self, kind: str, positions: int, seconds: float) -> None:
        return None


def use_costs(engine: Engine, costs: CostModel) -> None:
    """The engine's requests start from and choose by `costs`."""
    engine.costs = engine.rounds.costs = costs


def request(prompt: str, **options) -> GenerationRequest:
    values = {"max_new_tokens": 48, "ignore_eos": True, "seed": 9, **options}
    return GenerationRequest(prompt=prompt, **values)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("prompt", REPEATING)
@pytest.mark.parametrize(
    "costs",
    [measured(), measured(verify=(0.05, 0.02), head=(0.01, 0.005))],
    ids=["drafting-pays", "heads-are-cheap"],
)
def test_auto_gives_the_non_speculative_tokens(engine, prompt, temperature, costs):
    """Whatever it picks per round, the automatic mode (the default) gives the tokens of
    non-speculative PoE over every head: greedy by argmax, sampled by the coupling. (Up
    to rounding: rows computed in batches of other shapes can flip a near tie.)"""
    reference = engine.generate(request(prompt, rule="verifier_only", temperature=temperature))
    use_costs(engine, FixedCosts(costs))
    output = engine.generate(request(prompt, temperature=temperature))
    assert output.token_ids == reference.token_ids
    assert output.jury == ["head0", "head1", "head2", "head3"]
    chosen = output.stats["rounds_by_drafter"]
    if temperature:
        assert "head" not in chosen  # no head drafts under sampling
        assert chosen.get("ngram", 0) > 0, chosen  # the repeating prompts offer drafts
    inputs = output.stats["auto_inputs"]
    assert 0 < inputs["ngram1_acceptance"] < 1 and inputs["plain_step_s"] > 0
    assert output.stats["drafted"] > 0  # it did speculate


class NeverExplores(FixedCosts):
    def explores(self, kind: DrafterKind) -> bool:
        return False


def test_a_plain_step_is_sent_before_its_round_is_counted(jury_model, tokenizer):
    """Batched (`serve`), the automatic mode sends a plain round's next step as soon as
    its token is drawn, and counts the round (its cost, its acceptance) after: the
    bookkeeping runs while the step joins the other sessions' batch, not between the
    token and the call."""
    thread = ModelThread("test-model")
    backend = LocalBackend(
        jury_model, limits=SessionLimits(2, 128), thread=thread, batching=BatchLimits()
    )
    engine = Engine(backend, tokenizer)
    use_costs(engine, NeverExplores(measured(verify=(0.001, 1.0))))  # drafts never pay
    counted_when_sent = []
    send = backend.draft_ahead

    def draft_ahead(call):
        counted_when_sent.append((call.start, engine.costs.rounds))
        return send(call)

    backend.draft_ahead = draft_ahead
    try:
        output = engine.generate(request("Count the sheep.", max_new_tokens=5, temperature=0.8))
    finally:
        backend.close()
    assert output.stats["rounds_by_drafter"] == {"none": 5}
    # The step after round r (r = 1..4) went before round r was counted.
    starts = [start for start, _ in counted_when_sent]
    assert [rounds for _, rounds in counted_when_sent] == list(range(4))
    assert starts == list(range(starts[0], starts[0] + 4))


@pytest.mark.parametrize("prompt", REPEATING[:2])
def test_a_prompt_lookup_check_goes_ahead_as_a_plain_step_does(jury_model, tokenizer, prompt):
    """Batched (`serve`), the next round's trunk call goes as soon as this round's tokens
    are known when it is a plain step or a one-pass check of prompt-lookup drafts (both
    known by then), and that round uses it: every round but the first. The tokens stay
    non-speculative PoE's."""
    limits = SessionLimits(2, 128)
    reference = Engine(LocalBackend(jury_model, limits=limits), tokenizer).generate(
        request(prompt, rule="verifier_only", temperature=0.9)
    )
    thread = ModelThread("test-model")
    backend = LocalBackend(jury_model, limits=limits, thread=thread, batching=BatchLimits())
    engine = Engine(backend, tokenizer)
    use_costs(engine, NeverExplores(measured()))  # drafts pay
    sent, used = [], []
    send, count_ahead = backend.draft_ahead, backend.count_ahead
    backend.draft_ahead = lambda call: sent.append(call) or send(call)
    backend.count_ahead = lambda share: used.append(share) or count_ahead(share)
    try:
        output = engine.generate(request(prompt, temperature=0.9))
    finally:
        backend.close()
    assert output.token_ids == reference.token_ids
    assert output.stats["rounds_by_drafter"]["ngram"] > 0
    assert any(call.outside_drafts for call in sent)
    assert len(sent) == len(used) == output.stats["rounds"] - 1
