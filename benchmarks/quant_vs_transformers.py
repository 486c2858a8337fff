"""Decode speed of kvweave's ``quant:bits=4`` (KIVI) against transformers' own ``QuantizedCache``.

Not a test: a benchmark script that writes results. One random-weight model with a Llama layout (labelled
``random weights`` in every row; weights do not change speed) is prefilled with ``--context`` tokens, then
``--new-tokens`` tokens are decoded greedily, one forward per token, with each cache:

- ``full``: transformers' ``DynamicCache`` (the speed reference: every row carries ``speed_vs_full``),
- ``kvweave:quant:bits=4,kernel=cpp``: kvweave's attention over packed 4-bit blocks in its fused C++ CPU
  kernel (scores and weighted values straight from the codes), and ``kernel=torch``, the same in plain torch
  (unpack a chunk, matmul, online softmax),
- ``transformers:QuantizedCache:<backend>:4``: transformers' quantized cache (dequantizes the whole cache
  every step), with the ``quanto`` backend (``pip install optimum-quanto``) or else ``hqq``; when neither
  is installed the script says so and measures the other two.

Both quantized caches use the same settings: 4 bits, 32-element groups, a 128-token exact residual.
Each method warms up, then every method runs once per round for ``--repeats`` rounds (interleaved, so
background load hits all alike), each on a fresh cache; rows report the median decode
tokens/s, the prefill seconds and the KV bytes held (kvweave's ``nbytes``; ``None`` for transformers'
cache, whose quanto tensors do not expose their packed size). Rows are appended to ``--out`` (JSONL), with
the hardware and versions. Usage::

    python benchmarks/quant_vs_transformers.py --context 2048,4096 --new-tokens 32 --out runs/quant-speed.jsonl
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import transformers

import kvweave
from kvweave._compat import cache_kwarg

GROUP, RESIDUAL, BITS = 32, 128, 4
LAYOUT = dict(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=32768,
)
"""A tiny-ish Llama layout (head_dim 64, GQA 4:1): small weights, so the KV cache matters at a few K tokens."""


def transformers_backend() -> str | None:
    """``quanto`` or ``hqq`` if their package is installed (transformers' QuantizedCache backends), else None."""
    if importlib.util.find_spec("optimum") and importlib.util.find_spec("optimum.quanto"):
        return "quanto"
    if importlib.util.find_spec("hqq"):
        return "hqq"
    return None


def make_model(device: str, dtype: torch.dtype, name: str | None = None) -> Any:
    """The random-weight model (seeded), in eval mode with SDPA attention; or the registry model ``name``."""
    if name:
        model, _ = kvweave.load_model(name, dtype=str(dtype).removeprefix("torch."))
        return model.to(device).eval()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**LAYOUT)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model.to(device).eval()


def make_cache(name: str, model: Any) -> Any:
    """A fresh cache for method ``name``."""
    if name == "full":
        return transformers.DynamicCache(config=model.config)
    if name.startswith("kvweave:"):
        return kvweave.make_cache(name.removeprefix("kvweave:"), model)
    backend = name.split(":")[2]
    axis = {"quanto": 0, "hqq": 1}[backend]
    return transformers.QuantizedCache(
        backend=backend,
        config=model.config,
        nbits=BITS,
        q_group_size=GROUP,
        residual_length=RESIDUAL,
        axis_key=axis,
        axis_value=axis,
    )


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def run_once(model: Any, name: str, ids: torch.Tensor, new_tokens: int, device: str) -> dict[str, Any]:
    """Prefill ``ids`` then decode ``new_tokens`` greedily; timings and bytes held."""
    cache = make_cache(name, model)
    key = cache_kwarg(model)
    synchronize(device)
    start = time.perf_counter()
    logits = model(ids, **{key: cache}).logits[:, -1]
    synchronize(device)
    prefill_s = time.perf_counter() - start
    step = logits.argmax(-1, keepdim=True)
    start = time.perf_counter()
    for _ in range(new_tokens):
        step = model(step, **{key: cache}).logits[:, -1].argmax(-1, keepdim=True)
    synchronize(device)
    decode_s = time.perf_counter() - start
    return {"prefill_s": prefill_s, "decode_tok_s": new_tokens / decode_s, "kv_bytes": kv_bytes(cache)}


def kv_bytes(cache: Any) -> int | None:
    """Bytes held: kvweave's ``nbytes``, a DynamicCache's keys + values, None for transformers' quantized one."""
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes())
    if isinstance(cache, transformers.QuantizedCache):
        return None
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def measure_all(
    model: Any, names: list[str], context: int, new_tokens: int, repeats: int, device: str
) -> dict[str, dict[str, Any]]:
    """Per method, medians over ``repeats`` runs after one short warm-up run each. The repeats are interleaved
    (every method once per round), so a change in background load hits all methods alike. Random token
    ids: speed does not depend on them."""
    vocab = min(LAYOUT["vocab_size"], model.config.vocab_size)
    ids = torch.randint(3, vocab, (1, context), generator=torch.Generator().manual_seed(context))
    ids = ids.to(device)
    for name in names:
        run_once(model, name, ids[:, : min(context, 256)], 2, device)  # warm-up
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for _ in range(repeats):
        for name in names:
            runs[name].append(run_once(model, name, ids, new_tokens, device))
    return {
        name: {
            "prefill_s": statistics.median(r["prefill_s"] for r in rs),
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in rs),
            "decode_tok_s_all": [round(r["decode_tok_s"], 3) for r in rs],
            "kv_bytes": rs[-1]["kv_bytes"],
        }
        for name, rs in runs.items()
    }


def environment(device: str, dtype: torch.dtype) -> dict[str, Any]:
    """Hardware and versions written beside every row."""
    info = {
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", default="2048,4096", help="comma-separated prompt lengths")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens decoded per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per cell (median reported)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16 (default: bf16 on GPU)")
    parser.add_argument("--out", type=Path, default=Path("runs/quant_vs_transformers.jsonl"))
    parser.add_argument(
        "--model",
        default=None,
        help="a kvweave registry model (real weights) instead of the random Llama layout",
    )
    args = parser.parse_args(argv)

    dtype = (
        getattr(torch, args.dtype)
        if args.dtype
        else (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    )
    backend = transformers_backend()
    kvweave_quant = f"kvweave:quant:bits={BITS},group={GROUP},residual={RESIDUAL}"
    methods = ["full", f"{kvweave_quant},kernel=cpp", f"{kvweave_quant},kernel=torch"]
    if backend is None:
        print(
            "transformers' QuantizedCache needs optimum-quanto or hqq; neither is installed "
            "(pip install optimum-quanto). Measuring full and kvweave only."
        )
    else:
        methods.append(f"transformers:QuantizedCache:{backend}:{BITS}")
    model = make_model(args.device, dtype, args.model)
    label = args.model or "random weights, Llama layout " + json.dumps(LAYOUT, sort_keys=True)
    env = environment(args.device, dtype)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for context in (int(c) for c in args.context.split(",") if c.strip()):
        results = measure_all(model, methods, context, args.new_tokens, args.repeats, args.device)
        reference = results["full"]["decode_tok_s"]
        for name, result in results.items():
            row = {
                "benchmark": "quant_vs_transformers",
                "method": name,
                "context": context,
                "new_tokens": args.new_tokens,
                "repeats": args.repeats,
                **result,
                "speed_vs_full": result["decode_tok_s"] / reference,
                "model": label,
                **env,
            }
            with args.out.open("a") as handle:
                handle.write(json.dumps(row) + "\n")
            print(
                f"{context:>6} {name:48s} {result['decode_tok_s']:8.1f} tok/s  x{row['speed_vs_full']:.2f} vs full"
                f"  prefill {result['prefill_s']:.2f}s  kv {result['kv_bytes']}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
