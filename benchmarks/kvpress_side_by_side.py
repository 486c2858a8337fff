"""NVIDIA kvpress presses on the same samples, model and protocol as ``kvweave eval``, as rows kvweave reports.

Not a test: a benchmark script that writes results. Three stages, like RULER and kvpress's own evaluation:

1. **export** (this environment, kvweave installed): the samples come from kvweave's task generators with the
   runner's depths and seeds, and are tokenized by kvweave's prompt builder (chat template, question split
   off after the document) into ``prompts.jsonl``: token ids of the prefill and of the whole prompt. Both
   sides therefore see identical tokens.
2. **predict** (a separate venv with kvpress, which pins ``transformers<5.3``; this script re-runs itself
   there with ``--child``): per prompt and press, the document is prefilled with the press active (so it is
   compressed before the question is seen, exactly as kvpress's pipeline does), then the question and
   answer prefix are fed and the answer decoded greedily with positions continuing from the uncompressed
   length. The uncompressed baseline (``kvpress:full``) runs in the same process, so decode speed can be
   quoted as a ratio against it. Output: ``predictions.jsonl`` (append-only, resumable).
3. **score** (this environment): answers are decoded with the same tokenizer and scored by kvweave's scorer
   into ``rows.jsonl`` in the runner's row format, with ``method = kvpress:<Press>:<compression_ratio>``.

kvpress's ``compression_ratio`` is the fraction of the context *removed*: 0.75 keeps a quarter, like
kvweave's ``ratio=0.25``. Usage::

    python benchmarks/kvpress_side_by_side.py --model qwen2.5-coder-0.5b --task passkey,niah_multikey \\
        --context 2048 --trials 3 --presses KeyDiff,SnapKV,StreamingLLM,ExpectedAttention,Knorm --ratios 0.75
    kvweave report runs/demo-qwen2.5-coder-0.5b-2048 runs/kvpress-qwen2.5-coder-0.5b-2048 -o report.html

``--dry-run`` prints the plan and touches nothing; ``--export-only`` stops after stage 1. Only the standard
library is imported at module level: the same file runs in both environments.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PRESSES = ("KeyDiff", "SnapKV", "StreamingLLM", "ExpectedAttention", "Knorm")
"""Default presses (kvpress class names without the ``Press`` suffix)."""

REQUIREMENTS = ("kvpress", "transformers<5.3", "torch==2.13.0")
"""What the kvpress venv gets (kvpress pins transformers below 5.3; torch as in kvweave's venv). The torch
requirement is installed first and then held by a constraint, so kvpress's dependencies cannot swap it for
another build (for instance a CUDA wheel from PyPI in place of a local CPU one)."""

DEFAULT_VENV = Path(__file__).resolve().parent.parent / "runs" / "kvpress-venv"
"""Where the kvpress venv lives unless ``--venv`` says otherwise: ``runs/kvpress-venv`` of this checkout,
whatever the working directory."""

BASELINE = "kvpress:full"
"""Method name of the uncompressed run in the kvpress environment (the speed reference)."""


def press_method(press: str, ratio: float) -> str:
    """Row method name: ``kvpress:SnapKV:0.75``."""
    return f"kvpress:{press}:{ratio:g}"


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _ints(text: str) -> list[int]:
    return [int(part.lower().replace("k", "000")) for part in _csv(text)]


def _floats(text: str) -> list[float]:
    values = [float(part) for part in _csv(text)]
    for value in values:
        if not 0.0 < value < 1.0:
            raise argparse.ArgumentTypeError(
                f"kvpress compression ratios are the fraction removed, in (0, 1); got {value}"
            )
    return values


# ============================================================================ stage 1: export (kvweave env)


def model_folder(model: str, pull: bool) -> Path:
    """The Hugging Face folder of a registry model (``~/.cache/kvweave/models/<name>``) or a local folder."""
    from kvweave import models

    if model in models.REGISTRY:
        return models.resolve(model) if pull else models.converted_folder(model)
    return Path(os.path.expanduser(model))


def eval_config(args: argparse.Namespace) -> Any:
    """The kvweave ``EvalConfig`` whose samples both sides share (its method list is irrelevant here)."""
    from kvweave.eval import runner

    return runner.EvalConfig(
        model=args.model,
        tasks=_csv(args.task),
        contexts=args.context,
        methods=["full"],
        trials=args.trials,
        haystack=args.haystack,
        data_dir=args.data,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
    )


def export_prompts(args: argparse.Namespace, path: Path) -> int:
    """Write ``prompts.jsonl``: one line per (task, context, trial) with the token ids both sides use."""
    from transformers import AutoTokenizer

    from kvweave.eval import runner
    from kvweave.eval import tasks as task_lib

    config = eval_config(args)
    tokenizer = AutoTokenizer.from_pretrained(model_folder(args.model, pull=True))
    lines = []
    for trial in runner.plan(config):
        sample = task_lib.make_sample(
            trial.task,
            tokenizer,
            trial.context,
            depth=trial.depth,
            seed=trial.seed,
            haystack=config.haystack,
            data_dir=config.data_dir,
        )
        prefill_ids, full_ids = runner.build_prompt(tokenizer, sample, question_aware=False)
        lines.append(
            {
                "id": f"{trial.task}|{trial.context}|{trial.trial}",
                "task": trial.task,
                "context": trial.context,
                "trial": trial.trial,
                "depth": round(trial.depth, 3),
                "seed": trial.seed,
                "answers": sample.answers,
                "prefill_ids": prefill_ids,
                "full_ids": full_ids,
                "max_new_tokens": config.max_new_tokens or task_lib.TASKS[trial.task].max_new_tokens,
            }
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return len(lines)


# ============================================================================ stage 2: predict (kvpress env)


def venv_python(venv: Path) -> Path:
    """The interpreter of a venv."""
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def ensure_venv(venv: Path, requirements: list[str]) -> Path:
    """Create the kvpress venv and install ``requirements`` unless kvpress already imports there."""
    python = venv_python(venv)
    if (
        python.exists()
        and subprocess.run([python, "-c", "import kvpress"], capture_output=True).returncode == 0
    ):
        return python
    print(f"creating {venv} with {' '.join(requirements)} (several minutes, once)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
    torch_first = [r for r in requirements if re.match(r"torch\b(?![-_.\w])", r)]
    rest = [r for r in requirements if r not in torch_first]
    constraint: list[str] = []
    if torch_first:
        # torch alone first (the build it picks, e.g. a local CPU wheel, is then the one installed), and
        # pinned to exactly that version while kvpress and its dependencies resolve around it
        subprocess.run([python, "-m", "pip", "install", *torch_first], check=True)
        installed = subprocess.run(
            [python, "-c", "import torch; print(torch.__version__)"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        pin = venv / "torch-constraint.txt"
        pin.write_text(f"torch=={installed}\n")
        constraint = ["-c", str(pin)]
    if rest:
        subprocess.run([python, "-m", "pip", "install", *constraint, *rest], check=True)
    return python


def child_command(python: Path, args: argparse.Namespace, out: Path) -> list[str]:
    """The command that runs stage 2 inside the kvpress venv."""
    return [
        str(python),
        str(Path(__file__).resolve()),
        "--child",
        "--prompts",
        str(out / "prompts.jsonl"),
        "--predictions",
        str(out / "predictions.jsonl"),
        "--model-folder",
        str(model_folder(args.model, pull=False)),
        "--presses",
        ",".join(args.presses),
        "--ratios",
        ",".join(f"{r:g}" for r in args.ratios),
        "--dtype",
        args.dtype,
        *([] if args.baseline else ["--no-baseline"]),
    ]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Lines of a JSONL file; a line cut short by a crash is skipped."""
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def _append_jsonl(path: Path, row: dict[str, Any]) -> None:
    """Append one line durably, starting a new line if a crash left the last one unterminated."""
    needs_newline = path.exists() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
    with path.open("a") as handle:
        handle.write(("\n" if needs_newline else "") + json.dumps(row) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def _cache_bytes(cache: Any) -> tuple[int, int]:
    """``(bytes held, K+V elements per token per layer)`` of a transformers ``DynamicCache``."""
    held, per_token = 0, 0
    for layer in cache.layers:
        keys, values = layer.keys, layer.values  # [B, H, T, D]
        held += keys.numel() * keys.element_size() + values.numel() * values.element_size()
        per_token = keys.shape[1] * keys.shape[3] + values.shape[1] * values.shape[3]
    return held, per_token


def predict_one(model: Any, press: Any, prompt: dict[str, Any]) -> dict[str, Any]:
    """kvpress's question-agnostic protocol for one prompt: compress the document, then answer greedily.

    Mirrors ``KVPressTextGenerationPipeline._forward`` / ``generate_answer``: prefill the context with the
    press hooks active (``model.model``, no LM head), then feed the question with positions continuing
    from the uncompressed context length, then decode token by token until EOS or ``max_new_tokens``.
    """
    import contextlib

    import torch
    from transformers import DynamicCache

    context_ids = torch.tensor([prompt["prefill_ids"]])
    question_ids = torch.tensor([prompt["full_ids"][len(prompt["prefill_ids"]) :]])
    context_length = context_ids.shape[1]
    cache = DynamicCache()
    with torch.no_grad():
        start = time.perf_counter()
        with press(model) if press is not None else contextlib.nullcontext():
            model.model(input_ids=context_ids, past_key_values=cache)
        prefill_s = time.perf_counter() - start
        held_after_prefill, _ = _cache_bytes(cache)

        position_ids = torch.arange(context_length, context_length + question_ids.shape[1]).unsqueeze(0)
        outputs = model(
            input_ids=question_ids, past_key_values=cache, position_ids=position_ids, logits_to_keep=1
        )
        step_times = [time.perf_counter()]
        generated = [int(outputs.logits[0, -1].argmax())]
        stop = model.generation_config.eos_token_id
        stop = set(stop if isinstance(stop, list) else [stop])
        position = position_ids[:, -1:] + 1
        for step in range(prompt["max_new_tokens"] - 1):
            if generated[-1] in stop:
                break
            outputs = model(
                input_ids=torch.tensor([[generated[-1]]]), past_key_values=cache, position_ids=position + step
            )
            step_times.append(time.perf_counter())
            generated.append(int(outputs.logits[0, -1].argmax()))
    held_at_end, per_token = _cache_bytes(cache)
    seen = len(prompt["full_ids"]) + len(generated) - 1  # the last generated token is never fed
    steps = len(step_times) - 1
    decode_s = step_times[-1] - step_times[0]
    return {
        "new_ids": generated,
        "prefill_s": round(prefill_s, 4),
        "decode_tok_s": steps / decode_s if steps > 0 and decode_s > 0 else None,
        "kv_bytes": max(held_after_prefill, held_at_end),
        "full_kv_bytes": len(cache.layers) * per_token * seen * 2,  # a 16-bit DynamicCache, as kvweave counts
        "context_tokens": context_length,
        "prompt_tokens": len(prompt["full_ids"]),
    }


def child_main(args: argparse.Namespace) -> int:
    """Stage 2, inside the kvpress venv: every (prompt, press) not yet in ``predictions.jsonl``."""
    import importlib.metadata

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    names = _csv(args.presses)
    if names:
        import kvpress

    transformers.utils.logging.disable_progress_bar()  # one "Loading weights" bar line per tensor otherwise
    dtype = getattr(torch, args.dtype)
    dtype_kwarg = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(
        args.model_folder, attn_implementation="sdpa", **{dtype_kwarg: dtype}
    )
    model.eval()
    versions = {
        "kvpress": importlib.metadata.version("kvpress") if names else None,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    jobs: list[tuple[str, Any]] = [(BASELINE, None)] if args.baseline else []
    for name in names:
        cls = getattr(kvpress, f"{name}Press", None)
        if cls is None:
            raise SystemExit(f"kvpress has no {name}Press (kvpress {versions['kvpress']})")
        jobs += [(press_method(name, ratio), cls(compression_ratio=ratio)) for ratio in _floats(args.ratios)]
    prompts = _read_jsonl(Path(args.prompts))
    out = Path(args.predictions)
    done = {row["key"] for row in _read_jsonl(out)}
    todo = [(p, m, press) for p in prompts for m, press in jobs if f"{m}|{p['id']}" not in done]
    print(f"kvpress {versions['kvpress']}: {len(todo)} predictions to make", file=sys.stderr)
    started = time.perf_counter()
    for index, (prompt, method, press) in enumerate(todo, 1):
        result = predict_one(model, press, prompt)
        _append_jsonl(
            out,
            {
                "key": f"{method}|{prompt['id']}",
                "method": method,
                "id": prompt["id"],
                **result,
                "versions": versions,
            },
        )
        elapsed = time.perf_counter() - started
        eta = elapsed / index * (len(todo) - index)
        print(f"[{index}/{len(todo)}] {method} {prompt['id']}  eta {eta / 60:.1f} min", file=sys.stderr)
    return 0


# ============================================================================ stage 3: score (kvweave env)


def score_predictions(args: argparse.Namespace, out: Path) -> int:
    """Turn ``predictions.jsonl`` into ``rows.jsonl`` (runner format), rewritten whole each time."""
    from transformers import AutoTokenizer

    from kvweave.eval import tasks as task_lib

    tokenizer = AutoTokenizer.from_pretrained(model_folder(args.model, pull=False))
    prompts = {p["id"]: p for p in _read_jsonl(out / "prompts.jsonl")}
    rows = []
    for pred in _read_jsonl(out / "predictions.jsonl"):
        prompt = prompts.get(pred["id"])
        if prompt is None:
            continue  # from an earlier plan
        prediction = tokenizer.decode(pred["new_ids"], skip_special_tokens=True)
        sample = task_lib.Sample(
            prompt["task"], "", "", prompt["answers"], prompt["depth"], prompt["seed"], pred["context_tokens"]
        )
        parts = pred["method"].split(":")
        options = {"press": parts[1], "compression_ratio": float(parts[2])} if len(parts) == 3 else {}
        rows.append(
            {
                "model": args.model,
                "method": pred["method"],
                "options": options,
                "task": prompt["task"],
                "context": prompt["context"],
                "context_tokens": pred["context_tokens"],
                "prompt_tokens": pred["prompt_tokens"],
                "trial": prompt["trial"],
                "depth": prompt["depth"],
                "seed": prompt["seed"],
                "question_aware": False,
                "score": task_lib.score(sample, prediction),
                "prediction": prediction,
                "answers": prompt["answers"],
                "kv_bytes": pred["kv_bytes"],
                "full_kv_bytes": pred["full_kv_bytes"],
                "compression": pred["full_kv_bytes"] / pred["kv_bytes"] if pred["kv_bytes"] else None,
                "prefill_s": pred["prefill_s"],
                "decode_tok_s": pred["decode_tok_s"],
                "new_tokens": len(pred["new_ids"]),
                "key": pred["key"],
                "engine": pred.get("versions", {}),
            }
        )
    staged = out / "rows.jsonl.tmp"
    staged.write_text("".join(json.dumps(row) + "\n" for row in rows))
    staged.replace(out / "rows.jsonl")
    return len(rows)


def write_meta(args: argparse.Namespace, out: Path, argv: list[str]) -> None:
    """``config.json`` and ``command.txt`` beside the rows, as ``kvweave eval`` leaves them."""
    import dataclasses

    from kvweave.eval import runner

    predictions = _read_jsonl(out / "predictions.jsonl")
    environment = {**runner.environment(), **(predictions[-1].get("versions", {}) if predictions else {})}
    config = {
        **dataclasses.asdict(eval_config(args)),
        "methods": ([BASELINE] if args.baseline else [])
        + [press_method(p, r) for p in args.presses for r in args.ratios],
        "engine": "kvpress",
        "dtype": args.dtype,
    }
    (out / "config.json").write_text(json.dumps({"config": config, "environment": environment}, indent=2))
    (out / "command.txt").write_text(
        shlex.join(["python", "benchmarks/kvpress_side_by_side.py", *argv]) + "\n"
    )


# ============================================================================ driver


def default_out(model: str, contexts: list[int]) -> Path:
    """``runs/kvpress-<model>-<contexts>``."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(model).name or model).strip("-")
    return Path("runs") / f"kvpress-{slug}-{'-'.join(str(c) for c in contexts)}"


def print_plan(args: argparse.Namespace, out: Path) -> None:
    """What a run would do (``--dry-run``)."""
    tasks = _csv(args.task)
    prompts = len(tasks) * len(args.context) * args.trials
    methods = ([BASELINE] if args.baseline else []) + [
        press_method(p, r) for p in args.presses for r in args.ratios
    ]
    print(f"model:       {args.model} -> {model_folder(args.model, pull=False)}")
    print(
        f"samples:     {len(tasks)} tasks ({', '.join(tasks)}) x contexts {args.context} x {args.trials} trials "
        f"= {prompts} prompts (seed {args.seed}, question-agnostic)"
    )
    print(f"methods:     {', '.join(methods)}")
    print(f"predictions: {prompts * len(methods)}")
    print(
        f"venv:        {args.venv} ({'exists' if venv_python(Path(args.venv)).exists() else 'to create'}): "
        f"pip install {shlex.join(args.requirements)} (torch first, then held by a constraint)"
    )
    print(f"out:         {out}/prompts.jsonl, predictions.jsonl, rows.jsonl, config.json, command.txt")
    print(f"child:       {shlex.join(child_command(venv_python(Path(args.venv)), args, out))}")
    print(f"then:        kvweave report {out} [kvweave run folders...] -o report.html")


def parser() -> argparse.ArgumentParser:
    """Command-line options of both the driver and the ``--child`` stage."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="kvweave registry name or a local HF folder")
    p.add_argument("--task", default="passkey,niah_multikey", help="comma-separated kvweave tasks")
    p.add_argument("--context", type=_ints, default=[2048], help="comma-separated context lengths")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--haystack")
    p.add_argument("--data")
    p.add_argument("--max-new-tokens", type=int, help="override the tasks' answer length")
    p.add_argument("--presses", default=",".join(PRESSES), help="kvpress press names without 'Press'")
    p.add_argument("--ratios", default="0.75", help="kvpress compression ratios (fraction removed)")
    p.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip the uncompressed run")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--out", help="run folder (default runs/kvpress-<model>-<contexts>)")
    p.add_argument(
        "--venv",
        default=str(DEFAULT_VENV),
        help="venv for kvpress (created on first use; default runs/kvpress-venv)",
    )
    p.add_argument("--python", help="use this interpreter (with kvpress installed) instead of the venv")
    p.add_argument("--requirements", default=",".join(REQUIREMENTS), help="comma-separated pip requirements")
    p.add_argument("--dry-run", action="store_true", help="print the plan and stop")
    p.add_argument("--export-only", action="store_true", help="write prompts.jsonl and stop")
    # stage 2, inside the kvpress venv
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--prompts", help=argparse.SUPPRESS)
    p.add_argument("--predictions", help=argparse.SUPPRESS)
    p.add_argument("--model-folder", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    """Export, predict in the kvpress venv, score; or one of the partial modes."""
    argv = sys.argv[1:] if argv is None else argv
    cli = parser()
    args = cli.parse_args(argv)
    if args.child:
        return child_main(args)
    args.presses = _csv(args.presses)
    try:
        args.ratios = _floats(args.ratios)
        if not args.presses and not args.baseline:
            raise ValueError("nothing to run: give --presses or drop --no-baseline")
        if not args.dry_run:
            eval_config(args)  # validates tasks, contexts and trials before anything is written
    except (ValueError, argparse.ArgumentTypeError) as error:
        cli.error(str(error))
    args.requirements = _csv(args.requirements)
    out = Path(args.out) if args.out else default_out(args.model, args.context)
    if args.dry_run:
        print_plan(args, out)
        return 0
    count = export_prompts(args, out / "prompts.jsonl")
    print(f"exported {count} prompts to {out / 'prompts.jsonl'}", file=sys.stderr)
    if args.export_only:
        return 0
    python = Path(args.python) if args.python else ensure_venv(Path(args.venv), args.requirements)
    subprocess.run(child_command(python, args, out), check=True)
    rows = score_predictions(args, out)
    write_meta(args, out, argv)
    print(
        f"{rows} rows in {out / 'rows.jsonl'}; next: kvweave report {out} <kvweave run folders> -o report.html"
    )
    print(f"(host: {platform.node()}, {os.cpu_count()} CPUs)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
