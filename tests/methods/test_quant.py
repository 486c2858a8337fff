"""``quant`` (KIVI): packing, error bounds per bit width, honest bytes, chunked attention = dequantized attention."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvweave
from conftest import tiny_model
from kvweave._compat import cache_kwarg
from kvweave.cache import masked_attention
from kvweave.ops.quantize import dequantize, pack_codes, quantize, unpack_codes
from kvweave.registry import parse_method


def _prefill(model, ids, spec, mask=None):
    """Prefill ``ids`` (left-padded where ``mask`` is 0, positions counted from each row's first real token)."""
    cache = kvweave.make_cache(spec, model)
    positions = None if mask is None else (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        model(ids, attention_mask=mask, position_ids=positions, **{cache_kwarg(model): cache})
    return cache


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_pack_roundtrip(bits):
    codes = torch.randint(0, 1 << bits, (3, 5, 16), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == 16 * bits // 8
    assert torch.equal(unpack_codes(packed, bits), codes)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_dequantization_error_within_half_a_step(bits):
    torch.manual_seed(0)
    x = torch.randn(4, 32, 16) * 3 + 1
    codes, scale, minimum = quantize(x, 1, bits)  # per column, over 32 rows
    error = (dequantize(codes, scale, minimum) - x).abs()
    # half a quantization step, plus the float16 rounding of the stored minimum and scale
    bound = scale.float() / 2 + 1e-3 * x.abs().amax(1, keepdim=True)
    assert (error <= bound).all()
    assert scale.dtype == torch.float16 and minimum.dtype == torch.float16


def test_error_shrinks_with_more_bits():
    torch.manual_seed(0)
    x = torch.randn(8, 32, 64)
    errors = [(dequantize(*quantize(x, 1, b)) - x).abs().mean().item() for b in (2, 4, 8)]
    assert errors[0] > errors[1] > errors[2]


def test_constant_slice_is_exact():
    x = torch.full((2, 8, 4), 0.75)
    assert torch.equal(dequantize(*quantize(x, 1, 4)), x)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_nbytes_is_packed_codes_plus_scales(bits):
    model = tiny_model("llama")  # 2 KV heads, head_dim 16, fp32
    ids = torch.randint(3, 150, (1, 64))
    group = 16
    cache = _prefill(model, ids, f"quant:bits={bits},group={group},residual=0")
    layer = cache.layers[0]
    h, d, tokens = 2, 16, 64
    assert layer.layer_stats()["quantized_tokens"] == tokens and layer.layer_stats()["exact_tokens"] == 0
    codes = 2 * h * tokens * d * bits // 8
    key_scales = (tokens // group) * h * d * 2 * 2  # scale + minimum per block and channel, fp16
    value_scales = tokens * h * (d // min(group, d)) * 2 * 2  # per token and channel group
    bookkeeping = layer.block_start.nbytes + layer.recent_count.nbytes + layer.pad_count.nbytes
    assert layer.nbytes() == codes + key_scales + value_scales + bookkeeping
    # the codes alone are bits/16 of the fp16 cache
    assert codes == cache.full_kv_bytes(bits=16) // len(cache.layers) * bits // 16


def test_residual_window_stays_exact_and_full_blocks_leave_it():
    model = tiny_model("llama")
    cache = _prefill(model, torch.randint(3, 150, (1, 45)), "quant:bits=4,group=8,residual=16")
    stats = cache.layers[0].layer_stats()
    assert stats["quantized_tokens"] == 24 and stats["exact_tokens"] == 21  # 16 <= exact < 16 + 8
    with torch.no_grad():
        for _ in range(3):
            model(torch.randint(3, 150, (1, 1)), **{cache_kwarg(model): cache})
    stats = cache.layers[0].layer_stats()
    assert stats["quantized_tokens"] == 32 and stats["exact_tokens"] == 16


def test_chunked_online_softmax_equals_dequantized_attention():
    model = tiny_model("llama")
    torch.manual_seed(3)
    ids = torch.randint(3, 150, (2, 70))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # rows out of phase: their blocks start at different tokens
    cache = _prefill(model, ids, "quant:bits=2,group=8,residual=4,chunk=16", mask)  # several chunks
    layer = cache.layers[1]
    assert len(layer.segments) > 2
    query = torch.randn(2, 4, 1, 16)
    chunked = layer.chunked_attention(query, None, first=layer.seen - 1, scaling=0.25)
    keys, values, slots, valid = layer.dequantized()
    reference = masked_attention(query, keys, values, valid.view(2, 1, 1, -1).expand(2, 2, 1, -1), 0.25)
    assert (chunked - reference).abs().max().item() <= 1e-5


def test_padded_row_quantizes_the_blocks_of_its_single_run():
    model = tiny_model("qwen2")
    torch.manual_seed(4)
    ids = torch.randint(3, 150, (2, 50))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    batch = _prefill(model, ids, "quant:bits=4,group=8,residual=8", mask).layers[0]
    single = _prefill(model, ids[1:, 7:], "quant:bits=4,group=8,residual=8").layers[0]
    keys_b, _, slots_b, valid_b = batch.dequantized()
    keys_s, _, slots_s, valid_s = single.dequantized()
    row = slots_b[1][valid_b[1]] - 7
    order_b, order_s = row.argsort(), slots_s[0][valid_s[0]].argsort()
    assert torch.equal(row[order_b], slots_s[0][valid_s[0]][order_s])
    assert torch.allclose(
        keys_b[1][:, valid_b[1]][:, order_b], keys_s[0][:, valid_s[0]][:, order_s], atol=1e-5
    )


def test_more_bits_closer_to_full_logits():
    model = tiny_model("llama")
    torch.manual_seed(5)
    ids = torch.randint(3, 150, (1, 80))

    def decode_logits(cache):
        with torch.no_grad():
            model(ids[:, :60], **{cache_kwarg(model): cache})
            steps = [
                model(ids[:, i : i + 1], **{cache_kwarg(model): cache}).logits[:, -1] for i in range(60, 80)
            ]
        return torch.cat(steps)

    reference = decode_logits(DynamicCache(config=model.config))
    errors = [
        (decode_logits(kvweave.make_cache(f"quant:bits={b},group=8,residual=8", model)) - reference)
        .abs()
        .max()
        .item()
        for b in (2, 4, 8)
    ]
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 5e-3


def test_group_that_does_not_fit_head_dim_is_refused():
    model = tiny_model("llama")  # head_dim 16
    with pytest.raises(ValueError, match="group"):
        kvweave.make_cache("quant:group=12", model)
    assert parse_method("quant").options() == {
        "bits": 4,
        "group": 32,
        "residual": 128,
        "chunk": 4096,
        "kernel": "auto",
        "storage": "auto",
    }
    with pytest.raises(ValueError, match="multiple of 4"):
        kvweave.make_cache("quant:bits=2,group=6", model)


def test_beam_reorder_keeps_rows_consistent():
    model = tiny_model("llama")
    ids = torch.randint(3, 150, (2, 40))
    cache = _prefill(model, ids, "quant:bits=4,group=8,residual=8")
    layer = cache.layers[0]
    before = layer.dequantized()
    layer.reorder_cache(torch.tensor([1, 0]))
    after = layer.dequantized()
    assert torch.equal(before[0][0], after[0][1]) and torch.equal(before[1][1], after[1][0])
