"""What the Triton kernels share: whether they can run here, the torch attention they are tested against,
the split heuristic of their flash-decoding grids and the merge of split partials.

Nothing in :mod:`kvweave` imports a Triton kernel module at import time; a method imports one lazily when its
tensors are on CUDA and :func:`available` is true. Triton decides between compiling and interpreting when a
kernel module is imported (``@triton.jit`` reads ``TRITON_INTERPRET`` then), so ``TRITON_INTERPRET=1`` must
be set before the first import of a kernel module for the interpreter to run them on a CPU (the tests in
``tests/kernels`` do so when no CUDA device is present; the interpreter has no bfloat16 arithmetic, so they
run float32 there).
"""

from __future__ import annotations

import functools
import math
import os

import torch

from kvweave.ops.attention import (
    attention_with_lse,  # noqa: F401  (the kernels' reference)
    merge_splits,  # noqa: F401  (the flash-decoding splits' merge)
)

try:  # triton is an optional extra (``pip install 'kvweave[gpu]'``)
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    HAVE_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
"""Whether kernel modules imported now are interpreted (read once, like ``@triton.jit`` does)."""


def available() -> bool:
    """True when the Triton kernels can run: triton importable and a CUDA device present, or kernel modules
    imported under ``TRITON_INTERPRET=1`` (the interpreter, on CPU tensors)."""
    return HAVE_TRITON and (INTERPRET or torch.cuda.is_available())


def unavailable_reason() -> str | None:
    """Why :func:`available` is false (``None`` when it is true)."""
    if not HAVE_TRITON:
        return "triton is not installed (pip install 'kvweave[gpu]')"
    if not available():
        return "no CUDA device and TRITON_INTERPRET=1 was not set before the kernels were imported"
    return None


def block_size(n: int, low: int = 16, high: int = 128) -> int:
    """The power of two ``>= n`` clamped to ``[low, high]`` (``tl.dot`` wants every dimension >= 16)."""
    return max(low, min(high, _next_power_of_2(n)))


def _next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


@functools.lru_cache(maxsize=8)
def _multiprocessors(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def split_count(programs: int, tiles: int, device: torch.device, splits: int | None) -> int:
    """Splits of the token axis for a grid of ``programs`` (batch x heads x row blocks) over ``tiles`` token
    tiles: ``splits`` when given, else enough to give every multiprocessor about two programs (one split
    under the interpreter, where more programs only cost time)."""
    if splits is None:
        if device.type != "cuda" or INTERPRET:
            splits = 1
        else:
            splits = math.ceil(2 * _multiprocessors(device.index or 0) / max(1, programs))
    return max(1, min(int(splits), max(1, tiles)))
