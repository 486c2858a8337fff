"""What ``depthweave:recall`` costs a decode step, where the text copies an old passage and where it does not.

``kvweave bench`` decodes greedily from its prompt, so whether recall rebuilds anything during its rounds is up
to the model. This script teacher-forces three kinds of steps into caches prefilled with the same prompt (the
bench's pydoc prose, one exact prefill replayed into every method that prefills exactly):

- ``next``: the prose that follows the prompt. The pydoc prose repeats itself (a 16K prompt holds passages
  the next tokens repeat), so this phase copies where the document does;
- ``copy``: a passage of the prompt fed again token by token (from ``--context // 4`` on, another one each
  round), what an answer quoting its document does. With ``recall=N`` on, the first ``N`` tokens of it find
  the source and each ~32 tokens after that rebuild the next span (one forward pass over <= 128 tokens);
- ``other``: another document (``--other``, a haystack: by default CPython source code), which the prompt
  does not hold: recall's bookkeeping with little to rebuild;
- ``quote``: a question fed as one step that quotes 16 tokens of the prompt (from ``--context // 2`` on,
  another passage each round), then the prompt's next tokens one per step, an answer read from the passage
  quoted. With ``quote=M`` on (DepthWeave's default since spec version 9) the question's step rebuilds the
  passage, and the steps after it attend to it while it is held: the question's step is timed apart
  (``ms_question``), the decode steps as in the other phases.

Each round runs the phases for every method in turn (interleaved, so the machine's drift hits all alike).
Rows (JSON lines appended to ``--out``): per round, method and phase the mean, median and slowest step in ms,
the spans rebuilt, the teacher-forced loss of the phase's tokens and the cache's bytes; then per method and
phase a summary with the median over rounds of the mean step and its ratio to ``full``'s (the first method
given) in the same rounds. Example (docs/findings.md, twenty-seventh session)::

    OMP_NUM_THREADS=2 nice -n 5 python benchmarks/recall_speed.py --model qwen2.5-coder-0.5b --context 16384 \\
        --methods full,depthweave,depthweave:recall=8 --steps 64 --rounds 3 --out runs/recall-speed/rows.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

PHASES = ("next", "copy", "other", "quote")
QUESTION = 16
"""Tokens of the prompt the ``quote`` phase's question quotes (one multi-token step)."""


def rebuilds(cache: Any) -> int:
    """Spans recall has rebuilt in ``cache`` so far (0 without recall): the eval rows' count."""
    from kvweave.eval.runner import rebuilt_spans

    return rebuilt_spans(cache) or 0


def prefill(model: Any, spec: str, ids: torch.Tensor, shared: Any) -> tuple[Any, float]:
    """A ``spec`` cache holding ``ids`` (replayed from ``shared`` where the method prefills exactly) and the
    seconds that took."""
    import kvweave
    from kvweave._compat import cache_kwarg

    cache = kvweave.make_cache(spec, model)
    start = time.perf_counter()
    if cache.method.replays_prefill(model.config, ids.shape[1]):
        shared.fill(cache)
    else:
        with torch.no_grad():
            model(ids, use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache})
    return cache, time.perf_counter() - start


def feed(
    model: Any, cache: Any, tokens: torch.Tensor, question: torch.Tensor | None = None
) -> dict[str, Any]:
    """Teacher-force ``tokens: [1, n]`` one per step (after ``question: [1, q]`` as one step, timed apart, when
    given); each step's seconds, the loss of tokens 1..n given the ones before, and the spans rebuilt
    meanwhile (the question's included)."""
    from kvweave._compat import cache_kwarg

    before = rebuilds(cache)
    seconds: list[float] = []
    losses: list[float] = []
    asked = None
    with torch.no_grad():
        if question is not None:
            start = time.perf_counter()
            model(question, use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache})
            asked = 1000 * (time.perf_counter() - start)
        for i in range(tokens.shape[1]):
            start = time.perf_counter()
            logits = model(tokens[:, i : i + 1], use_cache=True, **{cache_kwarg(model): cache}).logits
            seconds.append(time.perf_counter() - start)
            if i + 1 < tokens.shape[1]:
                log_probs = torch.log_softmax(logits[0, -1].float(), -1)
                losses.append(-float(log_probs[tokens[0, i + 1]]))
    return {
        "ms_mean": 1000 * statistics.fmean(seconds),
        "ms_median": 1000 * statistics.median(seconds),
        "ms_max": 1000 * max(seconds),
        "loss": statistics.fmean(losses) if losses else None,
        "rebuilds": rebuilds(cache) - before,
        "ms_question": asked,
    }


def summaries(rows: list[dict[str, Any]], reference: str) -> list[dict[str, Any]]:
    """Per method and phase: the median over rounds of the mean step, and of its ratio to ``reference``'s in the
    same round (``speedup``: above 1 is faster than ``reference``)."""
    by_key = {(r["round"], r["method"], r["phase"]): r for r in rows if r.get("kind") == "round"}
    out = []
    for method in dict.fromkeys(r["method"] for r in by_key.values()):
        for phase in PHASES:
            mine = [r for (_, m, p), r in by_key.items() if m == method and p == phase]
            if not mine:
                continue
            ratios = [
                by_key[(r["round"], reference, phase)]["ms_mean"] / r["ms_mean"]
                for r in mine
                if (r["round"], reference, phase) in by_key
            ]
            asked = [r["ms_question"] for r in mine if r.get("ms_question") is not None]
            out.append(
                {
                    "kind": "summary",
                    "method": method,
                    "phase": phase,
                    "rounds": len(mine),
                    "ms_mean": statistics.median(r["ms_mean"] for r in mine),
                    "speedup": statistics.median(ratios) if ratios else None,
                    "rebuilds": sum(r["rebuilds"] for r in mine),
                    "loss": statistics.fmean(r["loss"] for r in mine if r["loss"] is not None),
                    "ms_question": statistics.median(asked) if asked else None,
                    "reference": reference,
                }
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="registry name or local folder")
    parser.add_argument("--context", type=int, default=16384, help="prompt tokens prefilled (default 16384)")
    parser.add_argument(
        "--methods",
        default="full,depthweave,depthweave:recall=8",
        help="comma-separated specs; the first is the reference of the ratios (default: full, depthweave and "
        "depthweave:recall=8)",
    )
    parser.add_argument("--steps", type=int, default=64, help="decode steps per phase and round (default 64)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of the three phases per method (default 3)"
    )
    parser.add_argument(
        "--other", default="code", help="haystack of the 'other' phase (pydoc, essays, code; default code)"
    )
    parser.add_argument("--out", required=True, help="rows file (JSON lines; appended)")
    args = parser.parse_args(argv)
    if min(args.context, args.steps, args.rounds) < 1:
        parser.error("--context, --steps and --rounds must be positive")
    if args.context // 2 + args.rounds * (QUESTION + args.steps) > args.context - 1024:
        parser.error(
            f"--context {args.context} is too short for {args.rounds} rounds of {args.steps} copied or quoted "
            "tokens (each round copies and quotes other passages of the prompt, before its newest 1,024 "
            "tokens); lower --steps or --rounds, or raise --context"
        )
    from kvweave.cli_args import _split
    from kvweave.registry import parse_method

    specs = _split(args.methods)
    for spec in specs:
        try:
            parse_method(spec)
        except ValueError as err:
            parser.error(str(err))

    import kvweave
    from kvweave.eval.bench import SharedRecording, prompt
    from kvweave.eval.runner import environment
    from kvweave.eval.tasks.data import HAYSTACKS, load_haystack
    from kvweave.report.specs import SPEC_VERSION

    if args.other not in HAYSTACKS:
        parser.error(f"--other {args.other!r} is no haystack; choose one of {', '.join(HAYSTACKS)}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    model, tokenizer = kvweave.load_model(args.model)
    stream = prompt(tokenizer, model.config.vocab_size, args.context + args.rounds * args.steps, 1, "cpu")
    ids, following = stream[:, : args.context], stream[:, args.context :]
    text = tokenizer.encode(load_haystack(args.other).text, add_special_tokens=False) if tokenizer else []
    if len(text) < args.rounds * args.steps:
        parser.error(f"the {args.other} haystack holds {len(text)} tokens, fewer than --rounds x --steps")
    other = torch.tensor([text[: args.rounds * args.steps]])

    def emit(row: dict[str, Any]) -> None:
        with out.open("a") as handle:
            handle.write(json.dumps(row) + "\n")

    emit({"kind": "run", "command": " ".join(sys.argv), "model": args.model, **environment()})
    shared = SharedRecording(model, ids, "cpu")
    caches = {}
    for spec in specs:
        print(f"[{spec}] prefill of {args.context} tokens", file=sys.stderr, flush=True)
        caches[spec], seconds = prefill(model, spec, ids, shared)
        emit({"kind": "prefill", "spec_version": SPEC_VERSION, "method": spec, "context": args.context,
              "seconds": seconds})  # fmt: skip
    rows: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        source = args.context // 4 + round_ * args.steps
        quoted = args.context // 2 + round_ * (QUESTION + args.steps)
        tokens = {
            "next": following[:, round_ * args.steps : (round_ + 1) * args.steps],
            "copy": ids[:, source : source + args.steps],
            "other": other[:, round_ * args.steps : (round_ + 1) * args.steps],
            "quote": ids[:, quoted + QUESTION : quoted + QUESTION + args.steps],
        }
        sources = {"copy": source, "quote": quoted}
        for spec in specs:
            for phase in PHASES:
                question = ids[:, quoted : quoted + QUESTION] if phase == "quote" else None
                measured = feed(model, caches[spec], tokens[phase], question)
                row = {
                    "kind": "round",
                    "spec_version": SPEC_VERSION,
                    "round": round_,
                    "method": spec,
                    "phase": phase,
                    "context": args.context,
                    "steps": args.steps,
                    "source": sources.get(phase),
                    **measured,
                    "kv_bytes": int(caches[spec].nbytes()),
                }
                emit(row)
                rows.append(row)
                print(
                    f"round {round_ + 1}/{args.rounds} {spec:28} {phase:5} {row['ms_mean']:8.1f} ms/step "
                    f"(max {row['ms_max']:.0f}) loss {row['loss']:.3f} rebuilds {row['rebuilds']}"
                    + (f" question {row['ms_question']:.0f} ms" if row["ms_question"] is not None else ""),
                    file=sys.stderr,
                    flush=True,
                )
    for summary in summaries(rows, specs[0]):
        summary["spec_version"] = SPEC_VERSION
        emit(summary)
        print(
            f"{summary['method']:28} {summary['phase']:5} {summary['ms_mean']:8.1f} ms/step  "
            f"{summary['speedup']:.2f}x of {specs[0]}  loss {summary['loss']:.3f}  rebuilds {summary['rebuilds']}"
            + (f"  question {summary['ms_question']:.0f} ms" if summary["ms_question"] is not None else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
