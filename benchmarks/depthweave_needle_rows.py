"""Does ``protect`` keep a needle's value exact? Tokenizer only: no model runs.

For every trial of a ``kvweave eval`` plan (the same samples: task, context, trials, haystack) this prints one
JSON line: the value's tokens with the score :func:`~kvweave.methods.depthweave.router.retrievable_scores`
gives each (today's default rules: ``protect_names=2``, ``protect_records=6``), ``protect``'s rows at its
fraction of the prompt, the score a token needs to be among them, how many of the prompt's tokens score at
least that, and how many score at least the value's best piece (the rows it would take to reach it). A value whose tokens score below the threshold is left to the ranks. Example (docs/findings.md,
thirtieth session: why word values break at 16x)::

    KVWEAVE_DATA=../shared/data python benchmarks/depthweave_needle_rows.py --task niah_word --context 8192
"""

from __future__ import annotations

import argparse
import json

import torch

from kvweave.eval import runner
from kvweave.methods.depthweave import router


def find(ids: list[int], value: list[int]) -> int | None:
    """The first position where ``value`` occurs in ``ids``, or ``None``."""
    for i in range(len(ids) - len(value) + 1):
        if ids[i : i + len(value)] == value:
            return i
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="whose tokenizer reads the prompts")
    parser.add_argument("--task", default="niah_word", help="a single-answer NIAH task (default niah_word)")
    parser.add_argument("--context", type=int, default=8192, help="context length (default 8192)")
    parser.add_argument("--trials", type=int, default=6, help="trials (default 6, as the tables)")
    parser.add_argument("--haystack", default=None, help="as kvweave eval's --haystack (default: the task's)")
    parser.add_argument("--protect", type=float, default=0.02, help="protect's fraction (default 0.02)")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from kvweave.models import resolve

    tokenizer = AutoTokenizer.from_pretrained(resolve(args.model))
    config = runner.EvalConfig(
        model=args.model,
        tasks=[args.task],
        contexts=[args.context],
        methods=["full"],
        trials=args.trials,
        haystack=args.haystack,
    )
    for trial in runner.plan(config):
        sample = config.sample(trial, tokenizer)
        prefill, _ = runner.build_prompt(tokenizer, sample, False)
        ids = torch.as_tensor(prefill).view(-1)
        score = router.retrievable_scores(ids, tokenizer, torch.arange(ids.numel()), 1, names=2, records=6)[0]
        rows = round(args.protect * ids.numel())
        threshold = float(torch.sort(score, descending=True).values[rows - 1])
        listed = ids.tolist()
        value = sample.answers[0]
        start = length = None
        for text in (" " + value, value):  # as the prompt has it: after a space, or not
            pieces = tokenizer(text, add_special_tokens=False).input_ids
            start = find(listed, pieces)
            if start is not None:
                length = len(pieces)
                break
        row: dict[str, object] = {
            "task": args.task,
            "context": args.context,
            "trial": trial.trial,
            "value": value,
            "protect_rows": rows,
            "threshold": threshold,
            "at_or_above": int((score >= threshold).sum()),
        }
        if start is None or length is None:
            row["value_tokens"] = None  # tokenised differently inside the prompt
        else:
            span = range(start, start + length)
            row["value_tokens"] = [tokenizer.decode([listed[i]]) for i in span]
            row["value_scores"] = [round(float(score[i]), 2) for i in span]
            best = max(float(score[i]) for i in span)  # rows it would take to reach the value's best piece
            row["at_or_above_value"] = int((score >= best).sum()) if best > 0 else None
            # tokens tied at the threshold share its last rows: kept for certain only when all the ties fit
            ties_fit = int((score >= threshold).sum()) <= rows
            row["kept_exact"] = [
                float(score[i]) > 0
                and (float(score[i]) > threshold or (float(score[i]) == threshold and ties_fit))
                for i in span
            ]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
