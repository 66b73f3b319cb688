"""The native kernels (kernels/) against a float64 reference: every format
(float32; int8 and int4 with float or int8 activations), every instruction set this CPU
has, bit for bit the same across sets, a row's output the same whatever rows come with
it; and the quantization they read."""

from __future__ import annotations

import platform

import pytest
import torch

from hydra_jury.hydra_model.products import CHUNKED_MAX_ROWS, KERNEL_MAX_ROWS, product
from hydra_jury.hydra_model.quantization import (
    QuantizationError,
    QuantizedWeight,
    int8_activations,
    pack_int4,
    quantize,
    unpack_int4,
)
from hydra_jury.kernels.native import INSTRUCTION_SETS, instruction_set, native

X86 = platform.machine().lower() in ("x86_64", "amd64")


def test_the_kernels_are_built_here():
    """On x86-64 the kernels must load: a silent fallback would leave them untested."""
    if not X86:
        pytest.skip("the kernels are for x86-64")
    assert native() is not None
    assert instruction_set() in INSTRUCTION_SETS


def _weights(stack: int, outputs: int, inputs: int) -> dict[str, torch.Tensor | QuantizedWeight]:
    generator = torch.Generator().manual_seed(outputs + inputs)
    w = torch.randn(stack, outputs, inputs, generator=generator)
    weights = {
        "float32": w,
        "int8": quantize(w, "int8"),
        "int4/32": quantize(w, "int4", 32),
        "int8, int8 activations": quantize(w, "int8", int8_activations=True),
        "int4/32, int8 activations": quantize(w, "int4", 32, int8_activations=True),
    }
    if inputs % 64 == 0:
        weights["int4/64"] = quantize(w, "int4", 64)
        weights["int4/64, int8 activations"] = quantize(w, "int4", 64, int8_activations=True)
    return weights


def _reference(x: torch.Tensor, weight) -> torch.Tensor:
    if isinstance(weight, QuantizedWeight):
        if weight.int8_activations:
            x = int8_activations(x)
        weight = weight.dequantize()
    return torch.matmul(x.double(), weight.double().mT)


@pytest.mark.parametrize("stack", [1, 3])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 17, KERNEL_MAX_ROWS])
@pytest.mark.parametrize("inputs", [128, 96])  # 96: a last block of 32 alone (a chunk's tail)
def test_products_match_the_reference_on_every_instruction_set(kernels, stack, rows, inputs):
    x = torch.randn(stack, rows, inputs, generator=torch.Generator().manual_seed(rows))
    for name, weight in _weights(stack, 96, inputs).items():
        results = {}
        for isa in kernels:
            instruction_set(isa)
            results[isa] = product(x, weight)
        first = results[kernels[0]]
        assert first.shape == (stack, rows, 96) and first.dtype == torch.float32
        torch.testing.assert_close(first.double(), _reference(x, weight), rtol=0, atol=2e-4)
        for isa, result in results.items():  # one summation order everywhere
            assert torch.equal(result, first), (name, isa)


@pytest.mark.parametrize("inputs", [64, 96])  # 96: a chunk's tail
def test_a_row_comes_out_the_same_whatever_rows_come_with_it(kernels, inputs):
    """Within what the kernels take (KERNEL_MAX_ROWS); an odd number of outputs, so that
    tiles of several outputs (float32 with many rows: AVX-512's tiles, AVX2's part tiles
    of 3; int4 with int8 activations in one row) leave some over."""
    rows = KERNEL_MAX_ROWS
    x = torch.randn(2, rows, inputs, generator=torch.Generator().manual_seed(1))
    for name, weight in _weights(2, 161, inputs).items():
        whole = product(x, weight)
        for first, last in [(0, 1), (3, 7), (8, 16), (5, 16), (rows - 1, rows)]:
            part = product(x[:, first:last].contiguous(), weight)
            assert torch.equal(part, whole[:, first:last]), (name, first, last)


@pytest.mark.parametrize("rows", [KERNEL_MAX_ROWS + 1, CHUNKED_MAX_ROWS])
def test_a_prompt_s_rows_are_a_decode_step_s_bits_with_int8_activations(kernels, rows):
    """Past KERNEL_MAX_ROWS, up to CHUNKED_MAX_ROWS, a quantized weight taking int8
    activations runs the kernels in chunks (with the norm, gate and residual a layer
    folds into its products): every row the bits that row gets alone."""
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(2, rows, 128, generator=generator)
    residual = torch.randn(2, rows, 96, generator=generator)
    norm = torch.rand(2, 64, generator=generator) + 0.5
    for name, weight in _weights(2, 96, 64).items():
        if not (isinstance(weight, QuantizedWeight) and weight.int8_activations):
            continue
        options = {"norm": norm, "eps": 1e-5, "glu": True, "residual": residual}
        whole = product(x, weight, **options)
        for row in (0, KERNEL_MAX_ROWS - 1, KERNEL_MAX_ROWS, rows - 1):
            alone = product(
                x[:, row : row + 1], weight, **{**options, "residual": residual[:, row : row + 1]}
            )
            assert torch.equal(alone, whole[:, row : row + 1]), (name, row)


def test_every_stack_member_may_read_the_same_rows(kernels):
    """Heads read the trunk's outputs as an expanded view (stride 0), not a copy."""
    rows = torch.randn(1, 3, 64)
    for weight in _weights(4, 64, 64).values():
        expanded = product(rows.expand(4, -1, -1), weight)
        assert torch.equal(expanded, product(rows.expand(4, -1, -1).contiguous(), weight))


def test_without_the_kernels_products_agree(kernels, monkeypatch):
    """PyTorch's products (a prefill's, or a machine without the kernels) give the same
    values to float32 rounding."""
    import hydra_jury.hydra_model.products as products

    x = torch.randn(1, 6, 64)
    for weight in _weights(1, 64, 64).values():
        native_result = product(x, weight)
        monkeypatch.setattr(products, "native", lambda: None)
        torch.testing.assert_close(product(x, weight), native_result, rtol=1e-5, atol=1e-5)
        monkeypatch.undo()


def test_the_kernels_refuse_what_they_cannot_compute(kernels):
    ops = native()

    def plain(x, weight, int8_activations=False):
        return ops.rows_times(x, weight, None, None, 0, None, 0.0, False, None, int8_activations)

    with pytest.raises(RuntimeError, match="multiple of 32"):
        plain(torch.randn(1, 1, 48), torch.randn(1, 8, 48))
    with pytest.raises(RuntimeError, match="float32"):
        plain(torch.randn(1, 1, 32).double(), torch.randn(1, 8, 32))
    with pytest.raises(RuntimeError, match="scale must be"):
        plain(torch.randn(1, 1, 32), torch.zeros(1, 8, 32, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="need an int8 or int4 weight"):
        plain(torch.randn(1, 1, 32), torch.randn(1, 8, 32), int8_activations=True)
    with pytest.raises(RuntimeError, match="unknown instruction set"):
        ops.kernel_isa("sse9")


@pytest.mark.parametrize("inputs", [64, 96, 160])
def test_int8_activations_are_quantized_bit_for_bit_as_pytorch_quantizes_them(kernels, inputs):
    """Through an identity int8 weight with unit scales, y[k] = q[k] * d: the kernels' q
    and d against `int8_activations` (products' PyTorch path), on every set — ties
    rounded to even, a block of zeros, a last block of 32 alone (96 and 160 inputs)."""
    identity = QuantizedWeight(
        torch.eye(inputs, dtype=torch.int8)[None], torch.ones(1, inputs), int8_activations=True
    )
    x = torch.randn(1, 5, inputs, generator=torch.Generator().manual_seed(inputs)) * 3
    x[0, 0, :32] = torch.arange(32) - 15.5  # a ramp
    x[0, 1, :32] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5] * 4)  # d = 1
    x[0, 2, 32:64] = 0.0
    expected = int8_activations(x)
    assert expected[0, 1, :8].tolist() == [127.0, 0.0, 2.0, 2.0, -0.0, -2.0, -2.0, 4.0]
    for isa in kernels:
        instruction_set(isa)
        assert torch.equal(product(x, identity), expected), isa


@pytest.mark.parametrize("rows", [1, 6])
def test_a_last_block_of_32_inputs_alone_takes_the_kernels(kernels, rows):
    """96 inputs: one chunk of 64 and a last block of 32, on every set alike."""
    x = torch.randn(2, rows, 96, generator=torch.Generator().manual_seed(rows))
    w = torch.randn(2, 40, 96, generator=torch.Generator().manual_seed(7))
    for weight in (
        quantize(w, "int8", int8_activations=True),
        quantize(w, "int4", 32, int8_activations=True),
        quantize(w, "int4", 96, int8_activations=True),
    ):
        results = {}
        for isa in kernels:
            instruction_set(isa)
            results[isa] = product(x, weight)
        first = results[kernels[0]]
        torch.testing.assert_close(first.double(), _reference(x, weight), rtol=0, atol=1e-4)
        assert all(torch.equal(result, first) for result in results.values())
        assert torch.equal(product(x[:, :1].contiguous(), weight), first[:, :1])


def test_int8_activations_refuse_a_width_not_in_blocks_of_32():
    with pytest.raises(QuantizationError, match="blocks of 32"):
        quantize(torch.randn(4, 48), "int8", int8_activations=True)


def test_int8_rounds_each_weight_to_its_channel_step():
    w = torch.randn(2, 16, 64) * torch.linspace(0.01, 3, 16)[:, None]
    q = quantize(w, "int8")
    assert q.data.dtype == torch.int8 and q.scale.shape == (2, 16)
    assert (q.dequantize() - w).abs().le(q.scale[..., None] / 2 + 1e-7).all()
    assert q.data.abs().amax(-1).eq(127).all()  # the scale is the row's largest magnitude


def test_int4_rounds_each_weight_within_its_group():
    w = torch.randn(3, 8, 128)
    q = quantize(w, "int4", 64)
    assert q.data.shape == (3, 8, 64) and q.scale.shape == q.minimum.shape == (3, 8, 2)
    step = q.scale.repeat_interleave(64, -1)
    assert (q.dequantize() - w).abs().le(step / 2 + 1e-6).all()
    values = torch.randint(0, 16, (5, 96), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(values)), values)


def test_a_constant_group_or_row_quantizes_exactly():
    w = torch.zeros(2, 64)
    w[1] = 0.25
    assert torch.equal(quantize(w, "int8").dequantize(), w)
    assert torch.equal(quantize(w, "int4").dequantize(), w)


def test_bad_quantizations_are_refused():
    with pytest.raises(QuantizationError, match="multiple of 32"):
        quantize(torch.randn(4, 64), "int4", 48)
    with pytest.raises(QuantizationError, match="does not divide"):
        quantize(torch.randn(4, 96), "int4", 64)
    with pytest.raises(QuantizationError, match="unknown quantization"):
        quantize(torch.randn(4, 64), "int3")


def _attention_reference(qkv, keys, values, layer, start, rope, heads, kv_heads):
    """PyTorch's attention of the new positions over the cache (the fallback's maths)."""
    from hydra_jury.hydra_model.rope import rotate

    stack, length, _ = qkv.shape
    dim = keys.shape[-1]
    qk = qkv[..., : (heads + kv_heads) * dim].reshape(stack, length, heads + kv_heads, dim)
    qk = rotate(qk, rope.rotation(start, length)).transpose(1, 2)
    q, k = qk.split([heads, kv_heads], dim=1)
    v = qkv[..., (heads + kv_heads) * dim :].reshape(stack, length, kv_heads, dim).transpose(1, 2)
    keys, values = keys.clone(), values.clone()
    keys[:, layer, :, start : start + length] = k
    values[:, layer, :, start : start + length] = v
    seen_k, seen_v = keys[:, layer, :, : start + length], values[:, layer, :, : start + length]
    positions = torch.arange(start + length)
    mask = positions[None, :] <= torch.arange(start, start + length)[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, seen_k, seen_v, attn_mask=mask, enable_gqa=heads != kv_heads
    )
    return out.transpose(1, 2).reshape(stack, length, heads * dim), keys, values


@pytest.mark.parametrize(
    ("stack", "start", "length"), [(1, 0, 1), (1, 7, 1), (2, 5, 4), (3, 0, 9), (1, 61, 3)]
)
def test_attention_matches_pytorch_on_every_instruction_set(kernels, stack, start, length):
    """(The softmax takes 32 positions at a time: the last case's rows see 62 to 64.)"""
    from hydra_jury.hydra_model.config import DecoderConfig
    from hydra_jury.hydra_model.rope import RotaryTable

    heads, kv_heads, dim, layers, capacity = 4, 2, 32, 3, 64
    config = DecoderConfig.from_dict(
        {
            "family": "llama",
            "model_type": "llama",
            "vocab_size": 32,
            "hidden_size": heads * dim,
            "intermediate_size": 64,
            "num_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": dim,
            "max_position_embeddings": capacity,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
        }
    )
    rope = RotaryTable(config, capacity, torch.float32, "cpu")
    generator = torch.Generator().manual_seed(start * 10 + length)
    qkv = torch.randn(stack, length, (heads + 2 * kv_heads) * dim, generator=generator)
    keys = torch.randn(stack, layers, kv_heads, capacity, dim, generator=generator)
    values = torch.randn(stack, layers, kv_heads, capacity, dim, generator=generator)
    expected, expected_keys, expected_values = _attention_reference(
        qkv, keys, values, 1, start, rope, heads, kv_heads
    )
    results = []
    for isa in kernels:
        instruction_set(isa)
        cache_keys, cache_values = keys.clone(), values.clone()
        cos, sin = rope.rotation(start, length)
        out = native().attend(qkv, cache_keys, cache_values, 1, start, cos, sin, heads, kv_heads)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(cache_keys, expected_keys, rtol=0, atol=1e-6)
        assert torch.equal(cache_values, expected_values)
        results.append((out, cache_keys))
    for out, cache_keys in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(cache_keys, results[0][1])


def test_norm_gate_and_residual_travel_with_the_product(kernels, monkeypatch):
    """What `product` fuses (RMS norm, silu gate, residual) equals PyTorch's separate ops."""
    import hydra_jury.hydra_model.products as products

    generator = torch.Generator().manual_seed(3)
    x = torch.randn(1, 5, 128, generator=generator)
    norm = torch.rand(2, 64, generator=generator) + 0.5
    residual = torch.randn(2, 5, 96, generator=generator)
    for weight in _weights(2, 96, 64).values():
        fused = {
            "glu": product(x.expand(2, -1, -1), weight, glu=True, residual=residual),
            "norm": product(x[..., :64].expand(2, -1, -1), weight, norm=norm, eps=1e-5),
        }
        monkeypatch.setattr(products, "native", lambda: None)
        separate = {
            "glu": product(x.expand(2, -1, -1).contiguous(), weight, glu=True, residual=residual),
            "norm": product(
                x[..., :64].expand(2, -1, -1).contiguous(), weight, norm=norm, eps=1e-5
            ),
        }
        monkeypatch.undo()
        for name, value in fused.items():
            torch.testing.assert_close(value, separate[name], rtol=1e-5, atol=1e-5)


def test_a_norm_alone_has_the_bits_of_a_norm_inside_a_product(kernels, monkeypatch):
    """`rms_norm` by the kernels (a head's final norm before a shared LM head) equals the
    norm a product carries, bit for bit on every set; PyTorch's to float rounding; each
    stack member its own weight, or one row set for every member."""
    import hydra_jury.hydra_model.products as products
    from hydra_jury.hydra_model.products import rms_norm

    generator = torch.Generator().manual_seed(4)
    x = torch.randn(2, 5, 64, generator=generator) * 3
    norm = torch.rand(2, 64, generator=generator) + 0.5
    weight = torch.randn(2, 96, 64, generator=generator)
    for rows in (x, x[:1].expand(2, -1, -1)):
        for isa in kernels:
            instruction_set(isa)
            alone = rms_norm(rows, norm, 1e-5)
            assert alone.shape == (2, 5, 64)
            inside = product(rows, weight, norm=norm, eps=1e-5)
            assert torch.equal(product(alone, weight), inside), isa
        monkeypatch.setattr(products, "native", lambda: None)
        torch.testing.assert_close(rms_norm(rows, norm, 1e-5), alone, rtol=1e-6, atol=1e-6)
        monkeypatch.undo()
    with pytest.raises(RuntimeError, match="x must be"):
        native().rms_norm(x, norm[:1].expand(3, -1).contiguous(), 1e-5)


def test_the_gate_has_the_same_bits_on_every_set(kernels):
    """A gated product's input, silu(gate) * up, is computed 32 lanes at a time with the
    kernels' own exp: the same bits on every set, PyTorch's silu to float rounding, at
    the ends of float's exp (where e^-gate flushes to 0 or overflows) too."""
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(5)
    ends = [-100.0, -88.8, -87.4, -20.0, -1.0, -0.0, 0.0, 1e-30, 1.0, 20.0, 87.4, 88.8, 100.0]
    gate = torch.randn(3, 64, generator=generator) * 4
    gate[0, : len(ends)] = torch.tensor(ends)
    up = torch.randn(3, 64, generator=generator)
    x = torch.cat([gate, up], dim=-1)[None]  # [1, rows, gate | up]
    identity = torch.eye(64)[None]  # the product hands the gated input back unchanged
    results = {}
    for isa in kernels:
        instruction_set(isa)
        results[isa] = product(x, identity, glu=True)[0]
    for isa, result in results.items():
        assert torch.equal(result, next(iter(results.values()))), isa
    torch.testing.assert_close(result, F.silu(gate) * up, rtol=1e-6, atol=1e-30)


def test_one_call_for_every_layer_gives_the_bits_of_a_call_per_step(kernels, wide_jury_checkpoint):
    """`LayerStack`'s single native call over all layers (a session's decode step) runs
    the same kernels in the same order as the per-operation path: the same bits."""
    import hydra_jury.hydra_model.layers as layers
    from hydra_jury.hydra_model import HydraModel

    jury_model = HydraModel.load(wide_jury_checkpoint)

    def decode(model) -> list[torch.Tensor]:
        cache = model.trunk_cache(16)
        hidden = [model.trunk.forward(torch.tensor([3, 1, 4, 1, 5]), cache, 0)]
        for position, token in enumerate([9, 2, 6], start=5):
            hidden.append(model.trunk.forward(torch.tensor([token]), cache, position))
        return hidden

    calls = []
    original = layers.decoded_layers

    def counted(*args, **kwargs):
        result = original(*args, **kwargs)
        calls.append(result is not None)
        return result

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layers, "decoded_layers", counted)
        fused = decode(jury_model)
    assert calls and all(calls)  # the single call really ran
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layers, "decoded_layers", lambda *args, **kwargs: None)
        stepwise = decode(jury_model)
    for one, other in zip(fused, stepwise, strict=True):
        assert torch.equal(one, other)


def test_one_call_for_several_sessions_gives_the_bits_of_a_call_per_step(
    kernels, wide_jury_checkpoint
):
    """A ragged batch of sessions (a step of `serve` or of the services) goes through
    every layer in one native call too, each session's attention over its own cache:
    the same bits as the per-operation path, and as each session alone."""
    import hydra_jury.hydra_model.layers as layers
    from hydra_jury.hydra_model import HydraModel
    from hydra_jury.hydra_model.layers import Segment

    model = HydraModel.load(wide_jury_checkpoint)
    prompts = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5]]
    steps = [[7, 8], [1], [2, 7, 1]]  # a step of one session may hold several positions

    def batched_step() -> torch.Tensor:
        caches = [model.trunk_cache(16) for _ in prompts]
        for prompt, cache in zip(prompts, caches, strict=True):
            model.trunk.forward(torch.tensor(prompt), cache, 0)
        segments = [
            Segment(cache, len(prompt), len(step))
            for prompt, step, cache in zip(prompts, steps, caches, strict=True)
        ]
        tokens = torch.tensor([token for step in steps for token in step])
        return model.trunk.forward_ragged(tokens, segments)

    calls = []
    original = layers.decoded_layers

    def counted(*args, **kwargs):
        result = original(*args, **kwargs)
        calls.append((len(args[5]), result is not None))
        return result

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layers, "decoded_layers", counted)
        fused = batched_step()
    assert (3, True) in calls  # the three sessions' step was one native call
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layers, "decoded_layers", lambda *args, **kwargs: None)
        stepwise = batched_step()
    assert torch.equal(fused, stepwise)
    alone = []
    for prompt, step in zip(prompts, steps, strict=True):
        cache = model.trunk_cache(16)
        model.trunk.forward(torch.tensor(prompt), cache, 0)
        alone.append(model.trunk.forward(torch.tensor(step), cache, len(prompt)))
    assert torch.equal(fused, torch.cat(alone))
