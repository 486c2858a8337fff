"""Perplexity with a compressed cache: ``kvweave ppl``.

For each window of ``window`` tokens of a long text, the first ``window - target`` tokens are prefilled (and
compressed by the method, like a document before a question), then the last ``target`` tokens are fed in one
forward pass through the same cache and scored by teacher forcing. Their own keys and values are appended
exactly, so the score measures what compression of the prefix costs. ``full`` is the reference.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from kvweave._compat import cache_kwarg
from kvweave.cache import make_cache, parse_method
from kvweave.eval import tasks as task_lib


def window_nll(model: Any, ids: list[int], method: str, target: int) -> dict[str, Any]:
    """Mean negative log-likelihood of the last ``target`` tokens of ``ids`` given the compressed rest."""
    prefix, scored = torch.tensor([ids[:-target]]), torch.tensor([ids[-target - 1 :]])
    cache = make_cache(method, model)
    kw = cache_kwarg(model)
    start = time.perf_counter()
    with torch.no_grad():
        model(prefix[:, :-1], use_cache=True, logits_to_keep=1, **{kw: cache})
        held, full = cache.nbytes(), cache.full_kv_bytes(bits=16)
        logits = model(scored[:, :-1], use_cache=True, **{kw: cache}).logits.float()
    nll = torch.nn.functional.cross_entropy(logits[0], scored[0, 1:], reduction="mean").item()
    return {"nll": nll, "kv_bytes": held, "full_kv_bytes": full, "seconds": time.perf_counter() - start}


def run_perplexity(
    model: Any,
    tokenizer: Any,
    model_name: str,
    methods: list[str],
    corpus: str = "wikitext2_valid",
    window: int = 4096,
    target: int = 512,
    windows: int = 4,
    data_dir: str | None = None,
    out_dir: Path | None = None,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Rows (one per method and window) and a JSONL file in ``out_dir`` (resumable)."""
    from tqdm import tqdm

    if not 0 < target < window:
        raise ValueError(f"--target must be between 1 and --window - 1, got {target} for window {window}")
    specs = [parse_method(m).spec() for m in methods]
    text = task_lib.load_corpus(corpus, data_dir=data_dir)
    chunks = task_lib.perplexity_windows(tokenizer, text, window, windows)
    rows_path = out_dir / "ppl.jsonl" if out_dir else None
    done = set()
    if rows_path is not None:
        out_dir.mkdir(parents=True, exist_ok=True)  # type: ignore[union-attr]
        if rows_path.exists():
            done = {json.loads(line)["key"] for line in rows_path.read_text().splitlines() if line.strip()}
    rows = []
    work = [(i, spec) for i in range(len(chunks)) for spec in specs]
    for i, spec in tqdm(work, desc="ppl", disable=not progress):
        key = f"{spec}|{corpus}|{window}|{target}|{i}"
        if key in done:
            continue
        row = {
            "model": model_name,
            "method": spec,
            "corpus": corpus,
            "window": window,
            "target": target,
            "index": i,
            "key": key,
            **window_nll(model, chunks[i], spec, target),
        }
        rows.append(row)
        if rows_path is not None:
            with rows_path.open("a") as handle:
                handle.write(json.dumps(row) + "\n")
    if rows_path is not None:
        rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()]
    return rows


def summarize_perplexity(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method: perplexity over all windows, compression, and the change against ``full``."""
    by_method: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_method.setdefault(row["method"], []).append(row)
    summary = []
    for method, members in by_method.items():
        nll = sum(r["nll"] for r in members) / len(members)
        kv, full = max(r["kv_bytes"] for r in members), max(r["full_kv_bytes"] for r in members)
        summary.append(
            {
                "method": method,
                "ppl": math.exp(nll),
                "n": len(members),
                "kv_bytes": kv,
                "compression": full / kv if kv else None,
            }
        )
    reference = next((s["ppl"] for s in summary if s["method"] == "full"), None)
    for entry in summary:
        entry["ppl_vs_full"] = entry["ppl"] / reference - 1 if reference else None
    return sorted(summary, key=lambda s: s["method"])


def format_perplexity(summary: list[dict[str, Any]]) -> str:
    """Plain-text table."""
    lines = [f"{'method':<40} {'ppl':>8} {'vs full':>8} {'x':>6} {'n':>3}"]
    for s in summary:
        delta = f"{100 * s['ppl_vs_full']:+.1f}%" if s["ppl_vs_full"] is not None else "-"
        lines.append(
            f"{s['method']:<40} {s['ppl']:>8.3f} {delta:>8} {s['compression'] or 0:>6.2f} {s['n']:>3}"
        )
    return "\n".join(lines)
