"""Which prompt rows an answer's format reads: keep `full`'s most-attended prompt slots exact in DepthWeave.

For each trial of a task (the eval's own samples: same task, length, seed and haystack as ``kvweave eval``),
`full` answers greedily for ``--tokens`` tokens; its attention at answer token ``--at`` (the query that predicts
it: the answer's token before, fed over the prompt and the question) is read over the prompt, mean over layers
and heads. Each DepthWeave spec is then run once per pin set with those slots forced to exact rows in every fold
(an oracle: no method knows the answer's attention at prefill), fed the question the way ``kvweave eval`` feeds
it and `full`'s answer as in ``benchmarks/answer_divergence.py``. Pin sets (``--pins``, comma-separated):

- ``none``: nothing forced (the spec as it is);
- ``topN``: the N prompt slots `full` attends most at ``--at``;
- ``topN@K``: the same among slots ``K`` and later (``@24`` leaves Qwen's system prompt to the spec's own rules).

One JSON line per (trial, spec, pin set): the first divergence from `full`'s answer and the log-probabilities as
answer_divergence writes them, ``logp_at`` (of `full`'s token ``--at``), ``pinned`` (how many slots), ``mass``
(their share of `full`'s attention there), ``compression`` (the cache's 16-bit full bytes over its held bytes
after the prefill: the pins are paid on top of the spec's budget) and ``top`` (the 24 most attended slots, with
the text before each). Not a test: its output is summarised in docs/findings.md with the command. Example::

    KVWEAVE_DATA=../shared/data python benchmarks/attention_oracle.py --task niah_multiquery_common \\
        --haystack essays --context 8192 --seed 1 --trials 3 --at 3 --pins none,top64,top64@24 \\
        --methods depthweave --out runs/oracle.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from answer_divergence import eval_samples, follow, sample_arguments, trial_numbers

import kvweave
from kvweave._compat import cache_kwarg
from kvweave.eval.runner import build_prompt, plan
from kvweave.methods.depthweave import factorize
from kvweave.methods.depthweave.chunk import EXACT

PIN_SET = re.compile(r"^(none|top(\d+)(?:@(\d+))?)$")


@contextlib.contextmanager
def pinned(slots: torch.Tensor | None) -> Iterator[None]:
    """While open, every DepthWeave fold keeps ``slots`` (prompt slot indices) as exact rows, whatever its plan
    says (``None``: no change)."""
    planner = factorize.make_plan

    def plan_with_pins(chunk: Any, novelty: Any, method: Any) -> Any:
        made = planner(chunk, novelty, method)
        if slots is not None:
            made.kind[torch.isin(chunk.slots, slots.to(chunk.slots.device))] = EXACT
        return made

    factorize.make_plan = plan_with_pins
    try:
        yield
    finally:
        factorize.make_plan = planner


def attention_at(model: Any, prompt: list[int], rest: list[int], answer: list[int], at: int) -> torch.Tensor:
    """``[len(prompt)]``: `full`'s attention over the prompt from the query that predicts ``answer[at]`` (after
    ``rest`` and ``answer[:at]``), mean over layers and heads."""
    kw = cache_kwarg(model)
    cache = kvweave.make_cache("full", model)
    fed = rest + answer[: at - 1] if at > 0 else rest[:-1]
    last = answer[at - 1] if at > 0 else rest[-1]
    with torch.no_grad():
        model(torch.tensor([prompt]), **{kw: cache}, use_cache=True, logits_to_keep=1)
        model(torch.tensor([fed]), **{kw: cache}, use_cache=True, logits_to_keep=1)
        model.set_attn_implementation("eager")  # the only implementation that returns attention weights
        try:
            out = model(torch.tensor([[last]]), **{kw: cache}, use_cache=True, output_attentions=True)
        finally:
            model.set_attn_implementation("sdpa")
    return torch.stack([a[0, :, -1, : len(prompt)].float().mean(0) for a in out.attentions]).mean(0)


def recorder(into: list[float]) -> Callable[[Any], None]:
    """A callback that appends a cache's compression (16-bit full bytes over held bytes) to ``into``."""

    def record(cache: Any) -> None:
        into.append(cache.full_kv_bytes() / cache.nbytes())

    return record


def pin_slots(name: str, score: torch.Tensor) -> torch.Tensor | None:
    """The slots of pin set ``name`` (see the module's docstring) under attention ``score``."""
    match = PIN_SET.match(name)
    assert match is not None
    if match.group(1) == "none":
        return None
    count, start = int(match.group(2)), int(match.group(3) or 0)
    ranked = score[start:].argsort(descending=True)[:count] + start
    return ranked.sort().values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sample_arguments(parser)
    parser.add_argument("--at", type=int, default=3, help="answer token whose attention is read (default 3)")
    parser.add_argument("--pins", default="none,top64", help="pin sets: none, topN, topN@K (comma-separated)")
    parser.add_argument("--methods", required=True, help="DepthWeave specs, separated by ';'")
    parser.add_argument("--tokens", type=int, default=40, help="answer tokens followed (default 40)")
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, appended")
    args = parser.parse_args(argv)
    trials = trial_numbers(parser, args)
    if not 0 <= args.at < args.tokens:
        parser.error(f"--at must be an answer token, 0 to {args.tokens - 1} (--tokens), got {args.at}")
    pins = [p.strip() for p in args.pins.split(",") if p.strip()]
    bad = [p for p in pins if not PIN_SET.match(p)]
    if bad or not pins:
        parser.error(f"--pins takes none, topN or topN@K (e.g. top64@24), got {args.pins!r}")
    methods = [m.strip() for m in args.methods.split(";") if m.strip()]
    if not methods or any(not m.startswith("depthweave") for m in methods):
        parser.error(f"--methods takes DepthWeave specs (the pins are its exact rows), got {args.methods!r}")
    config = eval_samples(args, ["full"], "attention_oracle")
    if config is None:
        return 2
    model, tokenizer = kvweave.load_model(args.model)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for trial in (t for t in plan(config) if t.trial in trials):
        sample = config.sample(trial, tokenizer)
        prompt, whole = build_prompt(tokenizer, sample, False)
        rest = whole[len(prompt) :]
        ref = follow(model, kvweave.make_cache("full", model), prompt, rest, None, args.tokens)["argmax"]
        score = attention_at(model, prompt, rest, ref, args.at)
        top = [
            [s, round(float(score[s]), 4), tokenizer.decode(prompt[max(0, s - 3) : s + 1])]
            for s in score.argsort(descending=True)[:24].tolist()
        ]
        print(f"trial {trial.trial}: full answers {tokenizer.decode(ref)!r}", flush=True)
        for name in pins:
            slots = pin_slots(name, score)
            for spec in methods:
                start = time.perf_counter()
                cache = kvweave.make_cache(spec, model, tokenizer=tokenizer)
                held: list[float] = []
                with pinned(slots):
                    got = follow(
                        model,
                        cache,
                        prompt,
                        rest,
                        ref,
                        args.tokens,
                        recorder(held),
                    )
                div = next(
                    (i for i, (a, b) in enumerate(zip(got["argmax"], ref, strict=True)) if a != b), None
                )
                row = {
                    "model": args.model,
                    "task": args.task,
                    "context": args.context,
                    "seed": trial.seed,
                    "trial": trial.trial,
                    "haystack": args.haystack,
                    "method": spec,
                    "pins": name,
                    "pinned": 0 if slots is None else int(slots.numel()),
                    "mass": 0.0 if slots is None else round(float(score[slots].sum() / score.sum()), 3),
                    "compression": round(held[0], 2),
                    "at": args.at,
                    "diverge": div,
                    "wanted": None if div is None else tokenizer.decode([ref[div]]),
                    "got": None if div is None else tokenizer.decode([got["argmax"][div]]),
                    "logp_at": round(got["logp"][args.at], 3),
                    "logp_sum": round(sum(got["logp"]), 3),
                    "reference": tokenizer.decode(ref),
                    "top": top,
                }
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                where = "none" if div is None else f"{div} (wants {row['wanted']!r}, got {row['got']!r})"
                print(
                    f"  {spec} pins {name} ({row['pinned']} slots, {row['mass']:.0%} of the mass, "
                    f"{row['compression']}x): first divergence {where}, log p at {args.at} {row['logp_at']} "
                    f"[{time.perf_counter() - start:.0f} s]",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
