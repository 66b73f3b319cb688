"""The stack on a GPU: the same exactness guarantees as on the CPU, the same seeded
tokens as the CPU's float32 where the distributions agree, and the split stack on the
device giving `serve`'s tokens.

Tolerance, and why float32: a GPU's products are not batch-invariant bit for bit (cuBLAS
picks its kernel by shape, so a row's sum can be ordered differently alone and batched),
so equality of tokens is asserted where the maths makes them equal *and* the runs'
margins are far above float32's rounding: every test that compares greedy tokens first
checks that no step was a near-tie (top-two probability gap over `NEAR_TIE`), so a
failure is a wrong result, never a rounding coin flip. The checkpoints' logits are
scaled up (`build_jury_checkpoint`), which keeps the margins wide by construction.
"""

from __future__ import annotations

import pytest
import torch

from hydra_jury.hydra_model import DraftModel, HydraModel, Segment
from hydra_jury.hydra_model.graphs import MODE_VARIABLE
from hydra_jury.orchestrator.engine import Engine
from hydra_jury.orchestrator.local_backend import LocalBackend
from hydra_jury.orchestrator.request import GenerationRequest
from hydra_jury.workers.calls import HiddenStates, ScoreResult, to_host
from hydra_jury.workers.sessions import SessionLimits
from tests.engine_sampling import first_two_tokens
from tests.grpc_stack import Stack
from tests.hydra_model.test_decode_graph import greedy_logits
from tests.models import build_draft_checkpoint, build_jury_checkpoint
from tests.orchestrator.test_engine_distribution import (
    BETA,
    DRAFT_HEAD,
    JURY,
    PROMPT,
    SMALL_JURY,
    TOP_K,
    TOP_K_TEMPERATURE,
    joint_distribution,
    top_k_targets,
)
from tests.orchestrator.test_grpc_stack import to_pb
from tests.statistics import assert_fits
from tests.workers.test_static_steps import REQUESTS, generate

pytestmark = pytest.mark.gpu

# float32 on a GPU differs from another order of the same sums by about 1e-6 of a
# probability; a gap this wide cannot be closed by rounding.
NEAR_TIE = 1e-3
GREEDY = {"temperature": 0.0, "max_new_tokens": 32, "ignore_eos": True}


def assert_no_near_ties(result) -> None:
    margins = [record.stability_margin for record in result.tokens]
    assert min(margins) > NEAR_TIE, f"a near-tie decided a token (margins {margins})"


def test_bfloat16_is_the_default_on_cuda(gpu_device, jury_checkpoint):
    model = HydraModel.load(jury_checkpoint, device=gpu_device)
    expected = torch.bfloat16 if model.device.type == "cuda" else torch.float32
    assert model.dtype == expected
    assert model.device.index is not None or model.device.type == "cpu"  # "cuda" -> "cuda:0"
    assert all(t.device == model.device for t in model.heads.tensors())


@pytest.mark.parametrize("drafter", ["head", "model", "ngram"])
def test_greedy_speculative_gives_the_non_speculative_tokens(device_engine, drafter):
    plain = device_engine.generate(
        GenerationRequest(prompt="the cat", rule="verifier_only", jury=JURY, **GREEDY)
    )
    assert_no_near_ties(plain)
    drafting = {"drafter": drafter, "draft_head": DRAFT_HEAD if drafter == "head" else None}
    speculative = device_engine.generate(
        GenerationRequest(prompt="the cat", rule="exact", gamma=4, jury=JURY, **drafting, **GREEDY)
    )
    assert speculative.token_ids == plain.token_ids
    assert speculative.stats["drafted"] > 0


SEEDED = [
    {"rule": "exact", "temperature": 0.9, "gamma": 4, "top_k": 10, "drafter": "head"},
    {"rule": "exact", "temperature": 0.9, "gamma": 3, "top_p": 0.9, "drafter": "model"},
    {"rule": "verifier_only", "temperature": 0.8},
    # (A drafter named: the automatic one chooses by measured costs, which differ by run.)
    {
        "rule": "cascade_token_v2",
        "lenience": 0.2,
        "temperature": 1.0,
        "gamma": 2,
        "drafter": "head",
    },
]


@pytest.mark.parametrize("case", SEEDED, ids=[c["rule"] for c in SEEDED])
def test_seeded_tokens_agree_with_the_cpu_in_float32(device_engine, jury_model, draft_model, case):
    """The counter-based draws are made on the host from (seed, position, purpose), so a
    device changes no uniform; with float32 distributions that agree to rounding, the
    seeded tokens are the CPU's."""
    cpu_engine = Engine(
        LocalBackend(jury_model, draft_model=draft_model, limits=SessionLimits(2, 128)),
        jury_model.load_tokenizer(),
    )
    options = {"prompt": "the cat", "max_new_tokens": 24, "ignore_eos": True, "seed": 11, **case}
    on_cpu = cpu_engine.generate(GenerationRequest(**options))
    on_device = device_engine.generate(GenerationRequest(**options))
    assert on_device.token_ids == on_cpu.token_ids
    assert on_device.stats["accepted"] == on_cpu.stats["accepted"]


def test_a_ragged_batch_gives_each_session_its_lone_logits(device_model):
    """Three sessions' positions in one forward (a prefill, a decode step, a round's
    verify) against each alone: the same logits to float32 rounding, the same argmax."""
    model = device_model
    lengths, starts = [5, 1, 4], [0, 3, 2]
    generator = torch.Generator().manual_seed(0)
    histories = [
        torch.randint(5, 32, (start + length,), generator=generator)
        for start, length in zip(starts, lengths, strict=True)
    ]

    def run(sessions: list[int]) -> list[torch.Tensor]:
        trunk_caches = [model.trunk_cache(16) for _ in sessions]
        head_caches = [model.head_cache(model.heads.size, 16) for _ in sessions]
        for index, trunk_cache, head_cache in zip(sessions, trunk_caches, head_caches, strict=True):
            prefix = histories[index][: starts[index]].to(model.device)
            if len(prefix):
                hidden = model.trunk.forward(prefix, trunk_cache, 0)
                model.heads.forward(hidden, head_cache, 0)
        tokens = torch.cat([histories[i][starts[i] :] for i in sessions]).to(model.device)

        def segments(caches):
            return [Segment(caches[k], starts[i], lengths[i]) for k, i in enumerate(sessions)]

        hidden = model.trunk.forward_ragged(tokens, segments(trunk_caches))
        logits = model.heads.forward_ragged(hidden, segments(head_caches))  # [S, N, V]
        return list(logits.split([lengths[i] for i in sessions], dim=1))

    batched = run([0, 1, 2])
    for index in range(3):
        (alone,) = run([index])
        torch.testing.assert_close(batched[index], alone, rtol=1e-4, atol=1e-4)
        top = alone.softmax(-1).topk(2, dim=-1).values
        clear = (top[..., 0] - top[..., 1]) > NEAR_TIE
        assert torch.equal(batched[index].argmax(-1)[clear], alone.argmax(-1)[clear])


def test_results_come_to_the_host_in_pinned_buffers(gpu_device):
    on_device = torch.randn(3, 40, device=gpu_device)
    hidden = HiddenStates(2, torch.randn(2, 64, device=gpu_device)).on_host()
    votes = torch.zeros(3, 2, dtype=torch.long, device=gpu_device)
    result = ScoreResult(on_device, None, votes, ("a", "b"))
    moved = result.on_host()
    for tensor in (hidden.payload, moved.log_product, moved.votes):
        assert tensor.device.type == "cpu"
        if torch.device(gpu_device).type == "cuda":
            assert tensor.is_pinned()
    assert torch.equal(moved.log_product, on_device.cpu())
    host = [torch.ones(2)]
    assert to_host(host) is host  # host tensors are not copied


CASES = [
    {"rule": "exact", "temperature": 0.0, "gamma": 3, "drafter": "head"},
    {"rule": "exact", "temperature": 0.9, "gamma": 4, "top_k": 10, "drafter": "head"},
    {"rule": "verifier_only", "temperature": 0.8},
    {"rule": "exact", "temperature": 0.9, "gamma": 3, "drafter": "model"},
]


@pytest.fixture(scope="module")
def device_stacks(gpu_device, jury_checkpoint, draft_checkpoint, redis_url):
    """On the device: the split stack (trunk service and two jury shards) and `serve`,
    each with the draft model, both in the device's default dtype."""
    draft = str(draft_checkpoint)
    shards = [["head0", "head1"], ["head2", "head3"]]
    split = Stack(str(jury_checkpoint), shards, redis_url, draft_model=draft, device=gpu_device)
    serve = Stack(str(jury_checkpoint), [], redis_url, draft_model=draft, device=gpu_device)
    split.start_services().start_orchestrator()
    serve.start_embedded()
    yield split, serve
    split.close()
    serve.close()


@pytest.mark.parametrize("case", CASES, ids=[c["rule"] + str(c["temperature"]) for c in CASES])
def test_the_split_stack_gives_the_tokens_of_serve(device_stacks, case):
    split, serve = device_stacks
    options = {"max_new_tokens": 24, "seed": 11, "ignore_eos": True, **case}
    expected = serve.generation().Generate(to_pb("the cat", **options), timeout=60)
    response = split.generation().Generate(to_pb("the cat", **options), timeout=60)
    assert list(response.token_ids) == list(expected.token_ids)
    assert response.stats.accepted == expected.stats.accepted


# A thousand seeded runs reject the wrong target (the draft's) by far (p < 1e-10) while
# an exact sampler passes with probability 1 − 1e-4 (`tests.statistics.assert_fits`).
DEVICE_RUNS = 1000


@pytest.fixture(scope="module")
def small_checkpoints(tmp_path_factory) -> tuple:
    """`test_engine_distribution`'s small jury and its draft model."""
    checkpoint = build_jury_checkpoint(tmp_path_factory.mktemp("gpu-small-jury"), **SMALL_JURY)
    return checkpoint, build_draft_checkpoint(checkpoint)


@pytest.mark.parametrize("drafter", ["head", "model"])
def test_the_exact_rule_samples_the_poe_target_on_the_device(
    gpu_device, small_checkpoints, drafter
):
    """Seeded runs on the device against the closed-form joint of the first two tokens,
    computed from the CPU's float32 forward passes (float32 rounding is far below what
    a thousand runs can see)."""
    checkpoint, draft_checkpoint = small_checkpoints
    reference = HydraModel.load(checkpoint)
    target, draft = top_k_targets(reference.head_names, TOP_K_TEMPERATURE, TOP_K)

    # The wrong target is the draft's: the draft model is built to give the draft head's
    # distribution (`test_engine_distribution` checks it), so one closed form serves both.
    tokens = reference.load_tokenizer().encode(PROMPT, add_special_tokens=False)
    joint, _ = joint_distribution(reference, tokens, target)
    wrong, _ = joint_distribution(reference, tokens, draft)

    model = HydraModel.load(checkpoint, dtype="float32", device=gpu_device)
    backend = LocalBackend(
        model,
        draft_model=DraftModel.load(draft_checkpoint, dtype="float32", device=gpu_device),
        limits=SessionLimits(1, 32),
    )
    engine = Engine(backend, model.load_tokenizer())
    drafting = (
        {"drafter": "model", "jury": JURY}
        if drafter == "model"
        else {"drafter": "head", "draft_head": DRAFT_HEAD}
    )
    options = dict(
        prompt=PROMPT,
        ignore_eos=True,
        beta=BETA,
        rule="exact",
        gamma=3,
        max_new_tokens=4,
        temperature=TOP_K_TEMPERATURE,
        top_k=TOP_K,
        **drafting,
    )
    vocab = model.config.vocab_size
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    for seed in range(DEVICE_RUNS):
        x1, x2 = first_two_tokens(engine, GenerationRequest(seed=seed, **options))
        counts[x1, x2] += 1
    assert_fits(counts, joint, wrong)


def test_the_cuda_graph_replays_the_eager_steps(device_model):
    """Token for token and to float32's rounding: the graph's replay against the ragged
    forward (another kernel per product: summation order only) and against the same
    fixed-shape step run eagerly (the same kernels)."""
    for head in range(device_model.heads.size):
        ragged, _ = greedy_logits(device_model, head, static=False)
        eager, _ = greedy_logits(device_model, head, static=True, graph=False)
        replayed, _ = greedy_logits(device_model, head, static=True)
        top = ragged.softmax(-1).topk(2, dim=-1).values
        assert ((top[..., 0] - top[..., 1]) > NEAR_TIE).all()
        torch.testing.assert_close(replayed, ragged, rtol=0, atol=1e-4)
        torch.testing.assert_close(replayed, eager, rtol=0, atol=1e-5)
        assert torch.equal(replayed.argmax(-1), ragged.argmax(-1))


@pytest.mark.parametrize("name", list(REQUESTS))
def test_the_workers_graphs_give_the_eager_tokens(name, device_model, device_draft, monkeypatch):
    """The engine with its workers' one-position steps replayed from CUDA graphs (the
    default on CUDA) against the same engine launching every kernel (graphs off)."""
    options, trunk_steps, jury_steps = REQUESTS[name]
    monkeypatch.setenv(MODE_VARIABLE, "off")
    eager, _ = generate(device_model, device_draft, options)
    on_cuda = device_model.device.type == "cuda"
    monkeypatch.setenv(MODE_VARIABLE, "auto" if on_cuda else "eager")
    graphed, backend = generate(device_model, device_draft, options)
    assert graphed == eager
    assert backend.trunk.graphs.mode == ("graph" if on_cuda else "eager")
    assert len(backend.trunk.graphs) >= trunk_steps and len(backend.jury.graphs) >= jury_steps
