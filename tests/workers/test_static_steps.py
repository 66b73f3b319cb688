"""The workers' fixed-shape steps (`hydra_model.graphs`: what a GPU replays from CUDA
graphs), run eagerly on the CPU with HYDRA_JURY_CUDA_GRAPHS=eager, give the ragged
forward's tokens: decode steps, draft-head steps, draft-model rounds and scores take
them, and a request's tokens do not change. tests/gpu replays them from real graphs."""

from __future__ import annotations

import pytest

from hydra_jury.hydra_model.graphs import MODE_VARIABLE, graph_mode
from hydra_jury.orchestrator.engine import Engine
from hydra_jury.orchestrator.local_backend import LocalBackend
from hydra_jury.orchestrator.request import GenerationRequest
from hydra_jury.workers.sessions import SessionLimits

NEAR_TIE = 1e-3  # float32 sums in another order move a probability by about 1e-6
GREEDY = {"prompt": "the cat", "temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
# Each request's options, and the fixed-shape steps its workers make at least: the
# trunk's (a decode step, a draft head's step, a draft model's round) and the jury's (a
# score of one position, or of a speculative round's).
REQUESTS = {
    "non-speculative": ({"rule": "verifier_only", "jury": ["head0"]}, 1, 1),
    "jury of three": ({"rule": "verifier_only", "jury": ["head0", "head1", "head2"]}, 1, 1),
    "head drafts": (
        {"rule": "exact", "drafter": "head", "draft_head": "head3", "jury": ["head0"], "gamma": 3},
        2,
        1,
    ),
    "draft model": (
        {"rule": "exact", "drafter": "model", "jury": ["head1", "head2"], "gamma": 2},
        1,
        1,
    ),
}


def generate(model, draft, options: dict) -> tuple[list[int], LocalBackend]:
    backend = LocalBackend(model, draft_model=draft, limits=SessionLimits(2, 128))
    result = Engine(backend, model.load_tokenizer()).generate(
        GenerationRequest(**GREEDY, **options)
    )
    margins = [record.stability_margin for record in result.tokens]
    assert min(margins) > NEAR_TIE, f"a near-tie decided a token (margins {margins})"
    return result.token_ids, backend


@pytest.mark.parametrize("name", list(REQUESTS))
def test_fixed_shape_steps_give_the_ragged_forwards_tokens(
    name, jury_model, draft_model, monkeypatch
):
    options, trunk_steps, jury_steps = REQUESTS[name]
    monkeypatch.setenv(MODE_VARIABLE, "off")
    ragged, backend = generate(jury_model, draft_model, options)
    assert backend.trunk.graphs is None and backend.jury.graphs is None
    monkeypatch.setenv(MODE_VARIABLE, "eager")
    static, backend = generate(jury_model, draft_model, options)
    assert static == ragged
    assert len(backend.trunk.graphs) >= trunk_steps and len(backend.jury.graphs) >= jury_steps


def test_the_mode_is_checked(monkeypatch):
    import torch

    monkeypatch.setenv(MODE_VARIABLE, "always")
    with pytest.raises(ValueError, match=r"\$HYDRA_JURY_CUDA_GRAPHS='always': expected one of"):
        graph_mode(torch.device("cpu"))
    for mode, expected in (("auto", None), ("off", None), ("eager", "eager"), ("", None)):
        monkeypatch.setenv(MODE_VARIABLE, mode)
        assert graph_mode(torch.device("cpu")) == expected
    monkeypatch.setenv(MODE_VARIABLE, "auto")
    assert graph_mode(torch.device("cuda", 0)) == "graph"
