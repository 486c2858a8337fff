"""``kvweave bench``: decode speed and memory of methods against full, beside the bandwidth bound."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from kvweave.cli_args import _methods


def cmd_bench(args: argparse.Namespace) -> int:
    from kvweave.eval import bench

    config = bench.BenchConfig(
        methods=_methods(args.methods),
        contexts=args.context,
        batches=args.batch,
        model=None if args.shape else args.model,
        shape=args.shape,
        layers=args.layers,
        device=args.device,
        dtype=args.dtype,
        steps=args.steps,
        rounds=args.rounds,
        prefill_rounds=args.prefill_rounds,
        warmup=args.warmup,
        share_prefill=not args.own_prefill,
        prefill_chunk=args.prefill_chunk,
    )
    out = None
    if args.out:  # a folder gets bench.jsonl and the command line beside it (the report prints it)
        out = Path(args.out) if args.out.endswith(".jsonl") else Path(args.out) / "bench.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        if not args.out.endswith(".jsonl"):
            with (out.parent / "command.txt").open("a") as handle:
                handle.write(shlex.join(["kvweave", *sys.argv[1:]]) + "\n")
    if out is not None and not args.restart:
        config.skip = bench.done_points(out, config)
    emit = bench.write_rows(out) if out else (lambda row: None)
    rows: list[dict[str, Any]] = []

    def show(row: dict[str, Any]) -> None:
        emit(row)
        rows.append(row)
        print(bench.format_row(row), flush=True)

    if all((c, b) in config.skip for c in config.contexts for b in config.batches):
        print(f"every point already has its rows in {out}; --restart measures them again")
        return 0
    print(bench.HEADER)
    bench.run_bench(config, show, progress=lambda text: print(f"  [{text}]", file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
    if out:
        print(f"rows: {out}")
    return 0
