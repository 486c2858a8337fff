"""``kvweave diagnose``: DK-Cache's degradation signals against context length, as JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvweave.cli_args import _load, _methods


def cmd_diagnose(args: argparse.Namespace) -> int:
    from kvweave.diagnostics import run_diagnostics
    from kvweave.eval import tasks as task_lib

    model, tokenizer = _load(args)
    text = task_lib.load_corpus(args.corpus, data_dir=args.data)
    result = run_diagnostics(
        model, tokenizer, text, args.lengths, methods=_methods(args.methods or "", allow_empty=True)
    )
    result["command"] = "kvweave " + " ".join(sys.argv[1:])
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2, default=float))
        print(f"diagnostics: {args.out}", file=sys.stderr)
    else:
        print(json.dumps(result, indent=2, default=float))
    return 0
