"""Helpers of the ``kvweave`` command line: method-spec lists with sweeps, token counts, run-folder commands,
loading a model and a saved cache for ``kvweave generate``."""

from __future__ import annotations

import argparse
import errno
import itertools
import math
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


def _methods(text: str, allow_empty: bool = False) -> list[str]:
    """Method specs from a comma list, with option sweeps expanded: ``window:ratio=0.25|0.125`` is two specs
    (several swept options give every combination). An empty list is refused unless ``allow_empty``."""
    if not allow_empty and not _split(text):
        raise ValueError(f"--methods {text!r} names no method; give method specs like full,window:ratio=0.25")
    specs = []
    for item in _split(text):
        name, _, options = item.partition(":")
        if not options.strip() or "|" not in options:  # nothing to sweep: as written (parse_method judges it)
            specs.append(item)
            continue
        choices = []
        for pair in (p for p in options.split(",") if p):
            key, eq, values = pair.partition("=")
            choices.append([f"{key}={value}" for value in values.split("|")] if eq else [pair])
        for combination in itertools.product(*choices):
            specs.append(name + (":" + ",".join(combination) if combination else ""))
    return specs


def _ints(text: str) -> list[int]:
    """Token counts like ``2048,4096`` or ``4k,8K`` (k = 1024, as in "a 4K context"); each positive."""
    values = [_count_of(item, text) for item in (v.strip().lower() for v in text.split(",")) if item]
    if not values:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token counts like 2048,4096 or 4k,8k, got {text!r}"
        )
    return values


def _length(text: str) -> int:
    """One token count like ``2048`` or ``4k`` (k = 1024), positive: what every single-length option takes."""
    item = text.strip().lower()
    if not item or "," in item:
        raise argparse.ArgumentTypeError(f"expected one token count like 2048 or 4k, got {text!r}")
    return _count_of(item, text)


def _whole(text: str, minimum: int, example: int) -> int:
    """``text`` as a whole number of at least ``minimum`` (``argparse`` type error otherwise)."""
    try:
        value = int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number like {example}, got {text!r}") from None
    if value < minimum:
        least = "at least 1" if minimum == 1 else f"{minimum} or more"
        raise argparse.ArgumentTypeError(f"expected {least}, got {value}")
    return value


def _count(text: str) -> int:
    """A positive whole number (trials, rounds, windows, layers)."""
    return _whole(text, 1, 3)


def _non_negative(text: str) -> int:
    """A whole number >= 0 (e.g. warm-up steps)."""
    return _whole(text, 0, 2)


_MAX_TOKENS = 2**31 - 1  # slots are int32: no context is longer


def _count_of(item: str, text: str) -> int:
    """``item`` (lower case, ``4k`` = 4096) as a token count in ``[1, 2**31)``."""
    try:
        scaled = float(item[:-1]) * 1024 if item.endswith("k") else float(int(item))
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(
            f"expected token counts like 2048,4096 or 4k,8k, got {text!r}"
        ) from None
    if not math.isfinite(scaled) or scaled != int(scaled):
        raise argparse.ArgumentTypeError(f"{item!r} is not a whole number of tokens (4k = 4096, 0.5k = 512)")
    if not 1 <= scaled <= _MAX_TOKENS:
        raise argparse.ArgumentTypeError(f"a token count must be between 1 and 2**31 - 1, got {item!r}")
    return int(scaled)


def _prompt_text(path: str) -> str:
    """The text of ``--prompt-file``, with a one-line error for a folder, a missing, unreadable, binary or
    empty file."""
    file = Path(path)
    if file.is_dir():
        raise ValueError(f"--prompt-file {path} is a folder; give a text file")
    if not file.is_file():
        raise ValueError(f"--prompt-file {path}: no such file; give the path of a text file")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"--prompt-file {path} is not UTF-8 text; give a text file") from None
    except OSError as err:
        raise ValueError(f"--prompt-file {path}: cannot read it ({err.strerror})") from None
    if not text.strip():
        raise ValueError(f"--prompt-file {path} is empty; give a file with the prompt")
    return text


def _check_generate_length(model: Any, prompt_tokens: int, new_tokens: int, beyond_trained: bool) -> None:
    """``kvweave generate``'s own length check: the ways out it names are its own options."""
    from kvweave.eval.runner import trained_context

    limit = trained_context(model)
    if limit and prompt_tokens + new_tokens > limit and not beyond_trained:
        raise ValueError(
            f"the prompt ({prompt_tokens} tokens) plus --max-new-tokens {new_tokens} exceeds the {limit} tokens "
            "the model was trained for; shorten the prompt, lower --max-new-tokens, or pass --beyond-trained to "
            "run past the trained range on purpose"
        )


def _user_error(error: BaseException) -> str:
    """An error as the one line the command line prints (file-system errors name the path and the way out)."""
    if isinstance(error, OSError) and not isinstance(error, FileNotFoundError) and error.strerror:
        where = f"{error.filename}: " if error.filename else ""
        if error.errno == errno.ENOSPC:
            return f"{where}no space left on the device; free some space and run the command again"
        return f"{where}{error.strerror.lower()}; check the path and its permissions"
    text = str(error) or type(error).__name__
    return " ".join(text.split())  # one line, whatever the message


def _write_command(folder: Path) -> None:
    """Record the command line that produced (part of) a run folder beside its results: a resumed or
    extended run adds its command as a new line, so every row's producer stays listed."""
    path = folder / "command.txt"
    line = "kvweave " + " ".join(sys.argv[1:])
    held = path.read_text().splitlines() if path.exists() else []
    if line not in held:
        path.write_text("\n".join([*held, line]) + "\n")


def _load(args: argparse.Namespace) -> tuple[Any, Any]:
    from kvweave.distributed import is_main_process
    from kvweave.models import load_model

    ranks = getattr(args, "tp", 1)
    if is_main_process():
        sharded = f", sharded over {ranks} ranks" if ranks > 1 else ""
        print(f"loading {args.model} ({args.dtype}{sharded}) ...", file=sys.stderr)
    return load_model(args.model, dtype=args.dtype, tp_plan="auto" if ranks > 1 else None)


def _loaded_cache(path: str, model: Any, ids: Any) -> Any:
    """The saved cache at ``path``, checked to be a prefix of the prompt ``ids``."""
    from kvweave.distributed import is_main_process, load_cache

    cache, manifest = load_cache(path, model)  # this rank's file set under tensor parallelism
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
    if is_main_process():
        print(
            f"loaded the cache of {len(prefix)} prompt tokens from {path} ({manifest.method})",
            file=sys.stderr,
        )
    return cache


def _verify_saved(path: str) -> None:
    """Check the checksums of a saved cache (one process's folder, or every rank's of a tensor-parallel set)
    before any model is loaded, so a corrupt file is reported in a second, not after the model load."""
    from kvweave.distributed import rank_folder, read_tp_manifest
    from kvweave.persist import verify_cache

    record = read_tp_manifest(path)
    if record is None:
        verify_cache(path)
        return
    size = int(record["world_size"])
    for rank in range(size):
        verify_cache(rank_folder(path, rank, size))


def _device(text: str) -> str:
    """A torch device this machine has (``cpu``, ``cuda``, ``cuda:1``, ``mps``)."""
    import torch

    try:
        device = torch.device(text.strip())
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; use cpu or cuda (cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: no CUDA device here; use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(
            f"{text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: no MPS device here; use --device cpu")
    if device.type not in ("cpu", "cuda", "mps"):
        raise argparse.ArgumentTypeError(f"{text!r}: kvweave runs on cpu or cuda")
    return text.strip()


def _run_folder(path: str | None, option: str = "--out") -> None:
    """Refuse an output path that is a file where a run folder is meant."""
    if path and Path(path).is_file():
        raise ValueError(f"{option} {path} is a file; give a run folder (a new one, or one to resume)")


def _check_model(name: str) -> None:
    """Refuse a ``--model`` that is neither a registry name nor a Hugging Face folder, before any work."""
    from kvweave.model_registry import REGISTRY

    if name in REGISTRY:
        return
    folder = Path(name).expanduser()
    if folder.is_dir() and not (folder / "config.json").is_file():
        raise ValueError(
            f"--model {name}: the folder has no config.json, so it is not a Hugging Face model folder; give a "
            "registry name (see `kvweave models`) or a folder written by save_pretrained"
        )
    if not folder.exists():
        raise ValueError(
            f"--model {name}: not in the registry ({', '.join(sorted(REGISTRY))}) and no such folder; give one "
            "of those names (see `kvweave models`) or a local Hugging Face folder"
        )
    if not folder.is_dir():
        raise ValueError(f"--model {name} is a file; give a registry name or a Hugging Face model folder")
