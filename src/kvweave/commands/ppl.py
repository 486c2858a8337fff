"""``kvweave ppl``: perplexity of long text through a compressed cache."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvweave.cli_args import _load, _methods, _run_folder, _write_command


def cmd_ppl(args: argparse.Namespace) -> int:
    from kvweave.eval import perplexity

    for spec in _methods(args.methods):
        from kvweave.registry import parse_method

        parse_method(spec)
    if not 0 < args.target < args.window:  # before the model loads
        raise ValueError(
            f"--target must be between 1 and --window - 1, got {args.target} for window {args.window}; give a "
            "smaller --target or a larger --window"
        )
    _run_folder(args.out)
    model, tokenizer = _load(args)
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        _write_command(out)
    rows = perplexity.run_perplexity(
        model,
        tokenizer,
        args.model,
        _methods(args.methods),
        corpus=args.corpus,
        window=args.window,
        target=args.target,
        windows=args.windows,
        data_dir=args.data,
        out_dir=out,
        stepwise=args.stepwise,
    )
    summary = perplexity.summarize_perplexity(rows)
    print(json.dumps(summary, indent=2) if args.json else perplexity.format_perplexity(summary))
    return 0
