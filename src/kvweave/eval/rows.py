"""A run folder's rows: reading them back (a torn last line from a crash is skipped), what is finished, and the
environment written beside every run."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kvweave._compat import TRANSFORMERS_VERSION


def environment() -> dict[str, Any]:
    """Hardware, versions and git revision, written beside every run."""
    try:
        revision = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        revision = ""
    import kvweave

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": TRANSFORMERS_VERSION,
        "kvweave": kvweave.__version__,
        "git": revision,
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
    }


def finished_keys(rows_path: Path) -> set[str]:
    """Keys of rows already written (a truncated last line from a crash is ignored)."""
    keys: set[str] = set()
    if rows_path.exists():
        for line in rows_path.read_text().splitlines():
            try:
                keys.add(json.loads(line)["key"])
            except (json.JSONDecodeError, KeyError):
                continue
    return keys


def _end_with_newline(path: Path) -> None:
    """After a crash mid-write, start the next row on a line of its own (the torn one is ignored)."""
    if path.exists() and path.stat().st_size:
        with path.open("rb+") as handle:
            handle.seek(-1, os.SEEK_END)
            if handle.read(1) != b"\n":
                handle.write(b"\n")


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a run folder (or a rows file)."""
    rows_path = path / "rows.jsonl" if path.is_dir() else path
    rows = []
    for line in rows_path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def iter_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Rows of a JSONL file."""
    yield from read_rows(path)
