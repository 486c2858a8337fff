"""The Triton ``quant`` (KIVI) decode-attention kernel against its torch reference and the method's own path.

Skipped where triton is not installed. Without a CUDA device the kernels run in Triton's interpreter
(``TRITON_INTERPRET=1``, set below before the kernel module is imported; float32 only: the interpreter has no
bfloat16 arithmetic). On a GPU the float16 / bfloat16 cases run as well.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # @triton.jit reads this when the kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvweave.kernels import triton_quant  # noqa: E402
from kvweave.ops.attention import OnlineSoftmax, merge_parts  # noqa: E402
from kvweave.ops.kivi import Blocks, dequantize_blocks, quantize_blocks  # noqa: E402

pytestmark = pytest.mark.skipif(
    not triton_quant.available(), reason=f"Triton kernels cannot run: {triton_quant.unavailable_reason()}"
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = triton_quant.available() and not torch.cuda.is_available()
DTYPES = [torch.float32] + ([] if INTERPRETED else [torch.bfloat16, torch.float16])
TOLERANCE = {  # out and lse against the float32 reference (on the same, dtype-rounded, query)
    torch.float32: dict(rtol=1e-4, atol=1e-4),
    torch.float16: dict(rtol=1e-2, atol=1e-2),
    torch.bfloat16: dict(rtol=4e-2, atol=4e-2),
}

SHAPES = [  # B, KV heads, GQA groups, new queries, D, G (block tokens), n (blocks), channel group
    (1, 1, 1, 1, 16, 8, 3, 8),  # 24 tokens: less than one tile
    (2, 3, 7, 1, 64, 32, 5, 32),  # 160 tokens: 2.5 tiles; 7 query heads per KV head
    (1, 2, 1, 3, 128, 16, 7, 64),  # 112 tokens; three new queries
    (3, 2, 7, 2, 16, 4, 17, 16),  # 68 tokens: one token over a tile; R = 14 rows
]


def _case(shape: tuple[int, ...], bits: int, seed: int = 0) -> tuple[torch.Tensor, Blocks]:
    """Packed query ``[B, H, groups*q, D]`` (as ``QuantLayer.chunked_attention`` packs it) and the blocks."""
    b, h, groups, q_len, d, g, n, cg = shape
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, h, n, g, d, generator=gen) * 3 + torch.randn(d, generator=gen)  # channel offsets
    values = torch.randn(b, h, n, g, d, generator=gen)
    blocks = quantize_blocks(keys, values, bits, cg).map(lambda t: t.to(DEVICE))
    query = torch.randn(b, h * groups, q_len, d, generator=gen).to(DEVICE)
    return query.reshape(b, h, groups * q_len, d), blocks


def _args(query: torch.Tensor, blocks: Blocks, bits: int, scaling: float) -> tuple:
    return (
        query,
        blocks.key_codes,
        blocks.key_scale,
        blocks.key_min,
        blocks.value_codes,
        blocks.value_scale,
        blocks.value_min,
        bits,
        scaling,
    )


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_matches_reference(shape: tuple[int, ...], bits: int) -> None:
    query, blocks = _case(shape, bits)
    args = _args(query, blocks, bits, shape[4] ** -0.5)
    want_out, want_lse = triton_quant.quant_attention_reference(*args)
    for splits in (1, 3):  # one pass, and the token axis split (partials merged by log-sum-exp)
        out, lse = triton_quant.quant_attention(*args, splits=splits)
        assert out.shape == want_out.shape and lse.shape == want_lse.shape
        assert out.dtype == lse.dtype == torch.float32
        torch.testing.assert_close(out, want_out, **TOLERANCE[torch.float32])
        torch.testing.assert_close(lse, want_lse, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_visibility_mask_and_rows_that_see_nothing(dtype: torch.dtype) -> None:
    shape = (2, 2, 7, 1, 64, 8, 11, 32)  # 88 tokens
    query, blocks = _case(shape, 4, seed=1)
    query = query.to(dtype)
    b, h, r, _ = query.shape
    gen = torch.Generator().manual_seed(2)
    visible = (torch.rand(b, 1, r, 88, generator=gen) > 0.3).to(DEVICE)  # broadcast over the KV heads
    visible[1, 0, 3] = False  # a row that sees nothing: out 0, lse -inf
    visible[0, 0, :, 8:16] = False  # an empty block slot of a padded row
    args = _args(query, blocks, 4, 0.125)
    want_out, want_lse = triton_quant.quant_attention_reference(*args, visible)
    for splits in (1, 2):
        out, lse = triton_quant.quant_attention(*args, visible, splits=splits)
        torch.testing.assert_close(out, want_out, **TOLERANCE[dtype])
        torch.testing.assert_close(lse, want_lse, **TOLERANCE[dtype])
        assert torch.isneginf(lse[1, :, 3]).all() and (out[1, :, 3] == 0).all()
    per_head = visible.expand(b, h, r, 88).clone()
    per_head[0, 1] = True  # a mask that differs per KV head
    want_out, _ = triton_quant.quant_attention_reference(*args, per_head)
    out, _ = triton_quant.quant_attention(*args, per_head)
    torch.testing.assert_close(out, want_out, **TOLERANCE[dtype])


@pytest.mark.skipif(INTERPRETED, reason="float16 / bfloat16 arithmetic needs a GPU (not in the interpreter)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES[1:3], ids=lambda s: "x".join(map(str, s)))
def test_half_precision_queries(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    query, blocks = _case(shape, 4, seed=3)
    args = _args(query.to(dtype), blocks, 4, shape[4] ** -0.5)
    want_out, want_lse = triton_quant.quant_attention_reference(*args)
    out, lse = triton_quant.quant_attention(*args)
    torch.testing.assert_close(out, want_out, **TOLERANCE[dtype])
    torch.testing.assert_close(lse, want_lse, **TOLERANCE[dtype])


@pytest.mark.parametrize("bits", [2, 4])
def test_reference_is_the_methods_torch_path_and_merges_with_the_exact_tail(bits: int) -> None:
    """Blocks + the exact recent tail: kernel output merged with ``merge_parts`` = ``OnlineSoftmax`` over
    ``dequantize_blocks`` and the tail (what ``QuantLayer.chunked_attention`` computes)."""
    shape = (2, 2, 7, 1, 16, 8, 9, 8)
    query, blocks = _case(shape, bits, seed=4)
    b, h, r, d = query.shape
    gen = torch.Generator().manual_seed(5)
    tail_k, tail_v = (torch.randn(b, h, 13, d, generator=gen).to(DEVICE) for _ in range(2))
    scaling = d**-0.5
    softmax = OnlineSoftmax(query.float(), scaling)
    keys, values = dequantize_blocks(blocks, bits)
    softmax.add(keys, values, torch.ones(b, 1, r, keys.shape[2], dtype=torch.bool, device=DEVICE))
    softmax.add(tail_k, tail_v, torch.ones(b, 1, r, 13, dtype=torch.bool, device=DEVICE))
    args = _args(query, blocks, bits, scaling)
    reference = triton_quant.quant_attention_reference(*args)
    kernel = triton_quant.quant_attention(*args)
    logits = (query @ tail_k.transpose(-1, -2)) * scaling
    tail = (torch.softmax(logits, -1) @ tail_v, torch.logsumexp(logits, -1))
    torch.testing.assert_close(merge_parts([reference, tail]), softmax.result(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merge_parts([kernel, tail]), softmax.result(), rtol=1e-4, atol=1e-4)


def test_no_blocks_and_bad_arguments() -> None:
    query, blocks = _case((1, 2, 1, 1, 16, 8, 2, 8), 4)
    empty = blocks.map(lambda t: t[:, :, :0])
    out, lse = triton_quant.quant_attention(*_args(query, empty, 4, 0.25))
    assert out.shape == (1, 2, 1, 16) and (out == 0).all() and torch.isneginf(lse).all()
    with pytest.raises(ValueError, match="bits"):
        triton_quant.quant_attention(*_args(query, blocks, 3, 0.25))
    with pytest.raises(ValueError, match="key_codes"):
        triton_quant.quant_attention(*_args(query[..., :8], blocks, 4, 0.25))


@pytest.mark.parametrize("bits", [2, 4])
def test_the_method_runs_the_kernel_through_generate_token_equal_to_torch(bits: int) -> None:
    """``make_cache`` + ``model.generate`` with ``kernel=triton`` (the CUDA default; here the interpreter):
    the same tokens as the torch reference path, batch 2 with left padding, and the layers say it ran."""
    from through_methods import generate_per_backend

    spec = f"quant:bits={bits},group=8,residual=8,chunk=16,kernel={{}}"
    outputs, caches = generate_per_backend(spec, DEVICE, 40, 12, padded_row=1, pad=5, seed=3)
    assert torch.equal(outputs["triton"], outputs["torch"])
    assert {layer.kernel_used for layer in caches["triton"].layers} == {"triton"}
    assert caches["triton"].nbytes() == caches["torch"].nbytes()
