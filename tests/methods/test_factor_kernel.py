"""DepthWeave's fused C++ selective-decode kernel against the torch reference path (gather, dequantize, rebuild,
rotate, matmul), on INT4 and INT8 coordinates, pre- and post-RoPE keys."""

from __future__ import annotations

import pytest
import torch

import kvweave
from conftest import tiny_model
from kvweave._compat import cache_kwarg
from kvweave.kernels import cpu_factor

needs_kernel = pytest.mark.skipif(
    cpu_factor.load() is None,
    reason=f"C++ factor kernel not buildable here: {cpu_factor.unavailable_reason()}",
)

OPTIONS = dict(
    recent=8, block=8, probe=8, window=8, sinks=2, group=2, compression=3.0, decode_tokens=8, page=4
)


def _generate(model, ids, **options):
    cache = kvweave.make_cache("depthweave", model, **{**OPTIONS, **options})
    out = model.generate(
        ids,
        max_new_tokens=10,
        min_new_tokens=10,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        **{cache_kwarg(model): cache},
    )
    return out, cache


@needs_kernel
@pytest.mark.parametrize("bits,keys", [(4, "pre_rope"), (8, "pre_rope"), (4, "post_rope")])
def test_fused_kernel_equals_the_torch_path(bits, keys):
    model = tiny_model("llama")
    torch.manual_seed(2)
    ids = torch.randint(3, 150, (1, 90))
    fused, cache = _generate(model, ids, bits=bits, keys=keys, kernel="cpp")
    reference, _ = _generate(model, ids, bits=bits, keys=keys, kernel="torch")
    assert torch.equal(fused.sequences, reference.sequences)
    gap = max((a - b).abs().max().item() for a, b in zip(fused.logits, reference.logits, strict=True))
    assert gap < 1e-4
    store = cache.layers[0].group.rows[0]
    assert sum(s.bounds[0].pages for s in store.segments.values()) > 2  # selection really chose a subset


def test_kernel_cpp_refuses_coordinates_it_cannot_read():
    model = tiny_model("llama")
    ids = torch.randint(3, 150, (1, 90))
    if cpu_factor.load() is None:
        pytest.skip("no C++ kernel here")
    with pytest.raises(RuntimeError, match="kernel=cpp"):
        _generate(model, ids, bits=16, kernel="cpp")


@needs_kernel
@pytest.mark.parametrize("dim", [48, 64, 128])
@pytest.mark.parametrize("bits", [4, 8])
def test_kernel_at_real_head_sizes_equals_the_rebuild_in_torch(dim, bits):
    """At the head sizes real models use (64, 128: the register-resident rebuild; 48: the general loop) and odd
    coordinate widths, the kernel's logits and weighted value coordinates equal the torch rebuild: gather the
    rows, dequantize, project on ``R``, rotate, score."""
    from kvweave.ops.quantize import pack

    torch.manual_seed(dim + bits)
    heads, queries, n, width, used, chosen = 2, 7, 300, 37, 33, 70
    packed = pack(torch.randn(n, width), bits, 64, torch.float32)
    r_k = torch.randn(used, heads, dim)
    rows = torch.randint(0, n, (heads, chosen))
    positions = torch.randperm(400)[:n].to(torch.int32)
    angles = torch.arange(400).float().unsqueeze(1) * torch.rand(dim // 2).repeat(2)
    cos, sin = angles.cos(), angles.sin()
    query = torch.randn(heads, queries, dim)
    coords = packed.dequantize()  # [n, width]
    keys = torch.einsum("htw,whd->htd", coords[rows][..., :used], r_k)  # [H, T, D]
    c, s = cos[positions[rows].long()], sin[positions[rows].long()]
    half = dim // 2
    rotated = keys * c + torch.cat([-keys[..., half:], keys[..., :half]], -1) * s
    expected = query @ rotated.transpose(-1, -2)  # [H, G, T]
    got = cpu_factor.factor_logits(query, packed, r_k, rows, positions, cos, sin)
    assert torch.allclose(got, expected, atol=1e-3, rtol=1e-4)
    unrotated = cpu_factor.factor_logits(query, packed, r_k, rows, None, None, None)
    assert torch.allclose(unrotated, query @ keys.transpose(-1, -2), atol=1e-3, rtol=1e-4)
    probs = torch.rand(heads, queries, chosen)
    weighted = cpu_factor.factor_weighted(probs, packed, rows)
    assert torch.allclose(weighted, probs @ coords[rows], atol=1e-4, rtol=1e-4)
