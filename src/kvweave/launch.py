"""``kvweave generate --tp N`` and ``kvweave eval --tp N``: re-execute the command under ``torchrun`` with ``N``
local ranks (:func:`launch`), unless it already runs as one of them (:func:`needs_launch`).

Re-exported by :mod:`kvweave.distributed`. It imports :mod:`kvweave.tp` and, inside :func:`launch` (a model's head
counts are checked once before the ranks start), :mod:`kvweave.models`; neither of those imports it back.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

from kvweave.tp import TensorParallelError, check_head_counts

__all__ = ["launch", "needs_launch", "torchrun_command"]


def torchrun_command(argv: list[str], ranks: int) -> list[str]:
    """The command that runs ``kvweave ARGV`` on ``ranks`` local processes (one machine, a free port)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        "-m",
        "kvweave.cli",
        *argv,
    ]


def launch(argv: list[str], ranks: int, model: str | None = None) -> int:
    """Run ``kvweave ARGV`` under ``torchrun`` with ``ranks`` processes and return its exit status.

    ``model`` (a registry name or folder), when given, is checked first: head counts that do not divide by
    ``ranks`` are refused here, once, instead of by every rank. Each rank gets ``OMP_NUM_THREADS = cpus / ranks``
    unless it is set (torchrun would give every rank one thread)."""
    if model is not None:
        from transformers import AutoConfig

        from kvweave._compat import text_config
        from kvweave.models import resolve

        check_head_counts(text_config(AutoConfig.from_pretrained(resolve(model))), ranks)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
    print(
        f"kvweave: launching {ranks} tensor-parallel ranks: {shlex.join(torchrun_command(argv, ranks))}",
        file=sys.stderr,
    )
    return subprocess.run(torchrun_command(argv, ranks), env=env, check=False).returncode


def needs_launch(ranks: int) -> bool:
    """Whether a command given ``--tp ranks`` must first start its ranks (it is not running under torchrun);
    :class:`TensorParallelError` when it runs under a torchrun of another size."""
    if ranks < 1:
        raise TensorParallelError(f"--tp must be at least 1, got {ranks}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if "WORLD_SIZE" not in os.environ:
        return ranks > 1
    if world != ranks:
        raise TensorParallelError(
            f"--tp {ranks} runs under a torchrun of {world} processes; give --tp {world} or launch "
            f"{ranks} processes (or drop torchrun: `kvweave ... --tp {ranks}` starts them itself)"
        )
    return False
