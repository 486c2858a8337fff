"""Summaries of evaluation rows: one entry per (model, method, task, context), speed ratios, a text table."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any


def summarize(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (model, method, task, context): accuracy, n, bytes, compression, speed."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:  # a long-generation row is its own task: "<task> +<N> gen"
        task = f"{row['task']} +{row['generated']} gen" if row.get("generated") else row["task"]
        groups[(row.get("model"), row["method"], task, row["context"])].append(row)
    summary = []
    for (model, method, task, context), members in groups.items():
        speeds = [r["decode_tok_s"] for r in members if r.get("decode_tok_s")]
        kv = max(r["kv_bytes"] for r in members)
        full = max(r["full_kv_bytes"] for r in members)
        summary.append(
            {
                "model": model,
                "method": method,
                "options": members[0].get("options", {}),
                "task": task,
                "context": context,
                "accuracy": sum(r["score"] for r in members) / len(members),
                "n": len(members),
                "kv_bytes": kv,
                "full_kv_bytes": full,
                "compression": full / kv if kv else None,
                "prefill_s": _median([r["prefill_s"] for r in members]),
                "decode_tok_s": _median(speeds) if speeds else None,
            }
        )
    return sorted(summary, key=lambda s: (s["task"], s["context"], s["method"]))


def _median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def add_speed_ratios(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Decode speed as a ratio against ``full`` of the same task and length in the same run."""
    full = {(s["task"], s["context"]): s["decode_tok_s"] for s in summary if s["method"] == "full"}
    for entry in summary:
        reference = full.get((entry["task"], entry["context"]))
        entry["speed_vs_full"] = (
            entry["decode_tok_s"] / reference if reference and entry["decode_tok_s"] else None
        )
    return summary


def format_table(summary: list[dict[str, Any]]) -> str:
    """A plain-text table of a summary."""
    header = (
        f"{'method':<34} {'task':<16} {'context':>7} {'acc':>6} {'n':>3} {'KV MiB':>8} {'x':>6} "
        f"{'prefill s':>9} {'tok/s':>6} {'vs full':>7}"
    )
    lines = [header, "-" * len(header)]
    for s in summary:
        ratio = s.get("speed_vs_full")
        lines.append(
            f"{s['method']:<34} {s['task']:<16} {s['context']:>7} {100 * s['accuracy']:>5.0f}% {s['n']:>3} "
            f"{s['kv_bytes'] / 2**20:>8.2f} {s['compression'] or 0:>6.2f} {s['prefill_s']:>9.2f} "
            f"{s['decode_tok_s'] or 0:>6.1f} {f'{ratio:.2f}' if ratio else '-':>7}"
        )
    return "\n".join(lines)
