"""Hand-built cache layers for method tests: a layer fed keys/values directly, without a model."""

from __future__ import annotations

import dataclasses
import types

import torch


def hand_built_layer(
    layer_class,
    method,
    keys: torch.Tensor,
    values: torch.Tensor | None = None,
    pad_count: torch.Tensor | None = None,
    scaling: float = 1.0,
):
    """A ``layer_class`` layer holding ``keys, values: [B, H, T, D]`` as a prompt just stored (no eviction yet),
    at their own width (``storage=model``)."""
    values = torch.randn_like(keys) if values is None else values
    if "storage" in getattr(method, "__dataclass_fields__", {}):  # hold the given keys as they are
        method = dataclasses.replace(method, storage="model")
    cache = types.SimpleNamespace(method=method, head_dim=keys.shape[-1])
    layer = layer_class(cache, 0)
    layer.lazy_initialization(keys, values)
    layer.append(keys, values, None)
    layer.seen = keys.shape[2]
    layer.pad_count = torch.zeros(keys.shape[0], dtype=torch.int64) if pad_count is None else pad_count
    layer.scaling = scaling
    return layer


def add_token(layer, key: torch.Tensor, value: torch.Tensor | None = None) -> int:
    """Append one decoded token ``key: [B, H, 1, D]``; returns its index (``first`` for ``after_attention``)."""
    first = layer.seen
    layer.append(key, torch.randn_like(key) if value is None else value, None)
    layer.seen += key.shape[2]
    return first
