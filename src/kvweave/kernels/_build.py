"""Building kvweave's C++ CPU kernels on first use (``torch.utils.cpp_extension.load_inline``), once per machine.

Each kernel's source is a ``.cpp`` file beside its Python module (:func:`source` reads it).

Builds live under ``$KVWEAVE_HOME/kernels`` (:func:`build_folder`), not torch's own extension folder; a first
build says so on stderr and how long it took.

A kernel that cannot be built (no compiler, no ninja, ``KVWEAVE_NO_CPP=1``) is reported, not fatal: callers
use their torch reference path, and say which one ran.

Builds of one kernel are serialised by :func:`exclusive` (an ``flock`` the kernel drops when its holder dies), so
torch's own build lock (a ``lock`` file it deletes when done) found inside that lock can only be one a killed build
left behind: it is removed with a warning instead of torch waiting on it forever.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def source(filename: str) -> str:
    """The C++ source ``filename`` kept beside the kernel modules (``kernels/*.cpp``, shipped as package data)."""
    return (Path(__file__).resolve().parent / filename).read_text()


def build_folder(name: str) -> Path:
    """Where kernel ``name`` is built: ``$KVWEAVE_HOME/kernels/torch-<version>-py<major><minor>/<name>``
    (one folder per torch and Python version, so a new venv with the same versions reuses the build)."""
    import torch

    from kvweave.models import kvweave_home

    version = f"torch-{torch.__version__.replace('+', '-')}-py{sys.version_info[0]}{sys.version_info[1]}"
    return kvweave_home() / "kernels" / version / name


@contextlib.contextmanager
def exclusive(folder: Path) -> Iterator[None]:
    """Hold the build lock of the kernel built in ``folder`` (``<folder>.build-lock``, an ``flock``).

    Says on stderr when another process holds it (its build is waited for); once held, a torch ``lock`` file left
    in ``folder`` by a build that was killed is removed with a warning (torch would otherwise wait on it forever,
    silently). The lock is :func:`kvweave.models.file_lock`'s, the one model pulls take."""
    from kvweave.models import file_lock

    folder.mkdir(parents=True, exist_ok=True)
    waiting = f"kvweave: waiting for another process building the C++ kernel {folder.name} in {folder}..."
    with file_lock(folder.parent / f"{folder.name}.build-lock", waiting):
        stale = folder / "lock"
        if stale.exists():
            warnings.warn(
                f"kvweave: removing {stale}, left by a build of {folder.name} that was interrupted",
                stacklevel=3,
            )
            stale.unlink(missing_ok=True)
        yield


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

        folder = build_folder(name)
        folder.mkdir(parents=True, exist_ok=True)
        fresh = not any(folder.glob("*.so"))
        if fresh:
            print(
                f"kvweave: building the C++ kernel {name} in {folder} (once per machine and torch version, "
                "about a minute)...",
                file=sys.stderr,
                flush=True,
            )
        start = time.perf_counter()
        with exclusive(folder):
            module = cpp_extension.load_inline(
                name=name,
                cpp_sources=[declarations, source.replace("#include <torch/extension.h>", "")],
                functions=functions,
                extra_cflags=["-O3", "-march=native", "-fopenmp" if openmp else "-fopenmp-simd"],
                extra_ldflags=["-fopenmp"] if openmp else [],
                build_directory=str(folder),
                verbose=False,
            )
        seconds = time.perf_counter() - start
        if fresh or seconds > 5:  # a first build, or a rebuild after the source changed
            print(f"kvweave: C++ kernel {name} ready ({seconds:.0f} s)", file=sys.stderr, flush=True)
        return module, None
    except Exception as exc:  # no compiler, no ninja, unsupported platform: report and use the torch path
        text = str(exc).strip()
        reason = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
        warnings.warn(
            f"kvweave: the C++ kernel {name} could not be built ({reason}); using torch", stacklevel=3
        )
        return None, reason
