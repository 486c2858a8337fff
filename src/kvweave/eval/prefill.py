"""Shared prefill: run a long prompt through the model once, then build every method's cache from it.

Prefill attention is exact for most methods (they compress *after* a layer has attended over the whole
prompt), so the hidden states of a prefill do not depend on the method: only what each layer stores does.
:func:`record_prefill` runs the model once and keeps, per layer, the attention step's inputs (queries, post-RoPE
keys, values, mask, positions); :func:`replay_prefill` feeds them, layer by layer and in order, to a fresh
cache of any method whose ``exact_prefill`` is true. The cache then holds what a real forward pass would have
left in it (a test checks this for every registered method); the evaluation saves one model prefill per
method and sample. Methods that change prefill attention (position interpolation, say) declare
``exact_prefill = False`` and always get a real forward pass; a method exact only for some prompts (DK-Cache:
inside the trained context) says so per prompt with ``Method.replays_prefill``.

A long prompt at a large batch does not fit a whole-prompt forward pass in memory (the MLP's activations of
4 x 32K tokens at an 8B shape are ~20 GB) nor its recording beside the weights (queries, keys and values of
every layer). ``record_prefill(..., chunk=N)`` runs the prompt through the model ``N`` tokens at a time, each
chunk attending exactly over everything before it, and writes each layer's queries, keys and values into
memory-mapped files (unlinked at once, so nothing is left behind; the operating system pages them out under
memory pressure): RAM then holds the weights and one chunk's activations. The recorded step is the whole
prompt's, as the unchunked prefill would have recorded it (the same tensors up to the summation order of
chunked attention: a test compares every method's replay of both).
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvweave._compat import cache_kwarg
from kvweave.attention import kvweave_attention, prepare
from kvweave.cache import CompressedLayer, KVCache
from kvweave.registry import Method


@dataclasses.dataclass
class LayerStep:
    """One layer's attention step of the prefill."""

    module: torch.nn.Module
    query: torch.Tensor  # [B, Hq, N, D] post-RoPE
    key: torch.Tensor  # [B, H, N, D] post-RoPE
    value: torch.Tensor  # [B, H, N, D]
    mask: torch.Tensor | None
    kwargs: dict[str, Any]


@dataclasses.dataclass
class _Record(Method):
    """Internal (not registered): an exact cache that records each layer's prefill attention inputs."""

    name = "_record"
    exact = True

    def make_layer(self, cache: KVCache, layer_idx: int) -> CompressedLayer:
        return _RecordingLayer(cache, layer_idx)


class _RecordingLayer(CompressedLayer):
    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> torch.Tensor:
        steps: dict[int, LayerStep] = self.cache.context.recorded
        steps[self.layer_idx] = LayerStep(module, query, key, value, attention_mask, dict(kwargs))
        return super().attend(module, query, key, value, attention_mask, **kwargs)


class _Spill:
    """Per layer, the whole prompt's queries, keys and values in memory-mapped files, filled chunk by chunk."""

    def __init__(self, tokens: int, folder: str | Path | None) -> None:
        self.tokens = tokens
        self.folder = Path(folder) if folder is not None else Path(tempfile.gettempdir())
        self.tensors: dict[tuple[int, str], torch.Tensor] = {}
        self.positions: dict[int, list[torch.Tensor]] = {}
        self.kwargs: dict[int, dict[str, Any]] = {}
        self.module: dict[int, torch.nn.Module] = {}

    def tensor(self, layer: int, name: str, like: torch.Tensor) -> torch.Tensor:
        """``[B, H, tokens, D]`` of ``like``'s dtype, backed by a file that is unlinked as soon as it is mapped."""
        found = self.tensors.get((layer, name))
        if found is not None:
            return found
        b, h, _, d = like.shape
        if like.device.type != "cpu":  # an accelerator's memory is its own; no file behind it
            made = like.new_empty(b, h, self.tokens, d)
        else:
            self.folder.mkdir(parents=True, exist_ok=True)
            handle, path = tempfile.mkstemp(prefix=f"kvweave-prefill-{layer}-{name}-", dir=self.folder)
            os.close(handle)
            try:
                count = b * h * self.tokens * d
                flat = torch.from_file(path, shared=True, size=count, dtype=like.dtype)
            finally:
                os.unlink(path)  # the mapping keeps the pages; the name is gone even if this process dies
            made = flat.view(b, h, self.tokens, d)
        self.tensors[(layer, name)] = made
        return made


@dataclasses.dataclass
class _ChunkRecord(Method):
    """Internal (not registered): an exact cache whose layers write a chunked prefill into a :class:`_Spill`."""

    name = "_record"
    exact = True
    spill: Any = None  # the _Spill the layers write into

    def make_layer(self, cache: KVCache, layer_idx: int) -> CompressedLayer:
        return _SpillingLayer(cache, layer_idx)


class _SpillingLayer(CompressedLayer):
    def append(self, key: torch.Tensor, value: torch.Tensor, position_ids: torch.Tensor | None) -> None:
        spill: _Spill = self.cache.method.spill  # type: ignore[attr-defined]
        start, end = self.seen, self.seen + key.shape[2]
        keys, values = spill.tensor(self.layer_idx, "key", key), spill.tensor(self.layer_idx, "value", value)
        keys[:, :, start:end] = key
        values[:, :, start:end] = value
        self.keys, self.values = keys[:, :, :end], values[:, :, :end]

    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> torch.Tensor:
        spill: _Spill = self.cache.method.spill  # type: ignore[attr-defined]
        start = self.seen
        spill.tensor(self.layer_idx, "query", query)[:, :, start : start + query.shape[2]] = query
        spill.module[self.layer_idx] = module
        spill.kwargs.setdefault(self.layer_idx, dict(kwargs))
        positions = kwargs.get("position_ids")
        if isinstance(positions, torch.Tensor):
            spill.positions.setdefault(self.layer_idx, []).append(positions)
        return super().attend(module, query, key, value, attention_mask, **kwargs)


def record_prefill(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    logits: list[torch.Tensor] | None = None,
    chunk: int = 0,
    spill: str | Path | None = None,
    progress: Any = None,
) -> list[LayerStep | tuple[torch.Tensor, torch.Tensor]]:
    """Run the prefill once; per layer either its attention step or, for layers kvweave leaves to
    transformers (sliding windows), the ``(key, value)`` it stored. ``logits``, when given, receives the
    last position's logits ``[B, 1, V]`` (every replaying method's, since their prefill is exact).

    ``chunk > 0`` (shorter than the prompt) runs the prompt ``chunk`` tokens at a time and keeps the recording in
    memory-mapped files under ``spill`` (default: the system's temporary folder); ``progress(done, total)`` is
    called after each chunk. Prompts with padding are recorded whole (``chunk`` is refused for them)."""
    tokens = int(input_ids.shape[1])
    if chunk < 0:
        raise ValueError(f"--prefill-chunk must be 0 (whole prompt) or a positive token count, got {chunk}")
    if 0 < chunk < tokens:
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError(
                "a chunked prefill recording takes prompts without padding; record this batch whole "
                "(--prefill-chunk 0) or give rows of equal length"
            )
        return _record_chunked(model, input_ids, logits, chunk, spill, progress)
    prepare(model)
    cache = KVCache(_Record(), model)
    plain: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for idx, layer in enumerate(cache.layers):
        if not isinstance(layer, CompressedLayer):  # e.g. sliding windows: record what they are given
            layer.update = _recording_update(layer.update, plain, idx)
    with torch.no_grad():
        out = model(
            input_ids,
            attention_mask=attention_mask,
            use_cache=True,
            logits_to_keep=1,
            **{cache_kwarg(model): cache},
        )
    if logits is not None:
        logits.append(out.logits[:, -1:])
    steps: dict[int, LayerStep] = cache.context.recorded
    recorded: list[LayerStep | tuple[torch.Tensor, torch.Tensor]] = []
    for idx in range(len(cache.layers)):
        recorded.append(steps[idx] if idx in steps else _joined(plain[idx]))
    return recorded


def _record_chunked(
    model: Any,
    input_ids: torch.Tensor,
    logits: list[torch.Tensor] | None,
    chunk: int,
    folder: str | Path | None,
    progress: Any,
) -> list[LayerStep | tuple[torch.Tensor, torch.Tensor]]:
    prepare(model)
    tokens = int(input_ids.shape[1])
    spill = _Spill(tokens, folder)
    method = _ChunkRecord()
    method.spill = spill
    cache = KVCache(method, model)
    plain: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for idx, layer in enumerate(cache.layers):
        if not isinstance(layer, CompressedLayer):
            layer.update = _recording_update(layer.update, plain, idx)
    pieces = math.ceil(tokens / chunk)
    out = None
    with torch.no_grad():
        for piece in range(pieces):
            start = piece * chunk
            out = model(
                input_ids[:, start : start + chunk],
                use_cache=True,
                logits_to_keep=1,
                **{cache_kwarg(model): cache},
            )
            if progress is not None:
                progress(min(tokens, start + chunk), tokens)
    if logits is not None and out is not None:
        logits.append(out.logits[:, -1:])
    recorded: list[LayerStep | tuple[torch.Tensor, torch.Tensor]] = []
    for idx, layer in enumerate(cache.layers):
        if not isinstance(layer, CompressedLayer):
            recorded.append(_joined(plain[idx]))
            continue
        kwargs = dict(spill.kwargs[idx])
        if idx in spill.positions:
            kwargs["position_ids"] = torch.cat(spill.positions[idx], dim=-1)
        recorded.append(
            LayerStep(
                spill.module[idx],
                spill.tensors[(idx, "query")],
                spill.tensors[(idx, "key")],
                spill.tensors[(idx, "value")],
                None,  # no padding: the whole prompt's causal attention, as an unchunked prefill records it
                kwargs,
            )
        )
    return recorded


def _recording_update(
    update: Any, store: dict[int, list[tuple[torch.Tensor, torch.Tensor]]], idx: int
) -> Any:
    def wrapped(key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        store.setdefault(idx, []).append((key, value))
        return update(key, value, *args, **kwargs)

    return wrapped


def _joined(pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    if len(pieces) == 1:
        return pieces[0]
    return torch.cat([k for k, _ in pieces], dim=2), torch.cat([v for _, v in pieces], dim=2)


def replay_prefill(
    cache: KVCache,
    recorded: list[LayerStep | tuple[torch.Tensor, torch.Tensor]],
    input_ids: torch.Tensor | None = None,
) -> None:
    """Fill a fresh ``cache`` from a recorded prefill, as a real forward pass would have: with the prompt's
    ``input_ids: [B, n]`` handed over first, as the forward pass hands them (content-aware methods read them)."""
    tokens = _prompt_tokens(recorded)
    if not cache.method.replays_prefill(cache.config, tokens):
        raise ValueError(f"{cache.method.name} changes prefill attention; it needs a real forward pass")
    if input_ids is not None:
        cache.observe_input_ids(input_ids)
    cache.replaying = True
    try:
        _replay_layers(cache, recorded)
    finally:
        cache.replaying = False


def _prompt_tokens(recorded: list[LayerStep | tuple[torch.Tensor, torch.Tensor]]) -> int:
    first = recorded[0]
    return int((first.key if isinstance(first, LayerStep) else first[0]).shape[2])


def _replay_layers(cache: KVCache, recorded: list[LayerStep | tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for idx, step in enumerate(recorded):
            layer = cache.layers[idx]
            if isinstance(step, LayerStep):
                key, value = layer.update(step.key, step.value)
                if isinstance(layer, CompressedLayer):
                    kvweave_attention(step.module, step.query, key, value, step.mask, **step.kwargs)
            else:
                layer.update(*step)
