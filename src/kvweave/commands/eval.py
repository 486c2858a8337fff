"""``kvweave eval``: methods x tasks x context lengths x trials on a real model (a run folder resumes)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvweave.cli_args import _methods, _run_folder, _split, _write_command


def cmd_eval(args: argparse.Namespace) -> int:
    from kvweave.eval import runner

    config = runner.EvalConfig(
        model=args.model,
        tasks=_split(args.task),
        contexts=args.context,
        methods=_methods(args.methods),
        trials=args.trials,
        question_aware=args.question_aware,
        dtype=args.dtype,
        haystack=args.haystack,
        data_dir=args.data,
        seed=args.seed,
        beyond_trained=args.beyond_trained,
        max_new_tokens=args.max_new_tokens,
        tp=args.tp,
        generated=args.generated,
        batch=args.batch,
    )
    from kvweave.distributed import is_main_process
    from kvweave.launch import launch, needs_launch

    _run_folder(args.out)
    out = Path(args.out) if args.out else None
    if out is not None:
        runner.check_resumable(out / "rows.jsonl", runner.plan(config), config)  # before command.txt grows
    if needs_launch(args.tp):  # --tp N: start N ranks under torchrun, each running this command
        return launch(args.argv, args.tp, args.model)
    if out is not None and is_main_process():
        out.mkdir(parents=True, exist_ok=True)
        _write_command(out)
    rows = runner.run(config, out_dir=out, progress=not args.json)
    if not is_main_process():  # rank 0 wrote the rows and prints the table
        return 0
    summary = runner.add_speed_ratios(runner.summarize(rows))
    if args.json:
        print(json.dumps({"rows": rows, "summary": summary}, default=str))
    else:
        print(runner.format_table(summary))
        if out:
            print(f"\nrows: {out / 'rows.jsonl'}")
    return 0
