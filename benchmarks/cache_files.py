"""Prefix reuse through saved caches: prefill time against load time, file size against bytes held.

Not a test: a benchmark script that writes results. For each method, the first ``--context`` tokens of
CPython's documentation prose are prefilled into a fresh cache (timed), the cache is saved with
:func:`kvweave.save_cache` (timed, file size measured) and loaded back with :func:`kvweave.load_cache` (timed).
Both caches then decode ``--steps`` tokens greedily; the row records whether the tokens are identical. Rows
are appended to ``--out`` (JSONL) with the hardware and versions. Usage::

    python benchmarks/cache_files.py --model smollm2-135m --context 4096 \\
        --methods "full;dkcache;depthweave;quant:bits=4" --out docs/data/cache-files.jsonl
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from dkcache_decode_speed import prompt_ids  # a sibling script: benchmarks/ is on sys.path when run

import kvweave
from kvweave._compat import cache_kwarg
from kvweave.eval.runner import environment
from kvweave.registry import parse_method


def _decode(model: torch.nn.Module, cache: object, token: torch.Tensor, steps: int) -> list[int]:
    out = []
    for _ in range(steps):
        token = model(token, use_cache=True, **{cache_kwarg(model): cache}).logits[:, -1:].argmax(-1)
        out.append(int(token))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="registry name or local folder")
    parser.add_argument("--context", type=int, required=True, help="prompt tokens")
    parser.add_argument("--methods", required=True, help="';'-separated method specs")
    parser.add_argument("--steps", type=int, default=8, help="tokens decoded from each cache to compare")
    parser.add_argument("--out", required=True, help="JSONL file the rows are appended to")
    args = parser.parse_args()
    specs = [s for s in args.methods.split(";") if s]
    for spec in specs:
        try:
            parse_method(spec)
        except ValueError as err:
            parser.error(str(err))
    model, tokenizer = kvweave.load_model(args.model)
    ids = prompt_ids(tokenizer, args.context)
    env = environment()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), tempfile.TemporaryDirectory() as scratch:
        for spec in specs:
            cache = kvweave.make_cache(spec, model)
            start = time.perf_counter()
            logits = model(ids, use_cache=True, **{cache_kwarg(model): cache}).logits
            prefill_s = time.perf_counter() - start
            folder = Path(scratch) / spec.replace(":", "_").replace(",", "_")
            start = time.perf_counter()
            kvweave.save_cache(cache, model, folder, prompt_ids=ids)
            save_s = time.perf_counter() - start
            start = time.perf_counter()
            loaded, _ = kvweave.load_cache(folder, model)
            load_s = time.perf_counter() - start
            held, loaded_held = cache.nbytes(), loaded.nbytes()
            first = logits[:, -1:].argmax(-1)
            same = _decode(model, cache, first, args.steps) == _decode(model, loaded, first, args.steps)
            row = {
                "model": args.model,
                "context": args.context,
                "method": spec,
                "prefill_s": round(prefill_s, 2),
                "save_s": round(save_s, 3),
                "load_s": round(load_s, 3),
                "load_vs_prefill": round(prefill_s / load_s, 1),
                "file_bytes": sum(f.stat().st_size for f in folder.iterdir()),
                "kv_bytes": held,
                "loaded_kv_bytes": loaded_held,
                "same_tokens": same,
                "steps": args.steps,
                "environment": env,
            }
            with out.open("a") as fh:
                fh.write(json.dumps(row) + "\n")
            print(
                f"{spec:30s} prefill {prefill_s:7.2f} s  save {save_s:6.3f} s  load {load_s:6.3f} s  "
                f"file {row['file_bytes'] / 2**20:7.2f} MiB  held {row['kv_bytes'] / 2**20:7.2f} MiB  "
                f"same tokens: {same}"
            )


if __name__ == "__main__":
    main()
