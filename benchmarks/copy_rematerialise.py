"""Can a passage be copied again from its token ids alone? The soak's copy stretch, with the copied passage's KV
recomputed from its tokens and a little local context, beside a window of the same bytes.

The soak's stream repeats, around steps 4,500-5,500 on smollm2-135m, a passage it carried ~4,000 tokens before
(``benchmarks/soak_copy.py``): ``full`` copies it, and no cache measured at 4x or more does (docs/findings.md,
seventeenth session). Token ids cost 2-4 bytes a token, far below any KV. This script asks whether a cache that
keeps them could re-materialise the passage when the stream starts copying it: the tokens of the interval are
scored chunk by chunk (``--chunk`` tokens), each chunk attending to

- ``window``: the first ``--sinks`` tokens and the newest ``--window`` tokens, exact (a budget-bound cache);
- ``window+span:oracle``: those and, for every copy detected before the chunk (the preceding ``--ngram``
  tokens occurred earlier, followed by the same token; with ``--fresh N`` only those of the last ``N`` tokens),
  the earlier passage from ``--before`` tokens before that occurrence to ``--after`` after it, with its exact KV
  (what ``full`` holds there);
- ``window+span:local=L``: the same passage with KV recomputed from its token ids at their positions, with only
  ``L`` tokens of context before it (what a cache holding token ids could rebuild);
- ``window:equal``: a window as large as ``window`` plus the mean span the variants above held (equal bytes).

``full`` is one exact forward pass. Rows (JSON lines, appended to ``--out``) carry the loss over every token,
over the copyable ones and over the rest, and the tokens each variant held. Not a test: a diagnosis tool; its
output is summarised in docs/findings.md with the command that made it. Example::

    OMP_NUM_THREADS=1 python benchmarks/copy_rematerialise.py --model smollm2-135m --begin 5012 --steps 1000 \\
        --out runs/copy/rematerialise.jsonl
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
from soak_copy import copyable  # noqa: E402

from kvweave._compat import cache_kwarg  # noqa: E402
from kvweave.models import load_model  # noqa: E402

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer: keys and values ``[1, kv_heads, tokens, dim]``, rotated at their positions as the model caches them."""


def forward_kv(model: Any, ids: torch.Tensor, start: int) -> tuple[torch.Tensor, KV]:
    """Logits and per-layer KV of ``ids`` (``[1, n]``) placed at positions ``start..start+n``, from no context."""
    from transformers import DynamicCache

    cache = DynamicCache()
    positions = torch.arange(start, start + ids.shape[1]).view(1, -1)
    with torch.no_grad():
        out = model(ids, position_ids=positions, use_cache=True, **{cache_kwarg(model): cache})
    return out.logits[0].float(), layer_kv(cache)


def layer_kv(cache: Any) -> KV:
    """``(keys, values)`` of every layer of a transformers cache."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def pick(kv: KV, index: torch.Tensor) -> KV:
    """The tokens ``index`` of every layer's KV."""
    return [(k[:, :, index], v[:, :, index]) for k, v in kv]


def score_chunk(model: Any, past: KV, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Logits of ``ids`` at positions ``start..`` attending to ``past`` (any positions, already rotated) and to
    each other causally."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer, (k, v) in enumerate(past):
        cache.update(k.clone(), v.clone(), layer)
    held = past[0][0].shape[2]
    n = ids.shape[1]
    with torch.no_grad():
        out = model(
            ids,
            position_ids=torch.arange(start, start + n).view(1, -1),
            **{cache_kwarg(model): cache},
            cache_position=torch.arange(held, held + n),
            attention_mask=torch.ones(1, held + n, dtype=torch.long),
            use_cache=True,
        )
    return out.logits[0].float()


def sources(ids: list[int], begin: int, stop: int, ngram: int, blind: bool = False) -> dict[int, int]:
    """For each copyable position ``p`` in ``[begin, stop)`` (see :func:`soak_copy.copyable`): the position of the
    latest earlier token that followed the same ``ngram`` tokens (where the copy reads from). ``blind``: for
    every ``p`` whose preceding ``ngram`` tokens occurred before, the latest such occurrence, whatever token
    followed it (what a cache can know before the token arrives: ``depthweave:recall``'s match)."""
    where: dict[tuple[int, ...], int] = {}
    first = 0
    found = {}
    width = ngram if blind else ngram + 1
    for p in range(begin, stop):
        while first < p - ngram:
            where[tuple(ids[first : first + width])] = first + ngram
            first += 1
        key = tuple(ids[p - ngram : p - ngram + width])
        if key in where:
            found[p] = where[key]
    return found


def run(
    model: Any,
    stream: torch.Tensor,
    full_kv: KV,
    begin: int,
    steps: int,
    args: argparse.Namespace,
    variant: str,
    window: int,
    found: dict[int, int],
) -> dict[str, Any]:
    """Losses of the tokens ``begin+1 .. begin+steps`` for one variant, chunk by chunk."""
    losses: list[float] = []
    held_spans: list[int] = []
    local_cache: dict[tuple[int, int], KV] = {}
    for lo in range(begin, begin + steps, args.chunk):
        hi = min(lo + args.chunk, begin + steps)
        keep = set(range(args.sinks)) | set(range(max(args.sinks, lo - window), lo))
        spans: list[tuple[int, int]] = []
        if variant.startswith("window+span"):
            for p, q in found.items():
                if p + 1 < lo and (
                    args.fresh is None or p + 1 >= lo - args.fresh
                ):  # detected, recently enough
                    s, e = max(0, q - args.before), min(lo, q + args.after)
                    spans.append((s, e))
        span_tokens = sorted({t for s, e in spans for t in range(s, e)} - keep)
        held_spans.append(len(span_tokens))
        base = pick(full_kv, torch.tensor(sorted(keep)))
        if span_tokens and variant == "window+span:oracle":
            extra = pick(full_kv, torch.tensor(span_tokens))
        elif span_tokens:
            local = int(variant.rsplit("=", 1)[1])
            parts: list[KV] = []
            for s, e in merge(span_tokens):
                if (s, e) not in local_cache:
                    c = max(0, s - local)
                    _, kv = forward_kv(model, stream[:, c:e], c)
                    local_cache[(s, e)] = [(k[:, :, s - c :], v[:, :, s - c :]) for k, v in kv]
                parts.append(local_cache[(s, e)])
            extra = [
                (torch.cat([p[i][0] for p in parts], 2), torch.cat([p[i][1] for p in parts], 2))
                for i in range(len(full_kv))
            ]
        else:
            extra = None
        past = (
            base
            if extra is None
            else [
                (torch.cat([ek, k], 2), torch.cat([ev, v], 2))
                for (k, v), (ek, ev) in zip(base, extra, strict=True)
            ]
        )
        logits = score_chunk(model, past, stream[:, lo:hi], lo)
        targets = stream[0, lo + 1 : hi + 1]
        losses += torch.log_softmax(logits, -1).gather(1, targets[:, None]).neg()[:, 0].tolist()
    return {"losses": losses, "span_tokens": statistics.fmean(held_spans)}


def merge(tokens: list[int]) -> list[tuple[int, int]]:
    """Sorted token positions as ``[start, stop)`` runs."""
    runs: list[tuple[int, int]] = []
    for t in tokens:
        if runs and runs[-1][1] == t:
            runs[-1] = (runs[-1][0], t + 1)
        else:
            runs.append((t, t + 1))
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="registry name or local folder (the soak's)")
    parser.add_argument("--begin", type=int, default=5012, help="tokens before the interval (default 5012)")
    parser.add_argument("--steps", type=int, default=1000, help="tokens scored (default 1000)")
    parser.add_argument("--every", type=int, default=500, help="tokens per row (default 500)")
    parser.add_argument("--chunk", type=int, default=32, help="tokens scored per cache (default 32)")
    parser.add_argument("--ngram", type=int, default=8, help="context tokens a copy must match (default 8)")
    parser.add_argument("--sinks", type=int, default=4, help="first tokens always held (default 4)")
    parser.add_argument("--window", type=int, default=622, help="newest tokens held (default 622: 8x at 5K)")
    parser.add_argument(
        "--before", type=int, default=16, help="span tokens before a copy's source (default 16)"
    )
    parser.add_argument(
        "--after", type=int, default=256, help="span tokens after a copy's source (default 256)"
    )
    parser.add_argument(
        "--blind",
        action="store_true",
        help="match the preceding NGRAM tokens only, not the token that follows (what a cache knows in time)",
    )
    parser.add_argument(
        "--fresh",
        type=int,
        default=None,
        help="hold only the spans of copies detected in the last FRESH tokens (a span that slides along the copy; "
        "default: every span detected so far)",
    )
    parser.add_argument(
        "--local", default="0,64,256", help="context tokens for the recomputed spans (default 0,64,256)"
    )
    parser.add_argument("--out", required=True, help="rows file (JSON lines; appended)")
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model)
    model.eval()
    stream = token_stream(tokenizer, model.config.vocab_size, args.begin + args.steps + 1)
    ids = stream[0].tolist()
    marks = copyable(ids, args.begin + 1, args.begin + args.steps + 1, args.ngram)
    found = sources(ids, args.begin + 1, args.begin + args.steps + 1, args.ngram, blind=args.blind)
    found = {p - 1: q - 1 for p, q in found.items()}  # the token before each copied one, and its source's
    logits, full_kv = forward_kv(model, stream[:, : args.begin + args.steps], 0)
    targets = stream[0, args.begin + 1 : args.begin + args.steps + 1]
    full_losses = torch.log_softmax(logits[args.begin :], -1).gather(1, targets[:, None]).neg()[:, 0].tolist()
    results: dict[str, dict[str, Any]] = {"full": {"losses": full_losses, "span_tokens": 0.0}}
    variants = ["window", "window+span:oracle"] + [f"window+span:local={n}" for n in args.local.split(",")]
    for variant in variants:
        started = time.perf_counter()
        results[variant] = run(
            model, stream, full_kv, args.begin, args.steps, args, variant, args.window, found
        )
        print(f"{variant}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    extra = round(results["window+span:oracle"]["span_tokens"])
    results["window:equal"] = run(
        model, stream, full_kv, args.begin, args.steps, args, "window", args.window + extra, found
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as handle:
        for variant, result in results.items():
            for lo in range(0, args.steps, args.every):
                hi = min(lo + args.every, args.steps)
                part, flags = result["losses"][lo:hi], marks[lo:hi]
                copy = [x for x, f in zip(part, flags, strict=True) if f]
                other = [x for x, f in zip(part, flags, strict=True) if not f]
                row = {
                    "variant": variant,
                    "from_seen": args.begin + lo,
                    "seen": args.begin + hi,
                    "loss": statistics.fmean(part),
                    "copy_tokens": len(copy),
                    "copy_loss": statistics.fmean(copy) if copy else None,
                    "other_loss": statistics.fmean(other) if other else None,
                    "window": args.window + (extra if variant == "window:equal" else 0),
                    "span_tokens": result["span_tokens"],
                    "sinks": args.sinks,
                    "chunk": args.chunk,
                    "before": args.before,
                    "after": args.after,
                    "fresh": args.fresh,
                    "blind": args.blind,
                    "command": " ".join(sys.argv),
                }
                handle.write(json.dumps(row) + "\n")
                print(json.dumps({k: row[k] for k in ("variant", "seen", "loss", "copy_loss", "other_loss")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
