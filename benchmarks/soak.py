"""Soak: thousands of decode steps per method, checking memory, finiteness and DepthWeave's refreshes on the way.

Not a test: a benchmark script that writes results (``tests/reliability/test_soak.py`` runs a short version of
the same loop on a tiny random model). For each method, the first ``--prompt`` tokens of a token stream
(CPython's documentation prose, repeated; random ids for a model without a tokenizer) are prefilled, then the
stream is fed one token per step through the cache (teacher forcing: every step is a real one-token decode
step, and the next-token loss measures whether the cache still serves the model). Every ``--every`` steps a
checkpoint row records the bytes held (``cache.nbytes()``), what a 16-bit full cache would hold, the process's
resident memory, whether every logit of the interval was finite, the interval's mean next-token loss and step
times, and DepthWeave's fold and basis-refresh counts (``cache.stats()``) with the time of the steps that
refreshed.

Rows are appended (and flushed) to ``OUT/rows.jsonl`` as each checkpoint finishes, so a crash loses at most one
interval. With ``--save-every N`` the cache itself is saved (``kvweave.save_cache``) every N checkpoints to
``OUT/state/<method>``; rerunning the same command skips finished methods and resumes an unfinished one from
its last saved cache (without a saved cache it starts that method again). ``--minutes`` caps each method's
wall time: a method stopped by it is summarised with the steps it reached (``complete: false``), and a rerun
with a larger cap continues it. ``OUT/summary.json`` (one entry per method) is rewritten after each method.

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/soak.py --model smollm2-135m --steps 20000 \\
        --methods window,h2o,quant,dkcache,depthweave --out docs/data/soak --minutes 12 --save-every 4
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

DEFAULT_METHODS = "window,h2o,quant,dkcache,depthweave"


# ------------------------------------------------------------------------------------------------ memory


def resident_bytes() -> int:
    """The process's resident set size now (``/proc/self/status``; peak RSS where that file is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def refresh_counts(cache: Any) -> dict[str, int]:
    """DepthWeave's folds and basis refreshes summed over its layer groups and rows (``{}`` for other methods).

    Read from the row stores' logs directly: ``cache.stats()`` sums every part's bytes, too slow per step."""
    groups = [g for g in cache.context.groups.values() if hasattr(g, "rows")]
    if not groups:
        return {}
    stores = [store for group in groups for store in group.rows if store is not None]
    return {
        "folds": sum(int(store.log.get("folds", 0)) for store in stores),
        "refreshes": sum(int(store.log.get("refreshes", 0)) for store in stores),
    }


# ------------------------------------------------------------------------------------------------ the loop


def token_stream(tokenizer: Any, vocab: int, tokens: int) -> torch.Tensor:
    """``[1, tokens]`` ids: the pydoc prose (repeated) with a tokenizer, seeded random ids without one."""
    from kvweave.eval.bench import prompt

    return prompt(tokenizer, vocab, tokens, 1, "cpu")


def soak(
    model: Any,
    stream: torch.Tensor,
    spec: str,
    steps: int,
    every: int,
    prompt_tokens: int,
    emit: Callable[[dict[str, Any]], None],
    seconds: float | None = None,
    state_dir: Path | None = None,
    save_every: int = 0,
) -> dict[str, Any]:
    """Prefill ``stream[:, :prompt_tokens]`` into a ``spec`` cache and decode ``steps`` tokens of ``stream`` one
    per step, emitting a checkpoint row every ``every`` steps; returns the method's summary.

    ``seconds`` caps the wall time (the summary says how far it got); ``state_dir`` with ``save_every`` saves the
    cache every ``save_every`` checkpoints and resumes from it when it is there."""
    import kvweave
    from kvweave._compat import cache_kwarg
    from kvweave.persist import CacheFileError

    if stream.shape[1] < prompt_tokens + steps + 1:
        raise ValueError(f"the stream has {stream.shape[1]} tokens; {prompt_tokens + steps + 1} are needed")
    kwarg = cache_kwarg(model)
    start_step, rows = 0, []
    cache = None
    if state_dir is not None and save_every and (state_dir / "manifest.json").is_file():
        try:
            cache, manifest = kvweave.load_cache(state_dir, model)
            start_step = manifest.tokens - prompt_tokens
            print(f"  [{spec}: resumed at step {start_step} from {state_dir}]", file=sys.stderr, flush=True)
        except CacheFileError as err:  # a state from another model or kvweave: start again
            print(f"  [{spec}: not resuming ({err})]", file=sys.stderr, flush=True)
            cache = None
    began = time.perf_counter()
    with torch.no_grad():
        if cache is None:
            cache = kvweave.make_cache(spec, model)
            cache.set_prompt(stream[:, :prompt_tokens])
            model(stream[:, :prompt_tokens], **{kwarg: cache})
        step, interval = start_step, _Interval()
        while step < steps:
            if seconds is not None and time.perf_counter() - began > seconds:
                break
            token = stream[:, prompt_tokens + step : prompt_tokens + step + 1]
            target = int(stream[0, prompt_tokens + step + 1])
            before = refresh_counts(cache) if interval.track_refreshes else {}
            tick = time.perf_counter()
            logits = model(token, **{kwarg: cache}).logits[0, -1].float()
            elapsed = time.perf_counter() - tick
            refreshed = bool(before) and refresh_counts(cache).get("refreshes", 0) > before["refreshes"]
            interval.add(logits, target, elapsed, refreshed)
            step += 1
            if step % every == 0 or step == steps:
                row = _checkpoint(cache, spec, step, interval)
                rows.append(row)
                emit(row)
                interval = _Interval(track_refreshes=bool(refresh_counts(cache)))
                if state_dir is not None and save_every and (len(rows) % save_every == 0 or step == steps):
                    seen = prompt_tokens + step
                    kvweave.save_cache(cache, model, state_dir, prompt_ids=stream[:, :seen])
    return summarize(spec, rows, steps, getattr(cache.method, "bounded_memory", False))


class _Interval:
    """What the steps since the last checkpoint measured."""

    def __init__(self, track_refreshes: bool = True) -> None:
        self.track_refreshes = track_refreshes
        self.losses: list[float] = []
        self.times: list[float] = []
        self.refresh_times: list[float] = []
        self.finite = True

    def add(self, logits: torch.Tensor, target: int, seconds: float, refreshed: bool) -> None:
        finite = bool(torch.isfinite(logits).all())
        self.finite &= finite
        if finite:
            self.losses.append(float(torch.log_softmax(logits, -1)[target].neg()))
        self.times.append(seconds)
        if refreshed:
            self.refresh_times.append(seconds)


def _checkpoint(cache: Any, spec: str, step: int, interval: _Interval) -> dict[str, Any]:
    counts = refresh_counts(cache)
    row: dict[str, Any] = {
        "kind": "checkpoint",
        "method": spec,
        "step": step,
        "seen": cache.get_seq_length(),
        "bytes": cache.nbytes(),
        "full_kv_bytes_16bit": cache.full_kv_bytes(16),
        "rss_bytes": resident_bytes(),
        "finite": interval.finite,
        "loss": statistics.fmean(interval.losses) if interval.losses else None,
        "ms_per_step": 1000 * statistics.median(interval.times),
        "max_ms": 1000 * max(interval.times),
        "time": time.time(),
        "pid": os.getpid(),
    }
    if counts:
        row.update(counts)
        groups = [g for g in cache.context.groups.values() if hasattr(g, "rows")]
        # DepthWeave's exact newest tokens (``recent_share``) and exact rows, per layer group
        row["recent_tokens"] = [g.recent[g.members[-1]].count() for g in groups]
        row["exact_rows"] = [
            sum(s.token_counts.get("exact", 0) for s in g.rows if s is not None) for g in groups
        ]
        row["refresh_steps"] = len(interval.refresh_times)
        row["refresh_ms"] = (
            1000 * statistics.fmean(interval.refresh_times) if interval.refresh_times else None
        )
    return row


def summarize(spec: str, rows: list[dict[str, Any]], steps: int, bounded: bool) -> dict[str, Any]:
    """One method's figures from its checkpoint rows (in step order): bytes per token decoded (the slope from
    the first checkpoint to the last) against a 16-bit full cache's, the memory the process gained beyond the
    cache's own growth, finiteness, loss drift and DepthWeave's refreshes."""
    if not rows:
        return {"kind": "summary", "method": spec, "steps": 0, "target_steps": steps, "complete": False}
    first, last = rows[0], rows[-1]
    tokens = last["seen"] - first["seen"]
    per_token = (last["bytes"] - first["bytes"]) / tokens if tokens else 0.0
    full_per_token = (last["full_kv_bytes_16bit"] - first["full_kv_bytes_16bit"]) / tokens if tokens else 0.0
    losses = [r["loss"] for r in rows if r["loss"] is not None]
    # resident memory compares within one process: the checkpoints of the last (resumed) run
    same = [r for r in rows if r.get("pid") == last.get("pid")] or [last]
    flat = next(
        (r["step"] for i, r in enumerate(rows) if all(o["bytes"] == r["bytes"] for o in rows[i:])), None
    )
    summary: dict[str, Any] = {
        "kind": "summary",
        "method": spec,
        "steps": last["step"],
        "target_steps": steps,
        "complete": last["step"] >= steps,
        "bounded_memory": bounded,
        "bytes_first": first["bytes"],
        "bytes_last": last["bytes"],
        "bytes_max": max(r["bytes"] for r in rows),
        "bytes_per_token": per_token,
        "full_16bit_bytes_per_token": full_per_token,
        "growth_compression": (full_per_token / per_token) if per_token > 0 else None,
        "compression_last": last["full_kv_bytes_16bit"] / last["bytes"] if last["bytes"] else None,
        "bytes_flat_from_step": flat,
        "rss_first": same[0]["rss_bytes"],
        "rss_last": last["rss_bytes"],
        "rss_beyond_cache": (last["rss_bytes"] - same[0]["rss_bytes"]) - (last["bytes"] - same[0]["bytes"]),
        "rss_steps": last["step"] - same[0]["step"],
        "finite": all(r["finite"] for r in rows),
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "ms_per_step_first": first["ms_per_step"],
        "ms_per_step_last": last["ms_per_step"],
    }
    if "refreshes" in last:
        refresh_ms = [r["refresh_ms"] for r in rows if r.get("refresh_ms") is not None]
        summary.update(
            folds=last["folds"],
            refreshes=last["refreshes"],
            refreshes_per_1k_steps=1000 * last["refreshes"] / max(1, last["step"]),
            refresh_ms_mean=statistics.fmean(refresh_ms) if refresh_ms else None,
        )
    return summary


# ------------------------------------------------------------------------------------------------ files


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSONL file (none when it does not exist yet); a last line cut by a crash is skipped."""
    from kvweave.eval import runner

    return runner.read_rows(path) if path.is_file() else []


def appender(path: Path) -> Callable[[dict[str, Any]], None]:
    """A function appending one row to ``path`` and flushing it to disk (after a cut line, on a new line)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_file() and path.stat().st_size and not path.read_bytes().endswith(b"\n"):
        with path.open("a") as handle:
            handle.write("\n")

    def emit(row: dict[str, Any]) -> None:
        with path.open("a") as handle:
            handle.write(json.dumps(row, default=float) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    return emit


def checkpoints_of(rows: list[dict[str, Any]], spec: str, up_to: int | None = None) -> list[dict[str, Any]]:
    """The latest checkpoint row of each step of ``spec`` (a resumed run rewrites the steps after its state),
    in step order, up to step ``up_to``."""
    by_step = {
        r["step"]: r
        for r in rows
        if r.get("kind") == "checkpoint" and r.get("method") == spec and (up_to is None or r["step"] <= up_to)
    }
    return [by_step[s] for s in sorted(by_step)]


def format_summary(summary: dict[str, Any]) -> str:
    """One line of a summary for the terminal."""
    if not summary.get("steps"):
        return f"{summary['method']:<12} no steps"
    text = (
        f"{summary['method']:<12} {summary['steps']:>6} steps  bytes {summary['bytes_first'] / 2**20:8.2f} -> "
        f"{summary['bytes_last'] / 2**20:8.2f} MiB  {summary['bytes_per_token']:8.1f} B/token "
        f"(16-bit full {summary['full_16bit_bytes_per_token']:.0f})  rss beyond cache "
        f"{summary['rss_beyond_cache'] / 2**20:+.1f} MiB  finite {summary['finite']}  loss "
        f"{summary['loss_first']:.2f} -> {summary['loss_last']:.2f}"
    )
    if "refreshes" in summary:
        text += f"  refreshes {summary['refreshes']} (folds {summary['folds']})"
    return text


def markdown(rows: list[dict[str, Any]]) -> str:
    """The latest summary of each method as a markdown table (docs/reliability.md)."""
    summaries = {r["method"]: r for r in rows if r.get("kind") == "summary"}
    lines = [
        "| method | steps | bytes held first → last checkpoint | bytes / token decoded (16-bit full) | "
        "held bounded | RSS beyond the cache's growth | finite | loss first → last | ms / step first → last "
        "| refreshes (folds) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for spec, s in summaries.items():
        flat = s.get("bytes_flat_from_step")
        bounded = f"flat from step {flat}" if s.get("bounded_memory") and flat is not None else "grows"
        refreshes = f"{s['refreshes']} ({s['folds']})" if "refreshes" in s else "-"
        lines.append(
            f"| `{spec}` | {s['steps']} | {s['bytes_first'] / 2**20:.2f} → {s['bytes_last'] / 2**20:.2f} MiB | "
            f"{s['bytes_per_token']:.0f} ({s['full_16bit_bytes_per_token']:.0f}) | {bounded} | "
            f"{s['rss_beyond_cache'] / 2**20:+.1f} MiB over {s.get('rss_steps', s['steps'])} steps | "
            f"{'yes' if s['finite'] else 'NO'} | {s['loss_first']:.2f} → {s['loss_last']:.2f} | "
            f"{s['ms_per_step_first']:.0f} → {s['ms_per_step_last']:.0f} | {refreshes} |"
        )
    return "\n".join(lines) + "\n"


def loss_table(rows: list[dict[str, Any]], reference: str = "full") -> str:
    """Per checkpoint step, each method's interval loss beside ``reference``'s at the same step (the same
    stream: rows of several runs may be given together) and its compression against a 16-bit full cache, as a
    markdown table; the latest row of each (method, step) counts."""
    latest: dict[tuple[str, int], dict[str, Any]] = {}
    for row in rows:
        if row.get("kind") == "checkpoint":
            latest[(row["method"], int(row["step"]))] = row
    methods = list(dict.fromkeys(method for method, _ in latest))
    others = [m for m in methods if m != reference]
    header = f"| step | `{reference}` loss | " + " | ".join(
        f"`{m}` loss (vs `{reference}`), compression" for m in others
    )
    lines = [header + " |", "|---|---|" + "---|" * len(others)]
    for step in sorted({step for _, step in latest}):
        ref = latest.get((reference, step))
        cells = [f"{step:,}", f"{ref['loss']:.3f}" if ref else "-"]
        for method in others:
            row = latest.get((method, step))
            if row is None:
                cells.append("-")
                continue
            change = f" ({100 * (row['loss'] / ref['loss'] - 1):+.1f} %)" if ref else ""
            ratio = row["full_kv_bytes_16bit"] / max(row["bytes"], 1)
            cells.append(f"{row['loss']:.3f}{change}, {ratio:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="registry name or local folder")
    parser.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated method names or specs")
    parser.add_argument("--steps", type=int, default=20000, help="decode steps per method (default 20000)")
    parser.add_argument("--every", type=int, default=500, help="steps between checkpoints (default 500)")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens prefilled first (default 512)")
    parser.add_argument("--minutes", type=float, help="wall-time cap per method (a rerun continues)")
    parser.add_argument("--save-every", type=int, default=0, help="save the cache every N checkpoints")
    parser.add_argument("--out", help="folder: rows.jsonl and summary.json (required unless --losses)")
    parser.add_argument("--state", help="folder of the saved caches (default OUT/state; keep it out of git)")
    parser.add_argument(
        "--markdown", action="store_true", help="print the summaries in OUT as a markdown table and stop"
    )
    parser.add_argument(
        "--losses",
        nargs="+",
        metavar="ROWS",
        help="print each method's interval loss beside full's, checkpoint by checkpoint, from these rows files "
        "(one stream: runs of the same --model and --prompt) as a markdown table and stop",
    )
    parser.add_argument(
        "--summaries",
        nargs="+",
        metavar="ROWS",
        help="print the latest summary of each method in these rows files as a markdown table and stop",
    )
    args = parser.parse_args(argv)
    for option in ("losses", "summaries"):
        paths = getattr(args, option)
        if not paths:
            continue
        missing = [path for path in paths if not Path(path).is_file()]
        if missing:
            parser.error(f"no rows file {', '.join(missing)}; give the rows.jsonl a soak run wrote")
        rows = [row for path in paths for row in read_rows(Path(path))]
        print(loss_table(rows) if option == "losses" else markdown(rows), end="")
        return 0
    if min(args.steps, args.every, args.prompt) < 1 or args.save_every < 0:
        parser.error("--steps, --every and --prompt must be positive, --save-every not negative")
    if not args.out:
        parser.error("--out is required (or --losses ROWS...)")
    if args.markdown:
        print(markdown(read_rows(Path(args.out) / "rows.jsonl")), end="")
        return 0
    from kvweave.cli_args import _split
    from kvweave.registry import parse_method

    specs = _split(args.methods)
    for spec in specs:  # bad specs fail before the model loads
        try:
            parse_method(spec)
        except ValueError as err:
            parser.error(str(err))

    import kvweave
    from kvweave.eval.runner import environment

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / "rows.jsonl"
    emit = appender(rows_path)
    summaries = {s["method"]: s for s in read_rows(rows_path) if s.get("kind") == "summary"}
    model, tokenizer = kvweave.load_model(args.model)
    stream = token_stream(tokenizer, model.config.vocab_size, args.prompt + args.steps + 1)
    emit({"kind": "run", "command": " ".join(sys.argv), "model": args.model, **environment()})
    for spec in specs:
        done = summaries.get(spec)
        if done and done.get("complete") and done.get("target_steps") == args.steps:
            print(format_summary(done))
            continue
        state = Path(args.state or out / "state") / spec.replace(":", "_").replace(",", "_").replace("=", "-")
        seconds = args.minutes * 60 if args.minutes else None
        print(f"[{spec}] {args.steps} steps, checkpoint every {args.every}", file=sys.stderr, flush=True)
        summary = soak(
            model, stream, spec, args.steps, args.every, args.prompt, emit, seconds, state, args.save_every
        )
        # the summary covers every checkpoint of this method, those of earlier (resumed) runs included
        held = checkpoints_of(read_rows(rows_path), spec, up_to=summary["steps"] or None)
        summary = summarize(spec, held, args.steps, summary.get("bounded_memory", False))
        summary["minutes_cap"] = args.minutes
        emit(summary)
        summaries[spec] = summary
        (out / "summary.json").write_text(
            json.dumps(list(summaries.values()), indent=2, default=float) + "\n"
        )
        print(format_summary(summary), flush=True)
    return 0 if all(math.isfinite(s.get("bytes_per_token", 0.0)) for s in summaries.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
