"""The Triton kernels stay off CPU-only code paths, and their modules import cleanly without triton."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
import torch
import kvweave, kvweave.methods, kvweave.attention, kvweave.cache, kvweave.cli
loaded = sorted(m for m in sys.modules if m.startswith("kvweave.kernels.triton"))
assert not loaded, f"imported on the CPU path: {loaded}"
sys.modules["triton"] = None  # from here on, as if triton were not installed
from kvweave.kernels import triton_factor, triton_pages, triton_quant
for module in (triton_factor, triton_pages, triton_quant):
    assert not module.available() and "not installed" in module.unavailable_reason()
query, low = torch.randn(1, 1, 2, 16), torch.randn(1, 1, 3, 16)
assert triton_pages.page_upper_bounds_reference(query, low, low + 1).shape == (1, 1, 2, 3)
try:
    triton_pages.page_upper_bounds(query, low, low + 1)
except RuntimeError as error:
    assert "not installed" in str(error), error
else:
    raise AssertionError("the kernel ran without triton")
try:
    triton_factor.factor_weighted(torch.ones(1, 1, 1), None, torch.zeros(1, 1, dtype=torch.long))
except RuntimeError as error:
    assert "not installed" in str(error), error
else:
    raise AssertionError("the kernel ran without triton")
print("ok")
"""


def test_kernels_are_not_imported_by_the_package_and_degrade_without_triton() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
