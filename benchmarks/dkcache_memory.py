"""Bytes DK-Cache holds after a prefill and a short generation, against ``full``, by buffer growth step.

Not a test: a benchmark script that writes results. The first ``--context`` tokens of CPython's documentation
prose are prefilled and ``--new-tokens`` tokens generated greedily; ``nbytes`` counts every tensor held, spare
buffer capacity included. DK-Cache's buffers grow by 1/``GROWTH`` of their size when full; each ``--growth``
value is measured. Rows are appended to ``--out`` (JSONL) with the hardware and versions. Usage::

    python benchmarks/dkcache_memory.py --model smollm2-135m --context 4096 --growth 4,16 \\
        --out docs/data/dkcache-memory.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from dkcache_decode_speed import prompt_ids  # a sibling script: benchmarks/ is on sys.path when run

import kvweave
from kvweave._compat import cache_kwarg
from kvweave.eval.runner import environment
from kvweave.methods.dkcache import tiers


def held_after_generation(
    model: torch.nn.Module, ids: torch.Tensor, spec: str, new_tokens: int
) -> tuple[int, int]:
    """``(bytes held, bytes of a 16-bit DynamicCache)`` after generating ``new_tokens`` from ``ids``."""
    cache = kvweave.make_cache(spec, model)
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            **{cache_kwarg(model): cache},
        )
    return cache.nbytes(), cache.full_kv_bytes(16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="registry name or local folder")
    parser.add_argument("--context", type=int, default=4096, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens generated after the prompt")
    parser.add_argument("--method", default="dkcache:ratio=0.125,pages=16", help="the dkcache spec measured")
    parser.add_argument("--growth", default="4,16", help="comma-separated GROWTH values to measure")
    parser.add_argument("--out", required=True, help="JSONL file the rows are appended to")
    args = parser.parse_args()
    growths = [int(g) for g in args.growth.split(",") if g]
    if not growths or min(growths) < 1:
        parser.error("--growth needs positive integers, e.g. 4,16")
    model, tokenizer = kvweave.load_model(args.model)
    ids = prompt_ids(tokenizer, args.context)
    env = environment()
    full_held, reference = held_after_generation(model, ids, "full", args.new_tokens)
    rows = [{"method": "full", "growth": None, "kv_bytes": full_held}]
    saved = tiers.GROWTH
    try:
        for growth in growths:
            tiers.GROWTH = growth
            rows.append(
                {
                    "method": args.method,
                    "growth": growth,
                    "kv_bytes": held_after_generation(model, ids, args.method, args.new_tokens)[0],
                }
            )
    finally:
        tiers.GROWTH = saved
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as fh:
        for row in rows:
            row.update(
                model=args.model,
                context=args.context,
                new_tokens=args.new_tokens,
                full_kv_bytes_16bit=reference,
                vs_full=round(row["kv_bytes"] / full_held, 3),
                environment=env,
            )
            fh.write(json.dumps(row) + "\n")
            print(
                f"{row['method']:35s} growth 1/{row['growth'] or '-':<3} {row['kv_bytes'] / 2**20:8.1f} MiB "
                f"({row['vs_full']:.2f}x of full)"
            )


if __name__ == "__main__":
    main()
