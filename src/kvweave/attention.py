"""kvweave's attention path, registered with transformers' ``AttentionInterface``.

A decoder layer calls ``cache.update(k, v, layer_idx)`` and then the attention function with the tensors
``update`` returned. Compressed cache layers return only the *new* tokens from ``update`` and mark themselves
pending; :func:`kvweave_attention` recognises those tensors by identity and hands the whole attention step
(query, new K/V, mask, positions) to the layer, which attends over its own store (exact buffer + compressed
parts) without the rest of the model knowing. Any other call (no cache, a ``DynamicCache``, the exact
``full`` method, sliding-window layers kept by transformers) goes to transformers' own SDPA path unchanged.

Nothing is patched at import time: :func:`prepare` switches one model to this path, :func:`restore` undoes it.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch

from kvweave._compat import register_attention_function, sdpa_attention
from kvweave.prompt import install_hook, remove_hook

ATTENTION_NAME = "kvweave"
_PREVIOUS_ATTR = "_kvweave_previous_attn_implementation"


class AttendingLayer(Protocol):
    """A cache layer that computes attention over its own store."""

    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> torch.Tensor: ...


class _Pending(threading.local):
    layer: AttendingLayer | None = None
    key: torch.Tensor | None = None


_pending = _Pending()


def mark_pending(layer: AttendingLayer, key: torch.Tensor) -> None:
    """Called by a compressed layer's ``update``: the next attention call over ``key`` belongs to ``layer``."""
    if _pending.layer is not None:
        stale, _pending.layer, _pending.key = _pending.layer, None, None
        raise RuntimeError(
            f"kvweave: the cache layer {getattr(stale, 'layer_idx', '?')} stored new keys but kvweave's attention "
            "never ran for them, so attention would only see the newest tokens. The model is not using "
            "kvweave's attention path: call kvweave.prepare(model) (kvweave.make_cache(..., model) does it)."
        )
    _pending.layer, _pending.key = layer, key


def _take_pending(key: torch.Tensor) -> AttendingLayer | None:
    layer = _pending.layer
    if layer is None or _pending.key is not key:
        return None
    _pending.layer, _pending.key = None, None
    return layer


def kvweave_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention function: ``query: [B, Hq, q, D]``, ``key, value: [B, H, k, D]`` -> ``[B, q, Hq, D]``."""
    layer = _take_pending(key)
    if layer is None:
        return sdpa_attention(module, query, key, value, attention_mask, **kwargs)
    return layer.attend(module, query, key, value, attention_mask, **kwargs), None


_registered = False


def _ensure_registered() -> None:
    global _registered
    if not _registered:
        register_attention_function(ATTENTION_NAME, kvweave_attention)
        _registered = True


def is_prepared(model: Any) -> bool:
    """Whether ``model`` runs kvweave's attention path."""
    return getattr(model.config, "_attn_implementation", None) == ATTENTION_NAME


def prepare(model: Any) -> Any:
    """Switch ``model`` to kvweave's attention path (idempotent; :func:`restore` undoes it).

    Without a kvweave cache the path is transformers' SDPA attention, so a prepared model gives the same
    outputs as before for any other cache.
    """
    _ensure_registered()
    if is_prepared(model):
        return model
    previous = getattr(model.config, "_attn_implementation", None) or "sdpa"
    if previous not in ("sdpa", "eager"):
        raise ValueError(
            f"kvweave: the model uses attn_implementation={previous!r}; kvweave's attention path replaces "
            "'sdpa' or 'eager'. Load the model with attn_implementation='sdpa'."
        )
    setattr(model, _PREVIOUS_ATTR, previous)
    model.set_attn_implementation(ATTENTION_NAME)
    install_hook(model)  # every forward pass hands its input_ids to the kvweave cache it runs with
    return model


def restore(model: Any) -> Any:
    """Undo :func:`prepare`: the model's previous attention implementation comes back."""
    previous = getattr(model, _PREVIOUS_ATTR, None)
    if previous is not None and is_prepared(model):
        model.set_attn_implementation(previous)
        delattr(model, _PREVIOUS_ATTR)
    remove_hook(model)
    return model
