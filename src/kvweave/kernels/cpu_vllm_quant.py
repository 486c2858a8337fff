"""Fused CPU decode attention for kvweave's vLLM ``quant`` blocks: codes and scales read once, straight from the
packed blocks (no dequantized copy of a request's KV per step).

The vLLM backend (:mod:`kvweave.vllm.backend`) stores KIVI codes in vLLM's paged cache with the layout of
``kvweave.vllm.config.QuantSlot``: per slot the key codes, the value codes and the value groups' float16
(scale, minimum), and in the tails of a block's slots the key groups' per-channel (scale, minimum). A decode
step attends every decode row of a layer over its stored tokens and its new one (exact) in one call,
:func:`decode_rows`: pieces of about equal work (row, KV head, run of blocks) in parallel, each an online
softmax in float32 over codes that are never dequantized (a key group's scale is folded into the query), then
one merge per row and head. Where the build has AVX2 and FMA (``-march=native``) and the head size is 64 or 128,
a tile's hot loops are intrinsics: key codes gathered 8 tokens at a time, logits and value sums accumulated in
registers, the exponentials 8 lanes at a time; elsewhere the same arithmetic runs as portable loops.
:func:`decode` is the same for one request without the new token.

:func:`decode_reference` and :func:`decode_rows_reference` are the torch paths it is tested against (the
backend's own: unpack the blocks with the layout, then :func:`kvweave.ops.attention.attention_with_lse`). Built on first use like
:mod:`kvweave.kernels.cpu_quant`; :func:`load` returns ``None`` where it cannot be built.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from kvweave.kernels._build import build, source
from kvweave.ops.attention import attention_with_lse, merge_parts

_NAME = "kvweave_cpu_vllm_quant_v8"
_SOURCE = source("cpu_vllm_quant.cpp")
_CPP_DECL = (
    "std::vector<torch::Tensor> vllm_quant_decode_rows(torch::Tensor q, torch::Tensor k_new, torch::Tensor v_new, "
    "torch::Tensor pages, torch::Tensor table, const std::vector<int64_t>& cached, "
    "const std::vector<int64_t>& quantized, torch::Tensor residual, const std::vector<int64_t>& res_row, "
    "int64_t bits, int64_t group, int64_t key_group, int64_t code_bytes, int64_t value_bytes, double scaling, "
    "int64_t item_blocks);"
    "bool vllm_quant_write_values(torch::Tensor value, torch::Tensor pages, torch::Tensor blocks, "
    "torch::Tensor offsets, int64_t bits, int64_t group, int64_t code_bytes);"
    "bool vllm_quant_write_step(torch::Tensor key, torch::Tensor value, torch::Tensor pages, "
    "torch::Tensor residual, const std::vector<int64_t>& blocks, const std::vector<int64_t>& offsets, "
    "const std::vector<int64_t>& rows, int64_t bits, int64_t group, int64_t code_bytes);"
)
_FUNCTIONS = ["vllm_quant_decode_rows", "vllm_quant_write_values", "vllm_quant_write_step"]

_reason: str | None = None
_EMPTY = torch.empty(0)  # the kernel's "no tensor" (never written)


@functools.lru_cache(maxsize=1)
def load() -> Any | None:
    """The compiled extension, or ``None`` when it cannot be built here (``KVWEAVE_NO_CPP=1`` disables it)."""
    global _reason
    module, _reason = build(_NAME, _CPP_DECL, _SOURCE, _FUNCTIONS)
    return module


def unavailable_reason() -> str | None:
    """Why :func:`load` returned ``None`` (``None`` if it has not failed)."""
    return _reason


def _ints(values: Sequence[int] | torch.Tensor) -> list[int]:
    """Python ints for the extension's ``std::vector<int64_t>`` arguments (a list passes as it is)."""
    if isinstance(values, list):
        return values
    return values.tolist() if isinstance(values, torch.Tensor) else [int(v) for v in values]


def decode_rows(
    queries: torch.Tensor,
    new: tuple[torch.Tensor, torch.Tensor] | None,
    pages: torch.Tensor,
    table: torch.Tensor,
    cached: Sequence[int] | torch.Tensor,
    quantized: Sequence[int] | torch.Tensor,
    residual: torch.Tensor | None,
    res_rows: Sequence[int] | torch.Tensor,
    layout: Any,
    scaling: float,
    item_blocks: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One call for every decode row of a layer: row ``r``'s ``queries[r]: [H, G, D]`` (its query heads, packed
    per KV head) attend over its first ``cached[r]`` stored tokens in blocks ``table[r]`` of
    ``pages: [NB, H, block_size, slot]`` uint8 (``layout``: the ``QuantSlot``) and, with ``new = (keys,
    values)`` (``[R, H, D]``), over its new token, exact. Tokens from ``quantized[r]`` on take their keys from
    ``residual[res_rows[r]]: [H, block_size, D]`` (the exact keys of the unfinished key group's block; -1 where
    the row has none). Work is cut into pieces of ``item_blocks`` blocks (default: about 8 per thread).
    Returns ``out: [R, H, G, D]`` and ``lse: [R, H, G]`` float32."""
    module = load()
    assert module is not None, unavailable_reason()
    lengths = _ints(cached)
    if item_blocks is None:
        block_size = pages.shape[2]
        work = sum((n + block_size - 1) // block_size for n in lengths) * queries.shape[1]
        item_blocks = max(1, -(-work // (8 * torch.get_num_threads())))
    none = _EMPTY
    out, lse = module.vllm_quant_decode_rows(
        queries.float().contiguous(),
        none if new is None else new[0].float().contiguous(),
        none if new is None else new[1].float().contiguous(),
        pages.contiguous(),
        table,
        lengths,
        _ints(quantized),
        none if residual is None else residual.float().contiguous(),
        _ints(res_rows),
        layout.bits,
        layout.group,
        layout.key_group,
        layout.code_bytes,
        layout.value_bytes,
        float(scaling),
        int(item_blocks),
    )
    return out, lse


def write_values(
    value: torch.Tensor, pages: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, layout: Any
) -> None:
    """The write hook's values in one call: ``value: [N, H, D]`` quantized per token (``layout.pack_values``,
    bit for bit) and written into slots ``(blocks, offsets)`` of ``pages: [NB, H, block_size, slot]`` uint8.
    Raises ``ValueError`` as :func:`kvweave.ops.quantize.quantize` does on NaN/Inf or float16 overflow."""
    module = load()
    assert module is not None, unavailable_reason()
    if not module.vllm_quant_write_values(
        value.float().contiguous(),
        pages,
        blocks.to(torch.int64).contiguous(),
        offsets.to(torch.int64).contiguous(),
        layout.bits,
        layout.group,
        layout.code_bytes,
    ):
        raise ValueError(
            "quant: keys or values are NaN/Inf or exceed the float16 range; cannot quantize them"
        )


def write_step(
    key: torch.Tensor,
    value: torch.Tensor,
    pages: torch.Tensor,
    residual: torch.Tensor,
    blocks: list[int],
    offsets: list[int],
    rows: list[int],
    layout: Any,
) -> None:
    """A decode step's write hook in one call: :func:`write_values` for ``value: [N, H, D]``, and each key of
    ``key: [N, H, D]`` whose ``rows[n]`` is not -1 copied, exact, into slot ``offsets[n]`` of
    ``residual[rows[n]]: [H, block_size, D]`` (``residual`` contiguous, the keys' dtype). Raises as
    :func:`write_values` does, before writing anything."""
    module = load()
    assert module is not None, unavailable_reason()
    if not module.vllm_quant_write_step(
        key.contiguous(),
        value.float().contiguous(),
        pages,
        residual,
        blocks,
        offsets,
        rows,
        layout.bits,
        layout.group,
        layout.code_bytes,
    ):
        raise ValueError(
            "quant: keys or values are NaN/Inf or exceed the float16 range; cannot quantize them"
        )


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
    """:func:`decode_rows` for one request and no new token: ``query: [H, G, D]`` over its first ``cached``
    stored tokens in blocks ``ids: [held]``, ``residual: [H, block_size, D]`` or ``None``; ``splits`` cuts its
    blocks into that many pieces. Returns ``out: [H, G, D]`` and ``lse: [H, G]`` float32."""
    item_blocks = None if splits is None else max(1, -(-len(ids) // splits))
    out, lse = decode_rows(
        query[None],
        None,
        pages,
        ids.view(1, -1),
        [cached],
        [quantized],
        None if residual is None else residual[None],
        [0 if residual is not None else -1],
        layout,
        scaling,
        item_blocks,
    )
    return out[0], lse[0]


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


def decode_rows_reference(
    queries: torch.Tensor,
    new: tuple[torch.Tensor, torch.Tensor] | None,
    pages: torch.Tensor,
    table: torch.Tensor,
    cached: Sequence[int] | torch.Tensor,
    quantized: Sequence[int] | torch.Tensor,
    residual: torch.Tensor | None,
    res_rows: Sequence[int] | torch.Tensor,
    layout: Any,
    scaling: float,
    item_blocks: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode_rows` in torch, one row at a time: :func:`decode_reference`, then the new token merged."""
    outs, lses = [], []
    block_size = pages.shape[2]
    for r, (n, z, row) in enumerate(zip(_ints(cached), _ints(quantized), _ints(res_rows), strict=True)):
        held = -(-n // block_size)
        res = None if row < 0 or residual is None else residual[row]
        out, lse = decode_reference(queries[r], pages, table[r, :held], res, n, z, layout, scaling)
        if new is not None:
            key, value = new[0][r].float(), new[1][r].float()  # [H, D]
            new_lse = (queries[r].float() * key.unsqueeze(1)).sum(-1) * scaling  # [H, G]
            parts: list[tuple[torch.Tensor, torch.Tensor] | None] = [
                (out, lse),
                (value.unsqueeze(1).expand_as(out), new_lse),
            ]
            total = torch.logaddexp(lse, new_lse)
            out, lse = merge_parts(parts), total
        outs.append(out)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)
