"""Perplexity with a compressed cache: ``kvweave ppl``.

For each window of ``window`` tokens of a long text, the first ``window - target`` tokens are prefilled (and
compressed by the method, like a document before a question), then the last ``target`` tokens are fed in one
forward pass through the same cache and scored by teacher forcing. Their own keys and values are appended
exactly, so the score measures what compression of the prefix costs. ``full`` is the reference.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from kvweave._compat import cache_kwarg
from kvweave.cache import make_cache
from kvweave.eval import tasks as task_lib
from kvweave.registry import parse_method
from kvweave.report.specs import SPEC_VERSION


def window_nll(
    model: Any, ids: list[int], method: str, target: int, stepwise: bool = False, tokenizer: Any = None
) -> dict[str, Any]:
    """Mean negative log-likelihood of the last ``target`` tokens of ``ids`` given the compressed rest.

    The scored tokens go through the cache in one forward pass, or with ``stepwise`` one token per forward
    pass, as ``generate()`` decodes: methods whose attention depends on the query chunk (DK-Cache picks its
    far pages once per forward pass, for all of the pass's queries) or that evict while decoding are then
    scored as they behave in decoding. Both give the same NLL for ``full``. ``tokenizer`` is what
    content-aware methods read the ids' text with (default: the model's, ``make_cache``).
    """
    prefix, scored = torch.tensor([ids[:-target]]), torch.tensor([ids[-target - 1 :]])
    cache = make_cache(method, model, tokenizer=tokenizer)
    kw = cache_kwarg(model)
    start = time.perf_counter()
    with torch.no_grad():
        model(prefix[:, :-1], use_cache=True, logits_to_keep=1, **{kw: cache})
        held, full = cache.nbytes(), cache.full_kv_bytes(bits=16)
        if stepwise:
            logits = torch.cat(
                [
                    model(scored[:, t : t + 1], use_cache=True, **{kw: cache}).logits.float()
                    for t in range(scored.shape[1] - 1)
                ],
                dim=1,
            )
            held = max(held, cache.nbytes())
        else:
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
    stepwise: bool = False,
) -> list[dict[str, Any]]:
    """Rows (one per method and window) and a JSONL file in ``out_dir`` (resumable); ``stepwise`` scores the
    target tokens one forward pass per token (see :func:`window_nll`)."""
    from tqdm import tqdm

    if not 0 < target < window:
        raise ValueError(f"--target must be between 1 and --window - 1, got {target} for window {window}")
    from kvweave.eval.runner import _end_with_newline, read_rows

    specs = [parse_method(m).spec() for m in methods]
    text = task_lib.load_corpus(corpus, data_dir=data_dir)
    chunks = task_lib.perplexity_windows(tokenizer, text, window, windows)
    digests = [window_digest(chunk) for chunk in chunks]
    rows_path = out_dir / "ppl.jsonl" if out_dir else None
    done = set()
    if rows_path is not None:
        out_dir.mkdir(parents=True, exist_ok=True)  # type: ignore[union-attr]
        if rows_path.exists():
            old = read_rows(rows_path)  # a line torn by a crash is ignored and redone
            check_resumable(old, model_name, corpus, window, target, digests, rows_path)
            done = {row["key"] for row in old if "key" in row}
            _end_with_newline(rows_path)
    rows = []
    work = [(i, spec) for i in range(len(chunks)) for spec in specs]
    for i, spec in tqdm(work, desc="ppl", disable=not progress):
        key = f"{spec}|{corpus}|{window}|{target}|{i}" + ("|stepwise" if stepwise else "")
        if key in done:
            continue
        row = {
            "model": model_name,
            "method": spec,
            "spec_version": SPEC_VERSION,
            "corpus": corpus,
            "window": window,
            "target": target,
            "index": i,
            "window_sha1": digests[i],
            "stepwise": stepwise,
            "key": key,
            **window_nll(model, chunks[i], spec, target, stepwise=stepwise, tokenizer=tokenizer),
        }
        rows.append(row)
        if rows_path is not None:
            with rows_path.open("a") as handle:
                handle.write(json.dumps(row) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
    if rows_path is not None:
        rows = read_rows(rows_path)
    return rows


def window_digest(ids: list[int]) -> str:
    """A short fingerprint of one window's token ids (recorded per row, compared on resume)."""
    return hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:16]


def check_resumable(
    rows: list[dict[str, Any]],
    model_name: str,
    corpus: str,
    window: int,
    target: int,
    digests: list[str],
    rows_path: Path,
) -> None:
    """Refuse to add rows to a ppl folder written with another model, or whose window ``i`` holds other
    tokens than this command's (another ``--windows`` count spreads the windows differently)."""
    for row in rows:
        if row.get("model") not in (None, model_name):
            raise ValueError(
                f"{rows_path} holds rows of model {row['model']!r}, not {model_name!r}: give a new --out folder"
            )
        index = row.get("index")
        same_setting = (row.get("corpus"), row.get("window"), row.get("target")) == (corpus, window, target)
        if same_setting and "window_sha1" in row and isinstance(index, int):
            if index >= len(digests) or row["window_sha1"] != digests[index]:
                raise ValueError(
                    f"{rows_path} scored other tokens as window {index} of {corpus} (another --windows count "
                    "or corpus file): give a new --out folder, or the --windows of its command.txt"
                )


def summarize_perplexity(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (model, corpus, window, target, method): perplexity over the windows (exp of the mean NLL), the
    number of windows, compression, and the change against ``full`` of the same setting."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        setting = (
            row.get("model"),
            row.get("corpus"),
            row.get("window"),
            row.get("target"),
            row.get("stepwise", False),
        )
        groups.setdefault((*setting, row["method"]), []).append(row)
    summary = []
    for (model, corpus, window, target, stepwise, method), members in groups.items():
        nll = sum(r["nll"] for r in members) / len(members)
        kv, full = max(r["kv_bytes"] for r in members), max(r["full_kv_bytes"] for r in members)
        summary.append(
            {
                "model": model,
                "corpus": corpus,
                "window": window,
                "target": target,
                "stepwise": stepwise,
                "method": method,
                "nll": nll,
                "ppl": math.exp(nll),
                "n": len(members),
                "kv_bytes": kv,
                "compression": full / kv if kv else None,
            }
        )

    def same_windows(entry: dict[str, Any]) -> tuple[Any, ...]:
        return (entry["model"], entry["corpus"], entry["window"], entry["target"], entry["stepwise"])

    reference = {same_windows(s): s["ppl"] for s in summary if s["method"] == "full"}
    for entry in summary:
        base = reference.get(same_windows(entry))
        entry["ppl_vs_full"] = entry["ppl"] / base - 1 if base else None
    return sorted(summary, key=lambda s: (*map(str, same_windows(s)), s["method"] != "full", s["method"]))


def format_perplexity(summary: list[dict[str, Any]]) -> str:
    """Plain-text table."""
    lines = [f"{'method':<40} {'window':>7} {'scoring':>8} {'ppl':>8} {'vs full':>8} {'x':>6} {'n':>3}"]
    for s in summary:
        delta = f"{100 * s['ppl_vs_full']:+.1f}%" if s["ppl_vs_full"] is not None else "-"
        scoring = "stepwise" if s["stepwise"] else "one pass"
        lines.append(
            f"{s['method']:<40} {s['window']!s:>7} {scoring:>8} {s['ppl']:>8.3f} {delta:>8} "
            f"{s['compression'] or 0:>6.2f} {s['n']:>3}"
        )
    return "\n".join(lines)
