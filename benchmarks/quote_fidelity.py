"""How close `quote`'s rebuilt passages are to `full`'s keys and values, against what DepthWeave stores there.

For each trial of a task (the eval's own samples: same task, length, seed and haystack as ``kvweave eval``), the
prompt's document is prefilled once into a full cache (the reference keys and values) and, per DepthWeave spec,
into a DepthWeave cache; the question is then fed as one step (as ``kvweave eval`` feeds it, so ``quote`` acts).
One JSON line per (trial, spec) with, over the passages the question's quotes rebuilt (``spans``):

- ``rebuilt_err_k`` / ``rebuilt_err_v``: the relative error ``|x̂ - x| / |x|`` of the rebuilt keys / values
  against `full`'s, mean over layers (``_last``: the last layer's);
- ``stored_err_k`` / ``stored_err_v``: the same for what the cache's store holds at those slots (what the
  passages stand in for).

Specs are read with ``recall_bits=16`` added where they do not set it (4-bit passages add their own quantization
error, the same whatever they were rebuilt from). Not a test: its output is summarised in docs/findings.md with
the command that made it. Example::

    KVWEAVE_DATA=../shared/data python benchmarks/quote_fidelity.py --task niah_multiquery_common \\
        --context 4096 --seed 1 --trials 0,1,2 --methods "depthweave;depthweave:quote_over=cache" \\
        --out runs/quote-fidelity.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from answer_divergence import eval_samples, sample_arguments, trial_numbers
from transformers import DynamicCache

import kvweave
from kvweave._compat import cache_kwarg
from kvweave.eval.runner import build_prompt, plan


def errors(cache: Any, reference: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any] | None:
    """The rebuilt passages' and the store's errors at the passages' slots (``None``: nothing rebuilt)."""
    rebuilt_k, rebuilt_v, stored_k, stored_v = [], [], [], []
    spans = None
    for i, layer in enumerate(cache.layers):
        held = getattr(layer, "recall", {}).get(0)
        if held is None:
            return None
        keys, values, slots = held
        want_k, want_v = reference[i][0][:, slots], reference[i][1][:, slots]
        rebuilt_k.append(float((keys.float() - want_k).norm() / want_k.norm()))
        rebuilt_v.append(float((values.float() - want_v).norm() / want_v.norm()))
        k, v, where = layer.held_kv(0)
        index = {int(s): j for j, s in enumerate(where.tolist())}
        pick = torch.tensor([index[int(s)] for s in slots.tolist()])
        stored_k.append(float((k[:, pick] - want_k).norm() / want_k.norm()))
        stored_v.append(float((v[:, pick] - want_v).norm() / want_v.norm()))
        spans = layer.recall_spans.get(0)
    n = len(rebuilt_k)
    return {
        "spans": spans,
        "rebuilt_err_k": round(sum(rebuilt_k) / n, 4),
        "rebuilt_err_v": round(sum(rebuilt_v) / n, 4),
        "rebuilt_err_k_last": round(rebuilt_k[-1], 4),
        "rebuilt_err_v_last": round(rebuilt_v[-1], 4),
        "stored_err_k": round(sum(stored_k) / n, 4),
        "stored_err_v": round(sum(stored_v) / n, 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sample_arguments(parser)
    parser.add_argument("--methods", required=True, help="DepthWeave specs, separated by ';'")
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, appended")
    args = parser.parse_args(argv)
    trials = trial_numbers(parser, args)
    methods = [m.strip() for m in args.methods.split(";") if m.strip()]
    if not methods or any(not m.startswith("depthweave") for m in methods):
        parser.error(
            f"--methods takes DepthWeave specs (the method that rebuilds passages), got {args.methods!r}"
        )
    config = eval_samples(args, ["full"], "quote_fidelity")
    if config is None:
        return 2
    model, tokenizer = kvweave.load_model(args.model)
    kw = cache_kwarg(model)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for trial in (t for t in plan(config) if t.trial in trials):
        sample = config.sample(trial, tokenizer)
        prefill, whole = build_prompt(tokenizer, sample, False)
        question = torch.tensor([whole[len(prefill) :]])
        full = DynamicCache(config=model.config)
        with torch.no_grad():
            model(torch.tensor([prefill]), **{kw: full}, use_cache=True, logits_to_keep=1)
        reference = [(layer.keys[0].float(), layer.values[0].float()) for layer in full.layers]
        del full
        for spec in methods:
            written = (
                spec
                if "recall_bits" in spec
                else spec + (",recall_bits=16" if ":" in spec else ":recall_bits=16")
            )
            cache = kvweave.make_cache(written, model, tokenizer=tokenizer)
            with torch.no_grad():
                model(torch.tensor([prefill]), **{kw: cache}, use_cache=True, logits_to_keep=1)
                model(question, **{kw: cache}, use_cache=True, logits_to_keep=1)
            found = errors(cache, reference)
            row = {
                "model": args.model,
                "task": args.task,
                "context": args.context,
                "seed": trial.seed,
                "trial": trial.trial,
                "haystack": args.haystack,
                "method": written,
                **(found or {"spans": None}),
            }
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"trial {trial.trial} {written}: {found}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
