"""vLLM under load: requests served at a fixed KV space, per method and concurrency, on the real OpenAI server.

For each method (``none`` is vLLM's own cache, ``fp8`` / ``fp8_e4m3`` / ``fp8_e5m2`` the same cache stored in
FP8 (vLLM's ``--kv-cache-dtype``); the others are ``KVWEAVE_VLLM_METHOD`` specs), this starts
``python -m kvweave.vllm serve`` on 127.0.0.1 with ``VLLM_CPU_KVCACHE_SPACE=--kv-space``, then for each
concurrency sends ``--requests`` distinct passkey prompts (``kvweave eval``'s samples: question-agnostic, so
every answer is scored too) through a bounded load generator: at most ``concurrency`` requests in flight, a fixed
number of requests, each streamed (time to first token, time per output token), new requests stop after
``--time-cap`` seconds and every request has a timeout. While a point runs, vLLM's ``/metrics`` are polled once a
second (queue length, KV-cache use) and read before and after (preemptions).

A method whose server exits before it is healthy (vLLM's CPU backend refuses FP8 without AVX-512 or AMX, for
instance) gets one row per concurrency with ``refused`` set to the error its log ends with, and the run goes on
with the next method. One JSON row per (method, concurrency) is appended to ``--out``/rows.jsonl as it finishes; a rerun of the same
command skips the rows already there (``--restart`` measures again). ``kvweave report OUT`` draws them (output
tokens/s, time per output token and time to first token against concurrency, per method) and
``python benchmarks/vllm_load.py --table OUT`` prints them. Runs in the vLLM venv (``scripts/vllm_env.sh``):

    .venv-vllm/bin/python benchmarks/vllm_load.py --model ~/.cache/kvweave/models/qwen2.5-coder-0.5b \\
        --methods none,fp8,quant:bits=4,quant:bits=2,pages,depthweave --concurrency 1,4,16,32 --context 2048 \\
        --out runs/vllm-load

Loopback only. On this project's 2-core CPU machines a point of a few dozen 2K-token requests takes minutes;
set the thread limits first (``OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=1``, docs/vllm.md).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

METRICS = (
    "vllm:num_preemptions_total",  # the counter vllm:num_preemptions as Prometheus exposes it
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:num_preemptions",  # the same counter, where a client library exposes it without the suffix
)
USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
OWN_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
"""Method names that run vLLM's own cache with this ``--kv-cache-dtype`` (``none`` is its default, ``auto``)."""


def own_cache_dtype(method: str) -> str | None:
    """The ``--kv-cache-dtype`` of vLLM's own cache that ``method`` names, or None for a kvweave method."""
    if method == "none":
        return "auto"
    return method if method in OWN_DTYPES else None


# ------------------------------------------------------------------------------------------ statistics


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values`` by linear interpolation; ``None`` for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> ``{name: value}`` summed over label sets, for the names in METRICS and USAGE."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in METRICS or name in USAGE:
            try:
                found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                continue
    return found


def summarize_point(results: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """Throughput and latency of one point from its requests' results (failed ones counted, not timed)."""
    done = [r for r in results if r.get("error") is None]
    ttft = [r["ttft_s"] for r in done if r.get("ttft_s") is not None]
    tpot = [r["tpot_s"] for r in done if r.get("tpot_s") is not None]
    tokens = sum(r["output_tokens"] for r in done)
    return {
        "requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({str(r["error"]) for r in results if r.get("error") is not None})[:5],
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(done) / wall, 4) if wall > 0 else None,
        "output_tokens_per_s": round(tokens / wall, 3) if wall > 0 else None,
        "output_tokens": tokens,
        "ttft_median_s": _round(percentile(ttft, 0.5)),
        "ttft_p99_s": _round(percentile(ttft, 0.99)),
        "tpot_median_s": _round(percentile(tpot, 0.5)),
        "tpot_p99_s": _round(percentile(tpot, 0.99)),
        "accuracy": round(statistics.mean(r["score"] for r in done), 4) if done else None,
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


# ------------------------------------------------------------------------------------------ the server


def server_command(args: argparse.Namespace, method: str) -> list[str]:
    """``python -m kvweave.vllm serve ...`` for ``method`` (vLLM's own cache at its ``--kv-cache-dtype`` for
    ``none`` and the FP8 names)."""
    own = own_cache_dtype(method)
    command = [
        sys.executable, "-m", "kvweave.vllm", "serve", "--method", "none" if own else method, args.model,
        "--host", "127.0.0.1", "--port", str(args.port), "--max-model-len", str(args.max_model_len),
        "--enforce-eager", "--dtype", args.dtype, "--served-model-name", "kvweave",
        "--max-num-seqs", str(max(args.concurrency)),
    ] + ([] if args.prefix_caching else ["--no-enable-prefix-caching"])  # fmt: skip
    if own and own != "auto":
        command += ["--kv-cache-dtype", own]
    return command


def start_server(args: argparse.Namespace, method: str, log_path: Path) -> subprocess.Popen[bytes]:
    command = server_command(args, method)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_space)}
    log = log_path.open("w")
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)


def stop_server(server: subprocess.Popen[bytes]) -> None:
    server.terminate()
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait(30)


def read_metrics(port: int) -> dict[str, float]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            return parse_metrics(reply.read().decode())
    except OSError:
        return {}


_LOG_PREFIX = re.compile(r"^(\(\w+ pid=\d+\) )?(ERROR [^\]]*\] )?")
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception): .+")


def start_error(log_path: Path) -> str:
    """Why a server exited before it was healthy: the first exception its log names (the root cause: vLLM's
    processes re-raise it wrapped, and the last line is only "Engine core initialization failed"), else its
    last line."""
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    for line in lines:
        text = _LOG_PREFIX.sub("", line)
        if _EXCEPTION.match(text):
            return text[:300]
    return lines[-1][-300:] if lines else "the server exited with an empty log"


def kv_tokens(log_path: Path) -> int | None:
    """The KV capacity vLLM reported at start-up (``... KV cache size: N tokens``)."""
    for line in reversed(log_path.read_text(errors="replace").splitlines()):
        if "KV cache size" in line:
            digits = "".join(ch for ch in line.split("KV cache size")[-1].split("tokens")[0] if ch.isdigit())
            return int(digits) if digits else None
    return None


# ------------------------------------------------------------------------------------------ the load


def one_request(
    client: Any, ids: list[int], sample: Any, tokens: int, timeout: float, ignore_eos: bool = False
) -> dict[str, Any]:
    """Stream one completion; its time to first token, time per output token, tokens and score. ``ignore_eos``:
    every request generates ``tokens`` tokens (vLLM's ``ignore_eos``), so the decode load is fixed."""
    from kvweave.eval import tasks as task_lib

    start = time.perf_counter()
    first = last = None
    text, usage_tokens, chunks = [], None, 0
    try:
        stream = client.completions.create(
            model="kvweave", prompt=ids, max_tokens=tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, timeout=timeout,
            extra_body={"ignore_eos": True} if ignore_eos else None,
        )  # fmt: skip
        for chunk in stream:
            if chunk.usage is not None:
                usage_tokens = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].text:
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
                chunks += 1
                text.append(chunk.choices[0].text)
    except Exception as error:  # a failed request is a result of the point, not a crash of the benchmark
        return {"error": f"{type(error).__name__}: {str(error)[:200]}", "output_tokens": 0}
    produced = usage_tokens if usage_tokens is not None else chunks
    prediction = "".join(text)
    return {
        "error": None,
        "output_tokens": produced,
        "ttft_s": None if first is None else first - start,
        "tpot_s": (last - first) / (produced - 1) if first is not None and produced > 1 else None,
        "latency_s": time.perf_counter() - start,
        "score": task_lib.score(sample, prediction),
        "prediction": prediction,
    }


def run_point(
    client: Any, samples: list[tuple[list[int], Any]], concurrency: int, args: argparse.Namespace
) -> dict[str, Any]:
    """``len(samples)`` requests, at most ``concurrency`` in flight; no new one after ``--time-cap`` s."""
    before = read_metrics(args.port)
    peak = {"waiting": 0.0, "running": 0.0, "kv_usage": 0.0}
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(1.0):
            now = read_metrics(args.port)
            peak["waiting"] = max(peak["waiting"], now.get("vllm:num_requests_waiting", 0.0))
            peak["running"] = max(peak["running"], now.get("vllm:num_requests_running", 0.0))
            usage = max((now.get(name, 0.0) for name in USAGE), default=0.0)
            peak["kv_usage"] = max(peak["kv_usage"], usage)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    started = time.perf_counter()
    results: list[dict[str, Any]] = []
    skipped = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=concurrency) as pool:
        pending: set[concurrent.futures.Future[dict[str, Any]]] = set()
        queue = list(samples)
        while queue or pending:
            while queue and len(pending) < concurrency:
                if time.perf_counter() - started > args.time_cap:
                    skipped, queue = len(queue), []
                    break
                ids, sample = queue.pop(0)
                pending.add(
                    pool.submit(
                        one_request, client, ids, sample, args.tokens, args.request_timeout, args.ignore_eos
                    )
                )
            if not pending:
                break
            finished, pending = concurrent.futures.wait(pending, return_when="FIRST_COMPLETED")
            results += [future.result() for future in finished]
            print(f"  [{len(results)}/{len(samples)} requests done, {time.perf_counter() - started:.0f} s]",
                  file=sys.stderr, flush=True)  # fmt: skip
    wall = time.perf_counter() - started
    stop.set()
    poller.join(5)
    after = read_metrics(args.port)
    name = METRICS[0] if METRICS[0] in after else METRICS[3]
    preemptions = after.get(name, 0.0) - before.get(name, 0.0)
    return {
        **summarize_point(results, wall),
        "not_sent_time_cap": skipped,
        "preemptions": preemptions,
        "max_waiting": peak["waiting"],
        "max_running": peak["running"],
        "max_kv_usage": round(peak["kv_usage"], 4),
        "predictions": [r.get("prediction") for r in results],
    }


def load_samples(args: argparse.Namespace, count: int, offset: int) -> list[tuple[list[int], Any]]:
    """``count`` distinct passkey prompts of ``--context`` tokens (seeds ``offset`` on: every point its own)."""
    from transformers import AutoTokenizer

    from kvweave.eval import tasks as task_lib
    from kvweave.eval.runner import build_prompt

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    depths = task_lib.depths(count)
    out = []
    for index in range(count):
        sample = task_lib.make_sample(
            "passkey",
            tokenizer,
            args.context,
            depth=depths[index],
            seed=offset + index,
            haystack=args.haystack,
        )
        out.append((build_prompt(tokenizer, sample, question_aware=False)[1], sample))
    return out


def refused_row(args: argparse.Namespace, method: str, concurrency: int, reason: str) -> dict[str, Any]:
    """The row of a point whose server never became healthy: the setting, and why (no figures)."""
    from vllm_bench import versions

    return {
        "kind": "vllm_load", "method": method, "concurrency": concurrency, "model": args.model,
        "context": args.context, "max_tokens": args.tokens, "dtype": args.dtype, "kv_space_gib": args.kv_space,
        "refused": reason, "versions": versions(), "time": time.strftime("%F %T"), "kernel": None,
    }  # fmt: skip


def done_rows(path: Path) -> set[tuple[str, int]]:
    if not path.exists():
        return set()
    done = set()
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        done.add((row["method"], int(row["concurrency"])))
    return done


def table(folder: Path) -> str:
    rows = [json.loads(line) for line in (folder / "rows.jsonl").read_text().splitlines() if line.strip()]
    lines = [
        "| method | concurrency | KV tokens | req/s | out tok/s | TTFT p50 / p99 s | TPOT p50 / p99 s | "
        "preempted | max waiting | acc | failed |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in sorted(rows, key=lambda r: (r["method"], r["concurrency"])):
        if r.get("refused"):
            lines.append(f"| `{r['method']}` | {r['concurrency']} | refused at start-up: {r['refused']} |")
            continue
        lines.append(
            f"| `{r['method']}` | {r['concurrency']} | {r.get('kv_tokens') or '?'} | {r['requests_per_s']} | "
            f"{r['output_tokens_per_s']} | {r['ttft_median_s']} / {r['ttft_p99_s']} | "
            f"{r['tpot_median_s']} / {r['tpot_p99_s']} | {r['preemptions']:.0f} | {r['max_waiting']:.0f} | "
            f"{r['accuracy']} | {r['failed']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="a local model folder")
    parser.add_argument("--methods", default="none,fp8,quant:bits=4,quant:bits=2,pages,depthweave",
                        help="comma-separated: none (vLLM's own cache), fp8 / fp8_e4m3 / fp8_e5m2 (vLLM's own "
                        "cache in FP8, where its backend takes it) or KVWEAVE_VLLM_METHOD specs")  # fmt: skip
    parser.add_argument("--concurrency", default="1,4,16,32", help="comma-separated in-flight limits")
    parser.add_argument(
        "--requests", type=int, default=0, help="requests per point (default 2 x concurrency, >= 4)"
    )
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens (the passkey document)")
    parser.add_argument("--tokens", type=int, default=12, help="output tokens per request")
    parser.add_argument(
        "--kv-space", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE in GiB (the same for every method)"
    )
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every request generates --tokens tokens (a fixed decode load; answers are still scored)",
    )
    parser.add_argument(
        "--prefix-caching",
        action="store_true",
        help="leave vLLM's prefix caching on (off by default: the passkey prompts share their filler, and shared "
        "blocks would let vLLM's own cache hold more requests than their KV bytes say)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        help="default: context + tokens + 256 (the prompts run a little past --context; a smaller limit stops "
        "generation early, which rows show as output_tokens below requests x tokens)",
    )
    parser.add_argument(
        "--dtype", default="float32", help="float32 on CPUs without bf16 hardware (docs/vllm.md)"
    )
    parser.add_argument("--haystack", default=None)
    parser.add_argument(
        "--time-cap", type=float, default=900.0, help="seconds per point after which no request is sent"
    )
    parser.add_argument("--request-timeout", type=float, default=1800.0)
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--port", type=int, default=8766)
    parser.add_argument("--out", help="run folder: rows.jsonl (+ server logs); a rerun resumes")
    parser.add_argument("--restart", action="store_true", help="measure points already in rows.jsonl again")
    parser.add_argument(
        "--table", metavar="FOLDER", help="print the rows of FOLDER as a markdown table and exit"
    )
    args = parser.parse_args(argv)  # fmt: skip
    if args.table:
        print(table(Path(args.table)))
        return 0
    if not args.model or not args.out:
        parser.error("--model and --out are required (or --table FOLDER)")
    concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not concurrency or min(concurrency) < 1:
        parser.error("--concurrency needs positive integers, e.g. 1,4,16")
    args.concurrency = concurrency
    args.max_model_len = args.max_model_len or args.context + args.tokens + 256
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for method in methods:  # a bad spec fails before any server starts
        if own_cache_dtype(method) is None:
            from kvweave.vllm.config import VllmMethod

            VllmMethod.parse(method)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / "rows.jsonl"
    done = set() if args.restart else done_rows(rows_path)
    with (out / "command.txt").open("a") as handle:
        handle.write(" ".join(sys.argv) + "\n")
    from vllm_bench import versions, wait_healthy

    for method in methods:
        todo = [c for c in concurrency if (method, c) not in done]
        if not todo:
            print(f"{method}: every point already in {rows_path}")
            continue
        log_path = out / f"server-{method.replace(':', '_').replace(',', '_').replace('=', '')}.log"
        server = start_server(args, method, log_path)
        try:
            try:
                wait_healthy(args.port, server, args.start_timeout)
            except RuntimeError:
                if server.poll() is None:  # not healthy in time but still running: a fault, not a refusal
                    raise
                reason = start_error(log_path)
                print(f"{method}: the server exited before it was healthy: {reason} ({log_path})", flush=True)
                with rows_path.open("a") as handle:
                    for c in todo:
                        handle.write(json.dumps(refused_row(args, method, c, reason)) + "\n")
                continue
            from openai import OpenAI

            client = OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="local", max_retries=0)
            capacity = kv_tokens(log_path)
            for c in todo:
                count = args.requests or max(4, 2 * c)
                samples = load_samples(args, count, offset=1000 * c)
                print(f"{method} at concurrency {c}: {count} requests of {args.context} tokens", flush=True)
                point = run_point(client, samples, c, args)
                row = {
                    "kind": "vllm_load", "method": method, "concurrency": c, "model": args.model,
                    "context": args.context, "prompt_tokens": statistics.mean(len(ids) for ids, _ in samples),
                    "max_tokens": args.tokens, "dtype": args.dtype, "kv_space_gib": args.kv_space,
                    "ignore_eos": args.ignore_eos, "prefix_caching": args.prefix_caching,
                    "max_model_len": args.max_model_len,
                    "kv_tokens": capacity, **point, "versions": versions(), "time": time.strftime("%F %T"),
                    # the decode kernel kvweave's quant ran (KVWEAVE_VLLM_KERNEL: auto = fused C++, torch)
                    "kernel": None if own_cache_dtype(method) else os.environ.get("KVWEAVE_VLLM_KERNEL", "auto"),
                }  # fmt: skip
                with rows_path.open("a") as handle:
                    handle.write(json.dumps(row) + "\n")
                if args.ignore_eos and point["output_tokens"] < point["completed"] * args.tokens:
                    print(
                        f"vllm_load: {point['output_tokens']} output tokens for {point['completed']} requests of "
                        f"{args.tokens}: --max-model-len {args.max_model_len} stopped them early; raise it",
                        file=sys.stderr,
                        flush=True,
                    )
                print(
                    json.dumps({k: v for k, v in row.items() if k not in ("predictions", "versions")}),
                    flush=True,
                )
        finally:
            stop_server(server)
    print(table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
