"""Decode speed of ``dkcache`` against ``full`` on a real model, one prompt, interleaved rounds.

Not a test: a benchmark script that writes results. The model is prefilled once per method with the same
``--context`` tokens of CPython documentation prose (no question: speed does not depend on it); then, for
``--rounds`` rounds, every method decodes ``--steps`` tokens greedily, one forward per token, continuing its
own cache (interleaved, so background load hits all alike). Rows report the best round's ms/token, the ratio
against ``full`` measured in the same process, the KV bytes held (``nbytes`` of the cache after decoding) and
the entries attended per step (the layer stats). Rows are appended to ``--out`` (JSONL) with the hardware and
versions. Usage::

    python benchmarks/dkcache_decode_speed.py --model qwen2.5-coder-0.5b --context 8192 \\
        --methods "dkcache:ratio=0.125,pages=16;dkcache:ratio=0.125,pages=16,retrieve=never" \\
        --out docs/data/dkcache-decode-speed.jsonl

Method specs are separated by ``;`` (they contain commas). ``full`` is always measured first. With
``--reference`` every ``dkcache`` spec is measured a second time through the general (reference) attention path
(implementation setting ``path="reference"``), labelled ``<spec> [general path]``, so a speed-up of the fast paths is a ratio
measured in the same process.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import kvweave
from kvweave._compat import cache_kwarg
from kvweave.eval.bench import prompt
from kvweave.eval.runner import environment
from kvweave.registry import parse_method

GENERAL = " [general path]"


def cache_method(label: str) -> Any:
    """The method a row measures: its spec, with ``path="reference"`` for a ``[general path]`` row."""
    if label.endswith(GENERAL):
        return parse_method(label.removesuffix(GENERAL)).implementation(path="reference")  # type: ignore[attr-defined]
    return parse_method(label)


def prompt_ids(tokenizer: Any, tokens: int) -> torch.Tensor:
    """The first ``tokens`` tokens of the pydoc haystack (repeated if it is shorter): ``kvweave bench``'s prompt."""
    return prompt(tokenizer, 0, tokens, 1, "cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="registry name or local folder")
    parser.add_argument("--context", type=int, required=True, help="prompt tokens")
    parser.add_argument("--methods", required=True, help="';'-separated method specs (full is added first)")
    parser.add_argument("--steps", type=int, default=8, help="tokens decoded per method per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best is reported")
    parser.add_argument("--beyond-trained", action="store_true", help="allow a prompt past the trained range")
    parser.add_argument(
        "--reference",
        action="store_true",
        help="also measure each dkcache spec through the general (reference) decode path",
    )
    parser.add_argument("--out", required=True, help="JSONL file the rows are appended to")
    args = parser.parse_args()
    if args.context < 1 or args.steps < 1 or args.rounds < 1:
        parser.error("--context, --steps and --rounds must be positive")
    specs = ["full"] + [s for s in args.methods.split(";") if s and s != "full"]
    for spec in specs:  # bad specs fail before the model loads
        try:
            parse_method(spec)
        except ValueError as err:
            parser.error(str(err))
    model, tokenizer = kvweave.load_model(args.model)
    trained = int(model.config.max_position_embeddings)
    if args.context > trained and not args.beyond_trained:
        parser.error(
            f"--context {args.context} is beyond {args.model}'s trained context ({trained}); "
            "pass --beyond-trained to measure it anyway"
        )
    if args.reference:
        specs += [spec + GENERAL for spec in specs if parse_method(spec).name == "dkcache"]
    ids = prompt_ids(tokenizer, args.context)
    state: dict[str, list[Any]] = {}
    prefill_s: dict[str, float] = {}
    with torch.no_grad():
        for spec in tqdm(specs, desc="prefill"):
            cache = kvweave.make_cache(cache_method(spec), model)
            start = time.perf_counter()
            logits = model(ids, use_cache=True, **{cache_kwarg(model): cache}).logits
            prefill_s[spec] = time.perf_counter() - start
            state[spec] = [cache, logits[:, -1:].argmax(-1)]
        best = {spec: float("inf") for spec in specs}
        for _ in tqdm(range(args.rounds), desc="rounds"):
            for spec in specs:
                cache, token = state[spec]
                start = time.perf_counter()
                for _ in range(args.steps):
                    token = (
                        model(token, use_cache=True, **{cache_kwarg(model): cache}).logits[:, -1:].argmax(-1)
                    )
                best[spec] = min(best[spec], (time.perf_counter() - start) / args.steps)
                state[spec][1] = token
    env = environment()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as fh:
        for spec in specs:
            cache = state[spec][0]
            layers = cache.stats().get("layers", []) if hasattr(cache, "stats") else []
            attended = [layer.get("attended_entries") for layer in layers if layer.get("attended_entries")]
            row = {
                "model": args.model,
                "context": args.context,
                "method": spec,
                "steps": args.steps,
                "rounds": args.rounds,
                "ms_per_token": round(1000 * best[spec], 2),
                "speed_vs_full": round(best["full"] / best[spec], 3),
                "prefill_s": round(prefill_s[spec], 1),
                "kv_bytes": cache.nbytes() if hasattr(cache, "nbytes") else None,
                "attended_entries": max(attended) if attended else None,
                "environment": env,
            }
            fh.write(json.dumps(row) + "\n")
            print(f"{spec:55s} {row['ms_per_token']:8.1f} ms/token  {row['speed_vs_full']:.2f}x of full")


if __name__ == "__main__":
    main()
