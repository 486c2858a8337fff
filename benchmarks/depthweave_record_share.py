"""How much of each eval prompt ``depthweave:protect_records`` reads as record fields, beside ``protect``'s rows.

For every trial of a ``kvweave eval`` plan (the same samples, by task, context, trial count, haystack and
``--question-aware``) this writes one JSON line: the prompt's tokens, ``protect``'s rows at the default fraction,
the tokens ``protect_names`` marks as named values, the record fields found, those of them not named values
already with their share of the prompt (what the :data:`~kvweave.methods.depthweave.router.RECORD_SHARE` gate
reads), and the fields singled out after it. Tokenizer only:
no model runs. Example (the figures in docs/findings.md, twenty-fourth session)::

    KVWEAVE_DATA=../shared/data python benchmarks/depthweave_record_share.py --context 4096,8192 \\
        --out runs/record-share.jsonl
    # the long-generation task's 1K column drew from the built-in word lists (KVWEAVE_DATA unset)
    python benchmarks/depthweave_record_share.py --case "long generation" >> runs/record-share.jsonl
    python benchmarks/depthweave_record_share.py --soak >> runs/record-share.jsonl   # the soak's prompt
    python benchmarks/depthweave_record_share.py --bench --context 8192,16384,32768 >> runs/record-share.jsonl

``names_changes`` / ``records_changes`` count the tokens whose score ``protect_names=2`` (against 0) and
``protect_records`` (against ``protect_names=2`` alone) change: 0 means that option's rows are the rows without
it, token for token, since both act only on the prompt's scores at prefill.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kvweave.eval import runner
from kvweave.eval import tasks as task_lib
from kvweave.methods.depthweave import router

# (label, task, haystack, question_aware, contexts): the tables protect_records was measured on, at --context
# (contexts None); then issue #30's point-5 tables (their default haystack, pydoc), also at --context; then the
# long-generation task's prompt (multi-key at 2K: what is prefilled before the generated tokens), at 2,048 only
CASES: list[tuple[str, str, str | None, bool, list[int] | None]] = [
    ("common words, essays", "niah_multiquery_common", "essays", False, None),
    ("hex, essays", "niah_multivalue_hex", "essays", False, None),
    ("common words, question in the prompt", "niah_multiquery_common", "essays", True, None),
    ("common words, pydoc", "niah_multiquery_common", "pydoc", False, None),
    ("multi-query numbers, essays", "niah_multiquery", "essays", False, None),
    ("code", "code", None, False, None),
    ("multi-key numbers, pydoc", "niah_multikey", None, False, None),
    ("multi-query numbers, pydoc", "niah_multiquery", None, False, None),
    ("word, pydoc", "niah_word", None, False, None),
    ("uuid, pydoc", "niah_uuid", None, False, None),
    ("long generation's prompt (multi-key, pydoc)", "niah_multikey", None, False, [2048]),
]


def prompt_row(ids: torch.Tensor, tokenizer: object, records: int, protect: float) -> dict[str, object]:
    """What ``protect``'s rules read in one prompt's ``ids``: named values, record fields, the gate's share, the
    fields singled out, and how many tokens' scores each option changes (0: its rows are the option-off rows)."""
    n = ids.numel()
    slots = torch.arange(n)
    off = router.retrievable_scores(ids, tokenizer, slots, 1)[0]
    plain = router.retrievable_scores(ids, tokenizer, slots, 1, names=2)[0]
    score = router.retrievable_scores(ids, tokenizer, slots, 1, names=2, records=records)[0]
    table = router.token_classes(tokenizer).lookup(torch.unique(ids))
    _, inverse = torch.unique(ids, return_inverse=True)
    found = router._record_fields(inverse, table[:, 3][inverse] > 0, records)
    # what the gate reads: fields that are not named values already (those take rows either way)
    contested = int((found.gt(0) & (plain < router.NAMED)).sum())
    return {
        "tokens": n,
        "protect_rows": round(protect * n),
        "named": int((score >= router.NAMED).sum()),
        "fields": int(found.gt(0).sum()),
        "contested": contested,
        "share": round(contested / n, 4),
        "singled_out": int(((score >= router.RECORD) & (score < router.NAMED)).sum()),
        "names_changes": int((plain != off).sum()),  # protect_names=2 against 0
        "records_changes": int((score != plain).sum()),  # protect_records against protect_names=2 alone
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="whose tokenizer reads the prompts")
    parser.add_argument("--context", default="4096", help="comma-separated context lengths (default 4096)")
    parser.add_argument("--trials", type=int, default=6, help="trials per task (default 6, as the tables)")
    parser.add_argument("--records", type=int, default=6, help="protect_records' phrase length (default 6)")
    parser.add_argument("--protect", type=float, default=0.02, help="protect's fraction (default 0.02)")
    parser.add_argument(
        "--case",
        action="append",
        default=[],
        help="only the cases whose label contains this text (repeatable; default every case)",
    )
    parser.add_argument(
        "--soak",
        action="store_true",
        help="instead, the soak's prompt (benchmarks/soak.py's stream): one row",
    )
    parser.add_argument(
        "--bench", action="store_true", help="instead, kvweave bench's prompt at each --context: one row each"
    )
    parser.add_argument(
        "--soak-model", default="smollm2-135m", help="the soak's model (default smollm2-135m)"
    )
    parser.add_argument("--soak-prompt", type=int, default=512, help="the soak's --prompt (default 512)")
    parser.add_argument("--out", type=Path, help="JSONL file (default: standard output)")
    args = parser.parse_args()
    try:
        contexts = [int(c) for c in args.context.split(",")]
    except ValueError:
        parser.error(f"--context {args.context!r}: give comma-separated integers, e.g. 4096,8192")
    from transformers import AutoTokenizer

    from kvweave.models import resolve

    tokenizer = AutoTokenizer.from_pretrained(resolve(args.model))
    out = args.out.open("w") if args.out else sys.stdout
    cases = [case for case in CASES if not args.case or any(part in case[0] for part in args.case)]
    if args.soak or args.bench:
        cases = []
    elif not cases:
        labels = "; ".join(case[0] for case in CASES)
        parser.error(f"--case {args.case}: no case's label contains it; the labels: {labels}")
    for label, task, haystack, question_aware, fixed in cases:
        config = runner.EvalConfig(
            model=args.model,
            tasks=[task],
            contexts=fixed or contexts,
            methods=["full"],
            trials=args.trials,
            haystack=haystack,
            question_aware=question_aware,
        )
        for trial in runner.plan(config):
            prefill, _ = runner.build_prompt(tokenizer, config.sample(trial, tokenizer), question_aware)
            row = {
                "case": label,
                "task": task,
                "context": trial.context,
                "trial": trial.trial,
                "word_lists": task_lib.word_lists(config.data_dir),
            }
            row.update(prompt_row(torch.as_tensor(prefill).view(-1), tokenizer, args.records, args.protect))
            print(json.dumps(row), file=out, flush=True)
    if args.bench:  # kvweave bench's prompt (kvweave.eval.bench.prompt: pydoc prose) at each --context
        from kvweave.eval.bench import prompt

        for context in contexts:
            ids = prompt(tokenizer, len(tokenizer), context, 1, "cpu")[0]
            row = {"case": "kvweave bench's prompt", "model": args.model, "context": context}
            row.update(prompt_row(ids, tokenizer, args.records, args.protect))
            print(json.dumps(row), file=out, flush=True)
    if args.soak:  # the soak's prompt (benchmarks/soak.py: the first --prompt tokens of its stream)
        import soak

        soak_tokenizer = AutoTokenizer.from_pretrained(resolve(args.soak_model))
        stream = soak.token_stream(soak_tokenizer, len(soak_tokenizer), args.soak_prompt + 1)
        row = {"case": "the soak's prompt", "model": args.soak_model, "context": args.soak_prompt}
        row.update(prompt_row(stream[0, : args.soak_prompt], soak_tokenizer, args.records, args.protect))
        print(json.dumps(row), file=out, flush=True)
    if args.out:
        out.close()


if __name__ == "__main__":
    main()
