"""``kvweave report``: one HTML page (and optionally markdown and CSV) from run folders and bench files."""

from __future__ import annotations

import argparse


def cmd_report(args: argparse.Namespace) -> int:
    from kvweave.report import bench_csv_path, write_report

    runs = write_report(args.runs, args.output, markdown=args.md, csv=args.csv)
    rows, bench = sum(len(r.rows) for r in runs), sum(len(r.bench) for r in runs)
    serving = sum(len(r.serving) for r in runs)
    counts = ", ".join(
        ([f"{rows} rows"] if rows or not (bench or serving) else [])
        + ([f"{bench} bench rows"] if bench else [])
        + ([f"{serving} serving rows"] if serving else [])
    )
    print(f"report: {args.output} ({counts} from {len(runs)} run(s))")
    if args.md:
        print(f"summary: {args.md}")
    if args.csv:
        print(f"numbers: {args.csv}")
        if bench:
            print(f"bench numbers: {bench_csv_path(args.csv)}")
    return 0
