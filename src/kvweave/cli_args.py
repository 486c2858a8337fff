"""Helpers of the ``kvweave`` command line: method-spec lists with sweeps, token counts, run-folder commands,
loading a model and a saved cache for ``kvweave generate``."""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Any


def _split(text: str) -> list[str]:
    """Split a comma list of method specs, keeping 'name:k=v,k=v' together."""
    items: list[str] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if items and "=" in part and ":" not in part.split("=")[0]:
            items[-1] += "," + part  # an option of the previous method
        else:
            items.append(part)
    return items


def _methods(text: str) -> list[str]:
    """Method specs from a comma list, with option sweeps expanded: ``window:ratio=0.25|0.125`` is two specs
    (several swept options give every combination)."""
    specs = []
    for item in _split(text):
        name, _, options = item.partition(":")
        choices = [
            [f"{key}={value}" for value in values.split("|")]
            for key, _, values in (pair.partition("=") for pair in options.split(",") if pair)
        ]
        for combination in itertools.product(*choices):
            specs.append(name + (":" + ",".join(combination) if combination else ""))
    return specs


def _ints(text: str) -> list[int]:
    """Token counts like ``2048,4096`` or ``4k,8K`` (k = 1024, as in "a 4K context")."""
    values = []
    for item in (v.strip().lower() for v in text.split(",")):
        if not item:
            continue
        try:
            values.append(int(float(item[:-1]) * 1024) if item.endswith("k") else int(item))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated token counts like 2048,4096 or 4k,8k, got {text!r}"
            ) from None
    return values


def _write_command(folder: Path) -> None:
    """Record the command line that produced (part of) a run folder beside its results: a resumed or
    extended run adds its command as a new line, so every row's producer stays listed."""
    path = folder / "command.txt"
    line = "kvweave " + " ".join(sys.argv[1:])
    held = path.read_text().splitlines() if path.exists() else []
    if line not in held:
        path.write_text("\n".join([*held, line]) + "\n")


def _load(args: argparse.Namespace) -> tuple[Any, Any]:
    from kvweave.models import load_model

    print(f"loading {args.model} ({args.dtype}) ...", file=sys.stderr)
    return load_model(args.model, dtype=args.dtype)


def _loaded_cache(path: str, model: Any, ids: Any) -> Any:
    """The saved cache at ``path``, checked to be a prefix of the prompt ``ids``."""
    from kvweave.persist import load_cache

    cache, manifest = load_cache(path, model)
    cached = manifest.prompt_ids
    if not cached or len(cached) != 1:
        raise ValueError(
            f"{path}: the saved cache records no single prompt to check against; save it with "
            "`kvweave generate --save-cache`"
        )
    prefix = cached[0]
    given = ids[0].tolist()
    if len(given) <= len(prefix) or given[: len(prefix)] != prefix:
        where = next(
            (i for i, (a, b) in enumerate(zip(prefix, given, strict=False)) if a != b),
            min(len(prefix), len(given)),
        )
        raise ValueError(
            f"the prompt ({len(given)} tokens) does not continue the {len(prefix)} cached tokens of {path} "
            f"(first difference at token {where}); give the cached prompt followed by new text, with --raw so "
            "no chat template wraps it"
        )
    print(f"loaded the cache of {len(prefix)} prompt tokens from {path} ({manifest.method})", file=sys.stderr)
    return cache
