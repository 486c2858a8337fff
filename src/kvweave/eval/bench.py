"""``kvweave bench``: decode speed and memory of each method against ``full``, measured in the same process.

Not a test: a measurement that writes rows. Per context length and batch size, every method gets the same
prompt (the model's own haystack text with a real model; random token ids with ``--shape``), then decodes in
interleaved rounds (``full`` first, then each method, ``--rounds`` times; one forward per token, greedy), so
background load hits every method alike. The prompt is prefilled **once** per point: the model's exact prefill is
recorded and replayed into every method whose prefill attention is exact (``Method.replays_prefill``, the
evaluation's :mod:`kvweave.eval.prefill`; the replay hands the cache the prompt's ids as a forward pass would);
the others (``prefill: "own"`` in their rows) run their own forward pass. Each row reports:

- ``prefill_chunk``: 0 for a whole-prompt prefill; else the prompt went through the model this many tokens
  at a time (``--prefill-chunk``: the recording then lives in memory-mapped temporary files, for points whose
  whole prefill does not fit in memory; :func:`kvweave.eval.prefill.record_prefill`);
- ``ms_per_token``: the median over rounds of the round's mean step time; ``tok_s`` = batch / step time;
- ``speedup``: ``full``'s step time / this method's, measured in the same run;
- ``prefill_s`` and ``overhead_s`` (prefill minus ``full``'s prefill: what compressing costs), after an
  untimed 256-token prefill of every method (kernel builds, allocator warm-up); a replayed method's
  ``prefill_s`` is the shared recording plus its own replay, so ``overhead_s`` is what its replay costs beyond
  ``full``'s. ``--prefill-rounds N`` prefills every method N times, interleaved (``full``, then each method,
  N times): ``prefill_s`` is then the median, ``prefill_round_s`` every round, and ``prefill_vs_full`` the
  median of the per-round ratios to ``full`` (one prefill of each is no figure: on this kind of machine the
  same prefill moves by 10-20 % between runs, and the first of a kind is often the slowest);
- ``kv_bytes`` (tensors held, ``cache.nbytes()``), ``kv_read_bytes`` (what one decode step reads from the
  cache, ``cache.read_bytes()``: fewer than held where a method attends to part of what it holds);
- ``weight_bytes``, ``bandwidth_gb_s`` (this machine's measured copy bandwidth, the lower of the two
  measurements taken before and after the point's decode rounds: ``bandwidth_start_gb_s``,
  ``bandwidth_end_gb_s``) and the **bound**
  ``(W + KV_read_full) / (W + KV_read)``: the most a method can gain when a step is bound by the bytes it
  reads (DESIGN §7); ``of_bound`` = speedup / bound;
- ``loaded``: the copy bandwidth moved by more than 20 % across the point (another job took the memory bus);
  such a point's rounds are run once more, and ``reruns`` says how often; a point still loaded after that keeps
  ``loaded: true``, so its ratios are read with care;
- ``round_min_ms`` / ``round_max_ms``: the spread of the round means around the median;
- ``peak_bytes``: the CUDA allocator's peak for this method on a GPU; on a CPU the process's resident high-water
  mark (``peak_kind`` says which; the CPU figure is process-wide, so it only grows across methods).

``--shape NAME`` builds random weights of a real architecture (``qwen2.5-0.5b``, ``llama-3.1-8b``; rows are
labelled ``random:NAME``): speed depends on shapes, not on weight values.
"""

from __future__ import annotations

import dataclasses
import json
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvweave.report.specs import SPEC_VERSION

SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        rope_theta=1e6,
        tie_word_embeddings=True,
    ),
    "llama-3.1-8b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=5e5,
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        model_type="llama",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        max_position_embeddings=131072,
        rope_theta=5e5,
        tie_word_embeddings=False,
    ),
}
"""Architectures ``--shape`` builds with random weights (the published configs' shape numbers; ``tiny`` is no
real architecture: the GPU check's dry run on a CPU uses it, so the whole script runs in seconds)."""


@dataclasses.dataclass
class BenchConfig:
    """What ``kvweave bench`` measures."""

    methods: list[str]
    contexts: list[int]
    batches: list[int] = dataclasses.field(default_factory=lambda: [1])
    model: str | None = "qwen2.5-coder-0.5b"
    shape: str | None = None
    layers: int | None = None
    device: str = "cpu"
    dtype: str = "float32"
    steps: int = 8
    rounds: int = 3
    prefill_rounds: int = 1  # each method's prefill this many times, interleaved; rows report the median
    warmup: int = 2
    share_prefill: bool = True  # one recorded exact prefill per point, replayed into every method that can
    prefill_chunk: int = 0  # > 0: prefill this many tokens at a time (recording in memory-mapped files)
    reruns: int = 1  # a loaded point's decode rounds are run again at most this often
    skip: frozenset[tuple[int, int]] = frozenset()  # (context, batch) points already in the output rows

    def __post_init__(self) -> None:
        if self.shape is not None and self.shape not in SHAPES:
            raise ValueError(f"--shape {self.shape!r} is not known; choose one of {sorted(SHAPES)}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype {self.dtype!r}: choose float32, bfloat16 or float16")
        if self.prefill_chunk < 0:
            raise ValueError(
                f"--prefill-chunk must be 0 (whole prompt) or positive, got {self.prefill_chunk}"
            )
        for name in ("steps", "rounds", "prefill_rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not self.contexts or min(self.contexts) < 1:
            raise ValueError("--context needs positive token counts, e.g. 4k,16k")
        if not self.batches or min(self.batches) < 1:
            raise ValueError("--batch needs positive batch sizes, e.g. 1,4")
        if self.layers is not None and self.layers < 1:
            raise ValueError(f"--layers must be at least 1, got {self.layers}")

    @property
    def label(self) -> str:
        """The model as rows name it."""
        return (
            f"random:{self.shape}" + (f"/{self.layers}L" if self.layers else "")
            if self.shape
            else str(self.model)
        )


def load_bench_model(config: BenchConfig) -> tuple[Any, Any]:
    """``(model, tokenizer or None)``: a registry / local model, or random weights of ``config.shape``."""
    dtype = getattr(torch, config.dtype)
    if config.shape is None:
        from kvweave.models import load_model

        model, tokenizer = load_model(str(config.model), dtype=dtype)
        return model.to(config.device), tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    numbers = dict(SHAPES[config.shape])
    if config.layers:
        numbers["num_hidden_layers"] = config.layers
    model_config = AutoConfig.for_model(numbers.pop("model_type"), **numbers)
    torch.manual_seed(0)
    with torch.device(config.device):
        model = AutoModelForCausalLM.from_config(model_config, dtype=dtype, attn_implementation="sdpa")
    return model.eval(), None


def prompt(tokenizer: Any, vocab: int, tokens: int, batch: int, device: str) -> torch.Tensor:
    """``[batch, tokens]`` prompt ids: CPython's documentation prose (repeated as needed) with a tokenizer,
    seeded random ids without one; each row starts at another offset so rows differ."""
    if tokenizer is None:
        generator = torch.Generator().manual_seed(tokens)
        return torch.randint(3, vocab, (batch, tokens), generator=generator).to(device)
    from kvweave.eval.tasks import load_haystack

    ids: list[int] = tokenizer.encode(load_haystack("pydoc").text, add_special_tokens=False)
    if not ids:
        raise ValueError("the pydoc haystack is empty on this Python; cannot build a prompt")
    while len(ids) < tokens + batch * 997:
        ids = ids + ids
    return torch.tensor([ids[row * 997 : row * 997 + tokens] for row in range(batch)], device=device)


def copy_bandwidth(device: str, megabytes: int = 256) -> float:
    """Measured device-memory copy bandwidth in GB/s (bytes read + written per second, best of 5)."""
    source = torch.empty(megabytes << 20, dtype=torch.uint8, device=device).fill_(1)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        target.copy_(source)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * source.numel() / best / 1e9


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak(device: str) -> tuple[int, str]:
    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated()), "cuda allocator peak"
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    return resource.getrusage(
        resource.RUSAGE_SELF
    ).ru_maxrss * scale, "process RSS high-water (all methods so far)"


def weight_bytes(model: Any) -> int:
    """Bytes of the weights a decode step reads (tied embeddings counted once)."""
    seen: set[int] = set()
    total = 0
    for parameter in model.parameters():
        if parameter.data_ptr() not in seen:
            seen.add(parameter.data_ptr())
            total += parameter.numel() * parameter.element_size()
    return total


def read_bytes(cache: Any) -> int:
    """Bytes one decode step reads from ``cache``: ``cache.read_bytes()`` where a method reads less than it
    holds, else everything held."""
    reader = getattr(cache, "read_bytes", None)
    return int(reader()) if callable(reader) else int(cache.nbytes())


@dataclasses.dataclass
class _Trial:
    spec: str
    cache: Any
    token: torch.Tensor
    prefill_s: float
    peak: tuple[int, str]
    rounds: list[float] = dataclasses.field(default_factory=list)
    prefill_rounds: list[float] = dataclasses.field(default_factory=list)  # every prefill round's seconds
    how: str = "own"  # "own" forward pass or "replayed" from the point's shared recording


class SharedRecording:
    """One exact prefill of a point's prompt, recorded on first use and replayed into each method's cache."""

    def __init__(
        self,
        model: Any,
        ids: torch.Tensor,
        device: str,
        chunk: int = 0,
        progress: Callable[[str], None] = lambda text: None,
    ) -> None:
        self.model, self.ids, self.device, self.chunk, self.progress = model, ids, device, chunk, progress
        self.steps: list[Any] | None = None
        self.token: torch.Tensor | None = None
        self.seconds = 0.0

    def fill(self, cache: Any) -> tuple[torch.Tensor, float]:
        """Fill ``cache`` from the recording (made now if it is the first); ``(next token, seconds charged)``."""
        from kvweave.eval.prefill import record_prefill, replay_prefill

        if self.steps is None:
            logits: list[torch.Tensor] = []
            _sync(self.device)
            start = time.perf_counter()
            started = time.perf_counter()

            def report(done: int, total: int) -> None:
                spent = time.perf_counter() - started
                left = spent * (total - done) / done if done else 0.0  # attention grows: a lower bound
                self.progress(
                    f"recording the prefill: {done}/{total} tokens, {spent:.0f} s, >= {left:.0f} s to go"
                )

            self.steps = record_prefill(
                self.model, self.ids, logits=logits, chunk=self.chunk, progress=report
            )
            _sync(self.device)
            self.seconds, self.token = time.perf_counter() - start, logits[0].argmax(-1)
        _sync(self.device)
        start = time.perf_counter()
        replay_prefill(cache, self.steps, self.ids)
        _sync(self.device)
        return self.token, self.seconds + time.perf_counter() - start  # type: ignore[return-value]


def _prefill(
    model: Any,
    spec: str,
    ids: torch.Tensor,
    device: str,
    shared: SharedRecording | None = None,
    chunk: int = 0,
) -> _Trial:
    import kvweave
    from kvweave._compat import cache_kwarg

    cache = kvweave.make_cache(spec, model)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    if shared is not None and cache.method.replays_prefill(model.config, ids.shape[1]):
        token, elapsed = shared.fill(cache)
        return _Trial(spec, cache, token, elapsed, _peak(device), how="replayed")
    _sync(device)
    start = time.perf_counter()
    step = chunk if 0 < chunk < ids.shape[1] else ids.shape[1]  # a chunked prefill: the prefix pattern
    for first in range(0, ids.shape[1], step):
        piece = ids[:, first : first + step]
        logits = model(piece, use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache}).logits
    _sync(device)
    elapsed = time.perf_counter() - start
    return _Trial(spec, cache, logits[:, -1:].argmax(-1), elapsed, _peak(device))


def _decode(model: Any, trial: _Trial, steps: int, device: str) -> float:
    """Decode ``steps`` tokens; returns seconds per step (0 for no steps: ``--warmup 0``)."""
    from kvweave._compat import cache_kwarg

    if steps == 0:
        return 0.0

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    _sync(device)
    start = time.perf_counter()
    token = trial.token
    for _ in range(steps):
        token = model(token, use_cache=True, **{cache_kwarg(model): trial.cache}).logits[:, -1:].argmax(-1)
    _sync(device)
    trial.token = token
    peak = _peak(device)
    trial.peak = (max(trial.peak[0], peak[0]), peak[1])
    return (time.perf_counter() - start) / steps


LOADED = 0.2
"""A point whose copy bandwidth moved by more than this fraction between its start and end is marked loaded."""


def moved(start: float, end: float) -> bool:
    """Whether the bandwidth moved by more than :data:`LOADED` across a point."""
    return abs(end - start) > LOADED * max(start, end)


def done_points(path: str | Path, config: BenchConfig) -> frozenset[tuple[int, int]]:
    """``(context, batch)`` points of ``config`` whose rows for every method are already in the JSONL ``path``
    (same model, device, dtype and spec version), so a rerun of the same command resumes after them."""
    target = Path(path)
    if not target.exists():
        return frozenset()
    specs = {"full", *config.methods}
    seen: dict[tuple[int, int], set[str]] = {}
    for line in target.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash: that point is measured again
        if (
            row.get("kind") == "bench"
            and row.get("model") == config.label
            and row.get("device") == config.device
            and row.get("dtype") == config.dtype
            and row.get("spec_version") == SPEC_VERSION
        ):
            seen.setdefault((int(row["context"]), int(row["batch"])), set()).add(str(row["method"]))
    return frozenset(point for point, methods in seen.items() if specs <= methods)


def run_bench(
    config: BenchConfig,
    emit: Callable[[dict[str, Any]], None],
    progress: Callable[[str], None] = lambda text: None,
) -> list[dict[str, Any]]:
    """Measure every (context, batch, method); ``emit`` receives each row as soon as its point is done."""
    from kvweave.eval.runner import environment
    from kvweave.registry import parse_method

    specs = ["full"] + [s for s in config.methods if s != "full"]
    for spec in specs:  # a bad spec fails before the model loads
        parse_method(spec)
    model, tokenizer = load_bench_model(config)
    environment_info = {**environment(), "device": config.device, "dtype": config.dtype}
    if config.device.startswith("cuda"):
        environment_info["gpu"] = torch.cuda.get_device_name()
    weights = weight_bytes(model)
    vocab = int(model.config.get_text_config().vocab_size)
    rows: list[dict[str, Any]] = []
    with torch.no_grad():
        for context in config.contexts:
            for batch in config.batches:
                if (context, batch) in config.skip:
                    progress(f"context {context}, batch {batch}: rows already written, skipped")
                    continue
                ids = prompt(tokenizer, vocab, context, batch, config.device)
                for spec in specs:  # untimed: the first forward of each method pays one-off costs
                    _prefill(model, spec, ids[:, : min(context, 256)], config.device)
                point_progress = _point_progress(progress, context, batch)
                shared = (
                    SharedRecording(model, ids, config.device, config.prefill_chunk, point_progress)
                    if config.share_prefill
                    else None
                )
                slots: list[_Trial | None] = [None] * len(specs)
                started = time.perf_counter()
                for round_ in range(config.prefill_rounds):  # interleaved: drift hits every method alike
                    for index, spec in enumerate(specs):
                        label = f"prefill {index + 1}/{len(specs)} {spec}"
                        if config.prefill_rounds > 1:
                            label += f", round {round_ + 1}/{config.prefill_rounds}"
                        progress(f"context {context}, batch {batch}: {label}")
                        earlier = slots[index]
                        rounds = earlier.prefill_rounds if earlier is not None else []
                        slots[index] = earlier = None  # free the older cache before the next prefill
                        trial = _prefill(model, spec, ids, config.device, shared, config.prefill_chunk)
                        trial.prefill_rounds = [*rounds, trial.prefill_s]
                        slots[index] = trial
                        done = time.perf_counter() - started
                        recording = shared.seconds if shared is not None else 0.0
                        rest = specs[index + 1 :] + specs * (config.prefill_rounds - round_ - 1)
                        so_far = [t for t in slots[: index + 1] if t is not None]
                        left = _prefill_eta(so_far, rest, model, context, recording, shared is not None)
                        progress(
                            f"context {context}, batch {batch}: {spec} {trial.how} prefill "
                            f"{trial.prefill_s:.1f} s (all so far {done:.0f} s, about {left:.0f} s to go)"
                        )
                trials = [t for t in slots if t is not None]
                for trial in trials:
                    trial.prefill_s = statistics.median(trial.prefill_rounds)
                del shared
                for trial in trials:  # warm-up steps, not timed
                    _decode(model, trial, config.warmup, config.device)
                reruns = 0
                while True:
                    start_bw = copy_bandwidth(config.device)
                    for index in range(config.rounds):
                        progress(f"context {context}, batch {batch}: round {index + 1}/{config.rounds}")
                        for trial in trials:
                            trial.rounds.append(_decode(model, trial, config.steps, config.device))
                    end_bw = copy_bandwidth(config.device)
                    if not moved(start_bw, end_bw) or reruns >= config.reruns:
                        break
                    reruns += 1
                    progress(
                        f"context {context}, batch {batch}: loaded (copy bandwidth {start_bw:.1f} -> "
                        f"{end_bw:.1f} GB/s); its rounds run again"
                    )
                    for trial in trials:
                        trial.rounds.clear()
                bandwidth = (start_bw, end_bw, reruns)
                point = _rows(config, trials, context, batch, weights, bandwidth, environment_info)
                for row in point:
                    emit(row)
                rows += point
                del trials
    return rows


def _point_progress(progress: Callable[[str], None], context: int, batch: int) -> Callable[[str], None]:
    def show(text: str) -> None:
        progress(f"context {context}, batch {batch}: {text}")

    return show


def _prefill_eta(
    done: Sequence[_Trial],
    rest: Sequence[str],
    model: Any,
    context: int,
    recording: float,
    sharing: bool = True,
) -> float:
    """Seconds the remaining prefills should take: a replay what the compressing replays so far cost beyond the
    shared ``recording`` (a third of the recording before any, ``full``'s replay being no guide), an own
    prefill what a whole prefill did (the recording, or the slowest own one). Without ``sharing``
    (``--own-prefill``) every prefill is an own one."""
    from kvweave.registry import parse_method

    replays = [t.prefill_s - recording for t in done if t.how == "replayed" and t.spec != "full"]
    whole = max([recording] + [t.prefill_s for t in done if t.how == "own"])
    replay = statistics.median(replays) if replays else recording / 3
    return sum(
        replay if sharing and parse_method(spec).replays_prefill(model.config, context) else whole
        for spec in rest
    )


def _rows(
    config: BenchConfig,
    trials: Sequence[_Trial],
    context: int,
    batch: int,
    weights: int,
    measured: tuple[float, float, int],
    environment_info: dict[str, Any],
) -> list[dict[str, Any]]:
    start_bw, end_bw, reruns = measured
    bandwidth = min(start_bw, end_bw)
    full = trials[0]
    full_step = statistics.median(full.rounds)
    full_read = read_bytes(full.cache)
    rows = []
    for trial in trials:
        step = statistics.median(trial.rounds)
        kv_read = read_bytes(trial.cache)
        bound = (weights + full_read) / (weights + kv_read)
        speedup = full_step / step
        held = trial.cache.nbytes()
        rows.append(
            {
                "kind": "bench",
                "spec_version": SPEC_VERSION,
                "model": config.label,
                "method": trial.spec,
                "context": context,
                "batch": batch,
                "device": config.device,
                "dtype": config.dtype,
                "steps": config.steps,
                "rounds": config.rounds,
                "warmup": config.warmup,  # untimed decode steps first: the cache then holds context + warmup tokens
                "ms_per_token": round(1000 * step, 3),
                "tok_s": round(batch / step, 3),
                "round_ms": [round(1000 * r, 3) for r in trial.rounds],
                "round_min_ms": round(1000 * min(trial.rounds), 3),
                "round_max_ms": round(1000 * max(trial.rounds), 3),
                "speedup": round(speedup, 4),
                "bound": round(bound, 4),
                "of_bound": round(speedup / bound, 4),
                "prefill_s": round(trial.prefill_s, 3),
                "prefill_round_s": [round(r, 3) for r in trial.prefill_rounds or [trial.prefill_s]],
                # median over rounds of this method's prefill / full's in the same round (interleaved pairs)
                "prefill_vs_full": round(
                    statistics.median(
                        r / f
                        for r, f in zip(
                            trial.prefill_rounds or [trial.prefill_s],
                            full.prefill_rounds or [full.prefill_s],
                            strict=True,
                        )
                    ),
                    4,
                ),
                "prefill": trial.how,
                "prefill_chunk": config.prefill_chunk,
                "kernels": kernels_used(trial.cache),
                "overhead_s": round(trial.prefill_s - full.prefill_s, 3),
                "kv_bytes": held,
                "kv_read_bytes": kv_read,
                "full_kv_bytes_16bit": trial.cache.full_kv_bytes(16),
                "compression": round(trial.cache.full_kv_bytes(16) / held, 3) if held else None,
                "weight_bytes": weights,
                "bandwidth_gb_s": round(bandwidth, 2),
                "bandwidth_start_gb_s": round(start_bw, 2),
                "bandwidth_end_gb_s": round(end_bw, 2),
                "loaded": moved(start_bw, end_bw),
                "reruns": reruns,
                "step_bound_ms": round(1000 * (weights + kv_read) / (bandwidth * 1e9), 3),
                "peak_bytes": trial.peak[0],
                "peak_kind": trial.peak[1],
                "environment": environment_info,
            }
        )
    return rows


def kernels_used(cache: Any) -> list[str]:
    """The backends the cache's layers last ran their hot loops on (``cpp``, ``triton``, ``torch``; empty for
    methods without a kernel choice), so a row says whether its speed is a kernel's."""
    found = {
        getattr(layer, name, None) for layer in cache.layers for name in ("kernel_used", "scores_kernel")
    }
    return sorted(str(k) for k in found if k)


def write_rows(path: str | Path) -> Callable[[dict[str, Any]], None]:
    """An ``emit`` that appends each row to the JSONL file ``path`` as it comes (nothing lost on a crash)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)

    def emit(row: dict[str, Any]) -> None:
        with target.open("a") as handle:
            handle.write(json.dumps(row) + "\n")

    return emit


def format_row(row: dict[str, Any]) -> str:
    """One line of the table ``kvweave bench`` prints."""
    return (
        f"{row['method'][:44]:44s} {row['context']:>7} {row['batch']:>3} {row['ms_per_token']:10.1f} "
        f"{row['tok_s']:8.2f} {row['speedup']:7.2f}x {row['bound']:6.2f}x {row['of_bound']:6.0%} "
        f"{row['kv_bytes'] / 2**20:9.1f} {row['prefill_s']:8.1f} {row.get('prefill_vs_full', float('nan')):7.2f}x"
    )


HEADER = (
    f"{'method':44s} {'context':>7} {'B':>3} {'ms/token':>10} {'tok/s':>8} {'speedup':>8} {'bound':>7} "
    f"{'of bnd':>6} {'KV MiB':>9} {'prefill':>8} {'vs full':>8}"
)
