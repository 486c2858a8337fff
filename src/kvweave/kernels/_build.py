"""Building kvweave's C++ CPU kernels on first use (``torch.utils.cpp_extension.load_inline``), once per machine.

A kernel that cannot be built (no compiler, no ninja, ``KVWEAVE_NO_CPP=1``) is reported, not fatal: callers
use their torch reference path, and say which one ran.
"""

from __future__ import annotations

import os
import warnings
from typing import Any


def build(
    name: str, declarations: str, source: str, functions: list[str], openmp: bool = True
) -> tuple[Any | None, str | None]:
    """``(module, None)`` or ``(None, reason)`` for the C++ ``source`` exporting ``functions``.

    With ``openmp`` (the default) the extension links ``libgomp.so.1``, which resolves to the copy torch has
    already loaded, so ``#pragma omp`` and ``at::parallel_for`` share torch's thread pool; ``openmp=False``
    builds it single-threaded (``simd`` pragmas only)."""
    if os.environ.get("KVWEAVE_NO_CPP", "") not in ("", "0"):
        return None, "disabled by KVWEAVE_NO_CPP"
    try:
        from torch.utils import cpp_extension

        module = cpp_extension.load_inline(
            name=name,
            cpp_sources=[declarations, source.replace("#include <torch/extension.h>", "")],
            functions=functions,
            extra_cflags=["-O3", "-march=native", "-fopenmp" if openmp else "-fopenmp-simd"],
            extra_ldflags=["-fopenmp"] if openmp else [],
            verbose=False,
        )
        return module, None
    except Exception as exc:  # no compiler, no ninja, unsupported platform: report and use the torch path
        text = str(exc).strip()
        reason = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
        warnings.warn(
            f"kvweave: the C++ kernel {name} could not be built ({reason}); using torch", stacklevel=3
        )
        return None, reason
