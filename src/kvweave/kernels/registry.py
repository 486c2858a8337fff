"""Which kernel runs a method's hot loop: one rule for every method and backend.

A :class:`Kernel` names a hot loop (``quant`` decode attention, DK-Cache's far-page bounds) and where its
fast paths live: a C++ CPU kernel (a module with ``load()`` / ``unavailable_reason()``, built on first use by
:mod:`kvweave.kernels._build`) and a Triton module (imported lazily, only when chosen). :func:`choose` turns a
method's ``kernel`` option into the backend that runs:

- ``auto``: Triton on CUDA when triton is installed, the C++ kernel on the CPU when it builds, else torch.
- ``cpp`` / ``triton``: that backend or a one-line error saying why not and the way out. ``triton`` on CPU
  tensors runs only under Triton's interpreter (``TRITON_INTERPRET=1`` set before the first kernel import:
  what the tests do to drive the Triton paths through the methods without a GPU).
- ``torch``: the reference every fast path is tested against.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from types import ModuleType
from typing import Any

import torch

BACKENDS = ("auto", "cpp", "triton", "torch")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A method's hot loop and its fast paths: ``cpp`` (module path of a C++ kernel with ``load()`` and
    ``unavailable_reason()``) and ``triton`` (module path of a Triton kernel with ``available()`` and
    ``unavailable_reason()``), either ``None`` when that backend has none."""

    name: str
    cpp: str | None = None
    triton: str | None = None

    def module(self, backend: str) -> ModuleType:
        """The ``cpp`` or ``triton`` module (imported now)."""
        path = self.cpp if backend == "cpp" else self.triton
        if path is None:
            raise ValueError(f"{self.name}: no {backend} kernel")
        return importlib.import_module(path)


@functools.lru_cache(maxsize=64)
def choose(kernel: Kernel, choice: str, device: torch.device) -> str:
    """The backend (``cpp``, ``triton`` or ``torch``) that runs ``kernel`` for option ``choice`` on ``device``.

    Remembered per arguments (layers ask every decode step; whether a kernel builds or triton runs does not
    change within a process: the C++ loaders and ``TRITON_INTERPRET`` are read once)."""
    if choice not in BACKENDS:
        raise ValueError(f"{kernel.name}: kernel={choice!r}; allowed: {', '.join(BACKENDS)}")
    if choice == "torch":
        return "torch"
    if choice == "auto":
        if device.type == "cuda" and _triton_reason(kernel, device) is None:
            return "triton"
        if device.type == "cpu" and _cpp_reason(kernel, device) is None:
            return "cpp"
        return "torch"
    reason = _triton_reason(kernel, device) if choice == "triton" else _cpp_reason(kernel, device)
    if reason is not None:
        raise RuntimeError(f"{kernel.name}: kernel={choice!r} cannot run here ({reason}); use kernel='auto'")
    return choice


def _cpp_reason(kernel: Kernel, device: torch.device) -> str | None:
    if kernel.cpp is None:
        return "no C++ kernel for it"
    if device.type != "cpu":
        return f"the C++ kernels run on the CPU, the cache is on {device}"
    module: Any = kernel.module("cpp")
    return None if module.load() is not None else module.unavailable_reason()


def _triton_reason(kernel: Kernel, device: torch.device) -> str | None:
    if kernel.triton is None:
        return "no Triton kernel for it"
    from kvweave.kernels.triton_common import HAVE_TRITON, INTERPRET

    if not HAVE_TRITON:
        return "triton is not installed (pip install 'kvweave[gpu]')"
    if device.type == "cpu" and not INTERPRET:
        return "Triton kernels run on CUDA, or on the CPU under TRITON_INTERPRET=1"
    if device.type not in ("cpu", "cuda"):
        return f"Triton kernels run on CUDA, the cache is on {device}"
    module: Any = kernel.module("triton")
    return None if module.available() else module.unavailable_reason()
