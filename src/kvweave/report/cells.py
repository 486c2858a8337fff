"""Table cells shared by the markdown summary and the HTML page: perplexity and ``kvweave bench`` lines."""

from __future__ import annotations

from html import escape
from typing import Any


def _num(value: Any, pattern: str) -> str:
    return "-" if value is None else pattern % value


PPL_HEADER = [
    "model",
    "corpus",
    "window (scored)",
    "method",
    "windows",
    "compression",
    "perplexity",
    "vs full",
]


def ppl_cells(entry: dict[str, Any]) -> list[str]:
    """One perplexity line: the setting, the method, and perplexity against ``full`` of the same setting."""
    change = entry.get("ppl_vs_full")
    return [
        str(entry.get("model")),
        str(entry.get("corpus")),
        f"{entry.get('window')} ({entry.get('target')}{', stepwise' if entry.get('stepwise') else ''})",
        f"`{entry['method']}`",
        str(entry["n"]),
        _num(entry.get("compression"), "%.2fx"),
        f"{entry['ppl']:.2f}",
        "-" if change is None else f"{100 * change:+.1f}%",
    ]


BENCH_HEADER = [
    "method",
    "context",
    "batch",
    "ms/token",
    "tok/s",
    "speedup",
    "bound",
    "achieved/bound",
    "KV MiB held",
    "KV MiB read",
    "prefill s",
    "overhead s",
    "peak MiB",
]


def _speed(value: Any) -> str:
    """ms or tok/s with three or four significant digits: 0.84, 7.04, 14.2, 142."""
    if value is None:
        return "-"
    value = float(value)
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


def _mib(value: Any, pattern: str = "%.2f") -> str:
    return "-" if value is None else pattern % (value / 2**20)


def bench_cells(row: dict[str, Any]) -> list[str]:
    """One ``kvweave bench`` point: step time and throughput, speedup against ``full`` beside its bound, the
    KV bytes held and read per step, prefill and its overhead over ``full``'s, and peak memory."""
    return [
        f"`{row['method']}`",
        str(row["context"]),
        str(row["batch"]),
        _speed(row.get("ms_per_token")),
        _speed(row.get("tok_s")),
        _num(row.get("speedup"), "%.2fx"),
        _num(row.get("bound"), "%.2fx"),
        "-" if row.get("of_bound") is None else f"{100 * row['of_bound']:.0f}%",
        _mib(row.get("kv_bytes")),
        _mib(row.get("kv_read_bytes")),
        _num(row.get("prefill_s"), "%.2f"),
        _num(row.get("overhead_s"), "%+.2f"),
        _mib(row.get("peak_bytes"), "%.0f"),
    ]


def html_table(header: list[str], lines: list[list[str]]) -> str:
    """An HTML table: the first column is the name (left), the rest numbers; markdown backticks dropped."""
    head = f'<th class="name">{escape(header[0])}</th>' + "".join(f"<th>{escape(c)}</th>" for c in header[1:])
    body = []
    for line in lines:
        name, *numbers = (cell.strip("`") for cell in line)
        cells = f'<td class="name">{escape(name)}</td>' + "".join(f"<td>{escape(c)}</td>" for c in numbers)
        body.append(f"<tr>{cells}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def markdown_table(header: list[str], lines: list[list[str]], align: list[str] | None = None) -> str:
    """A markdown table; ``align``: "l" or "r" per column (default: the first left, the rest right)."""
    align = align or ["l"] + ["r"] * (len(header) - 1)
    rule = ["---:" if a == "r" else ":---" for a in align]
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join(rule) + " |"]
    out += ["| " + " | ".join(cells) + " |" for cells in lines]
    return "\n".join(out)
