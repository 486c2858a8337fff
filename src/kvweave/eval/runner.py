"""``kvweave eval``: run methods × tasks × context lengths × trials on a real model, as JSONL rows.

Question-agnostic by default (as a multi-turn chat, and as kvpress evaluates): the chat prompt up to the end
of the document is prefilled into the cache first, so the method compresses without knowing the question;
then ``model.generate`` is called with the whole prompt (document + question + answer prefix) and the same
cache, and continues where the prefill stopped. ``question_aware=True`` puts the question inside the
prefill instead.

Every row records the method and options, task, context length, depth, seed, score, the KV bytes held (max
over the run), the bytes a 16-bit ``DynamicCache`` would hold for the same tokens, prefill seconds, decode
tokens per second and the trial's peak memory (:class:`PeakMemory`). Rows are appended to ``rows.jsonl`` in the run folder as they finish; a rerun skips the
finished ones, so an interrupted run loses nothing.

``tp > 1`` (``kvweave eval --tp N``, under ``torchrun``): the model is sharded over the ranks
(:mod:`kvweave.distributed`); every rank runs every trial, rank 0 alone shows progress and writes the run folder,
and a row's bytes and peak memory are summed over the ranks (its ``tp`` field says how many).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvweave._compat import cache_kwarg
from kvweave.cache import make_cache
from kvweave.distributed import is_main_process, summed_full_kv_bytes, summed_nbytes
from kvweave.eval import tasks as task_lib
from kvweave.eval.rows import (  # noqa: F401  (runner.read_rows etc. stay where callers find them)
    _end_with_newline,
    environment,
    finished_keys,
    iter_jsonl,
    read_rows,
)
from kvweave.eval.summary import _median, add_speed_ratios, format_table, summarize  # noqa: F401
from kvweave.prompt import chat_text
from kvweave.registry import METHODS, parse_method
from kvweave.report.specs import SPEC_VERSION, canonical_spec


@dataclasses.dataclass
class EvalConfig:
    """What one ``kvweave eval`` run covers."""

    model: str
    tasks: list[str]
    contexts: list[int]
    methods: list[str]
    trials: int = 3
    question_aware: bool = False
    dtype: str = "float32"
    haystack: str | None = None
    data_dir: str | None = None
    seed: int = 0
    beyond_trained: bool = False
    max_new_tokens: int | None = None
    shared_prefill: bool = True
    tp: int = 1  # tensor-parallel ranks the model is sharded over (run under torchrun with as many processes)
    # long generation: tokens of filler fed one decode step at a time between the document and the question, so
    # every fact's KV ages (and passes through decode-time compression) while that many tokens arrive
    generated: int = 0
    order: str = (
        "sample"  # "sample": every method on one sample, then the next; "method": one method at a time
    )
    # long generation: up to this many trials of one method (same task and length) as the rows of one batch —
    # prefill and filler together (left-padded), then each row answers alone (:func:`run_batch`)
    batch: int = 1

    def __post_init__(self) -> None:
        if self.order not in ("sample", "method"):
            raise ValueError(f"order must be 'sample' or 'method', got {self.order!r}")
        if self.trials < 1:
            raise ValueError(f"--trials must be at least 1, got {self.trials}")
        if self.tp < 1:
            raise ValueError(f"--tp must be at least 1, got {self.tp}")
        if self.generated < 0:
            raise ValueError(f"--generated must be 0 or more tokens, got {self.generated}")
        if self.batch < 1:
            raise ValueError(f"--batch must be at least 1, got {self.batch}")
        if self.batch > 1 and not self.generated:
            raise ValueError(
                "--batch runs the trials of a long generation together (their thousands of filler steps); "
                "it needs --generated N"
            )
        if self.batch > 1 and self.tp > 1:
            raise ValueError(
                "--batch is not supported with --tp: run one trial at a time under tensor parallelism"
            )
        if self.generated and self.question_aware:
            raise ValueError(
                "--generated feeds tokens between the document and the question, and --question-aware puts the "
                "question before compression: choose one"
            )
        for task in self.tasks:
            if task not in task_lib.TASKS:
                raise ValueError(f"unknown task {task!r}; available: {', '.join(task_lib.TASKS)}")
        for context in self.contexts:
            if context < 64:
                raise ValueError(f"context length {context} is too short; use at least 64 tokens")
        for spec in self.methods:
            parse_method(spec)  # validates names and options before any model is loaded
        if self.haystack is not None and not any(self.haystack_for(t) for t in self.tasks):
            takes = {t: task_lib.TASKS[t].haystacks for t in self.tasks}
            raise ValueError(
                f"no task of this run takes haystack {self.haystack!r}; haystacks by task: {takes}"
            )
        for task in self.tasks:  # missing data files fail here, not after the model has loaded
            spec_t = task_lib.TASKS[task]
            root = task_lib.resolve_data_dir(self.data_dir)
            for need in spec_t.needs:
                if root is None or not (root / need).exists():
                    raise task_lib.TaskDataMissing(
                        f"task {task!r} needs {need!r} from the evaluation-data folder "
                        f"({'none is configured' if root is None else f'not found under {root}'}): "
                        f"pass --data DIR or set {task_lib.DATA_ENV}"
                    )

    def haystack_for(self, task: str) -> str | None:
        """The haystack ``task`` is built with: ``haystack`` when the task takes it, else its own default."""
        spec = task_lib.TASKS[task]
        return self.haystack if self.haystack in spec.haystacks else None

    def sample(self, trial: Trial, tokenizer: Any) -> task_lib.Sample:
        """The prompt of ``trial`` (its task, length, depth and seed, this config's haystack and data)."""
        return task_lib.make_sample(
            trial.task,
            tokenizer,
            trial.context,
            depth=trial.depth,
            seed=trial.seed,
            haystack=self.haystack_for(trial.task),
            data_dir=self.data_dir,
        )


@dataclasses.dataclass
class Trial:
    """One unit of work (one row)."""

    task: str
    context: int
    method: str
    trial: int
    depth: float
    seed: int
    generated: int = 0

    def key(self) -> str:
        """Identity of the row, used to skip finished work on rerun."""
        tail = f"|gen{self.generated}" if self.generated else ""
        return f"{self.method}|{self.task}|{self.context}|{self.trial}{tail}"


def plan(config: EvalConfig) -> list[Trial]:
    """All trials of a run, in a stable order (the same sample for every method): sample by sample, every
    method on each, or with ``order="method"`` method by method, so each method's rows are complete early."""
    depth_list = task_lib.depths(config.trials)
    samples = [
        (task, context, trial)
        for task in config.tasks
        for context in config.contexts
        for trial in range(config.trials)
    ]
    specs = [parse_method(spec).spec() for spec in config.methods]
    pairs = (
        [(sample, spec) for spec in specs for sample in samples]
        if config.order == "method"
        else [(sample, spec) for sample in samples for spec in specs]
    )
    return [
        Trial(task, context, spec, trial, depth_list[trial], config.seed * 1000 + trial, config.generated)
        for (task, context, trial), spec in pairs
    ]


# ----------------------------------------------------------------------------------------- prompts


def build_prompt(
    tokenizer: Any, sample: task_lib.Sample, question_aware: bool
) -> tuple[list[int], list[int]]:
    """``(prefill_ids, full_ids)``: the prefix compressed before the question, and the whole prompt."""
    marker = "\u2063KVWEAVE_QUESTION\u2063"
    user = f"{sample.context}\n\n{marker}{sample.question}"
    templated = chat_text(tokenizer, user)
    text = templated if templated is not None else user + "\n"
    text += sample.answer_prefix
    before, after = text.split(marker)
    prefix_ids = tokenizer.encode(before, add_special_tokens=templated is None)
    rest_ids = tokenizer.encode(after, add_special_tokens=False)
    full = prefix_ids + rest_ids
    if question_aware:
        return full[:-1], full
    return prefix_ids, full


def generated_filler(tokenizer: Any, tokens: int, seed: int) -> list[int]:
    """``tokens`` ids of continuous prose (CPython's documentation, from a seeded offset), the stand-in for text
    a model generates: what a long-generation trial feeds one decode step at a time before the question."""
    if tokens == 0:
        return []
    from kvweave.eval.tasks import load_haystack

    ids: list[int] = tokenizer.encode("\n\n" + load_haystack("pydoc").text, add_special_tokens=False)
    if not ids:
        raise ValueError("the pydoc haystack is empty on this Python; --generated has no text to feed")
    while len(ids) < 2 * tokens + 1:
        ids = ids + ids
    start = (seed * 7919) % (len(ids) - tokens)
    return ids[start : start + tokens]


GENERATED_EVERY = 256
"""A long-generation trial reports its progress every this many fed tokens (:func:`feed_generated`)."""


def _decoder(model: Any) -> Any:
    """The model's decoder without its language-model head (``base_model``), or the model itself where it
    has none: what :func:`feed_generated` runs, since nothing reads the filler's logits."""
    decoder = getattr(model, "base_model", None)
    return decoder if isinstance(decoder, torch.nn.Module) and decoder is not model else model


def feed_generated(
    model: Any,
    cache: Any,
    filler: list[int],
    first: int,
    progress: Callable[[int, int], None] | None = None,
    chunk: int = 1,
) -> float:
    """Teacher-force ``filler`` through ``cache`` one token per forward pass (decode steps, not a prefill);
    returns the seconds it took. ``first`` is the position of the first filler token; ``progress(done,
    total)`` is called every :data:`GENERATED_EVERY` tokens and at the end (a 4K-token trial takes minutes).
    ``chunk``: tokens per pass, for an exact cache only (:func:`feed_chunk`).

    The passes run the decoder without the language-model head: nothing reads the filler's logits, and the
    cache sees the same layers, ids (the prompt hook sits on the decoder) and positions. On qwen2.5-coder-0.5b
    the head is 545 MB of the ~2 GB of float32 weights a decode step reads."""
    seconds, _ = feed_generated_rows(model, cache, [filler], [first], None, progress, chunk=chunk)
    return seconds


def feed_generated_rows(
    model: Any,
    cache: Any,
    fillers: list[list[int]],
    firsts: list[int],
    mask: torch.Tensor | None,
    progress: Callable[[int, int], None] | None = None,
    done: int = 0,
    checkpoint: Callable[[int, float], None] | None = None,
    every: int = 0,
    chunk: int = 1,
) -> tuple[float, torch.Tensor | None]:
    """:func:`feed_generated` for the rows of a left-padded batch: step ``i`` feeds ``fillers[b][i]`` at
    position ``firsts[b] + i`` of every row ``b`` (fillers of one length); ``mask: [B, T]`` is the attention
    mask of what the cache held before the first filler token, returned grown by the fed tokens with the
    seconds it took (``None``: one unpadded row, no mask passed, ``None`` returned). ``done``: the first ``done`` tokens are in ``cache`` already (a resumed feed).
    ``checkpoint(done, seconds)`` is called every ``every`` tokens (not after the last). ``chunk``: tokens per
    forward pass (1: decode steps); a pass never crosses a progress or checkpoint boundary."""
    if chunk < 1:
        raise ValueError(f"feed_generated: chunk must be at least 1, got {chunk}")
    forward = _decoder(model)
    kw = cache_kwarg(forward)
    device = next(model.parameters()).device
    tokens = torch.tensor(fillers, device=device)  # [B, N]
    first = torch.tensor(firsts, device=device).view(-1, 1)
    ones = torch.ones(len(fillers), max(chunk, done), dtype=torch.long, device=device)
    if mask is not None:
        mask = torch.cat([mask.to(device), ones[:, :done].to(mask.dtype)], dim=1)
    total = tokens.shape[1]
    seconds = 0.0
    start = time.perf_counter()
    index = done
    with torch.no_grad():
        while index < total:
            step = min(chunk, total - index, GENERATED_EVERY - index % GENERATED_EVERY)
            if every > 0:
                step = min(step, every - index % every)
            masked = {}
            if mask is not None:
                mask = torch.cat([mask, ones[:, :step].to(mask.dtype)], dim=1)
                masked = {"attention_mask": mask}
            forward(
                tokens[:, index : index + step],
                **masked,
                position_ids=first + torch.arange(index, index + step, device=device).view(1, -1),
                use_cache=True,
                **{kw: cache},
            )
            index += step
            if progress is not None and (index % GENERATED_EVERY == 0 or index == total):
                progress(index, total)
            if checkpoint is not None and every > 0 and index % every == 0 and index < total:
                seconds += time.perf_counter() - start
                checkpoint(index, seconds)  # the save is not fed time
                start = time.perf_counter()
    return seconds + time.perf_counter() - start, mask


EXACT_FEED_CHUNK = 256
"""Tokens per forward pass when a long-generation trial feeds its filler through an exact cache
(:func:`feed_chunk`)."""


def feed_chunk(cache: Any) -> int:
    """How many filler tokens one forward pass feeds into ``cache``: :data:`EXACT_FEED_CHUNK` for an exact
    cache (``full``), whose keys and values do not depend on how the tokens arrive (the causal mask gives every
    token the same attention; only float rounding differs), 1 for every other method, whose decode-time
    compression is what a long generation measures. Rows record it (``feed_chunk``)."""
    method = getattr(cache, "method", None)
    return EXACT_FEED_CHUNK if getattr(method, "exact", False) else 1


# ----------------------------------------------------------------------------------------- one trial


class _StepClock:
    """A logits processor that timestamps every decoding step of ``generate`` and, given the cache, keeps the
    most bytes it held after any step (``peak``: this process's share under tensor parallelism). What a method
    holds only for part of an answer (DepthWeave's rebuilt passages) counts in a row's bytes that way."""

    def __init__(self, cache: Any = None) -> None:
        self.times: list[float] = []
        self.cache, self.peak = cache, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        if self.cache is not None:
            self.peak = max(self.peak, self.cache.nbytes())
        return scores


class FirstLineDone:
    """A stopping criterion for tasks scored on the first code line: stop once that line is complete (a
    newline follows it). The score cannot change, since :func:`~kvweave.eval.tasks.first_code_line` of the
    shorter prediction is the same line; the decode steps after it are saved."""

    def __init__(self, tokenizer: Any, prompt_tokens: int) -> None:
        self.tokenizer, self.prompt_tokens = tokenizer, prompt_tokens

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        text = self.tokenizer.decode(input_ids[0, self.prompt_tokens :].tolist(), skip_special_tokens=True)
        done = task_lib.first_line_complete(text)
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


class SharedPrefill:
    """Exact prefills of samples, recorded once and replayed into each method's cache.

    Before a new sample is recorded, the oldest recordings are dropped until the rest fit ``max_bytes``
    (0: all of them): sample-major runs need only the current one, method-major runs (the demo) reuse every
    sample's recording across methods."""

    def __init__(self, max_bytes: int = 0) -> None:
        self.max_bytes = max_bytes
        self.recorded: dict[
            tuple[Any, ...], tuple[list[Any], float, int]
        ] = {}  # key -> steps, seconds, bytes

    def fill(self, model: Any, cache: Any, prefill_ids: list[int], key: tuple[Any, ...]) -> float:
        """Fill ``cache``; returns the prefill seconds charged to it (shared prefill + its own replay)."""
        from kvweave.eval.prefill import record_prefill, replay_prefill

        if key not in self.recorded:
            self.make_room()
            start = time.perf_counter()
            steps = record_prefill(model, torch.tensor([prefill_ids]))
            self.recorded[key] = (steps, time.perf_counter() - start, _recorded_bytes(steps))
        steps, seconds, _ = self.recorded[key]
        start = time.perf_counter()
        replay_prefill(cache, steps, torch.tensor([prefill_ids]))
        return seconds + time.perf_counter() - start

    def make_room(self) -> None:
        """Drop the oldest recordings until the rest fit ``max_bytes``."""
        while self.recorded and sum(entry[2] for entry in self.recorded.values()) > self.max_bytes:
            del self.recorded[next(iter(self.recorded))]


def _recorded_bytes(steps: list[Any]) -> int:
    """Bytes of the tensors of a recorded prefill."""
    total = 0
    for step in steps:
        tensors = vars(step).values() if dataclasses.is_dataclass(step) else step
        total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total


class PeakMemory:
    """Peak memory of one trial: the CUDA allocator's peak on a GPU, else the process's peak resident memory
    (Linux ``VmHWM``, reset per trial through ``/proc/self/clear_refs``; ``None`` where neither is available).
    The process peak includes the model weights and activations, not only the cache."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.kind: str | None = None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.kind = "cuda_max_allocated"
        elif _reset_rss_peak():
            self.kind = "process_peak_rss"

    def read(self) -> int | None:
        """Bytes at the peak since this object was made."""
        if self.kind == "cuda_max_allocated":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.kind == "process_peak_rss":
            return _rss_peak()
        return None


def _reset_rss_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # resets VmHWM to the current resident size (Linux >= 4.0)
        return _rss_peak() is not None
    except OSError:
        return False


def _rss_peak() -> int | None:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run_trial(
    model: Any,
    tokenizer: Any,
    config: EvalConfig,
    trial: Trial,
    sample: task_lib.Sample,
    shared: SharedPrefill | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Prefill, compress, answer; one result row. ``progress``: see :func:`feed_generated` (``--generated``)."""

    prefill_ids, full_ids = build_prompt(tokenizer, sample, config.question_aware)
    filler = generated_filler(tokenizer, trial.generated, trial.seed)
    full_ids = prefill_ids + filler + full_ids[len(prefill_ids) :]
    check_length(model, len(full_ids), config.beyond_trained)
    peak = PeakMemory(next(model.parameters()).device)
    cache = make_cache(trial.method, model, tokenizer=tokenizer)
    kw = cache_kwarg(model)
    replayed = shared is not None and cache.method.replays_prefill(model.config, len(prefill_ids))
    if shared is not None and replayed:
        prefill_s = shared.fill(model, cache, prefill_ids, (trial.task, trial.context, trial.trial))
    else:
        start = time.perf_counter()
        with torch.no_grad():
            model(torch.tensor([prefill_ids]), **{kw: cache}, use_cache=True, logits_to_keep=1)
        prefill_s = time.perf_counter() - start
    # the whole cache: under tensor parallelism summed over the ranks
    held_after_prefill = summed_nbytes(cache)
    chunk = feed_chunk(cache)
    generated_s = feed_generated(model, cache, filler, len(prefill_ids), progress, chunk) if filler else 0.0
    timing = {
        "prefill_s": prefill_s,
        "generated_s": generated_s,
        "shared_prefill": replayed,
        "feed_chunk": chunk,
    }
    return answer(
        model,
        tokenizer,
        config,
        trial,
        sample,
        cache,
        prefill_ids,
        full_ids,
        timing,
        held_after_prefill,
        peak,
    )


def answer(
    model: Any,
    tokenizer: Any,
    config: EvalConfig,
    trial: Trial,
    sample: task_lib.Sample,
    cache: Any,
    prefill_ids: list[int],
    full_ids: list[int],
    timing: dict[str, Any],
    held_before: int,
    peak: PeakMemory,
    padding: int = 0,
) -> dict[str, Any]:
    """Feed the question to ``cache`` (which holds the prompt's first ``len(full_ids) - len(question)`` tokens,
    after ``padding`` left-padding slots), generate the answer, score it; the trial's row."""
    from transformers import LogitsProcessorList, StoppingCriteriaList

    kw = cache_kwarg(model)
    spec = task_lib.TASKS[trial.task]
    max_new = config.max_new_tokens or spec.max_new_tokens
    clock = _StepClock(cache)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    full = torch.tensor([[pad_id or 0] * padding + full_ids])
    mask = torch.ones_like(full)
    mask[:, :padding] = 0
    stopping = StoppingCriteriaList([FirstLineDone(tokenizer, full.shape[1])] if spec.stop_after_line else [])
    rebuilt_before = rebuilt_spans(cache) or 0
    with torch.no_grad():
        out = model.generate(
            full,
            attention_mask=mask,
            max_new_tokens=max_new,
            do_sample=False,
            logits_processor=LogitsProcessorList([clock]),
            stopping_criteria=stopping,
            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            **{kw: cache},
        )
    new_ids = out[0, full.shape[1] :].tolist()
    rebuilt = rebuilt_spans(cache)
    prediction = tokenizer.decode(new_ids, skip_special_tokens=True)
    steps = len(clock.times) - 1
    decode_s = clock.times[-1] - clock.times[0] if steps > 0 else float("nan")
    # the most the cache held: after the prompt, after any answer step, at the end
    held = max(
        held_before, summed_nbytes(cache), cache.tp.sum(clock.peak) if cache.tp is not None else clock.peak
    )
    full_bytes = summed_full_kv_bytes(cache, bits=16)
    if padding:  # the reference is the row's own tokens; its held bytes keep whatever the batch left in it
        full_bytes -= full_bytes * padding // max(cache.get_seq_length(), 1)
    peak_bytes = peak.read()
    if cache.tp is not None and peak_bytes is not None:  # every rank's process holds its share
        peak_bytes = cache.tp.sum(peak_bytes)
    row = {
        "model": config.model,
        "method": trial.method,
        "spec_version": SPEC_VERSION,
        "options": parse_method(trial.method).options(),
        "task": trial.task,
        "context": trial.context,
        "context_tokens": len(prefill_ids),
        "prompt_tokens": len(full_ids),
        "trial": trial.trial,
        "depth": round(trial.depth, 3),
        "seed": trial.seed,
        "question_aware": config.question_aware,
        "haystack": sample.meta.get("haystack"),
        "word_lists": task_lib.word_lists(config.data_dir),
        "metric": spec.metric,
        "max_new_tokens": max_new,
        "score": task_lib.score(sample, prediction),
        "prediction": prediction,
        "answers": sample.answers,
        "kv_bytes": held,
        "full_kv_bytes": full_bytes,
        "compression": full_bytes / held if held else None,
        "prefill_s": round(timing["prefill_s"], 4),
        "generated": trial.generated,
        "generated_s": round(timing["generated_s"], 3),
        "shared_prefill": timing["shared_prefill"],
        "feed_chunk": timing.get("feed_chunk", 1) if trial.generated else None,
        "decode_tok_s": steps / decode_s if steps > 0 else None,
        "new_tokens": len(new_ids),
        "attended": attended_entries(cache),
        "rebuilt_spans": None if rebuilt is None else rebuilt - rebuilt_before,
        "peak_memory_bytes": peak_bytes,
        "peak_memory_kind": peak.kind if cache.tp is None else f"{peak.kind}_summed_over_ranks",
        "key": trial.key(),
    }
    if cache.tp is not None:
        row["tp"] = cache.tp.size
    if timing.get("batch", 1) > 1:  # prefill_s, generated_s and the peak are the batch's, not this row's
        row.update(batch=timing["batch"], padding=padding)
        row["peak_memory_kind"] = f"{peak.kind}_of_the_batch"
    return row


def run_batch(
    model: Any,
    tokenizer: Any,
    config: EvalConfig,
    trials: list[Trial],
    samples: list[task_lib.Sample],
    progress: Callable[[int, int], None] | None = None,
    checkpoint: Path | None = None,
) -> list[dict[str, Any]]:
    """Long-generation trials of one method, task and length as the rows of one batch: their prompts prefilled
    together (left-padded, each row at its own positions), every filler fed in the same decode steps, then each
    row taken out of the batch (``batch_select_indices`` on a copy) to answer its own question alone — the
    questions differ in length. Every method keeps its batch rows apart (the contract tests' batch rows equal
    single runs), so a row is the trial run alone but for floating-point rounding; the decode steps that
    dominate a long generation read the weights once for the batch. Rows carry ``batch`` and ``padding``;
    their ``prefill_s``, ``generated_s`` and peak memory are the batch's. A row's ``kv_bytes`` are what its
    copy holds, layout the batch left included (``quant``'s exact tail and block slots span the batch's rows,
    so its batched rows hold up to a group of tokens more than alone); ``full_kv_bytes`` counts its own tokens:
    a batched row never claims more compression than the trial alone.

    ``checkpoint``: a folder where the batch saves its cache every :data:`CHECKPOINT_EVERY` fed tokens
    (:func:`kvweave.save_cache`, the batch's rows in one cache) with how far it got; a run that finds one there
    goes on from it instead of starting over (a killed 8K-token batch loses at most that many steps). The
    caller removes it once the rows are written."""
    method = trials[0].method
    if any((t.method, t.task, t.context, t.generated) != (method, trials[0].task, trials[0].context,
                                                          trials[0].generated) for t in trials):  # fmt: skip
        raise ValueError("run_batch: the trials of a batch share their method, task, length and --generated")
    prompts = [build_prompt(tokenizer, sample, config.question_aware) for sample in samples]
    fillers = [generated_filler(tokenizer, t.generated, t.seed) for t in trials]
    prefills = [prefill for prefill, _ in prompts]
    fulls = [p + f + full[len(p) :] for (p, full), f in zip(prompts, fillers, strict=True)]
    for full_ids in fulls:
        check_length(model, len(full_ids), config.beyond_trained)
    width = max(len(p) for p in prefills)
    pads = [width - len(p) for p in prefills]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    ids = torch.tensor(
        [[pad_id or 0] * pad + p for pad, p in zip(pads, prefills, strict=True)], device=device
    )
    mask = (torch.arange(width).view(1, -1) >= torch.tensor(pads).view(-1, 1)).long()
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as generate() numbers a padded batch
    peak = PeakMemory(device)
    keys = [t.key() for t in trials]
    resumed = read_checkpoint(checkpoint, model, tokenizer, keys) if checkpoint is not None else None
    if resumed is not None:
        cache, state = resumed
        prefill_s, done, fed_s = state["prefill_s"], state["done"], state["generated_s"]
        held_after_prefill = state["held_after_prefill"]
    else:
        cache = make_cache(method, model, tokenizer=tokenizer)
        kw = cache_kwarg(model)
        start = time.perf_counter()
        with torch.no_grad():
            model(
                ids,
                attention_mask=mask.to(device),
                position_ids=positions.to(device),
                use_cache=True,
                logits_to_keep=1,
                **{kw: cache},
            )
        prefill_s = time.perf_counter() - start
        done, fed_s = 0, 0.0
        # each row's bytes after the prefill, as run_trial takes them (a row's held bytes: the most of these, its
        # bytes after any answer step and after the answer)
        held_after_prefill = [summed_nbytes(row_of(cache, b)) for b in range(len(trials))]
    firsts = [len(p) for p in prefills]

    def save(steps: int, seconds: float) -> None:
        assert checkpoint is not None
        state = {"keys": keys, "done": steps, "prefill_s": prefill_s, "generated_s": fed_s + seconds}
        write_checkpoint(checkpoint, cache, model, {**state, "held_after_prefill": held_after_prefill})

    chunk = feed_chunk(cache)
    seconds, _ = feed_generated_rows(
        model, cache, fillers, firsts, mask, progress, done, save if checkpoint is not None else None,
        CHECKPOINT_EVERY, chunk,
    )  # fmt: skip
    generated_s = fed_s + seconds
    timing = {
        "prefill_s": prefill_s,
        "generated_s": generated_s,
        "shared_prefill": False,
        "batch": len(trials),
        "feed_chunk": chunk,
    }
    rows = []
    for b, (trial, sample) in enumerate(zip(trials, samples, strict=True)):
        own = row_of(cache, b, last=b == len(trials) - 1)
        row = answer(
            model, tokenizer, config, trial, sample, own, prefills[b], fulls[b], timing, held_after_prefill[b],
            peak, pads[b],
        )  # fmt: skip
        rows.append(row)
        del own
    return rows


CHECKPOINT_EVERY = 1024
"""A ``--batch`` long generation saves its cache every this many fed tokens (:func:`run_batch`)."""

CHECKPOINT_STATE = "feed.json"
"""The checkpoint's state file: the rows' keys, the fed tokens, the seconds so far and which ``cache-N`` folder."""


def checkpoint_folder(out_dir: Path, trials: list[Trial]) -> Path:
    """Where the batch of ``trials`` keeps its checkpoint under a run folder: one folder per batch, named by
    its rows' keys."""
    digest = hashlib.sha256("\n".join(t.key() for t in trials).encode()).hexdigest()[:16]
    return out_dir / "checkpoints" / digest


def write_checkpoint(folder: Path, cache: Any, model: Any, state: dict[str, Any]) -> None:
    """Save ``cache`` beside the previous save in ``folder``, then point the state file (how far the feed got,
    replaced atomically) at it, then remove the previous save: a save killed at any point leaves the previous
    checkpoint (or none) readable, never a state with another cache."""
    from kvweave.persist import save_cache

    name = f"cache-{state['done']}"
    save_cache(cache, model, folder / name)
    staged = folder / (CHECKPOINT_STATE + ".tmp")
    staged.write_text(json.dumps({**state, "cache": name}))
    os.replace(staged, folder / CHECKPOINT_STATE)
    for old in folder.glob("cache-*"):
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)


def read_checkpoint(
    folder: Path, model: Any, tokenizer: Any, keys: list[str]
) -> tuple[Any, dict[str, Any]] | None:
    """``(cache, state)`` saved by :func:`write_checkpoint` for the rows ``keys``, or ``None`` where there is
    none yet."""
    from kvweave.persist import load_cache

    path = folder / CHECKPOINT_STATE
    if not path.is_file():
        return None
    state = json.loads(path.read_text())
    if state.get("keys") != keys:
        raise ValueError(
            f"{folder}: a checkpoint of other rows ({state.get('keys')}); remove the folder to start the batch "
            "over"
        )
    cache, _ = load_cache(folder / state["cache"], model)
    cache.context.tokenizer = tokenizer
    return cache, state


def row_of(cache: Any, row: int, last: bool = False) -> Any:
    """Batch row ``row`` of ``cache`` as a cache of its own: a copy (``last``: the cache itself, its other rows
    dropped) that shares the model's rotary modules and the tokenizer with it, and no state."""
    shared: list[Any] = [cache.context.tokenizer, *(r.rotary_emb for r in cache.rotary.values())]
    own = cache if last else copy.deepcopy(cache, memo={id(obj): obj for obj in shared if obj is not None})
    own.batch_select_indices(torch.tensor([row]))
    return own


def attended_entries(cache: Any) -> float | None:
    """Mean over layers of the entries the last decode step attended to, for methods that attend to fewer
    entries than they hold (DK-Cache's tiers and retrieved pages); ``None`` for the others."""
    counts = [layer.attended_entries() for layer in cache.layers if hasattr(layer, "attended_entries")]
    return sum(counts) / len(counts) if counts else None


def rebuilt_spans(cache: Any) -> int | None:
    """Passages the method's decode-time state has rebuilt so far (DepthWeave's ``quote`` and ``recall``:
    stored spans rebuilt exact from their token ids); ``None`` for a method with no such state. A row's
    ``rebuilt_spans`` counts those rebuilt while its question and answer were fed: whether ``quote`` acted."""
    state = cache.context.decode_state
    return None if state is None else getattr(state, "rebuilds", None)


def trained_context(model: Any) -> int:
    """The longest context the model was trained for (``max_position_embeddings``)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(getattr(config, "max_position_embeddings", 0) or 0)


def check_length(model: Any, prompt_tokens: int, beyond_trained: bool) -> None:
    """Refuse prompts beyond the model's trained context unless explicitly allowed."""
    limit = trained_context(model)
    if limit and prompt_tokens > limit and not beyond_trained:
        raise ValueError(
            f"the prompt has {prompt_tokens} tokens but the model was trained for {limit}; pass "
            "--beyond-trained to run past the trained range on purpose (e.g. to test RoPE compensation), "
            "or use a shorter --context"
        )


# ----------------------------------------------------------------------------------------- run folder


def sample_mismatch(row: dict[str, Any], trial: Trial, config: EvalConfig) -> list[str]:
    """How a finished row differs from the row ``trial`` would write (empty when it is the same sample and
    generation settings). Fields a row does not record are not compared."""
    spec = task_lib.TASKS[trial.task]
    expected: dict[str, Any] = {
        "model": config.model,
        "seed": trial.seed,
        "question_aware": config.question_aware,
        "max_new_tokens": config.max_new_tokens or spec.max_new_tokens,
        "generated": config.generated,
        "word_lists": task_lib.word_lists(config.data_dir),  # KVWEAVE_DATA's lists, or the built-in ones
    }
    if row.get("haystack") in spec.haystacks:  # a filler the user chooses, not one the task builds
        expected["haystack"] = config.haystack_for(trial.task) or spec.default_haystack
    hints = {"word_lists": f"; set or unset {task_lib.DATA_ENV} or --data as that run did"}
    found = [
        f"{name} {row[name]!r} (this command: {value!r}{hints.get(name, '')})"
        for name, value in expected.items()
        if name in row and row[name] != value
    ]
    name = trial.method.partition(":")[0]
    if name in METHODS and isinstance(row.get("method"), str) and isinstance(row.get("options"), dict):
        then = canonical_spec(
            row["method"],
            row["options"],
            version=row.get("spec_version", 1),
            generated=bool(row.get("generated")),
        )
        now = parse_method(trial.method).spec()
        if then != now:  # a default changed since: the finished row measured another configuration
            found.append(f"method {then!r}, the defaults then (this command's {trial.method!r}: {now!r})")
    if "depth" in row and abs(float(row["depth"]) - trial.depth) > 1e-3:
        found.append(
            f"depth {row['depth']} (this command: {round(trial.depth, 3)}; --trials changes the depths)"
        )
    return found


def check_resumable(rows_path: Path, todo: list[Trial], config: EvalConfig) -> None:
    """Refuse to resume a run folder whose finished rows were made from other samples or settings.

    A row is skipped on rerun by its key (method, task, length, trial index), so a folder written with
    another model, ``--seed``, ``--trials``, haystack, ``--question-aware`` or ``--max-new-tokens`` would
    otherwise be silently mixed with this command's rows. Adding tasks, lengths or methods is fine.
    """
    if not rows_path.exists():
        return
    by_key = {trial.key(): trial for trial in todo}
    for row in read_rows(rows_path):
        trial = by_key.get(row.get("key", ""))
        if trial is None:
            continue
        found = sample_mismatch(row, trial, config)
        if found:
            raise ValueError(
                f"{rows_path.parent} already holds row {row['key']!r} made with {'; '.join(found)}. "
                "A run folder holds one set of samples: give a new --out folder, or rerun with the options "
                f"of {rows_path.parent / 'command.txt'} to resume it"
            )


def batches(todo: list[Trial], size: int) -> list[list[Trial]]:
    """``todo`` in groups of at most ``size`` trials that can share a batch (:func:`run_batch`: one method,
    task, length and ``generated``), each group where its first trial was, in the order of ``todo``."""
    if size <= 1:
        return [[trial] for trial in todo]
    open_groups: dict[tuple[str, str, int, int], list[Trial]] = {}
    groups: list[list[Trial]] = []
    for trial in todo:
        key = (trial.method, trial.task, trial.context, trial.generated)
        group = open_groups.get(key)
        if group is None or len(group) == size:
            group = open_groups[key] = []
            groups.append(group)
        group.append(trial)
    return groups


def run(
    config: EvalConfig,
    out_dir: Path | None = None,
    progress: bool = True,
    model_and_tokenizer: tuple[Any, Any] | None = None,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    shared_bytes: int = 0,
) -> list[dict[str, Any]]:
    """Run (or resume) an evaluation; returns all rows of the run (old and new).

    ``on_row(row)`` is called after each row is written; ``shared_bytes`` bounds the recorded prefills kept
    for replay (0: only the current sample's, which is all a sample-major run needs)."""
    from tqdm import tqdm

    todo = plan(config)
    rows_path = None
    done: set[str] = set()
    # Under tensor parallelism every rank reads the finished rows itself: rank 0, the only writer, cannot finish a
    # row before every rank has loaded the model (loading starts the process group), so all ranks see one list.
    writer = is_main_process()
    if out_dir is not None:
        check_resumable(out_dir / "rows.jsonl", todo, config)
        rows_path = out_dir / "rows.jsonl"
        if writer:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "config.json").write_text(
                json.dumps({"config": dataclasses.asdict(config), "environment": environment()}, indent=2)
            )
        done = finished_keys(rows_path)
        if writer:
            _end_with_newline(rows_path)
    todo = [t for t in todo if t.key() not in done]
    if model_and_tokenizer is None and todo:
        from kvweave.models import load_model

        tp_plan = "auto" if config.tp > 1 else None
        model_and_tokenizer = load_model(config.model, dtype=config.dtype, tp_plan=tp_plan)
    rows: list[dict[str, Any]] = []
    samples: dict[tuple[str, int, int], task_lib.Sample] = {}
    shared = SharedPrefill(shared_bytes) if config.shared_prefill else None
    bar = tqdm(
        total=len(todo), desc="eval", unit="trial", disable=not (progress and writer), dynamic_ncols=True
    )
    for group in batches(todo, config.batch):
        trial = group[0]
        label = f"{trial.method} {trial.task} {trial.context}" + (f" x{len(group)}" if len(group) > 1 else "")
        bar.set_postfix_str(label)
        assert model_and_tokenizer is not None
        model, tokenizer = model_and_tokenizer
        for member in group:
            sample_key = (member.task, member.context, member.trial)
            if sample_key not in samples:
                samples[sample_key] = config.sample(member, tokenizer)

        def fed(done: int, total: int, label: str = label) -> None:
            bar.set_postfix_str(f"{label}, generated {done}/{total}")

        group_samples = [samples[(m.task, m.context, m.trial)] for m in group]
        checkpoint = None
        if len(group) > 1:
            checkpoint = checkpoint_folder(out_dir, group) if out_dir is not None and writer else None
            new_rows = run_batch(model, tokenizer, config, group, group_samples, fed, checkpoint)
        else:
            new_rows = [
                run_trial(
                    model,
                    tokenizer,
                    config,
                    trial,
                    group_samples[0],
                    shared,
                    fed if trial.generated else None,
                )
            ]
        for row in new_rows:
            rows.append(row)
            if rows_path is not None and writer:
                with rows_path.open("a") as handle:
                    handle.write(json.dumps(row) + "\n")
                    handle.flush()
                    os.fsync(handle.fileno())
            if on_row is not None:
                on_row(row)
            bar.update(1)
        if checkpoint is not None:
            shutil.rmtree(checkpoint, ignore_errors=True)  # its rows are written
    bar.close()
    if out_dir is not None:
        return read_rows(out_dir)
    return rows
