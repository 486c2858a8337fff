"""The fused INT8 CPU kernel (DK-Cache's tiers) against its torch reference, over odd shapes and strides."""

from __future__ import annotations

import pytest
import torch

from kvweave.kernels import cpu_int8
from kvweave.ops.quantize import quantize_int8

needs_kernel = pytest.mark.skipif(
    cpu_int8.load() is None, reason=f"C++ int8 kernel not buildable here: {cpu_int8.unavailable_reason()}"
)


@needs_kernel
@pytest.mark.parametrize(
    "b,h,r,t,d", [(1, 2, 7, 1500, 64), (2, 3, 1, 5, 16), (1, 1, 3, 1025, 128), (2, 2, 2, 0, 8)]
)
def test_kernel_equals_reference(b, h, r, t, d):
    torch.manual_seed(0)
    codes, scale = quantize_int8(torch.randn(b, h, t + 7, d))
    codes, scale = codes[:, :, 3 : 3 + t], scale[:, :, 3 : 3 + t]  # a view into a larger buffer (tier layout)
    rows = cpu_int8.HeldRows(codes, scale)
    assert rows.kernel_used == "cpp"
    query = torch.randn(b, h, r, d)
    torch.testing.assert_close(
        rows.logits(query), cpu_int8.logits_reference(query, codes, scale), rtol=1e-4, atol=1e-4
    )
    weights = torch.rand(b, h, r, t)
    torch.testing.assert_close(
        rows.weighted(weights), cpu_int8.values_reference(weights, codes, scale), rtol=1e-4, atol=1e-4
    )


def test_reference_path_when_asked():
    codes, scale = quantize_int8(torch.randn(1, 2, 9, 8))
    rows = cpu_int8.HeldRows(codes, scale, use_kernel=False)
    assert rows.kernel_used == "torch"
    query = torch.randn(1, 2, 3, 8)
    expected = query @ (codes.float() * scale).transpose(-1, -2)
    torch.testing.assert_close(rows.logits(query), expected)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,h,r,t,d", [(1, 2, 7, 1500, 64), (2, 3, 1, 5, 16), (2, 2, 2, 0, 8)])
def test_kernel_reads_16_bit_rows_like_the_widened_reference(dtype, b, h, r, t, d):
    # the exact core at 16-bit storage: the kernel widens each row in registers, the reference widens the tier
    torch.manual_seed(0)
    held = torch.randn(b, h, t + 7, d).to(dtype)[:, :, 3 : 3 + t]  # a view into a larger buffer
    rows = cpu_int8.HeldRows(held, None)
    assert rows.kernel_used == "cpp"
    query, weights = torch.randn(b, h, r, d), torch.rand(b, h, r, t)
    torch.testing.assert_close(
        rows.logits(query), query @ held.float().transpose(-1, -2), rtol=1e-4, atol=1e-4
    )
    torch.testing.assert_close(rows.weighted(weights), weights @ held.float(), rtol=1e-4, atol=1e-4)


def test_rows_without_a_scale_must_be_16_bit():
    with pytest.raises(ValueError, match="need a scale"):
        cpu_int8.HeldRows(torch.zeros(1, 1, 2, 4, dtype=torch.int8), None)
