"""One decode row of kvweave's vLLM backend, timed per layer and step without an engine: each decode path of a
method beside the others, at the model's attention shapes and several cached lengths.

For each ``--tokens`` length this writes one request's tokens through the backend (``forward`` with prefill
metadata, as vLLM's model runner calls it: chunks of ``--chunk`` tokens, blocks of ``--block-size``), then times
``--steps`` decode rows of each path (median of ``--rounds`` rounds, interleaved) and checks that the paths
agree. Paths:

- ``depthweave``: ``factored`` (the default: attention weights on the value coordinates) and ``rebuild``
  (``KVWEAVE_VLLM_KERNEL=torch``: every stored value rebuilt, then attention);
- ``quant:bits=N``: ``fused`` (the C++ kernel) and ``torch`` (dequantize, then attention).

One JSON row per (method, tokens, path) is appended to ``--out``. Runs in the vLLM venv (the backend imports
vLLM's interfaces; no engine starts)::

    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/vllm_decode_op.py --tokens 1024,2048,4096,8192 \\
        --out runs/vllm-decode-op.jsonl

Only ratios between paths of one run mean anything on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

PATHS = {"depthweave": ("factored", "rebuild"), "quant": ("fused", "torch")}


def build(method: str, tokens: int, args: argparse.Namespace) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """A backend layer holding one request of ``tokens`` tokens: ``impl, cache, block_table``."""
    from kvweave.vllm.backend import KvweaveAttentionImpl, KvweaveMetadata
    from kvweave.vllm.config import PageSlot, QuantSlot, VllmMethod, WeaveSlot

    os.environ["KVWEAVE_VLLM_METHOD"] = method
    heads, dim, block = args.kv_heads, args.head_size, args.block_size
    impl = KvweaveAttentionImpl(
        num_heads=heads * args.group, head_size=dim, scale=dim**-0.5, num_kv_heads=heads
    )
    impl.inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2).float() / dim))
    parsed = VllmMethod.parse(method)
    if parsed.name == "depthweave":
        slot: Any = WeaveSlot.of(parsed, dim, heads, block)
    elif parsed.name == "quant":
        slot = QuantSlot.of(parsed, dim, block)
    else:
        slot = PageSlot.of(dim, torch.float32, block)
    held = -(-(tokens + 1) // block)
    cache = torch.zeros(held + 4, heads, block, -(-slot.nbytes // 4))  # vLLM's float32 page view
    table = torch.randperm(held + 4)[:held].int()
    slots = (table.long().repeat_interleave(block) * block + torch.arange(block).repeat(held))[:tokens]
    generator = torch.Generator().manual_seed(0)
    mix_k = torch.randn(48, heads * dim, generator=generator)
    mix_v = torch.randn(64, heads * dim, generator=generator)
    for first in range(0, tokens, args.chunk):
        count = min(args.chunk, tokens - first)
        keys = (torch.randn(count, 48, generator=generator) @ mix_k).view(count, heads, dim)
        keys += 0.1 * torch.randn(count, heads, dim, generator=generator)
        values = (torch.randn(count, 64, generator=generator) @ mix_v).view(count, heads, dim)
        meta = KvweaveMetadata(
            num_actual_tokens=count,
            query_start=[0, count],
            seq_lens=[first + count],
            block_table=table.unsqueeze(0),
            slot_mapping=slots[first : first + count],
        )
        if parsed.name != "depthweave":
            impl.do_kv_cache_update(None, keys, values, cache, slots[first : first + count])
        query = torch.randn(count, heads * args.group, dim, generator=generator)
        impl.forward(None, query, keys, values, cache, meta, torch.empty_like(query))
    return impl, cache, table


def choose(impl: Any, path: str) -> None:
    """Point the layer's decode at ``path`` (what ``KVWEAVE_VLLM_KERNEL`` chooses, read once per layer)."""
    impl.fused_choice.clear()
    impl.fused_choice["weave"] = path == "factored"
    impl.fused_choice["cpu"] = path == "fused"


def one_step(
    impl: Any, cache: torch.Tensor, table: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, seq_len: int
):
    pages = cache.view(torch.uint8)
    layout = impl._layout(cache, torch.float32)
    return impl._attend(q, kv[0], kv[1], pages, layout, table, seq_len)


def measure(method: str, tokens: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    name = method.split(":")[0]
    impl, cache, table = build(method, tokens, args)
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(1, args.kv_heads * args.group, args.head_size, generator=generator)
    kv = torch.randn(2, 1, args.kv_heads, args.head_size, generator=generator)
    seq_len = tokens + 1
    outs, times = {}, {path: [] for path in PATHS[name]}
    for path in PATHS[name]:
        choose(impl, path)
        outs[path] = one_step(impl, cache, table, q, kv, seq_len)
    for _ in range(args.rounds):
        for path in PATHS[name]:
            choose(impl, path)
            start = time.perf_counter()
            for _ in range(args.steps):
                one_step(impl, cache, table, q, kv, seq_len)
            times[path].append((time.perf_counter() - start) / args.steps * 1e3)
    first = PATHS[name][0]
    reference = outs[PATHS[name][1]]
    error = float((outs[first] - reference).norm() / reference.norm())
    rows = []
    for path in PATHS[name]:
        rows.append(
            {
                "kind": "vllm_decode_op",
                "method": method,
                "path": path,
                "tokens": tokens,
                "ms_per_layer_step": round(statistics.median(times[path]), 4),
                "rounds_ms": [round(t, 4) for t in times[path]],
                "vs_reference": round(
                    statistics.median(times[PATHS[name][1]]) / statistics.median(times[path]), 3
                ),
                "relative_difference": error,
                "kv_heads": args.kv_heads,
                "query_heads": args.kv_heads * args.group,
                "head_size": args.head_size,
                "block_size": args.block_size,
                "threads": torch.get_num_threads(),
                "torch": torch.__version__,
                "time": time.strftime("%F %T"),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--methods", default="depthweave,quant:bits=4", help="comma-separated vLLM method specs"
    )
    parser.add_argument("--tokens", default="1024,2048,4096", help="comma-separated cached lengths")
    parser.add_argument("--steps", type=int, default=20, help="decode rows per round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (the median is reported)")
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk (the basis fits the first)")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--kv-heads", type=int, default=2, help="default: qwen2.5-coder-0.5b's shapes")
    parser.add_argument("--group", type=int, default=7, help="query heads per KV head")
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--rope-theta", type=float, default=1_000_000.0)
    parser.add_argument("--out", required=True, help="JSONL file the rows are appended to")
    args = parser.parse_args(argv)
    try:
        lengths = [int(t) for t in args.tokens.split(",") if t.strip()]
    except ValueError:
        parser.error(f"--tokens {args.tokens!r}: comma-separated integers, e.g. 1024,2048")
    if not lengths or min(lengths) < 2:
        parser.error("--tokens needs lengths of at least 2")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for method in methods:
        if method.split(":")[0] not in PATHS:
            parser.error(f"--methods: {method!r} has one decode path; choose among {', '.join(PATHS)}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for method in methods:
        for tokens in lengths:
            rows = measure(method, tokens, args)
            with out.open("a") as handle:
                for row in rows:
                    handle.write(json.dumps(row) + "\n")
            summary = ", ".join(f"{r['path']} {r['ms_per_layer_step']:.2f} ms" for r in rows)
            print(f"{method} at {tokens} tokens: {summary} (difference {rows[0]['relative_difference']:.1e})",
                  file=sys.stderr, flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
