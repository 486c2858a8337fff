"""The Triton DK-Cache far-tier kernel (page upper bounds and scores) against torch and through the method.

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

pytestmark = pytest.mark.skipif(
    not triton_pages.available(), reason=f"Triton kernels cannot run: {triton_pages.unavailable_reason()}"
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = triton_pages.available() and not torch.cuda.is_available()


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


# ------------------------------------------------------------------------------------------ through the method


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
