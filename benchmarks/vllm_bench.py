"""kvweave inside vLLM (CPU): greedy agreement, KV capacity, passkey over HTTP, DK-Cache blocks read.

Runs in the vLLM venv (``scripts/vllm_env.sh`` builds it), one vLLM engine per process. Each subcommand writes
one JSON file (``--out``) with its figures, the command and the versions; docs/vllm.md quotes them.

    python benchmarks/vllm_bench.py tiny --out /tmp/tiny-qwen2
    python benchmarks/vllm_bench.py generate --model M --method quant:bits=8 --out run.json
    python benchmarks/vllm_bench.py passkey --model M --method pages --context 8192 --trials 3 --out pk.json
    python benchmarks/vllm_bench.py serve-passkey --model M --method quant:bits=4 --context 4096 --out http.json

``--method none`` runs vLLM's own CPU backend. Set the thread limits before calling (docs/vllm.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "In 1969, the first person to walk on the moon was",
    "Water boils at a temperature of",
]

# ~400 tokens shared by the prefix-caching prompts (three full 128-token blocks and a partial one)
LONG_PREFIX = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(30)) + "\n"


def versions() -> dict[str, str]:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine()}
    try:
        import vllm

        if getattr(vllm, "__version__", None):  # not a folder named vllm on sys.path (tests/vllm)
            info["vllm"] = vllm.__version__
    except ImportError:
        pass
    info["cpus"] = str(os.cpu_count())
    return info


def write(out: str, record: dict[str, Any]) -> None:
    record = {**record, "command": " ".join(sys.argv), "versions": versions(), "time": time.strftime("%F %T")}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k not in ("tokens", "rows")}))


# ------------------------------------------------------------------------------------------------ tiny


def make_tiny(out: str, tokenizer_from: str) -> None:
    """A 2-layer random-config Qwen2 (head_dim 64, 2 KV heads) with the real model's tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    vocab = len(AutoTokenizer.from_pretrained(tokenizer_from))
    config = Qwen2Config(
        vocab_size=-(-vocab // 64) * 64,  # the tokenizer's, rounded up as real checkpoints pad it
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=0.2,  # peaky logits: greedy choices that are not near-ties
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(tokenizer_from) / name).exists():
            shutil.copy(Path(tokenizer_from) / name, Path(out) / name)
    print(out)


# ------------------------------------------------------------------------------------------- one engine


def engine(
    model: str, method: str, max_model_len: int, kv_space: int, dtype: str = "bfloat16", **extra: Any
) -> Any:
    """An in-process vLLM engine with ``method`` (``none``: vLLM's own backend)."""
    if method != "none":
        os.environ["KVWEAVE_VLLM_METHOD"] = method
    else:
        os.environ.pop("KVWEAVE_VLLM_METHOD", None)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_space)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: STATS readable
    from vllm import LLM

    return LLM(
        model=model,
        enforce_eager=True,
        max_model_len=max_model_len,
        dtype=dtype,
        seed=0,
        **extra,
    )


def capacity(llm: Any) -> dict[str, int]:
    cache = llm.llm_engine.vllm_config.cache_config
    return {
        "num_blocks": int(cache.num_gpu_blocks),
        "block_size": int(cache.block_size),
        "kv_tokens": int(cache.num_gpu_blocks) * int(cache.block_size),
    }


def stats() -> dict[str, int]:
    from kvweave.vllm import backend

    return dict(backend.STATS)


def generate(args: argparse.Namespace) -> None:
    from vllm import SamplingParams

    llm = engine(
        args.model,
        args.method,
        args.max_model_len,
        args.kv_space,
        args.dtype,
        enable_prefix_caching=args.prefix_caching,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, logprobs=2)
    if args.prefix_caching:  # long prompts (full blocks to cache), sent twice: the second pass hits the cache
        prompts = [LONG_PREFIX + p for p in PROMPTS]
        outputs = llm.generate(prompts, params) + llm.generate(prompts, params)
    else:
        outputs = llm.generate(PROMPTS, params)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    # per step, the gap between the best and the second-best logprob (a near tie flips under any rounding)
    gaps = [[top_gap(step) for step in o.outputs[0].logprobs or []] for o in outputs]
    cached = [int(o.num_cached_tokens or 0) for o in outputs]
    write(
        args.out,
        {
            "model": args.model,
            "method": args.method,
            "kv_space_gib": args.kv_space,
            "dtype": args.dtype,
            "prefix_caching": args.prefix_caching,
            **capacity(llm),
            "tokens": tokens,
            "top_gaps": gaps,
            "cached_tokens": cached,
            "texts": [o.outputs[0].text for o in outputs],
            "stats": stats(),
        },
    )


def top_gap(step: dict[int, Any]) -> float:
    ranked = sorted((entry.logprob for entry in step.values()), reverse=True)
    return float(ranked[0] - ranked[1]) if len(ranked) > 1 else float("inf")


def agreement(reference: dict[str, Any], candidate: dict[str, Any], tie: float) -> dict[str, Any]:
    """Greedy agreement of ``candidate`` with ``reference`` (two ``generate`` records): per prompt, the steps
    that match before the first mismatch, and whether that mismatch came at a near tie of the reference (its
    best and second-best logprobs within ``tie``), the only place a faithful backend may differ."""
    prompts = []
    for ref, cand, gaps in zip(reference["tokens"], candidate["tokens"], reference["top_gaps"], strict=True):
        first = next((i for i, (a, b) in enumerate(zip(ref, cand, strict=False)) if a != b), None)
        prompts.append(
            {
                "matched": len(ref) if first is None else first,
                "mismatch_gap": None if first is None else gaps[first],
            }
        )
    bad = [p for p in prompts if p["mismatch_gap"] is not None and p["mismatch_gap"] > tie]
    return {"prompts": prompts, "tie": tie, "confident_mismatches": len(bad)}


# -------------------------------------------------------------------------------------------- passkey


def passkey_prompts(
    model: str, context: int, trials: int, haystack: str | None, task: str = "passkey"
) -> list[tuple[list[int], Any]]:
    """The prompts of ``kvweave eval --task TASK --context C --trials N`` (same samples and template)."""
    from transformers import AutoTokenizer

    from kvweave.eval import tasks as task_lib
    from kvweave.eval.runner import build_prompt

    tokenizer = AutoTokenizer.from_pretrained(model)
    depths = task_lib.depths(trials)
    out = []
    for trial in range(trials):
        sample = task_lib.make_sample(
            task, tokenizer, context, depth=depths[trial], seed=trial, haystack=haystack
        )
        out.append((build_prompt(tokenizer, sample, question_aware=False)[1], sample))
    return out


def score_rows(samples: list[tuple[list[int], Any]], predictions: list[str]) -> list[dict[str, Any]]:
    from kvweave.eval import tasks as task_lib

    return [
        {
            "trial": i,
            "prompt_tokens": len(ids),
            "answers": sample.answers,
            "prediction": text,
            "score": task_lib.score(sample, text),
        }
        for i, ((ids, sample), text) in enumerate(zip(samples, predictions, strict=True))
    ]


def passkey(args: argparse.Namespace) -> None:
    from vllm.inputs import TokensPrompt

    from vllm import SamplingParams

    samples = passkey_prompts(args.model, args.context, args.trials, args.haystack, args.task)
    llm = engine(args.model, args.method, args.max_model_len, args.kv_space, args.dtype)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens)
    predictions = []
    for ids, _ in samples:  # one at a time: per-step block counts are per request
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        predictions.append(out[0].outputs[0].text)
    rows = score_rows(samples, predictions)
    record_stats = stats()
    read = record_stats["blocks_read"] / max(1, record_stats["blocks_held"])
    write(
        args.out,
        {
            "model": args.model,
            "method": args.method,
            "task": args.task,
            "dtype": args.dtype,
            "context": args.context,
            "trials": args.trials,
            "accuracy": sum(r["score"] for r in rows) / len(rows),
            **capacity(llm),
            "stats": record_stats,
            "decode_blocks_read_fraction": read,
            "rows": rows,
        },
    )


def serve_passkey(args: argparse.Namespace) -> None:
    """Start ``python -m kvweave.vllm serve`` (a real vLLM OpenAI server) on localhost and query it."""
    from openai import OpenAI

    samples = passkey_prompts(args.model, args.context, args.trials, args.haystack, args.task)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_space)}
    command = [
        sys.executable,
        "-m",
        "kvweave.vllm",
        "serve",
        "--method",
        args.method,
        args.model,
        "--host",
        "127.0.0.1",
        "--port",
        str(args.port),
        "--max-model-len",
        str(args.max_model_len),
        "--enforce-eager",
        "--dtype",
        args.dtype,
        "--served-model-name",
        "kvweave",
    ]
    log = open(args.out + ".server.log", "w")
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    started = time.time()
    try:
        wait_healthy(args.port, server, args.start_timeout)
        client = OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="local")
        predictions = []
        for ids, _ in samples:
            reply = client.completions.create(
                model="kvweave", prompt=ids, max_tokens=args.tokens, temperature=0.0
            )
            predictions.append(reply.choices[0].text)
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    rows = score_rows(samples, predictions)
    capacity_line = [
        line for line in Path(args.out + ".server.log").read_text().splitlines() if "KV cache size" in line
    ]
    write(
        args.out,
        {
            "model": args.model,
            "method": args.method,
            "task": args.task,
            "dtype": args.dtype,
            "context": args.context,
            "trials": args.trials,
            "accuracy": sum(r["score"] for r in rows) / len(rows),
            "server": " ".join(command),
            "server_kv_line": capacity_line[-1:] or None,
            "wall_s": round(time.time() - started, 1),
            "rows": rows,
        },
    )


def summary_rows(folder: Path) -> list[dict[str, Any]]:
    """One row per task run (``passkey`` / ``serve-passkey`` JSON) in ``folder``: method, task, accuracy and the
    KV tokens vLLM reported; what ``kvweave.report.headlines`` reads (``rows`` writes them to rows.jsonl)."""
    rows = []
    for path in sorted(folder.glob("*.json")):
        run = json.loads(path.read_text())
        if "accuracy" not in run or "task" not in run:
            continue
        tokens = run.get("kv_tokens")
        if tokens is None and run.get("server_kv_line"):
            tokens = int(
                run["server_kv_line"][0].split("KV cache size: ")[-1].split(" tokens")[0].replace(",", "")
            )
        rows.append(
            {
                "method": run["method"],
                "task": run["task"],
                "context": run["context"],
                "dtype": run["dtype"],
                "trials": len(run["rows"]),
                "score": run["accuracy"],
                "kv_tokens": tokens,
                "file": path.name,
            }
        )
    return rows


def write_rows(args: argparse.Namespace) -> None:
    folder = Path(args.folder)
    rows = summary_rows(folder)
    if not rows:
        raise SystemExit(f"vllm_bench rows: no passkey/serve-passkey JSON in {folder}")
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} rows -> {folder / 'rows.jsonl'}")


def wait_healthy(port: int, server: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.poll() is not None:
            raise RuntimeError(
                f"vLLM server exited with {server.returncode} before it was healthy (see its log)"
            )
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(3)
    raise RuntimeError(f"vLLM server not healthy after {timeout:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="action", required=True)
    tiny = sub.add_parser("tiny", help="save a tiny random-config Qwen2 model")
    tiny.add_argument("--out", required=True)
    tiny.add_argument("--tokenizer-from", required=True, help="a model folder to copy the tokenizer from")
    rows = sub.add_parser("rows", help="write FOLDER/rows.jsonl: one summary row per task run JSON in FOLDER")
    rows.add_argument("folder")
    for name in ("generate", "passkey", "serve-passkey"):
        p = sub.add_parser(name)
        p.add_argument("--model", required=True)
        p.add_argument("--method", default="none", help="a KVWEAVE_VLLM_METHOD spec, or 'none' (vLLM's own)")
        p.add_argument("--out", required=True)
        p.add_argument("--kv-space", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE in GiB")
        p.add_argument("--max-model-len", type=int, default=1024)
        # float32 for long prompts on CPUs without bf16 hardware (AVX2 only: bf16 GEMMs are emulated, ~5x slower)
        p.add_argument("--dtype", default="bfloat16" if name == "generate" else "float32")
        if name == "generate":
            p.add_argument("--tokens", type=int, default=16)
            p.add_argument("--prefix-caching", action="store_true")
        else:
            p.add_argument("--context", type=int, default=4096)
            p.add_argument("--trials", type=int, default=9)
            p.add_argument("--tokens", type=int, default=8)
            p.add_argument("--haystack", default=None)
            p.add_argument(
                "--task", default="passkey", help="any kvweave eval task (passkey, niah_multikey, ...)"
            )
            p.add_argument("--port", type=int, default=8765)
            p.add_argument("--start-timeout", type=float, default=900)
    args = parser.parse_args()
    if args.action == "tiny":
        make_tiny(args.out, args.tokenizer_from)
    elif args.action == "rows":
        write_rows(args)
    elif args.action == "generate":
        generate(args)
    elif args.action == "passkey":
        passkey(args)
    else:
        serve_passkey(args)


if __name__ == "__main__":
    main()
