"""The Triton DK-Cache far-tier kernels (page upper bounds, attention over chosen pages) against torch.

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

from kvweave.kernels import triton_pages  # noqa: E402
from kvweave.methods.dkcache.far import page_upper_bounds  # noqa: E402
from kvweave.ops.attention import masked_attention, merge_parts  # noqa: E402
from kvweave.ops.quantize import dequantize_int8, quantize_int8  # noqa: E402

pytestmark = pytest.mark.skipif(
    not triton_pages.available(), reason=f"Triton kernels cannot run: {triton_pages.unavailable_reason()}"
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = triton_pages.available() and not torch.cuda.is_available()
DTYPES = [torch.float32] + ([] if INTERPRETED else [torch.bfloat16, torch.float16])
TOLERANCE = {  # against the float32 reference on the same (dtype-rounded) tensors
    torch.float32: dict(rtol=1e-4, atol=1e-4),
    torch.float16: dict(rtol=1e-2, atol=1e-2),
    torch.bfloat16: dict(rtol=4e-2, atol=4e-2),
}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------------------------- page bounds

BOUND_SHAPES = [  # B, KV heads, query rows (groups x new queries), pages, D
    (1, 1, 1, 3, 16),
    (2, 3, 7, 37, 64),  # GQA group of 7, one query
    (1, 2, 21, 70, 128),  # 7 x 3 rows, pages over one tile
    (3, 1, 1, 17, 64),
]


@pytest.mark.parametrize("shape", BOUND_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_page_upper_bounds_match_far_tier(shape: tuple[int, ...]) -> None:
    b, h, n, pages, d = shape
    gen = _gen(0)
    query = torch.randn(b, h, n, d, generator=gen).to(DEVICE)
    low = torch.randn(b, h, pages + 5, d, generator=gen).to(DEVICE)
    high = low + torch.rand(b, h, pages + 5, d, generator=gen).to(DEVICE)
    page_min, page_max = low[:, :, :pages], high[:, :, :pages]  # a view of a larger buffer, as retrieve uses
    want = page_upper_bounds(query, page_min, page_max)
    got = triton_pages.page_upper_bounds(query, page_min, page_max)
    assert got.shape == (b, h, n, pages) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(triton_pages.page_upper_bounds_reference(query, page_min, page_max), want)
    scores = triton_pages.page_scores(query, page_min, page_max)
    torch.testing.assert_close(scores, want.amax(2), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(triton_pages.page_scores_reference(query, page_min, page_max), want.amax(2))


def test_page_upper_bounds_bound_every_key() -> None:
    """The bound is above ``q·k`` of every key of its page (what makes top-k retrieval sound)."""
    gen = _gen(1)
    keys = torch.randn(2, 2, 9, 13, 16, generator=gen).to(DEVICE)  # 9 pages of 13 tokens
    query = torch.randn(2, 2, 7, 16, generator=gen).to(DEVICE)
    bounds = triton_pages.page_upper_bounds(query, keys.amin(3), keys.amax(3))  # [B, H, n, P]
    exact = torch.einsum("bhnd,bhptd->bhnpt", query, keys).amax(-1)
    assert (bounds >= exact - 1e-4).all()


@pytest.mark.skipif(INTERPRETED, reason="float16 / bfloat16 arithmetic needs a GPU (not in the interpreter)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_page_upper_bounds_half_precision_query(dtype: torch.dtype) -> None:
    gen = _gen(2)
    query = torch.randn(2, 3, 7, 64, generator=gen).to(DEVICE, dtype)
    low = torch.randn(2, 3, 33, 64, generator=gen).to(DEVICE)
    high = low + 1
    torch.testing.assert_close(
        triton_pages.page_upper_bounds(query, low, high),
        page_upper_bounds(query, low, high),
        rtol=1e-5,
        atol=1e-3,
    )


# -------------------------------------------------------------------------------------------- page attention

ATTENTION_SHAPES = [  # B, KV heads, GQA groups, new queries, pages held, page size, pages chosen, D
    (1, 1, 1, 1, 4, 8, 2, 16),  # 16 tokens chosen: less than a tile
    (2, 3, 7, 1, 9, 13, 5, 64),  # 65 tokens: one over a tile, odd page size
    (1, 2, 1, 3, 6, 64, 3, 128),  # 192 tokens, three new queries
    (3, 2, 7, 2, 11, 16, 7, 16),  # 112 tokens, R = 14
]


def _pages(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    b, h, groups, q_len, pages, size, chosen, d = shape
    gen = _gen(seed)
    query = torch.randn(b, h * groups, q_len, d, generator=gen)
    keys = torch.randn(b, h, pages * size, d, generator=gen) * 2
    values = torch.randn(b, h, pages * size, d, generator=gen)
    index = torch.stack([torch.randperm(pages, generator=gen)[:chosen] for _ in range(b * h)]).view(
        b, h, chosen
    )
    return {
        "query": query.reshape(b, h, groups * q_len, d).to(DEVICE, dtype),  # packed as the far tier packs it
        "keys": keys.to(DEVICE, dtype),  # the far store [B, H, P*page, D]
        "values": values.to(DEVICE, dtype),
        "index": index.to(DEVICE),
    }


def _paged(x: torch.Tensor, size: int) -> torch.Tensor:
    b, h, cap, d = x.shape
    return x.view(b, h, cap // size, size, d)


@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
@pytest.mark.parametrize("shape", ATTENTION_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_page_attention_matches_reference(shape: tuple[int, ...], int8: bool) -> None:
    b, h, _, _, pages, size, chosen, d = shape
    case = _pages(shape, torch.float32, seed=3)
    keys, values, index = case["keys"], case["values"], case["index"].clone()
    index[0, 0, -1] = -1  # a chosen slot that is not a page: joins nothing
    lengths = torch.full((b,), pages * size, device=DEVICE)
    lengths[-1] -= size + 3  # the last row holds fewer tokens: its last page is gone, the one before partial
    scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    if int8:
        (keys, key_scales), (values, value_scales) = quantize_int8(keys), quantize_int8(values)
        scales = (_paged(key_scales, size), _paged(value_scales, size))
    args = (case["query"], _paged(keys, size), _paged(values, size), index, d**-0.5, *scales, lengths)
    want_out, want_lse = triton_pages.page_attention_reference(*args)
    for splits in (1, 3):
        out, lse = triton_pages.page_attention(*args, splits=splits)
        assert out.shape == (b, h, case["query"].shape[2], d) and lse.shape == out.shape[:3]
        torch.testing.assert_close(out, want_out, **TOLERANCE[torch.float32])
        torch.testing.assert_close(lse, want_lse, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_is_masked_attention_over_gathered_pages(dtype: torch.dtype) -> None:
    """Gathering the pages like ``FarTier.pages_of`` and attending with ``masked_attention`` gives the same
    output; merged with another part by ``merge_parts``, the union's softmax."""
    shape = (2, 2, 7, 1, 8, 13, 3, 64)
    b, h, groups, q_len, pages, size, chosen, d = shape
    case = _pages(shape, dtype, seed=4)
    query, keys, values, index = case["query"], case["keys"], case["values"], case["index"]
    take = (index.unsqueeze(-1) * size + torch.arange(size, device=DEVICE)).flatten(2)  # [B, H, k*page]
    gathered = [x.gather(2, take.unsqueeze(-1).expand(-1, -1, -1, d)) for x in (keys, values)]
    args = (query, _paged(keys, size), _paged(values, size), index, d**-0.5)
    out, lse = triton_pages.page_attention(*args)
    mask = torch.ones(b, h, q_len, chosen * size, dtype=torch.bool, device=DEVICE)
    want = masked_attention(
        query.reshape(b, h * groups, q_len, d).float(), *(x.float() for x in gathered), mask, d**-0.5
    )  # [B, q, Hq, D]
    got = out.view(b, h * groups, q_len, d).transpose(1, 2)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    other_k, other_v = (torch.randn(b, h, 10, d, generator=_gen(5)).to(DEVICE) for _ in range(2))
    logits = (query.float() @ other_k.transpose(-1, -2)) * d**-0.5
    other = (torch.softmax(logits, -1) @ other_v, torch.logsumexp(logits, -1))
    union = masked_attention(
        query.reshape(b, h * groups, q_len, d).float(),
        torch.cat([gathered[0].float(), other_k], 2),
        torch.cat([gathered[1].float(), other_v], 2),
        torch.ones(b, h, q_len, chosen * size + 10, dtype=torch.bool, device=DEVICE),
        d**-0.5,
    )
    merged = merge_parts([(out, lse), other]).view(b, h * groups, q_len, d).transpose(1, 2)
    torch.testing.assert_close(merged, union, **TOLERANCE[dtype])


@pytest.mark.skipif(INTERPRETED, reason="float16 / bfloat16 arithmetic needs a GPU (not in the interpreter)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
def test_page_attention_half_precision(dtype: torch.dtype, int8: bool) -> None:
    shape = ATTENTION_SHAPES[1]
    size, d = shape[5], shape[7]
    case = _pages(shape, dtype, seed=6)
    keys, values = case["keys"], case["values"]
    scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    if int8:
        (keys, key_scales), (values, value_scales) = quantize_int8(keys), quantize_int8(values)
        scales = (_paged(key_scales, size), _paged(value_scales, size))
    args = (case["query"], _paged(keys, size), _paged(values, size), case["index"], d**-0.5, *scales)
    want_out, want_lse = triton_pages.page_attention_reference(*args)
    out, lse = triton_pages.page_attention(*args)
    torch.testing.assert_close(out, want_out, **TOLERANCE[dtype])
    torch.testing.assert_close(lse, want_lse, **TOLERANCE[dtype])


def test_int8_reference_dequantizes_like_the_far_tier() -> None:
    case = _pages((1, 2, 1, 1, 3, 8, 2, 16), torch.float32, seed=7)
    (keys, key_scales), (values, value_scales) = quantize_int8(case["keys"]), quantize_int8(case["values"])
    quantized = (_paged(keys, 8), _paged(values, 8), case["index"], 0.25, _paged(key_scales, 8))
    plain = (
        _paged(dequantize_int8(keys, key_scales, torch.float32), 8),
        _paged(dequantize_int8(values, value_scales, torch.float32), 8),
        case["index"],
        0.25,
    )
    for got, want in zip(
        triton_pages.page_attention(case["query"], *quantized, _paged(value_scales, 8)),
        triton_pages.page_attention_reference(case["query"], *plain),
        strict=True,
    ):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_nothing_visible_and_bad_arguments() -> None:
    case = _pages((2, 1, 1, 1, 3, 8, 2, 16), torch.float32, seed=8)
    args = (case["query"], _paged(case["keys"], 8), _paged(case["values"], 8))
    index = torch.full_like(case["index"], -1)
    index[1] = case["index"][1]
    lengths = torch.tensor([24, 0], device=DEVICE)  # row 0 chooses nothing, row 1 holds nothing
    out, lse = triton_pages.page_attention(*args, index, 0.25, lengths=lengths)
    assert (out == 0).all() and torch.isneginf(lse).all()
    with pytest.raises(ValueError, match="INT8"):
        triton_pages.page_attention(*args, case["index"], 0.25, torch.ones(2, 1, 3, 8, 1, device=DEVICE))
    with pytest.raises(ValueError, match="page_index"):
        triton_pages.page_attention(*args, case["index"][0], 0.25)


def test_dkcache_scores_its_far_pages_in_the_kernel_through_generate() -> None:
    """``make_cache("dkcache:kernel=triton")`` + ``model.generate``: the far pages are scored by the Triton
    kernel (the CUDA default; here the interpreter) and the tokens equal the torch path's, batch 2, padded."""
    from through_methods import generate_per_backend

    spec = "dkcache:core=4,steady=16,page=8,pages=2,sinks=2,far_dtype=int8,kernel={}"
    outputs, caches = generate_per_backend(spec, DEVICE, 72, 10, padded_row=0, pad=6, seed=4)
    assert torch.equal(outputs["triton"], outputs["torch"])
    layers = [layer for layer in caches["triton"].layers if getattr(layer, "retrieval_steps", 0)]
    assert layers and {layer.scores_kernel for layer in layers} == {"triton"}
    assert caches["triton"].nbytes() == caches["torch"].nbytes()
