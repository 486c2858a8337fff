"""Fused CPU decode attention for kvweave's vLLM ``quant`` blocks: codes and scales read once, straight from the
packed blocks (no dequantized copy of a request's KV per step).

The vLLM backend (:mod:`kvweave.vllm.backend`) stores KIVI codes in vLLM's paged cache with the layout of
``kvweave.vllm.config.QuantSlot``: per slot the key codes, the value codes and the value groups' float16
(scale, minimum), and in the tails of a block's slots the key groups' per-channel (scale, minimum). A decode
step of one request attends over its stored tokens: :func:`decode` does it in one pass per KV head (and split
of the blocks), an online softmax in float32, and returns the output and log-sum-exp per split, merged by
:func:`kvweave.ops.attention.merge_splits`; the backend merges the new token (exact) with
:func:`kvweave.ops.attention.merge_parts`.

:func:`decode_reference` is the torch path it is tested against (the backend's own: unpack the blocks with the
layout, then :func:`kvweave.ops.attention.attention_with_lse`). Built on first use like
:mod:`kvweave.kernels.cpu_quant`; :func:`load` returns ``None`` where it cannot be built.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kvweave.kernels._build import build, source
from kvweave.ops.attention import attention_with_lse, merge_splits

_NAME = "kvweave_cpu_vllm_quant_v3"
_SOURCE = source("cpu_vllm_quant.cpp")
_CPP_DECL = (
    "std::vector<torch::Tensor> vllm_quant_decode(torch::Tensor q, torch::Tensor pages, torch::Tensor ids, "
    "torch::Tensor residual, int64_t cached, int64_t quantized, int64_t bits, int64_t group, int64_t key_group, "
    "int64_t code_bytes, int64_t value_bytes, double scaling, int64_t splits);"
)

_reason: str | None = None


@functools.lru_cache(maxsize=1)
def load() -> Any | None:
    """The compiled extension, or ``None`` when it cannot be built here (``KVWEAVE_NO_CPP=1`` disables it)."""
    global _reason
    module, _reason = build(_NAME, _CPP_DECL, _SOURCE, ["vllm_quant_decode"])
    return module


def unavailable_reason() -> str | None:
    """Why :func:`load` returned ``None`` (``None`` if it has not failed)."""
    return _reason


def decode(
    query: torch.Tensor,
    pages: torch.Tensor,
    ids: torch.Tensor,
    residual: torch.Tensor | None,
    cached: int,
    quantized: int,
    layout: Any,
    scaling: float,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query: [H, G, D]`` (a request's query heads, packed per KV head) over its first ``cached``
    stored tokens in blocks ``ids: [held]`` of ``pages: [NB, H, block_size, slot]`` uint8 (``layout``: the
    ``QuantSlot``); tokens from ``quantized`` on take their keys from ``residual: [H, block_size, D]`` (the exact
    keys of the unfinished key group's block). Returns ``out: [H, G, D]`` and ``lse: [H, G]`` float32."""
    module = load()
    assert module is not None, unavailable_reason()
    if splits is None:
        splits = max(1, torch.get_num_threads() // max(1, query.shape[0]))
    out, lse = module.vllm_quant_decode(
        query.float().contiguous(),
        pages.contiguous(),
        ids.to(torch.int64).contiguous(),
        torch.empty(0) if residual is None else residual.float().contiguous(),
        int(cached),
        int(quantized),
        layout.bits,
        layout.group,
        layout.key_group,
        layout.code_bytes,
        layout.value_bytes,
        float(scaling),
        int(splits),
    )
    merged, total = merge_splits(out.permute(1, 0, 2, 3), lse.permute(1, 0, 2))  # [H, S, G, D] -> [H, G, D]
    return merged, total


def decode_reference(
    query: torch.Tensor,
    pages: torch.Tensor,
    ids: torch.Tensor,
    residual: torch.Tensor | None,
    cached: int,
    quantized: int,
    layout: Any,
    scaling: float,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode` in torch: unpack the blocks with ``layout``, take the residual's keys, attend."""
    blocks = pages[ids.long()]  # [held, H, block_size, slot]
    keys, values = (x.transpose(0, 1).flatten(1, 2)[:, :cached] for x in layout.unpack(blocks))
    if quantized < cached:
        assert residual is not None
        block_size = pages.shape[2]
        keys = keys.clone()
        keys[:, quantized:cached] = residual[
            :, quantized % block_size : (cached - 1) % block_size + 1
        ].float()
    out, lse = attention_with_lse(query, keys.float(), values.float(), None, scaling)
    return out, lse
