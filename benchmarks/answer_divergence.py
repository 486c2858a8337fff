"""Where a method's answer first leaves `full`'s: teacher-force `full`'s greedy answer through each method's cache.

For each trial of a task (the eval's own samples: same task, length, seed and haystack as ``kvweave eval``),
`full` answers greedily for ``--tokens`` tokens; every other method's cache is prefilled with the same prompt,
fed the question the way ``kvweave eval`` feeds it (one multi-token step after the document, so ``quote`` acts),
then fed `full`'s answer one decode step at a time. One JSON line per (trial, method):

- ``diverge``: the first answer token where the method's own argmax differs from `full`'s (``null``: none in
  ``--tokens``), with ``text_before`` (the answer so far), ``wanted`` and ``got`` (the two tokens);
- ``logp_sum`` / ``logp_min``: log-probabilities the method gives `full`'s tokens (0 = it agrees surely);
- ``rebuilt_spans``: passages the method rebuilt while the question and answer were fed (DepthWeave);
- ``full_margin_at_diverge``: how far `full` itself put its token above its runner-up there (log-probability gap;
  near 0: a coin flip any perturbation turns), and ``full_margin_min`` / ``full_margin_where``: `full`'s smallest
  gap over the whole answer and where it is.

It tells which part of a configuration moves the answer (e.g. a list written as ``1. **word**: prose…`` instead
of ``1. word``): compare a method with one option changed at a time. Not a test: its output is summarised in
docs/findings.md with the command that made it. Example::

    KVWEAVE_DATA=../shared/data python benchmarks/answer_divergence.py --task niah_multiquery_common \\
        --haystack essays --context 4096 --seed 1 --trials 3,4,5 \\
        --methods "depthweave;depthweave:decode_tokens=0;depthweave:sinks=64" --out runs/diverge.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import kvweave
from kvweave._compat import cache_kwarg
from kvweave.eval.runner import EvalConfig, build_prompt, plan, rebuilt_spans


def follow(
    model: Any,
    cache: Any,
    prefill: list[int],
    rest: list[int],
    forced: list[int] | None,
    n: int,
    after_prefill: Callable[[Any], None] | None = None,
) -> dict[str, list[Any]]:
    """Prefill ``prefill``, feed ``rest`` as one step, then ``n`` decode steps: greedy (``forced=None``) or fed
    ``forced``; the argmax at each step, the log-probability of the token fed next and the gap between the top two
    log-probabilities (``margin``). ``after_prefill(cache)`` is called between the prefill and ``rest``."""
    kw = cache_kwarg(model)
    argmax: list[int] = []
    logp: list[float] = []
    margin: list[float] = []
    with torch.no_grad():
        model(torch.tensor([prefill]), **{kw: cache}, use_cache=True, logits_to_keep=1)
        if after_prefill is not None:
            after_prefill(cache)
        logits = model(torch.tensor([rest]), **{kw: cache}, use_cache=True, logits_to_keep=1).logits[0, -1]
        for i in range(n):
            argmax.append(int(logits.argmax()))
            fed = argmax[-1] if forced is None else forced[i]
            scores = torch.log_softmax(logits.float(), -1)
            logp.append(float(scores[fed]))
            top = scores.topk(2).values
            margin.append(float(top[0] - top[1]))
            logits = model(torch.tensor([[fed]]), **{kw: cache}, use_cache=True).logits[0, -1]
    return {"argmax": argmax, "logp": logp, "margin": margin}


def sample_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments that name the eval's samples: model, task, context, seed, haystack, trials and ``--of``."""
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--task", required=True)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0, help="the eval's --seed (its samples)")
    parser.add_argument("--haystack", default=None)
    parser.add_argument("--trials", default="0", help="trial numbers, comma-separated")
    parser.add_argument(
        "--of",
        type=int,
        default=6,
        help="the eval's --trials (default 6): where each trial's needles lie depends on it",
    )


def trial_numbers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[int]:
    """``--trials`` as sorted numbers, refused (``parser.error``) unless each is one of ``--of``'s."""
    try:
        trials = sorted({int(t) for t in args.trials.split(",")})
    except ValueError:
        parser.error(f"--trials takes numbers separated by commas, got {args.trials!r}")
    if max(trials) >= args.of or min(trials) < 0:
        parser.error(f"--trials are numbered 0 to {args.of - 1} (--of {args.of}), got {args.trials!r}")
    return trials


def eval_samples(
    args: argparse.Namespace, methods: list[str], script: str, question_aware: bool = False
) -> EvalConfig | None:
    """The :class:`EvalConfig` whose samples ``args`` name, or ``None`` after a one-line error on stderr."""
    try:
        return EvalConfig(
            model=args.model,
            tasks=[args.task],
            contexts=[args.context],
            methods=methods,
            trials=args.of,
            seed=args.seed,
            haystack=args.haystack,
            question_aware=question_aware,
        )
    except (ValueError, FileNotFoundError) as error:
        print(f"{script}: {error}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sample_arguments(parser)
    parser.add_argument("--question-aware", action="store_true")
    parser.add_argument(
        "--methods", required=True, help="method specs, separated by ';' (full is the reference)"
    )
    parser.add_argument("--tokens", type=int, default=40, help="answer tokens followed (default 40)")
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, appended")
    args = parser.parse_args(argv)
    trials = trial_numbers(parser, args)
    if args.tokens < 1:
        parser.error(f"--tokens must be at least 1, got {args.tokens}")
    methods = [m.strip() for m in args.methods.split(";") if m.strip()]
    config = eval_samples(args, ["full", *methods], "answer_divergence", args.question_aware)
    if config is None:
        return 2
    model, tokenizer = kvweave.load_model(args.model)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for trial in (t for t in plan(config) if t.method == "full" and t.trial in trials):
        sample = config.sample(trial, tokenizer)
        prefill, full = build_prompt(tokenizer, sample, args.question_aware)
        rest = full[len(prefill) :]
        answer = follow(model, kvweave.make_cache("full", model), prefill, rest, None, args.tokens)
        ref, margins = answer["argmax"], answer["margin"]
        narrowest = min(range(len(margins)), key=margins.__getitem__)
        print(f"trial {trial.trial}: full answers {tokenizer.decode(ref)!r}", flush=True)
        for spec in methods:
            start = time.perf_counter()
            cache = kvweave.make_cache(spec, model, tokenizer=tokenizer)
            got = follow(model, cache, prefill, rest, ref, args.tokens)
            div = next((i for i, (a, b) in enumerate(zip(got["argmax"], ref, strict=True)) if a != b), None)
            row = {
                "model": args.model,
                "task": args.task,
                "context": args.context,
                "seed": trial.seed,
                "trial": trial.trial,
                "haystack": args.haystack,
                "question_aware": args.question_aware,
                "method": spec,
                "tokens": args.tokens,
                "diverge": div,
                "text_before": None if div is None else tokenizer.decode(ref[:div]),
                "wanted": None if div is None else tokenizer.decode([ref[div]]),
                "got": None if div is None else tokenizer.decode([got["argmax"][div]]),
                "logp_sum": round(sum(got["logp"]), 3),
                "logp_min": round(min(got["logp"]), 3),
                "rebuilt_spans": rebuilt_spans(cache),
                "full_margin_at_diverge": None if div is None else round(margins[div], 3),
                "full_margin_min": round(margins[narrowest], 3),
                "full_margin_where": narrowest,
                "reference": tokenizer.decode(ref),
            }
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            where = "none" if div is None else f"{div} (wants {row['wanted']!r}, got {row['got']!r})"
            print(f"  {spec}: first divergence {where} [{time.perf_counter() - start:.0f} s]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
