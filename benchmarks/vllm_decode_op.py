"""A decode step of one attention layer in vLLM, timed without an engine: vLLM's own CPU attention beside each
decode path of kvweave's backend, at the model's attention shapes, several cached lengths and several decode rows
(requests) per step.

For each point (``--tokens`` cached tokens per request, ``--rows`` requests) every method gets a page pool
holding the same requests' keys and values, written the way vLLM's model runner writes them (prefill chunks of
``--chunk`` tokens, blocks of ``--block-size``). A timed step is what the engine runs per layer: the new tokens
written (``do_kv_cache_update`` / vLLM's ``cpu_attn_reshape_and_cache``), then attention of every row's query
over its request (``forward`` / vLLM's ``cpu_attention_with_kv_cache``). The median of ``--rounds`` rounds of
``--steps`` steps, all methods and paths interleaved in each round. Paths:

- ``none``: ``vllm`` (vLLM's own CPU attention over its float32 cache, the reference for time and output);
- ``quant:bits=N``: ``fused`` (the C++ kernel, one call for all rows) and ``torch`` (dequantize, then attend);
- ``depthweave``: ``fused`` (the C++ kernel: keys rebuilt and rotated inside it, attention weights on the value
  coordinates, one call for all rows), ``factored`` (the same in torch, row by row) and ``rebuild``
  (``KVWEAVE_VLLM_KERNEL=torch``: every stored value rebuilt, then attention).

One JSON row per (method, path, tokens, rows) is appended to ``--out``, with ``vs_vllm`` (vLLM's step time over
the path's: above 1 is faster) and the output's relative difference from vLLM's exact attention. Runs in the
vLLM venv (no engine starts)::

    OMP_NUM_THREADS=2 .venv-vllm/bin/python benchmarks/vllm_decode_op.py --tokens 2048,4096 --rows 1,32 \\
        --out runs/vllm-decode-step.jsonl

Only ratios within one run mean anything on a shared machine.
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

from kvweave.cli_args import _split

PATHS = {"none": ("vllm",), "depthweave": ("fused", "factored", "rebuild"), "quant": ("fused", "torch")}


def requests(rows: int, tokens: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """``keys, values: [rows, tokens + 1, H, D]``: low-rank plus noise, as real keys and values are, scaled so that unit queries give logits of std ~3 (the last
    token is the decode step's new one). The same for every method."""
    heads, dim = args.kv_heads, args.head_size
    generator = torch.Generator().manual_seed(0)
    mix_k = torch.randn(48, heads * dim, generator=generator)
    mix_v = torch.randn(64, heads * dim, generator=generator)
    n = tokens + 1
    keys = (torch.randn(rows, n, 48, generator=generator) @ mix_k).view(rows, n, heads, dim) * (3 / 48**0.5)
    keys += 0.1 * torch.randn(rows, n, heads, dim, generator=generator)  # logits of std ~3 for unit queries
    values = (torch.randn(rows, n, 64, generator=generator) @ mix_v).view(rows, n, heads, dim) / 8
    return keys, values


class Kvweave:
    """kvweave's backend layer holding the requests; :meth:`step` is one decode step of every row."""

    def __init__(
        self, method: str, keys: torch.Tensor, values: torch.Tensor, args: argparse.Namespace
    ) -> None:
        from kvweave.vllm.backend import KvweaveAttentionImpl, KvweaveMetadata
        from kvweave.vllm.config import PageSlot, QuantSlot, VllmMethod, WeaveSlot
        from kvweave.vllm.drive import feed, slots_of

        os.environ["KVWEAVE_VLLM_METHOD"] = method
        heads, dim, block = args.kv_heads, args.head_size, args.block_size
        self.impl = KvweaveAttentionImpl(
            num_heads=heads * args.group, head_size=dim, scale=dim**-0.5, num_kv_heads=heads
        )
        self.impl.inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2).float() / dim))
        self.impl.max_requests = max(self.impl.max_requests, keys.shape[0])  # vLLM's max_num_seqs
        parsed = VllmMethod.parse(method)
        if parsed.name == "depthweave":
            slot: Any = WeaveSlot.of(parsed, dim, heads, block)
        elif parsed.name == "quant":
            slot = QuantSlot.of(parsed, dim, block)
        else:
            slot = PageSlot.of(dim, torch.float32, block)
        rows, n = keys.shape[:2]
        held = -(-n // block)
        self.cache = torch.zeros(
            rows * held + 4, heads, block, -(-slot.nbytes // 4)
        )  # vLLM's float32 page view
        self.table = torch.randperm(rows * held + 4)[: rows * held].int().view(rows, held)
        generator = torch.Generator().manual_seed(2)
        chunks = [min(args.chunk, n - 1 - first) for first in range(0, n - 1, args.chunk)]
        for r in range(rows):  # each request's prompt, as the engine prefills it
            feed(self.impl, self.cache, self.table[r], keys[r, :-1], values[r, :-1], chunks,
                 lambda c: torch.randn(c, heads * args.group, dim, generator=generator))  # fmt: skip
        self.new = keys[:, -1].contiguous(), values[:, -1].contiguous()  # [rows, H, D]
        slots = torch.stack([slots_of(self.table[r], block, n)[-1] for r in range(rows)])
        self.meta = KvweaveMetadata(
            num_actual_tokens=rows,
            query_start=list(range(rows + 1)),
            seq_lens=[n] * rows,
            block_table=self.table,
            slot_mapping=slots,
        )

    def choose(self, path: str) -> None:
        self.impl.pin_decode("cpu", fused=path == "fused", factored=path in ("fused", "factored"))

    def step(self, query: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(query)
        self.impl.do_kv_cache_update(None, *self.new, self.cache, self.meta.slot_mapping)
        return self.impl.forward(None, query, *self.new, self.cache, self.meta, out)


class Vllm:
    """vLLM's own CPU attention (``cpu_attention_with_kv_cache``) over its float32 paged cache."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, args: argparse.Namespace) -> None:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        from vllm import _custom_ops as ops

        self.ops, heads, dim, block = ops, args.kv_heads, args.head_size, args.block_size
        self.isa = _get_attn_isa(torch.float32, block, dim)
        rows, n = keys.shape[:2]
        held = -(-n // block)
        cache = torch.zeros(rows * held + 4, heads, block, 2 * dim)
        self.key_cache, self.value_cache = cache.view(rows * held + 4, heads, 2 * block, dim).chunk(2, dim=2)
        self.table = torch.randperm(rows * held + 4)[: rows * held].int().view(rows, held)
        slots = self.table.long().repeat_interleave(block, 1) * block + torch.arange(block).repeat(held)
        slots = slots[:, :n]  # [rows, n]
        ops.cpu_attn_reshape_and_cache(
            keys[:, :-1].flatten(0, 1), values[:, :-1].flatten(0, 1), self.key_cache, self.value_cache,
            slots[:, :-1].flatten(), self.isa,
        )  # fmt: skip
        self.new, self.slots = (
            (keys[:, -1].contiguous(), values[:, -1].contiguous()),
            slots[:, -1].contiguous(),
        )
        self.query_start = torch.arange(rows + 1, dtype=torch.int32)
        self.seq_lens = torch.full((rows,), n, dtype=torch.int32)
        self.scale, self.heads = dim**-0.5, heads * args.group
        self.metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=rows, num_heads=self.heads, num_kv_heads=heads, head_dim=dim, seq_lens=self.seq_lens,
            dtype=torch.float32, query_start_loc=self.query_start, causal=True, sliding_window_size=-1,
            isa=self.isa, enable_kv_split=True,
        )  # fmt: skip

    def choose(self, path: str) -> None:
        pass

    def step(self, query: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(query)
        self.ops.cpu_attn_reshape_and_cache(*self.new, self.key_cache, self.value_cache, self.slots, self.isa)
        self.ops.cpu_attention_with_kv_cache(
            query=query, key_cache=self.key_cache, value_cache=self.value_cache, output=out,
            query_start_loc=self.query_start, seq_lens=self.seq_lens, scale=self.scale, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=self.table, softcap=0.0,
            scheduler_metadata=self.metadata, s_aux=None,
        )  # fmt: skip
        return out


def measure(methods: list[str], tokens: int, rows: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    keys, values = requests(rows, tokens, args)
    layers = {}
    for method in methods:
        name = method.split(":")[0]
        layers[method] = Vllm(keys, values, args) if name == "none" else Kvweave(method, keys, values, args)
    query = torch.randn(
        rows, args.kv_heads * args.group, args.head_size, generator=torch.Generator().manual_seed(1)
    )
    pairs = [(m, p) for m in methods for p in PATHS[m.split(":")[0]] if not args.paths or p in args.paths]
    outs, times = {}, {pair: [] for pair in pairs}
    for method, path in pairs:  # warm-up, and the outputs compared
        layers[method].choose(path)
        outs[method, path] = layers[method].step(query).float()
    for _ in range(args.rounds):
        for method, path in pairs:
            layers[method].choose(path)
            start = time.perf_counter()
            for _ in range(args.steps):
                layers[method].step(query)
            times[method, path].append((time.perf_counter() - start) / args.steps * 1e3)
    medians = {pair: statistics.median(t) for pair, t in times.items()}
    exact = next((outs[pair] for pair in pairs if pair[1] == "vllm"), None)
    result = []
    for method, path in pairs:
        ms = medians[method, path]
        reference = outs[method, [p for m, p in pairs if m == method][-1]]  # the method's last path timed
        vllm_ms = next((medians[pair] for pair in pairs if pair[1] == "vllm"), None)
        result.append(
            {
                "kind": "vllm_decode_step",
                "method": method,
                "path": path,
                "tokens": tokens,
                "rows": rows,
                "ms_per_step": round(ms, 4),
                "ms_per_row": round(ms / rows, 4),
                "rounds_ms": [round(t, 4) for t in times[method, path]],
                "vs_vllm": None if vllm_ms is None else round(vllm_ms / ms, 3),
                "difference_from_reference_path": float(
                    (outs[method, path] - reference).norm() / reference.norm()
                ),
                "difference_from_exact": None
                if exact is None
                else float((outs[method, path] - exact).norm() / exact.norm()),
                "kv_heads": args.kv_heads,
                "query_heads": args.kv_heads * args.group,
                "head_size": args.head_size,
                "block_size": args.block_size,
                "threads": torch.get_num_threads(),
                "torch": torch.__version__,
                "time": time.strftime("%F %T"),
            }
        )
    return result


def _ints(parser: argparse.ArgumentParser, flag: str, text: str, least: int) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        parser.error(f"{flag} {text!r}: comma-separated integers, e.g. 1024,2048")
    if not values or min(values) < least:
        parser.error(f"{flag} needs values of at least {least}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--methods",
        default="none,quant:bits=4,quant:bits=2,depthweave",
        help="comma-separated vLLM method specs",
    )
    parser.add_argument("--tokens", default="2048,4096", help="comma-separated cached lengths per request")
    parser.add_argument("--rows", default="1,32", help="comma-separated decode rows (requests) per step")
    parser.add_argument("--steps", type=int, default=10, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (the median is reported)")
    parser.add_argument(
        "--chunk", type=int, default=2048, help="prefill chunk (depthweave's basis fits the first)"
    )
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--kv-heads", type=int, default=2, help="default: qwen2.5-coder-0.5b's shapes")
    parser.add_argument("--group", type=int, default=7, help="query heads per KV head")
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--rope-theta", type=float, default=1_000_000.0)
    parser.add_argument(
        "--paths",
        default="",
        help="comma-separated paths to time (default every path of each method), e.g. vllm,fused",
    )
    parser.add_argument("--out", required=True, help="JSONL file the rows are appended to")
    args = parser.parse_args(argv)
    args.paths = [p for p in args.paths.split(",") if p]
    known = {p for paths in PATHS.values() for p in paths}
    if unknown := [p for p in args.paths if p not in known]:
        parser.error(f"--paths: {', '.join(unknown)} unknown; choose among {', '.join(sorted(known))}")
    lengths = _ints(parser, "--tokens", args.tokens, 2)
    row_counts = _ints(parser, "--rows", args.rows, 1)
    methods = _split(args.methods)  # "name:k=v,k=v" stays one spec
    for method in methods:
        if method.split(":")[0] not in PATHS:
            parser.error(f"--methods: {method!r} is not timed here; choose among {', '.join(PATHS)}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for tokens in lengths:
        for rows in row_counts:
            result = measure(methods, tokens, rows, args)
            with out.open("a") as handle:
                for row in result:
                    handle.write(json.dumps(row) + "\n")
            summary = ", ".join(
                f"{r['method']} {r['path']} {r['ms_per_step']:.2f} ms"
                + ("" if r["vs_vllm"] is None else f" ({r['vs_vllm']:.2f}x)")
                for r in result
            )
            print(f"{tokens} tokens x {rows} rows: {summary}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
