"""The seeds' comparison tables, regenerated from committed run folders (no figure is typed by hand).

Not a test: reads ``rows.jsonl`` of finished ``kvweave eval`` runs (and the DepthWeave probe JSONL) and prints
markdown tables:

- ``dkcache``: the DK-Cache seed's ablation rows (native / sliding window / INT8 / position interpolation /
  DK-Cache), per task and context: accuracy (trials), KV memory held, measured compression, and decode speed as
  a ratio against ``full`` *of the same run folder*;
- ``depthweave``: the DepthWeave probe ablation (held-out attention-output error, KL and top-1 agreement of a
  continuation, measured compression), one line per setting.

Usage::

    python benchmarks/seed_tables.py dkcache docs/data/runs/passkey-4k docs/data/runs/passkey-4k-slow
    python benchmarks/seed_tables.py depthweave docs/data/depthweave-ablation.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

# (label, predicate on the method spec) in the seed's order; the first matching label wins
DKCACHE_ROWS: list[tuple[str, str]] = [
    ("native (full cache)", "full"),
    ("sliding window + sinks", "window"),
    ("INT8 (KIVI-style)", "quant:bits=8"),
    ("position interpolation x2", "pi"),
    ("DK-Cache", "dkcache"),
]


def _label(method: str) -> str | None:
    for label, prefix in DKCACHE_ROWS:
        if method == prefix or method.startswith(prefix + ":"):
            return label
    return None


def _rows(folder: Path) -> list[dict[str, Any]]:
    path = folder / "rows.jsonl"
    if not path.is_file():
        raise SystemExit(f"seed_tables: {path} not found (pass finished kvweave eval run folders)")
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # an interrupted run's last line
    return rows


def dkcache_table(folders: list[Path]) -> str:
    groups: dict[tuple[str, str, int, str], list[dict[str, Any]]] = defaultdict(list)
    for folder in folders:
        for row in _rows(folder):
            groups[(folder.name, row["task"], row["context"], row["method"])].append(row)
    reference = {
        (run, task, ctx): statistics.median(r["decode_tok_s"] for r in rows if r.get("decode_tok_s"))
        for (run, task, ctx, method), rows in groups.items()
        if method == "full"
    }
    lines = [
        "| task | context | row | method | accuracy (n) | KV MiB | compression | per-step attention | decode vs full "
        "| run |",
        "| :--- | ---: | :--- | :--- | ---: | ---: | ---: | ---: | ---: | :--- |",
    ]
    order = {label: i for i, (label, _) in enumerate(DKCACHE_ROWS)}
    entries = []
    for (run, task, ctx, method), rows in groups.items():
        label = _label(method)
        if label is None:
            continue
        speeds = [r["decode_tok_s"] for r in rows if r.get("decode_tok_s")]
        full = reference.get((run, task, ctx))
        ratio = statistics.median(speeds) / full if speeds and full else None
        accuracy = sum(r["score"] for r in rows) / len(rows)
        kv = max(r["kv_bytes"] for r in rows)
        compression = max(r["full_kv_bytes"] for r in rows) / kv
        attended = [r["attended"] / (r["prompt_tokens"] + r["new_tokens"]) for r in rows if r.get("attended")]
        if attended:
            share = f"{100 * statistics.median(attended):.0f}%"
        else:  # rows from before the runner recorded ``attended`` say nothing either way
            share = "all held" if all("attended" in r for r in rows) else "not recorded"
        entries.append(
            (task, ctx, order[label], method, label, accuracy, len(rows), kv, compression, share, ratio, run)
        )
    for task, ctx, _, method, label, accuracy, n, kv, compression, share, ratio, run in sorted(entries):
        speed = f"{ratio:.2f}" if ratio is not None else "-"
        lines.append(
            f"| {task} | {ctx} | {label} | `{method}` | {100 * accuracy:.0f}% ({n}) | {kv / 2**20:.1f} | "
            f"{compression:.2f}x | {share} | {speed} | {run} |"
        )
    return "\n".join(lines)


def depthweave_table(path: Path) -> str:
    lines = [
        "| setting | compression | held-out attn-output error | continuation KL | top-1 agreement | NLL (full) |",
        "| :--- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for text in path.read_text().splitlines():
        if not text.strip():
            continue
        row = json.loads(text)
        cont = row.get("continuation") or {}
        held = row.get("mean_held_out_error")
        error = f"{100 * held:.1f}%" if held is not None else "-"
        kl = f"{cont['kl']:.3f}" if "kl" in cont else "-"
        top1 = f"{100 * cont['top1_agree']:.0f}%" if "top1_agree" in cont else "-"
        nll = f"{cont['nll']:.3f} ({cont['nll_full']:.3f})" if "nll" in cont and "nll_full" in cont else "-"
        lines.append(f"| `{row['setting']}` | {row['compression']:.2f}x | {error} | {kl} | {top1} | {nll} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("table", choices=["dkcache", "depthweave"])
    parser.add_argument("inputs", nargs="+", type=Path, help="run folders (dkcache) or the probe JSONL")
    args = parser.parse_args(argv)
    if args.table == "dkcache":
        print(dkcache_table(args.inputs))
    else:
        print(depthweave_table(args.inputs[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
