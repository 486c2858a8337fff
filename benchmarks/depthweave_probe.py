"""DepthWeave-KV probe benchmark: per-group attention-output error and measured compression on real text.

Prefills ``--tokens`` tokens of a text file once per setting and writes one JSON line per setting with:

- ``groups``: per group the probe error at prefill (the last prompt queries, which the router also saw:
  optimistic), the held-out error (queries of the next ``--continuation`` tokens of the text attend over the
  group's compressed tokens, exact vs stored KV: the number to trust), ranks, token kinds, bytes by part and
  the group's compression (quantized and as if every stored value were 16-bit);
- ``compression``: the whole cache vs a 16-bit full cache; ``share``: bytes by part over all groups;
- ``continuation``: NLL of the continuation through the compressed cache vs the full cache, mean KL of the
  next-token distributions and top-1 agreement.

Not a test: a script whose JSONL output chose depthweave's defaults. Example::

    nice python benchmarks/depthweave_probe.py --model qwen2.5-coder-0.5b \\
        --corpus /work/shared/data/corpus/wikitext2_valid.txt --tokens 2048 --out runs/depthweave_probe.jsonl

Held-out queries are rebuilt from ``q_proj`` and the model's rotary embedding (Llama/Qwen2-style attention;
models with query norms such as Qwen3 would need that norm too).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

import kvweave
from kvweave._compat import cache_kwarg
from kvweave.ops.rope import Rotary, find_rotary
from kvweave.registry import parse_method

DEFAULT_SETTINGS = [  # the defaults, then one change at a time (the ablation table in depthweave's docstring)
    "depthweave",
    # plain truncated SVD per layer at 8x of the 64-dim heads
    "depthweave:router=false,residuals=false,probes=false,rank=16,group=1,recent=0,bits=16,weighting=0",
    "depthweave:group=1",
    "depthweave:group=2",
    "depthweave:group=4",
    "depthweave:router=true",
    "depthweave:router=true,spread=1,residual_tokens=0.005,hi_tokens=0,lo_tokens=0",
    "depthweave:router=true,evict=0.5",
    "depthweave:residuals=false",
    "depthweave:probes=false,rank=192",
    "depthweave:keys=post_rope",
    "depthweave:bits=8",
    "depthweave:bits=16",
    "depthweave:weighting=0",
    "depthweave:recent=128",
    "depthweave:compression=4",
    "depthweave:compression=16",
]


def load(name: str) -> tuple[Any, Any]:
    """Model and tokenizer from kvweave's registry (or a local folder), float32, SDPA attention."""
    try:
        return kvweave.load_model(name)  # type: ignore[attr-defined,no-any-return]
    except (AttributeError, ImportError):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = Path(name) if Path(name).exists() else Path.home() / ".cache/kvweave/models" / name
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
        return model.eval(), AutoTokenizer.from_pretrained(folder)


def capture_queries(model: Any, ids: torch.Tensor) -> tuple[list[torch.Tensor], Any]:
    """Run ``ids`` with a DynamicCache; return per-layer post-RoPE queries ``[Hq, T, D]`` and the cache."""
    from transformers import DynamicCache

    layers = model.model.layers
    captured: dict[int, torch.Tensor] = {}
    hooks = [
        layer.self_attn.q_proj.register_forward_hook(
            lambda module, args, out, i=i: captured.__setitem__(i, out.detach())
        )
        for i, layer in enumerate(layers)
    ]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **{cache_kwarg(model): cache})
    for hook in hooks:
        hook.remove()
    rotary = Rotary(find_rotary(model))  # type: ignore[arg-type]
    head_dim = cache.layers[0].keys.shape[-1]
    positions = torch.arange(ids.shape[1]).view(1, -1)
    queries = []
    for i in range(len(layers)):
        q = captured[i].view(1, ids.shape[1], -1, head_dim).transpose(1, 2)  # [1, Hq, T, D]
        queries.append(rotary.rotate(q.float(), positions)[0])
    return queries, cache


def attention(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float
) -> torch.Tensor:
    """``queries: [Hq, q, D]`` over ``keys, values: [H, n, D]`` (all visible) -> ``[Hq, q, D]``."""
    h = keys.shape[0]
    packed = queries.reshape(h, -1, queries.shape[-1])
    probs = (packed @ keys.transpose(-1, -2) * scaling).softmax(-1)
    return (probs @ values).view_as(queries)


def held_out_errors(cache: Any, reference: Any, queries: list[torch.Tensor], prompt: int) -> dict[int, float]:
    """Per layer: relative output error of the continuation queries over the layer's compressed tokens."""
    errors = {}
    for idx, layer in enumerate(cache.layers):
        if not hasattr(layer, "held_kv"):
            continue
        keys, values, slots = layer.held_kv()
        block = prompt - layer.recent_count()  # tokens 0..block-1 left the exact recent buffer
        compressed = slots < block
        if block <= 0 or not compressed.any():
            continue
        exact_k = reference.layers[idx].keys[0].float()[:, :block]  # evicted tokens included: they count
        exact_v = reference.layers[idx].values[0].float()[:, :block]
        q = queries[idx][:, prompt:]
        scaling = q.shape[-1] ** -0.5
        exact = attention(q, exact_k, exact_v, scaling)
        approx = attention(q, keys[:, compressed], values[:, compressed], scaling)
        errors[idx] = ((approx - exact).norm() / exact.norm()).item()
    return errors


def continuation_quality(
    model: Any, cache: Any, ids: torch.Tensor, prompt: int, full_logits: torch.Tensor
) -> dict[str, float]:
    """NLL, KL vs full and top-1 agreement of the continuation fed through ``cache`` in one forward."""
    with torch.no_grad():
        logits = model(ids[:, prompt:], **{cache_kwarg(model): cache}).logits[0, :-1].float()
    targets = ids[0, prompt + 1 :]
    logp, ref = logits.log_softmax(-1), full_logits.log_softmax(-1)
    return {
        "nll": torch.nn.functional.nll_loss(logp, targets).item(),
        "nll_full": torch.nn.functional.nll_loss(ref, targets).item(),
        "kl": (ref.exp() * (ref - logp)).sum(-1).mean().item(),
        "top1_agree": (logits.argmax(-1) == full_logits.argmax(-1)).float().mean().item(),
    }


def run_setting(
    spec: str,
    model: Any,
    ids: torch.Tensor,
    prompt: int,
    reference: Any,
    queries: list[torch.Tensor],
    full_logits: torch.Tensor,
    full_prefill_s: float,
) -> dict[str, Any]:
    method = parse_method(spec)
    cache = kvweave.make_cache(method, model)
    start = time.perf_counter()
    with torch.no_grad():
        model(ids[:, :prompt], **{cache_kwarg(model): cache})
    prefill_s = time.perf_counter() - start
    stats = cache.stats()
    held_out = held_out_errors(cache, reference, queries, prompt)
    groups: dict[int, dict[str, Any]] = {}
    for layer in stats["layers"]:
        if "group" not in layer or not layer.get("compressed"):
            continue
        entry = groups.setdefault(
            layer["group"],
            {
                "group": layer["group"],
                "layers": layer["group_layers"],
                "rank_k": layer["rank_k"],
                "rank_v": layer["rank_v"],
                "probe_error": layer["probe_error"],
                "probe_error_k": layer["probe_error_k"],
                "probe_error_v": layer["probe_error_v"],
                "tokens": layer["tokens"],
                "compression": layer["group_compression"],
                "compression_unquantized": layer["group_compression_unquantized"],
                "bytes_by_part": layer["bytes_by_part"],
                "held_out_errors": [],
            },
        )
        if layer["layer"] in held_out:
            entry["held_out_errors"].append(held_out[layer["layer"]])
    share: dict[str, int] = {}
    for entry in groups.values():
        errors = entry.pop("held_out_errors")
        entry["held_out_error"] = sum(errors) / len(errors) if errors else None
        for part, size in entry["bytes_by_part"].items():
            share[part] = share.get(part, 0) + size
    total = sum(share.values()) or 1
    quality = continuation_quality(model, cache, ids, prompt, full_logits)

    def mean(key: str) -> float | None:
        values = [g[key] for g in groups.values() if g.get(key) is not None]
        return sum(values) / len(values) if values else None

    return {
        "setting": spec,
        "method": method.spec(),
        "options": method.options(),
        "tokens": prompt,
        "compression": stats["compression"],
        "bytes": stats["bytes"],
        "full_kv_bytes_16bit": stats["full_kv_bytes_16bit"],
        "mean_probe_error": mean("probe_error"),
        "mean_held_out_error": mean("held_out_error"),
        "mean_rank_k": mean("rank_k"),
        "mean_rank_v": mean("rank_v"),
        "share": {part: size / total for part, size in share.items()},
        "continuation": quality,
        "prefill_s": prefill_s,
        "full_prefill_s": full_prefill_s,
        "groups": list(groups.values()),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--corpus", required=True, help="text file (e.g. wikitext2_valid.txt)")
    parser.add_argument("--tokens", type=int, default=2048, help="prefill length")
    parser.add_argument("--continuation", type=int, default=128, help="held-out tokens after the prefill")
    parser.add_argument("--offset", type=int, default=0, help="characters of the corpus to skip")
    parser.add_argument("--settings", nargs="*", default=DEFAULT_SETTINGS, help="method specs")
    parser.add_argument("--out", default="-", help="JSONL file to append to ('-': stdout)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load(args.model)
    text = Path(args.corpus).read_text(encoding="utf-8")[args.offset :]
    ids = tokenizer(text[: args.tokens * 8], return_tensors="pt").input_ids[
        :, : args.tokens + args.continuation
    ]
    prompt = ids.shape[1] - args.continuation
    queries, reference = capture_queries(model, ids)
    from transformers import DynamicCache

    full = DynamicCache(config=model.config)
    with torch.no_grad():
        start = time.perf_counter()
        model(ids[:, :prompt], **{cache_kwarg(model): full})
        full_prefill_s = time.perf_counter() - start
        full_logits = model(ids[:, prompt:], **{cache_kwarg(model): full}).logits[0, :-1].float()
    # the reference cache covers prompt + continuation; held-out errors only index the prompt's slots
    environment = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "model": args.model,
        "corpus": Path(args.corpus).name,
        "threads": torch.get_num_threads(),
    }
    out = sys.stdout if args.out == "-" else open(args.out, "a", encoding="utf-8")  # noqa: SIM115
    try:
        for spec in args.settings:
            row = run_setting(spec, model, ids, prompt, reference, queries, full_logits, full_prefill_s)
            row["environment"] = environment
            out.write(json.dumps(row) + "\n")
            out.flush()
    finally:
        if out is not sys.stdout:
            out.close()


if __name__ == "__main__":
    main()
