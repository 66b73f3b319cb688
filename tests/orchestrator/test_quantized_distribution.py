"""The engine samples exactly from a quantized model's own PoE target: the closed form of
`test_engine_distribution`, computed from the int4 model's forward passes, against 5,000
seeded runs of the engine on it (same tolerance and control). A file of its own, so that
the test processes share the suite's two longest statistical tests between them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hydra_jury.hydra_model import HydraModel
from hydra_jury.hydra_model.build.quantize import quantize_checkpoint
from hydra_jury.hydra_model.quantization import QuantizationScheme
from tests.engine_sampling import RunSampler, worker_count
from tests.models import build_draft_checkpoint, build_jury_checkpoint
from tests.orchestrator.test_engine_distribution import (
    DRAFT_HEAD,
    PROMPT,
    SMALL_JURY,
    empirical,
    exact_target,
    joint_distribution,
)
from tests.statistics import assert_fits

pytestmark = pytest.mark.slow  # 5,000 generations


@pytest.fixture(scope="module")
def float_small(tmp_path_factory) -> Path:
    """`test_engine_distribution`'s small jury, in float32."""
    return build_jury_checkpoint(tmp_path_factory.mktemp("small-jury"), **SMALL_JURY)


@pytest.fixture(scope="module")
def quantized_small(float_small) -> HydraModel:
    """The small jury quantized to int4 in groups of 32: every layer of a decode step runs
    in one native call (int4 products, native attention), and the LM head on the int4
    kernel."""
    scheme = QuantizationScheme.from_flags("int4", 32, keep_output_matrix=False)
    out = float_small.parent / "int4"
    quantize_checkpoint(float_small, out, scheme, log=lambda line: None)
    return HydraModel.load(out)


def test_a_quantized_model_samples_its_own_poe_target(quantized_small, float_small):
    """Exactness is with respect to the quantized model's distributions: the target is
    computed from its own forward passes."""
    tokenizer = quantized_small.load_tokenizer()
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    names = quantized_small.head_names
    joint, _ = joint_distribution(
        quantized_small, prompt, lambda logits: (exact_target(logits, names, 1.0), False)
    )
    draft_joint, _ = joint_distribution(
        quantized_small,
        prompt,
        lambda logits: (torch.softmax(logits[names.index(DRAFT_HEAD)], -1), False),
    )
    # The runs draft with a head; the engine's draft model (unused) is the float base's.
    draft_checkpoint = build_draft_checkpoint(float_small)
    runs = RunSampler(quantized_small.directory, draft_checkpoint, worker_count())
    try:
        options = {"rule": "exact", "gamma": 3, "max_new_tokens": 4}
        counts = empirical(runs, quantized_small.config.vocab_size, options)
    finally:
        runs.close()
    assert_fits(counts, joint, draft_joint)
