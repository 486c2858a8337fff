"""DepthWeave's Triton selective-decode kernels against the torch path, op by op and through the method.

Skipped where triton is not installed. Without a CUDA device the kernels run in Triton's interpreter
(``TRITON_INTERPRET=1``, set below before the kernel module is imported; float32).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # @triton.jit reads this when the kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from through_methods import generate_per_backend  # noqa: E402

from kvweave.kernels import triton_factor  # noqa: E402
from kvweave.ops.quantize import pack  # noqa: E402
from kvweave.ops.rope import rotate_half  # noqa: E402

pytestmark = pytest.mark.skipif(
    not triton_factor.available(), reason=f"Triton kernels cannot run: {triton_factor.unavailable_reason()}"
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

SHAPES = [  # n stored rows, coordinate width w (R uses w' <= w), KV heads H, query heads per KV head G, D, T
    (40, 12, 9, 1, 1, 16, 5),  # less than a tile of everything
    (300, 64, 64, 2, 7, 64, 70),  # qwen-like: 7 query heads per KV head, 2.2 tiles of chosen tokens
    (129, 33, 20, 3, 3, 128, 32),  # odd width (a half-filled INT4 byte), w' < w, D = 128
    (64, 16, 16, 8, 4, 96, 33),  # D / 2 = 48: not a power of two
]


def _case(shape: tuple[int, ...], bits: int, seed: int = 0) -> dict:
    n, width, used, heads, groups, dim, tokens = shape
    gen = torch.Generator().manual_seed(seed)
    coords = torch.randn(n, width, generator=gen) * torch.linspace(3, 0.2, width)
    return dict(
        packed=pack(coords.to(DEVICE), bits, 64, torch.float16),
        r_k=torch.randn(used, heads, dim, generator=gen).to(DEVICE),
        query=torch.randn(heads, groups, dim, generator=gen).to(DEVICE),
        rows=torch.randint(0, n, (heads, tokens), generator=gen).to(DEVICE),
        positions=torch.randint(0, 500, (n,), generator=gen).to(torch.int32).to(DEVICE),
        probs=torch.rand(heads, groups, tokens, generator=gen).to(DEVICE),
    )


def _table(dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.outer(torch.arange(512).float(), inv)
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(DEVICE), emb.sin().to(DEVICE)


def _reference_logits(case: dict, rotate: bool) -> torch.Tensor:
    """The torch path: gather the rows, dequantize, rebuild with ``R_k``, rotate, score."""
    r_k = case["r_k"]
    coords = case["packed"].gather_rows(case["rows"])[..., : r_k.shape[0]]  # [H, T, w']
    keys = coords @ r_k.permute(1, 0, 2)  # [H, T, D]
    if rotate:
        cos, sin = _table(r_k.shape[2])
        pos = case["positions"][case["rows"]].long()
        keys = keys * cos[pos] + rotate_half(keys) * sin[pos]
    return case["query"] @ keys.transpose(-1, -2)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rotate", [True, False])
def test_factor_logits_match_the_torch_path(shape: tuple[int, ...], bits: int, rotate: bool) -> None:
    case = _case(shape, bits)
    cos, sin = _table(shape[5]) if rotate else (None, None)
    got = triton_factor.factor_logits(
        case["query"],
        case["packed"],
        case["r_k"],
        case["rows"],
        case["positions"] if rotate else None,
        cos,
        sin,
    )
    want = _reference_logits(case, rotate)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", SHAPES)
def test_factor_weighted_matches_the_torch_path(shape: tuple[int, ...], bits: int) -> None:
    case = _case(shape, bits)
    got = triton_factor.factor_weighted(case["probs"], case["packed"], case["rows"])
    want = case["probs"] @ case["packed"].gather_rows(case["rows"])  # [H, G, w]
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_factor_kernels_refuse_what_they_cannot_read() -> None:
    case = _case(SHAPES[0], 4)
    assert not triton_factor.supports(pack(torch.randn(8, 4), 16, 64, torch.float16))
    with pytest.raises(ValueError, match="odd"):
        triton_factor.factor_logits(
            case["query"][..., :15], case["packed"], case["r_k"], case["rows"], None, None, None
        )


@pytest.mark.parametrize("keys", ["pre_rope", "post_rope"])
@pytest.mark.parametrize("bits", [4, 8])
def test_depthweave_selective_decode_runs_the_triton_kernels_through_generate(
    bits: int, keys: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``make_cache`` + ``model.generate`` with ``depthweave:kernel=triton`` (selective decode on the Triton
    kernels) gives the torch path's tokens and bytes, batch 2 with left padding, a subset of pages chosen."""
    calls = {"factor_logits": 0, "factor_weighted": 0}
    for name in calls:
        kernel = getattr(triton_factor, name)

        def counted(*args, _kernel=kernel, _name=name, **kwargs):  # type: ignore[no-untyped-def]
            calls[_name] += 1
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(triton_factor, name, counted)
    spec = (
        "depthweave:kernel={},recent=8,block=8,probe=8,window=8,sinks=2,group=2,compression=3,"
        f"decode_tokens=8,page=4,bits={bits},keys={keys}"
    )
    outputs, caches = generate_per_backend(spec, DEVICE, 90, 8, padded_row=1, pad=5, seed=2)
    assert torch.equal(outputs["triton"], outputs["torch"])
    assert caches["triton"].nbytes() == caches["torch"].nbytes()
    store = caches["triton"].layers[0].group.rows[0]
    assert sum(s.bounds[0].pages for s in store.segments.values()) > 2  # selection really chose a subset
    assert (
        calls["factor_logits"] > 0 and calls["factor_weighted"] > 0
    )  # the triton run went through the kernels
