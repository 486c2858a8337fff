"""Every transformers-version shim kvweave needs, in one place.

kvweave is tested against transformers 5.17 (the GPU image) and the newest 5.x release. Between those the
attention modules renamed ``past_key_values`` to ``cache`` and stopped passing ``cache_kwargs`` to
``Cache.update``; the layered ``Cache`` API (``DynamicLayer``, ``DynamicSlidingWindowLayer``,
``get_mask_sizes(query_length, layer_idx)``) stayed the same. The rest of the package never checks versions.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
)

__all__ = [
    "Cache",
    "CacheLayerMixin",
    "DynamicCache",
    "DynamicLayer",
    "DynamicSlidingWindowLayer",
    "TRANSFORMERS_VERSION",
    "default_layers",
    "mask_to_bool",
    "register_attention_function",
    "rotary_cos_sin",
    "sdpa_attention",
    "text_config",
]

TRANSFORMERS_VERSION = transformers.__version__


def text_config(config: Any) -> Any:
    """The decoder's config (multimodal configs nest it under ``text_config``)."""
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def default_layers(config: Any) -> list[CacheLayerMixin]:
    """The per-layer objects transformers' own ``DynamicCache`` would use for this model config."""
    return list(DynamicCache(config=config).layers)


def sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' own SDPA attention forward (the reference path)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register_attention_function(name: str, function: Any) -> None:
    """Register an attention function and its (SDPA-style, boolean) mask builder under ``name``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, sdpa_mask)


def mask_to_bool(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A boolean "may attend" mask from either a boolean or an additive float mask."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def rotary_cos_sin(
    rotary_emb: torch.nn.Module, like: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin: [B, T, D]`` of the model's rotary embedding at (possibly fractional) ``position_ids``.

    Gemma3's rotary module takes the layer type (local / global RoPE bases); Llama-style ones do not.
    """
    import inspect

    params = inspect.signature(rotary_emb.forward).parameters
    if "layer_type" in params and layer_type is not None:
        return rotary_emb(like, position_ids, layer_type)  # type: ignore[no-any-return]
    return rotary_emb(like, position_ids)  # type: ignore[no-any-return]


def cache_kwarg(model: Any) -> str:
    """The keyword that passes a cache to ``model(...)`` / ``model.generate(...)``.

    transformers renamed ``past_key_values`` to ``cache`` (the old name still works with a warning).
    """
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
