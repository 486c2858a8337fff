"""``kvweave demo``: every registered method at 4x and 8x on the default model, with a verdict."""

from __future__ import annotations

import argparse
import textwrap

from kvweave.cli_args import _methods, _run_folder


def cmd_demo(args: argparse.Namespace) -> int:
    from kvweave import demo

    _run_folder(args.out)
    summary, folder, labels = demo.run_demo(
        model=args.model,
        context=args.context,
        trials=args.trials,
        methods=_methods(args.methods)
        if args.methods is not None
        else None,  # "" is refused, not the default
        out=args.out,
        dtype=args.dtype,
        max_new_tokens=args.max_new_tokens,
    )
    print(
        "\n"
        + textwrap.fill(
            demo.verdict(summary, args.context, args.trials, labels), width=110, break_on_hyphens=False
        )
    )
    print(
        f"\nrun folder: {folder}\nreport: {folder / 'report.html'}\nsummary: {folder / 'summary.md'} "
        f"(numbers: {folder / 'summary.csv'}; every row: {folder / 'rows.jsonl'})"
    )
    return 0
