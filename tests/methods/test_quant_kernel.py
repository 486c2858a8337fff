"""The fused C++ CPU kernel of ``quant`` against its torch reference (skipped where it cannot be built)."""

from __future__ import annotations

import pytest
import torch

import kvweave
from conftest import tiny_model
from kvweave._compat import cache_kwarg
from kvweave.kernels import cpu_quant
from kvweave.ops.attention import OnlineSoftmax
from kvweave.ops.kivi import (
    block_logits,
    dequantize_blocks,
    dequantize_values,
    quantize_blocks,
)
from kvweave.ops.quantize import pack_codes_split, unpack_codes_split

needs_kernel = pytest.mark.skipif(
    cpu_quant.load() is None, reason=f"C++ quant kernel not buildable here: {cpu_quant.unavailable_reason()}"
)

SHAPES = [  # B, H, R, D, G, n, channel group
    (1, 2, 7, 64, 32, 9, 32),
    (2, 3, 5, 16, 8, 5, 8),
    (1, 1, 1, 32, 4, 3, 32),
    (1, 2, 3, 128, 16, 4, 64),
    (1, 1, 2, 8, 8, 2, 4),
]


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_split_packing_round_trips(bits: int) -> None:
    codes = torch.randint(0, 1 << bits, (3, 5, 16), dtype=torch.uint8)
    packed = pack_codes_split(codes, bits)
    assert packed.shape == (3, 5, 16 * bits // 8)
    assert torch.equal(unpack_codes_split(packed, bits), codes)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("shape", SHAPES)
def test_torch_key_logits_match_dequantized_keys(bits: int, shape: tuple[int, ...]) -> None:
    b, h, r, d, g, n, cg = shape
    torch.manual_seed(1)
    blocks = quantize_blocks(torch.randn(b, h, n, g, d) * 3, torch.randn(b, h, n, g, d), bits, cg)
    keys, _ = dequantize_blocks(blocks, bits)
    query = torch.randn(b, h, r, d)
    torch.testing.assert_close(
        block_logits(query, blocks, bits), query @ keys.transpose(-1, -2), rtol=1e-4, atol=1e-4
    )


@needs_kernel
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_torch_reference(bits: int, shape: tuple[int, ...]) -> None:
    b, h, r, d, g, n, cg = shape
    torch.manual_seed(0)
    blocks = quantize_blocks(torch.randn(b, h, n, g, d) * 3, torch.randn(b, h, n, g, d), bits, cg)
    query = torch.randn(b, h, r, d)
    got = cpu_quant.block_logits(query, blocks.key_codes, blocks.key_scale, blocks.key_min, bits, 0.3)
    torch.testing.assert_close(got, block_logits(query, blocks, bits) * 0.3, rtol=1e-5, atol=1e-4)
    weights = torch.softmax(torch.randn(b, h, r, n * g), -1)
    got = cpu_quant.weighted_values(weights, blocks.value_codes, blocks.value_scale, blocks.value_min, bits)
    torch.testing.assert_close(got, weights @ dequantize_values(blocks, bits), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_masked_online_softmax_same_both_ways() -> None:
    b, h, r, d, g, n, cg = 2, 2, 4, 32, 8, 6, 16
    torch.manual_seed(2)
    blocks = quantize_blocks(torch.randn(b, h, n, g, d), torch.randn(b, h, n, g, d), 4, cg)
    query = torch.randn(b, h, r, d)
    visible = torch.rand(b, 1, r, n * g) > 0.4
    visible[0, 0, 1] = False  # a row that sees nothing here
    ref = OnlineSoftmax(query, 0.2)
    ref.add_logits(block_logits(query, blocks, 4), dequantize_values(blocks, 4), visible)
    fused = OnlineSoftmax(query, 0.2)
    fused.add_scaled(
        cpu_quant.block_logits(query, blocks.key_codes, blocks.key_scale, blocks.key_min, 4, 0.2),
        visible,
        lambda w: cpu_quant.weighted_values(w, blocks.value_codes, blocks.value_scale, blocks.value_min, 4),
    )
    torch.testing.assert_close(fused.result(), ref.result(), rtol=1e-5, atol=1e-5)
    assert torch.equal(fused.total == 0, ref.total == 0)


@needs_kernel
@pytest.mark.parametrize("bits", [2, 4])
def test_generate_same_with_either_kernel(bits: int) -> None:
    model = tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (2, 70))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: masked path

    def run(kernel: str) -> tuple[torch.Tensor, kvweave.KVCache]:
        cache = kvweave.make_cache(f"quant:bits={bits},group=8,residual=8,chunk=16,kernel={kernel}", model)
        with torch.no_grad():
            out = model(ids, attention_mask=mask, **{cache_kwarg(model): cache}).logits
            step = model(
                ids[:, -1:], attention_mask=torch.cat([mask, mask[:, -1:]], 1), **{cache_kwarg(model): cache}
            ).logits
        return torch.cat([out[:, -1:], step], 1), cache

    ref, _ = run("torch")
    got, cache = run("cpp")
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert {entry.get("kernel") for entry in cache.stats()["layers"]} == {"cpp"}


def test_kernel_option_is_validated() -> None:
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="kernel"):
        kvweave.make_cache("quant:kernel=fast", model)
