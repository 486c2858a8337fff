"""What a long generation does to the prompt DepthWeave stores: reconstruction error of the prompt's tokens as
generated tokens arrive (issue #30's long-generation task, where the oldest needles are lost at 4K and 8K).

For each sample (a long-generation trial of ``kvweave eval --generated``: the same prompt, filler and seed) and
each spec, this script prefills the context, then teacher-forces the filler one decode step at a time (the
eval's own :func:`~kvweave.eval.runner.feed_generated`) and, every ``--every`` fed tokens (and before the
first), rebuilds what every DepthWeave layer stores of the prompt (``held_kv``: factorized tokens dequantized
and rotated, exact rows) and compares it with the exact prefill. One JSON line per (sample, spec, checkpoint):

- ``needle_err_k`` / ``needle_err_v``: mean relative error ``|x̂ - x| / |x|`` of the asked value's tokens
  (every occurrence of the answers in the prompt), mean over layers and heads;
- ``name_err_k`` / ``name_err_v``: the same for the ``--name`` tokens before each of those spans (the needle's
  key name: what tells the asked needle from the others);
- ``rest_err_k`` / ``rest_err_v``: every other prompt token;
- ``refreshes``: basis refreshes so far (mean over groups and rows); ``compression``: the cache's ratio.

Not a test: a diagnosis tool; its output is summarised in docs/findings.md with the command that made it.
Example::

    KVWEAVE_DATA=../shared/data python benchmarks/depthweave_drift.py --task niah_multikey --context 2048 \\
        --generated 4096 --trials 0 --methods "depthweave;depthweave:drift=1e9" --out runs/dw-drift.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

import kvweave
from kvweave._compat import cache_kwarg
from kvweave.eval import tasks as task_lib
from kvweave.eval.prefill import LayerStep, record_prefill
from kvweave.eval.runner import build_prompt, feed_generated, generated_filler
from kvweave.methods.depthweave import DepthWeaveLayer

sys.path.insert(0, str(Path(__file__).parent))
from depthweave_diagnose import answer_tokens  # noqa: E402


def prompt_errors(
    cache: Any,
    exact: dict[int, tuple[torch.Tensor, torch.Tensor]],
    spans: dict[str, torch.Tensor],
    n_ctx: int,
) -> dict[str, float]:
    """Mean relative reconstruction error of the prompt's tokens in each of ``spans`` (and the rest), keys and
    values, over every DepthWeave layer (batch row 0)."""
    sums: dict[str, list[float]] = {}
    for layer in cache.layers:
        if not isinstance(layer, DepthWeaveLayer) or layer.layer_idx not in exact:
            continue
        keys, values, slots = layer.held_kv(0)
        inside = slots < n_ctx
        order = slots[inside].long()
        k_hat = torch.zeros(keys.shape[0], n_ctx, keys.shape[2])
        v_hat = torch.zeros_like(k_hat)
        k_hat[:, order] = keys[:, inside].float()
        v_hat[:, order] = values[:, inside].float()
        k, v = exact[layer.layer_idx]
        err_k = ((k_hat - k).norm(dim=-1) / k.norm(dim=-1).clamp_min(1e-9)).mean(0)  # [n]
        err_v = ((v_hat - v).norm(dim=-1) / v.norm(dim=-1).clamp_min(1e-9)).mean(0)
        for name, mask in spans.items():
            if mask.any():
                sums.setdefault(f"{name}_err_k", []).append(float(err_k[mask].mean()))
                sums.setdefault(f"{name}_err_v", []).append(float(err_v[mask].mean()))
    return {key: round(sum(vals) / len(vals), 4) for key, vals in sums.items()}


def refreshes(cache: Any) -> float | None:
    """Basis refreshes so far, mean over the cache's DepthWeave groups."""
    seen, counts = set(), []
    for layer in cache.layers:
        group = getattr(layer, "group", None)
        if isinstance(layer, DepthWeaveLayer) and group is not None and id(group) not in seen:
            seen.add(id(group))
            value = group.summary().get("refreshes")
            if value is not None:
                counts.append(value)
    return sum(counts) / len(counts) if counts else None


def drift(
    model: Any,
    tokenizer: Any,
    sample: task_lib.Sample,
    spec: str,
    generated: int,
    seed: int,
    every: int,
    name: int,
    write: Any,
) -> None:
    """Prefill ``sample``'s context into a ``spec`` cache, feed ``generated`` filler tokens, and ``write(row)``
    the prompt's reconstruction errors every ``every`` of them (and before the first)."""
    prefill_ids, _ = build_prompt(tokenizer, sample, question_aware=False)
    n_ctx = len(prefill_ids)
    needle = torch.tensor(answer_tokens(tokenizer, prefill_ids, sample.answers), dtype=torch.long)
    spans = {"needle": torch.zeros(n_ctx, dtype=torch.bool), "name": torch.zeros(n_ctx, dtype=torch.bool)}
    spans["needle"][needle] = True
    for start in needle.tolist():
        if start == 0 or not spans["needle"][start - 1]:  # the first token of an answer span
            spans["name"][max(0, start - name) : start] = True
    spans["name"] &= ~spans["needle"]
    spans["rest"] = ~(spans["needle"] | spans["name"])
    exact = {
        index: (step.key[0].float(), step.value[0].float())
        for index, step in enumerate(record_prefill(model, torch.tensor([prefill_ids])))
        if isinstance(step, LayerStep)
    }
    filler = generated_filler(tokenizer, generated, seed)
    cache = kvweave.make_cache(spec, model, tokenizer=tokenizer)
    with torch.no_grad():
        model(torch.tensor([prefill_ids]), **{cache_kwarg(model): cache}, use_cache=True, logits_to_keep=1)
    done, feed_s = 0, 0.0
    while True:
        row = {"generated": done, "feed_s": round(feed_s, 1), "refreshes": refreshes(cache)}
        row.update(kv_bytes=cache.nbytes(), **prompt_errors(cache, exact, spans, n_ctx))
        write(row)
        if done >= len(filler):
            return
        step = filler[done : done + every]
        start = time.perf_counter()
        feed_generated(model, cache, step, n_ctx + done)
        feed_s = time.perf_counter() - start
        done += len(step)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--task", default="niah_multikey")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--generated", type=int, default=4096, help="filler tokens fed after the prompt")
    parser.add_argument("--every", type=int, default=512, help="fed tokens between measurements")
    parser.add_argument("--name", type=int, default=6, help="tokens before a value counted as its name")
    parser.add_argument("--trials", default="0", help="comma-separated trial indices (as kvweave eval's)")
    parser.add_argument(
        "--of", type=int, default=6, help="trials the depths are spread over (eval's --trials)"
    )
    parser.add_argument("--methods", default="depthweave", help="DepthWeave specs, separated by semicolons")
    parser.add_argument("--out", type=Path, required=True, help="JSONL output (appended)")
    args = parser.parse_args(argv)
    if args.every < 1 or args.generated < 0:
        parser.error("--every must be at least 1 and --generated at least 0")
    model, tokenizer = kvweave.load_model(args.model)
    depths = task_lib.depths(args.of)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for trial in (int(t) for t in args.trials.split(",")):
        sample = task_lib.make_sample(args.task, tokenizer, args.context, depth=depths[trial], seed=trial)
        for spec in args.methods.split(";"):

            def write(row: dict[str, Any], spec: str = spec, trial: int = trial) -> None:
                row.update(task=args.task, context=args.context, trial=trial, method=spec)
                with args.out.open("a") as handle:
                    handle.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)

            drift(model, tokenizer, sample, spec, args.generated, trial, args.every, args.name, write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
