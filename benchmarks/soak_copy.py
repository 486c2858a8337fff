"""Why a compressed cache loses the soak's copy stretch: resume a saved soak cache and decode on with decode-time
options changed, scoring the tokens a copy can predict apart from the rest.

The soak's stream (``benchmarks/soak.py``: CPython's documentation prose) repeats, around steps 4,500-5,500 on
smollm2-135m, a passage the stream carried ~4,000 tokens before (generated tokens, not the prompt): ``full``'s
loss there drops well below its usual level, while a cache that cannot read that passage back (``window``) does
not. This script loads the cache a soak saved (``--state``), sets options that change only how decode steps
read the cache (``decode_tokens``, ``pin_tokens``, ``page``, ``recall``; they do not change what is stored), and decodes
``--steps`` more tokens of the same stream for each variant, writing per variant the interval loss over every
token and over the *copyable* tokens (those whose preceding ``--ngram`` tokens occurred earlier in the stream).

Not a test: a diagnosis tool; its output is summarised in docs/findings.md with the command that made it.
Example::

    python benchmarks/soak.py --model smollm2-135m --steps 4500 --methods depthweave --save-every 9 --out runs/copy/base
    python benchmarks/soak_copy.py --model smollm2-135m --state runs/copy/base/state/depthweave --steps 1000 \\
        --variants "default;decode_tokens=0;decode_tokens=2048" --out runs/copy/variants.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from soak import token_stream  # noqa: E402

import kvweave  # noqa: E402
from kvweave._compat import cache_kwarg  # noqa: E402
from kvweave.models import load_model  # noqa: E402

READ_OPTIONS = ("decode_tokens", "pin_tokens", "page", "recall", "recall_bits")
"""Options that change how a decode step reads a DepthWeave cache, not what it stores (``recall`` holds a
rebuilt passage beside the stores while a copy goes on; ``recall=0`` turns it off from the saved state on)."""


def copyable(ids: list[int], start: int, stop: int, ngram: int) -> list[bool]:
    """For each position ``p`` in ``[start, stop)``: whether ``ids[p - ngram : p]`` occurred before ``p - ngram``
    followed by ``ids[p]`` (a copy of an earlier occurrence predicts the token)."""
    seen: set[tuple[int, ...]] = set()
    first = 0
    marks = []
    for p in range(start, stop):
        while first < p - ngram:  # n-grams (with their next token) that ended before this one began
            seen.add(tuple(ids[first : first + ngram + 1]))
            first += 1
        marks.append(tuple(ids[p - ngram : p + 1]) in seen)
    return marks


def apply_variant(cache: Any, variant: str) -> dict[str, Any]:
    """Set ``variant``'s read options (``name=value,...``; ``default`` keeps the saved ones) on the loaded
    cache's method; returns what was set. Refuses options that change what is stored."""
    settings: dict[str, Any] = {}
    if variant == "default":
        return settings
    for item in variant.split(","):
        name, _, value = item.partition("=")
        if name not in READ_OPTIONS:
            raise SystemExit(
                f"soak_copy: {name!r} changes what is stored; vary only {', '.join(READ_OPTIONS)}"
            )
        settings[name] = int(value)
    for name, value in settings.items():
        object.__setattr__(cache.method, name, value)
    return settings


def run_variant(
    model: Any, stream: torch.Tensor, state: Path, variant: str, steps: int, marks: list[bool], every: int
) -> list[dict[str, Any]]:
    """Decode ``steps`` tokens of ``stream`` from the saved cache with ``variant``; a row every ``every`` steps."""
    cache, manifest = kvweave.load_cache(state, model)
    settings = apply_variant(cache, variant)
    kwarg = cache_kwarg(model)
    begin = manifest.tokens
    rows, losses, copy_losses, other_losses = [], [], [], []
    with torch.no_grad():
        for step in range(steps):
            at = begin + step
            logits = model(stream[:, at : at + 1], **{kwarg: cache}).logits[0, -1].float()
            loss = float(torch.log_softmax(logits, -1)[int(stream[0, at + 1])].neg())
            losses.append(loss)
            (copy_losses if marks[step] else other_losses).append(loss)
            if (step + 1) % every == 0 or step + 1 == steps:
                rows.append(
                    {
                        "variant": variant,
                        "settings": settings,
                        "method": manifest.method,
                        "from_seen": begin,
                        "seen": at + 1,
                        "loss": statistics.fmean(losses),
                        "copy_tokens": len(copy_losses),
                        "copy_loss": statistics.fmean(copy_losses) if copy_losses else None,
                        "other_loss": statistics.fmean(other_losses) if other_losses else None,
                        "bytes": cache.nbytes(),
                        "full_kv_bytes_16bit": cache.full_kv_bytes(16),
                        "time": time.time(),
                    }
                )
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                losses, copy_losses, other_losses = [], [], []
    return rows


def reference_rows(
    model: Any, stream: torch.Tensor, begin: int, steps: int, marks: list[bool], every: int
) -> list[dict[str, Any]]:
    """``full``'s losses on the same tokens: one exact forward pass over the stream (the prefill of a full cache
    gives the logits its decode steps would, to float rounding)."""
    with torch.no_grad():
        logits = model(stream[:, : begin + steps]).logits[0, begin:].float()  # step s predicts begin + s + 1
    targets = stream[0, begin + 1 : begin + steps + 1]
    losses = torch.log_softmax(logits, -1).gather(1, targets[:, None]).neg()[:, 0]
    rows = []
    for lo in range(0, steps, every):
        hi = min(lo + every, steps)
        part = losses[lo:hi].tolist()
        flags = marks[lo:hi]
        copy = [x for x, f in zip(part, flags, strict=True) if f]
        other = [x for x, f in zip(part, flags, strict=True) if not f]
        rows.append(
            {
                "variant": "full",
                "method": "full",
                "from_seen": begin,
                "seen": begin + hi,
                "loss": statistics.fmean(part),
                "copy_tokens": len(copy),
                "copy_loss": statistics.fmean(copy) if copy else None,
                "other_loss": statistics.fmean(other) if other else None,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="registry name or local folder (the soak's)")
    parser.add_argument("--state", required=True, help="a cache folder the soak saved (OUT/state/SPEC)")
    parser.add_argument(
        "--steps", type=int, default=1000, help="decode steps after the saved cache (default 1000)"
    )
    parser.add_argument("--every", type=int, default=500, help="steps per row (default 500)")
    parser.add_argument("--ngram", type=int, default=8, help="context tokens a copy must match (default 8)")
    parser.add_argument(
        "--variants",
        default="full;default",
        help="';'-separated variants: 'full' (the exact reference), 'default' (the saved options) or "
        "name=value,... of read options",
    )
    parser.add_argument("--out", required=True, help="rows file (JSON lines; appended)")
    args = parser.parse_args(argv)
    state = Path(args.state)
    if not (state / "manifest.json").is_file():
        parser.error(
            f"{state} holds no saved cache (manifest.json); run benchmarks/soak.py with --save-every first"
        )
    model, tokenizer = load_model(args.model)
    manifest = json.loads((state / "manifest.json").read_text())
    begin = int(manifest["tokens"])
    stream = token_stream(tokenizer, model.config.vocab_size, begin + args.steps + 1)
    ids = stream[0].tolist()
    marks = copyable(ids, begin + 1, begin + args.steps + 1, args.ngram)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for variant in args.variants.split(";"):
        if variant.strip() == "full":
            rows = reference_rows(model, stream, begin, args.steps, marks, args.every)
        else:
            rows = run_variant(model, stream, state, variant.strip(), args.steps, marks, args.every)
        with out.open("a") as handle:
            for row in rows:
                handle.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
