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
"""

from __future__ import annotations

import dataclasses
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


def record_prefill(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    logits: list[torch.Tensor] | None = None,
) -> list[LayerStep | tuple[torch.Tensor, torch.Tensor]]:
    """Run the prefill once; per layer either its attention step or, for layers kvweave leaves to
    transformers (sliding windows), the ``(key, value)`` it stored. ``logits``, when given, receives the
    last position's logits ``[B, 1, V]`` (every replaying method's, since their prefill is exact)."""
    prepare(model)
    cache = KVCache(_Record(), model)
    plain: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
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
        recorded.append(steps[idx] if idx in steps else plain[idx])
    return recorded


def _recording_update(update: Any, store: dict[int, tuple[torch.Tensor, torch.Tensor]], idx: int) -> Any:
    def wrapped(key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        store[idx] = (key, value)
        return update(key, value, *args, **kwargs)

    return wrapped


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
