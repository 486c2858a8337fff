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
@pytest.mark.parametrize("blocked", [True, False])
@pytest.mark.parametrize(
    "b,h,r,t,d",
    [
        (1, 2, 7, 1500, 64),
        (2, 3, 1, 5, 16),
        (1, 1, 3, 1025, 128),
        (2, 2, 2, 0, 8),
        (1, 2, 19, 77, 24),
        (1, 1, 4, 9, 6),
    ],
)
def test_kernel_equals_reference(b, h, r, t, d, blocked):
    # blocked: query rows in groups of 8 lanes (19 rows = 2 full groups + 3), token blocks of 8 and 64 with
    # short tails; a head dim of 6 is not a multiple of 8 and takes the plain form either way
    torch.manual_seed(0)
    codes, scale = quantize_int8(torch.randn(b, h, t + 7, d))
    codes, scale = codes[:, :, 3 : 3 + t], scale[:, :, 3 : 3 + t]  # a view into a larger buffer (tier layout)
    rows = cpu_int8.HeldRows(codes, scale, blocked=blocked)
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
@pytest.mark.parametrize("blocked", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "b,h,r,t,d", [(1, 2, 7, 1500, 64), (2, 3, 1, 5, 16), (2, 2, 2, 0, 8), (1, 1, 9, 70, 32)]
)
def test_kernel_reads_16_bit_rows_like_the_widened_reference(dtype, b, h, r, t, d, blocked):
    # the exact core at 16-bit storage: the kernel widens each row in registers, the reference widens the tier
    torch.manual_seed(0)
    held = torch.randn(b, h, t + 7, d).to(dtype)[:, :, 3 : 3 + t]  # a view into a larger buffer
    rows = cpu_int8.HeldRows(held, None, blocked=blocked)
    assert rows.kernel_used == "cpp"
    query, weights = torch.randn(b, h, r, d), torch.rand(b, h, r, t)
    torch.testing.assert_close(
        rows.logits(query), query @ held.float().transpose(-1, -2), rtol=1e-4, atol=1e-4
    )
    torch.testing.assert_close(rows.weighted(weights), weights @ held.float(), rtol=1e-4, atol=1e-4)


def test_rows_without_a_scale_must_be_16_bit():
    with pytest.raises(ValueError, match="need a scale"):
        cpu_int8.HeldRows(torch.zeros(1, 1, 2, 4, dtype=torch.int8), None)


@needs_kernel
def test_blocked_form_is_built_on_avx2_machines():
    # the blocked form is the one DK-Cache's step relies on for speed; a build without it must be visible
    flags = open("/proc/cpuinfo").read() if __import__("os").path.exists("/proc/cpuinfo") else ""
    if not all(f in flags.split() for f in ("avx2", "fma", "f16c")):
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    assert cpu_int8.blocked_available()


@needs_kernel
@pytest.mark.parametrize("widths", [(3, 1000, 33), (1,), (17, 0, 9)])
def test_parts_softmax_equals_the_concatenated_softmax(widths):
    # hidden entries (-inf), a row hidden in every part (padding: zeros), parts of odd and empty widths
    torch.manual_seed(0)
    logits = [torch.randn(2, 2, 7, w) * 5 for w in widths]
    logits[0][0, 0, 0, 0] = float("-inf")
    for part in logits:
        part[1, :, 2] = float("-inf")
    probs, entropy = cpu_int8.parts_softmax(logits, 0.125)
    expected, expected_entropy = cpu_int8.parts_softmax_reference(logits, 0.125)
    for got, want in zip(probs, expected, strict=True):
        assert got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(entropy, expected_entropy, rtol=1e-4, atol=1e-5)
    assert bool((entropy[1, :, 2] == 0).all()) and all(bool((p[1, :, 2] == 0).all()) for p in probs)
    assert all(bool(torch.isfinite(p).all()) for p in probs)
