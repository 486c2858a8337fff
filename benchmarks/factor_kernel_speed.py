"""DepthWeave's fused selective-decode kernel (``kernels/cpu_factor``) timed against an earlier version of its
source, at the attention shapes of real models: the two kernel calls one decode step makes per layer and row
store (``factor_logits``: rebuild, rotate and score the chosen tokens; ``factor_weighted``: weight their value
coordinates), 512 chosen tokens in pages of 64 from 4,096 stored, INT4 coordinates.

Both builds run in one process, interleaved, on the same inputs; the rows say whether their outputs are equal.
One JSON row per (shape, call) is appended to ``--out``::

    OMP_NUM_THREADS=2 python benchmarks/factor_kernel_speed.py --before eb69f11 --out runs/factor-kernel.jsonl

Only ratios within one run mean anything on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch

from kvweave.kernels import cpu_factor
from kvweave.kernels._build import build
from kvweave.ops.quantize import pack

SHAPES = {  # name: (KV heads, query heads per KV head, head size, coordinate rank)
    "smollm2-135m": (3, 3, 64, 48),
    "qwen2.5-0.5b": (2, 7, 64, 32),
    "llama-3.1-8b": (8, 4, 128, 32),
}


def timed(call, repeats: int, rounds: int) -> float:
    """Milliseconds per call: the best of ``rounds`` rounds of ``repeats`` calls."""
    for _ in range(5):
        call()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        best = min(best, (time.perf_counter() - start) / repeats)
    return 1000 * best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--before", required=True, help="git revision whose cpu_factor.cpp is the baseline")
    parser.add_argument("--tokens", type=int, default=4096, help="stored tokens (rows of coordinates)")
    parser.add_argument("--chosen", type=int, default=512, help="tokens the step rebuilds (pages of 64)")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", required=True, help="JSONL file the rows are appended to")
    args = parser.parse_args(argv)
    if args.chosen % 64 or args.chosen > args.tokens:
        parser.error("--chosen must be a multiple of 64 and at most --tokens")
    try:
        before_source = subprocess.run(
            ["git", "show", f"{args.before}:src/kvweave/kernels/cpu_factor.cpp"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    except subprocess.CalledProcessError as error:
        parser.error(f"--before {args.before}: no cpu_factor.cpp there ({error.stderr.strip()})")
    revision = subprocess.run(
        ["git", "rev-parse", "--short", args.before], check=True, capture_output=True, text=True
    ).stdout.strip()
    before, reason = build(
        f"kvweave_cpu_factor_at_{revision}",
        cpu_factor._CPP_DECL,
        before_source,
        ["factor_logits", "factor_weighted"],
    )
    now = cpu_factor.load()
    if before is None or now is None:
        raise SystemExit(
            f"factor_kernel_speed: a kernel did not build: {reason or cpu_factor.unavailable_reason()}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pages = args.chosen // 64
    for name, (heads, group, dim, rank) in SHAPES.items():
        generator = torch.Generator().manual_seed(0)
        packed = pack(torch.randn(args.tokens, rank, generator=generator), 4, 64, torch.float32)
        data, scale = cpu_factor._raw(packed)
        r_k = torch.randn(rank, heads, dim, generator=generator)
        first = torch.randint(0, args.tokens // 64, (heads, pages), generator=generator) * 64
        rows = (first.unsqueeze(-1) + torch.arange(64)).flatten(1).contiguous()
        positions = torch.arange(args.tokens, dtype=torch.int32)
        angles = torch.arange(args.tokens).float()[:, None] * torch.rand(
            dim // 2, generator=generator
        ).repeat(2)
        cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
        query = torch.randn(heads, group, dim, generator=generator)
        probs = torch.rand(heads, group, args.chosen, generator=generator)
        logits_args = (query, data, scale, 4, 64, r_k, rows, positions, cos, sin)
        weighted_args = (probs, data, scale, 4, 64, rows)
        calls = {
            "factor_logits": lambda m, a=logits_args: m.factor_logits(*a),
            "factor_weighted": lambda m, a=weighted_args: m.factor_weighted(*a),
        }
        for call, run in calls.items():
            equal = bool(torch.equal(run(before), run(now)))
            ms_before = timed(lambda run=run: run(before), args.repeats, args.rounds)
            ms_now = timed(lambda run=run: run(now), args.repeats, args.rounds)
            row = {
                "kind": "factor_kernel",
                "shape": name,
                "call": call,
                "kv_heads": heads,
                "group": group,
                "head_size": dim,
                "rank": rank,
                "tokens": args.tokens,
                "chosen": args.chosen,
                "before": revision,
                "ms_before": round(ms_before, 4),
                "ms_now": round(ms_now, 4),
                "speedup": round(ms_before / ms_now, 3),
                "outputs_equal": equal,
                "threads": torch.get_num_threads(),
            }
            with out.open("a") as handle:
                handle.write(json.dumps(row) + "\n")
            print(
                f"{name:14s} {call:16s} {ms_before:7.3f} -> {ms_now:7.3f} ms ({row['speedup']:.2f}x), equal {equal}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
