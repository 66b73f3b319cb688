import math

import pytest
import torch

from hydra_jury.poe.filters import NUCLEUS_START, SamplingParams, filter_logprobs
from hydra_jury.poe.leading import FULL_SORT_SHARE, leading

PROBS = torch.tensor([[0.5, 0.3, 0.15, 0.05]])


def filtered_probs(probs: torch.Tensor, **options) -> torch.Tensor:
    return filter_logprobs(probs.log(), SamplingParams(**options)).exp()


def assert_probs(actual: torch.Tensor, expected: list[float]) -> None:
    # Hand-computed values; float32 renormalisation is exact to ~1e-7.
    torch.testing.assert_close(actual, torch.tensor([expected]), atol=1e-6, rtol=0)


def test_all_off_is_identity():
    logprobs = PROBS.log()
    assert torch.equal(filter_logprobs(logprobs, SamplingParams()), logprobs)


def test_top_k_keeps_the_k_most_probable():
    assert_probs(filtered_probs(PROBS, top_k=2), [0.625, 0.375, 0.0, 0.0])
    assert torch.equal(filtered_probs(PROBS, top_k=4), PROBS.log().exp())


def test_top_k_ties_keep_exactly_k_lowest_ids():
    probs = torch.tensor([[0.2, 0.4, 0.2, 0.2]])
    assert_probs(filtered_probs(probs, top_k=2), [1 / 3, 2 / 3, 0.0, 0.0])


def test_top_p_keeps_smallest_set_reaching_the_mass():
    assert_probs(filtered_probs(PROBS, top_p=0.75), [0.625, 0.375, 0.0, 0.0])
    assert_probs(filtered_probs(PROBS, top_p=0.9), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])


def test_top_p_always_keeps_the_top_token():
    assert_probs(filtered_probs(PROBS, top_p=1e-9), [1.0, 0.0, 0.0, 0.0])


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    assert_probs(filtered_probs(PROBS, min_p=0.2), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])
    assert_probs(filtered_probs(PROBS, min_p=0.59), [0.625, 0.375, 0.0, 0.0])


def test_top_p_is_measured_after_top_k():
    # After top-k=3 the masses are 0.526, 0.842: top-p 0.82 stops at two tokens. On the
    # unfiltered masses (0.5, 0.8) it would have kept three.
    assert_probs(filtered_probs(PROBS, top_k=3, top_p=0.82), [0.625, 0.375, 0.0, 0.0])


def test_epsilon_drops_tokens_below_an_absolute_floor():
    assert_probs(filtered_probs(PROBS, epsilon=0.1), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])
    assert_probs(filtered_probs(PROBS, epsilon=0.2), [0.625, 0.375, 0.0, 0.0])
    # Measured on what top-k left: 0.3 / 0.8 = 0.375 < 0.4.
    assert_probs(filtered_probs(PROBS, top_k=2, epsilon=0.4), [1.0, 0.0, 0.0, 0.0])
    # The most probable token is kept whatever the floor.
    assert_probs(filtered_probs(PROBS, epsilon=0.9), [1.0, 0.0, 0.0, 0.0])


def test_dropped_entries_are_minus_infinity_and_rows_normalised(make_logits):
    logprobs = make_logits(6, 30, seed=5, scale=2.0).log_softmax(-1)
    result = filter_logprobs(logprobs, SamplingParams(top_k=10, top_p=0.8, min_p=0.05))
    assert ((result == -math.inf) | torch.isfinite(result)).all()
    assert (result == -math.inf).any()
    torch.testing.assert_close(result.exp().sum(-1), torch.ones(6))


@pytest.mark.parametrize(
    ("vocab", "options"),
    [
        (30, {"top_k": 12, "top_p": 0.85, "min_p": 0.01}),
        (4096, {"top_k": 12, "top_p": 0.85, "min_p": 0.01}),
        (4096, {"top_p": 0.85}),
        (4096, {"min_p": 0.01}),
        (4096, {"epsilon": 1e-4}),
    ],
)
def test_rows_are_filtered_independently(make_logits, vocab, options):
    # The engine filters the draft and the target with the same call: filtering them
    # stacked gives the same bits as filtering each, whatever their shapes of
    # distribution. With 4,096 tokens the filters look at the leading tokens alone, and
    # without top-k the flat target needs many more of them than the sharp draft.
    draft = make_logits(3, vocab, seed=6, scale=3.0).log_softmax(-1)
    target = make_logits(3, vocab, seed=7, scale=0.5).log_softmax(-1)
    params = SamplingParams(temperature=0.7, **options)
    stacked = filter_logprobs(torch.cat([draft, target]), params)
    assert torch.equal(stacked[:3], filter_logprobs(draft, params))
    assert torch.equal(stacked[3:], filter_logprobs(target, params))
    assert torch.equal(stacked[1:2], filter_logprobs(draft[1:2], params))


def test_greedy_property():
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams().greedy


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 5}, "top_k must be at most the vocabulary size 4"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.0}, "min_p"),
        ({"epsilon": -0.1}, "epsilon"),
        ({"epsilon": 1.0}, r"epsilon must be in \[0, 1\)"),
    ],
)
def test_validate_names_the_bad_option(options, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**options).validate(vocab_size=4)
    with pytest.raises(ValueError, match=message):
        filter_logprobs(PROBS.log(), SamplingParams(**options))


def test_validate_accepts_the_defaults_and_bounds():
    SamplingParams().validate(vocab_size=4)
    SamplingParams(temperature=0.0, top_k=4, top_p=1.0, min_p=0.0).validate(vocab_size=4)
    SamplingParams(top_k=10**6).validate()  # no vocabulary known yet


# Large enough that the filters sort only the leading tokens (below an eighth of the row).
VOCAB = 4096


def tied_logprobs(rows: int, seed: int) -> torch.Tensor:
    """Log-probabilities on a coarse grid: long runs of equal values at every rank."""
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, VOCAB, generator=generator) * 8).round() / 4
    return logits.log_softmax(-1)


@pytest.mark.parametrize("count", [1, 7, 40, 129, VOCAB // FULL_SORT_SHARE + 1])
def test_the_leading_tokens_are_a_stable_sort_s_first(make_logits, count):
    """Values and ids as a stable descending sort of the whole row orders them (equal
    values in token-id order), also where equal values straddle the count-th."""
    for logprobs in (tied_logprobs(4, seed=count), make_logits(4, VOCAB, seed=count)):
        values, ids = leading(logprobs, count)
        expected = torch.sort(logprobs, dim=-1, descending=True, stable=True)
        assert torch.equal(values, expected.values[:, :count])
        assert torch.equal(ids, expected.indices[:, :count])


def reference_kept(logprobs: torch.Tensor, params: SamplingParams) -> list[set[int]]:
    """The filters' definition on one stable sort of the whole row (float64 masses): the
    ids each row keeps, and the mass before each rank and the renormalised probabilities
    of what the filters before a stage left, for choosing thresholds between ranks."""
    values, order = torch.sort(logprobs.double(), dim=-1, descending=True, stable=True)
    ranks = torch.arange(logprobs.shape[1])
    keep = torch.ones_like(values, dtype=torch.bool)

    def renormalised():
        return torch.softmax(values.masked_fill(~keep, -math.inf), dim=-1)

    if 0 < params.top_k < logprobs.shape[1]:
        keep &= ranks < params.top_k
    if params.top_p < 1:
        probs = renormalised()
        keep &= (torch.cumsum(probs, -1) - probs < params.top_p) | (ranks == 0)
    if params.min_p > 0:
        keep &= values >= values[:, :1] + math.log(params.min_p)
    if params.epsilon > 0:
        keep &= (renormalised() >= params.epsilon) | (ranks == 0)
    return [set(order[row][keep[row]].tolist()) for row in range(len(values))]


def spaced_logprobs(seed: int, scale: float) -> torch.Tensor:
    """[1, VOCAB]: random logits of spread `scale`, no two closer than 1e-3 (probabilities
    apart by 0.1% at least), in a random order of token ids."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.sort(torch.randn(VOCAB, generator=generator) * scale).values
    logits = logits + torch.arange(VOCAB) * 1e-3
    return logits[torch.randperm(VOCAB, generator=generator)].log_softmax(-1)[None]


def midway(low: float, high: float) -> float:
    """A threshold halfway between two quantities of a row, apart by far more than the
    rounding of either computation (float32 inputs): both sides of it agree by
    construction."""
    assert high - low > 1e-5 * abs(high)
    return (low + high) / 2


def top_p_keeping(probs: torch.Tensor, rank: int) -> float:
    """Top-p keeping `rank` tokens of the descending probabilities `probs` (renormalised)."""
    mass = torch.cumsum(probs / probs.sum(), 0)
    return midway(float(mass[rank - 2]), float(mass[rank - 1]))


def min_p_keeping(probs: torch.Tensor, rank: int) -> float:
    return midway(float(probs[rank] / probs[0]), float(probs[rank - 1] / probs[0]))


def epsilon_keeping(probs: torch.Tensor, rank: int) -> float:
    probs = probs / probs.sum()
    return midway(float(probs[rank]), float(probs[rank - 1]))


@pytest.mark.parametrize(
    ("scale", "rank"),
    [(3.0, 5), (1.5, 60), (0.6, 300), (0.3, 700)],  # 300 and 700: top-p looks further
)
@pytest.mark.parametrize("combination", ["top_p", "min_p", "epsilon", "top_k+top_p", "all"])
def test_the_filters_keep_what_one_sort_of_the_whole_row_keeps(scale, rank, combination):
    """Each filter alone and with the others (each then dropping some of what the ones
    before it left), its threshold halfway between two ranks, from the leading tokens
    alone: the `rank` tokens the definition keeps on the whole sorted row, renormalised."""
    logprobs = spaced_logprobs(rank, scale)
    probs = torch.sort(logprobs[0].double().exp(), descending=True).values
    params = {
        "top_p": SamplingParams(top_p=top_p_keeping(probs, rank)),
        "min_p": SamplingParams(min_p=min_p_keeping(probs, rank)),
        "epsilon": SamplingParams(epsilon=epsilon_keeping(probs, rank)),
        "top_k+top_p": SamplingParams(top_k=2 * rank, top_p=top_p_keeping(probs[: 2 * rank], rank)),
        "all": SamplingParams(
            top_k=rank + 3,
            top_p=top_p_keeping(probs[: rank + 3], rank + 2),
            min_p=min_p_keeping(probs, rank + 1),
            epsilon=epsilon_keeping(probs[: rank + 1], rank),
        ),
    }[combination]
    filtered = filter_logprobs(logprobs, params)
    kept = set(torch.nonzero(filtered[0] > -math.inf).flatten().tolist())
    assert len(kept) == rank
    assert kept == reference_kept(logprobs, params)[0]
    ids = sorted(kept)
    torch.testing.assert_close(filtered[0, ids], logprobs[0, ids].log_softmax(-1))


def test_top_p_looks_past_the_first_leading_tokens_where_the_nucleus_is_wide():
    """A flat row's nucleus is wider than the first look (`NUCLEUS_START` tokens)."""
    logprobs = spaced_logprobs(3, scale=0.3)
    kept = filter_logprobs(logprobs, SamplingParams(top_p=0.9)) > -math.inf
    assert int(kept.sum()) > NUCLEUS_START
    assert (
        set(torch.nonzero(kept[0]).flatten().tolist())
        == reference_kept(logprobs, SamplingParams(top_p=0.9))[0]
    )


def test_top_k_breaks_ties_by_token_id_among_the_leading_tokens():
    """Equal values straddling the k-th: the lowest ids of them are kept."""
    logprobs = torch.full((1, VOCAB), -20.0)
    logprobs[0, [900, 17, 2500]] = -1.0  # the three most probable
    tied = [3000, 41, 1999, 5, 777, 4095, 60]  # seven equal values, ranks 3 to 9
    logprobs[0, tied] = -2.0
    filtered = filter_logprobs(logprobs.log_softmax(-1), SamplingParams(top_k=6))
    kept = set(torch.nonzero(filtered[0] > -math.inf).flatten().tolist())
    assert kept == {900, 17, 2500, 5, 41, 60}
