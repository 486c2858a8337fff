"""Fused CPU decode attention for kvweave's vLLM ``depthweave`` blocks: every decode row of a layer in one call,
keys rebuilt and rotated inside the kernel from the packed coordinates, values never rebuilt (the attention
weights weight the value coordinates, then one projection per query head).

The vLLM backend (:mod:`kvweave.vllm.backend`) stores each token as coordinates on its request's per-layer bases
(``kvweave.vllm.config.WeaveSlot``), a block's worst-represented tokens exact in its slots' tails, the first
``sinks`` tokens and the newest partial block exact beside the pages. :func:`decode_rows` reads all of it where
it lies: one work item per (row, KV head), an online softmax in float32 over the row's blocks, then its new token
merged. :func:`decode_rows_reference` is the same in torch (the tests' reference): unpack with the layout, rebuild
every key and value, lay the exact rows over them, attend.

Built on first use like :mod:`kvweave.kernels.cpu_vllm_quant`; :func:`load` returns ``None`` where it cannot be
built, and the backend then keeps its torch path.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from kvweave.kernels._build import build, source
from kvweave.ops.rope import apply_rotary

_NAME = "kvweave_cpu_vllm_weave_v6"
_SOURCE = source("cpu_vllm_weave.cpp")
_CPP_DECL = (
    "torch::Tensor vllm_weave_decode_rows(torch::Tensor q, torch::Tensor k_new, torch::Tensor v_new, "
    "torch::Tensor pages, torch::Tensor table, torch::Tensor chosen, const std::vector<int64_t>& cached, "
    "const std::vector<int64_t>& recent_first, const std::vector<torch::Tensor>& kb, "
    "const std::vector<torch::Tensor>& kmean, const std::vector<torch::Tensor>& vb, "
    "const std::vector<torch::Tensor>& vmean, const std::vector<torch::Tensor>& sink_k, "
    "const std::vector<torch::Tensor>& sink_v, const std::vector<torch::Tensor>& recent_k, "
    "const std::vector<torch::Tensor>& recent_v, torch::Tensor cos, torch::Tensor sin, int64_t bits, "
    "int64_t rank_k, int64_t rank_v, int64_t exact, int64_t scale_end, int64_t k_bytes, int64_t code_end, "
    "double scaling);\n"
    "void vllm_weave_store_rows(torch::Tensor k_pre, torch::Tensor v_flat, torch::Tensor k_exact, "
    "torch::Tensor v_exact, torch::Tensor pages, const std::vector<int64_t>& blocks, "
    "const std::vector<int64_t>& offsets, const std::vector<torch::Tensor>& k_rows, "
    "const std::vector<torch::Tensor>& k_mean, const std::vector<torch::Tensor>& k_scale, "
    "const std::vector<torch::Tensor>& v_rows, const std::vector<torch::Tensor>& v_mean, "
    "const std::vector<torch::Tensor>& v_scale, torch::Tensor k_res, torch::Tensor v_res, "
    "const std::vector<int64_t>& k_res_rows, const std::vector<int64_t>& v_res_rows, int64_t bits, "
    "int64_t rank_k, int64_t rank_v, int64_t exact, int64_t k_bytes, int64_t code_end, int64_t scale_end, "
    "int64_t exact_bytes);\n"
    "torch::Tensor vllm_weave_choose_rows(torch::Tensor q, torch::Tensor pages, torch::Tensor table, "
    "const std::vector<int64_t>& cached, int64_t budget, int64_t sink_blocks, int64_t scale_end, "
    "int64_t exact_bytes);"
)
_FUNCTIONS = ["vllm_weave_decode_rows", "vllm_weave_store_rows", "vllm_weave_choose_rows"]

_reason: str | None = None


@functools.lru_cache(maxsize=1)
def load() -> Any | None:
    """The compiled extension, or ``None`` when it cannot be built here (``KVWEAVE_NO_CPP=1`` disables it)."""
    global _reason
    module, _reason = build(_NAME, _CPP_DECL, _SOURCE, _FUNCTIONS)
    return module


def unavailable_reason() -> str | None:
    """Why :func:`load` returned ``None`` (``None`` if it has not failed)."""
    return _reason


@dataclasses.dataclass
class WeaveRow:
    """One decode row's stored state beside the pages, float32: ``kb, vb: [r, H·D]`` the bases' rows times their
    scales and ``kmean, vmean: [H·D]`` their means; ``sink_k, sink_v: [S, H, D]`` the exact first tokens (post-RoPE
    keys); ``recent_first`` the first token of the newest partial block (``cached``: none) and ``recent_k,
    recent_v: [H, block_size, D]`` its exact rows (empty when none)."""

    cached: int
    kb: torch.Tensor
    kmean: torch.Tensor
    vb: torch.Tensor
    vmean: torch.Tensor
    sink_k: torch.Tensor
    sink_v: torch.Tensor
    recent_first: int
    recent_k: torch.Tensor
    recent_v: torch.Tensor


def decode_rows(
    queries: torch.Tensor,
    new: tuple[torch.Tensor, torch.Tensor],
    pages: torch.Tensor,
    table: torch.Tensor,
    rows: list[WeaveRow],
    cos: torch.Tensor,
    sin: torch.Tensor,
    layout: Any,
    scaling: float,
    chosen: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row ``r``'s ``queries[r]: [H, G, D]`` (its query heads, packed per KV head) over its ``rows[r].cached``
    stored tokens in blocks ``table[r]`` of ``pages: [NB, H, block_size, slot]`` uint8 (``layout``: the
    ``WeaveSlot``) and its new token ``new = (keys, values)`` (``[R, H, D]``, exact). ``cos, sin: [T, D]``
    cover every stored position. ``chosen: [R, H, K]`` (indices into each row's table, -1 padding): read only
    those blocks per row and KV head (selective decode); ``None``: every block. Returns ``[R, H, G, D]`` float32."""
    module = load()
    assert module is not None, unavailable_reason()
    return module.vllm_weave_decode_rows(
        queries.float().contiguous(),
        new[0].float().contiguous(),
        new[1].float().contiguous(),
        pages.contiguous(),
        table,
        torch.empty(0, dtype=torch.long) if chosen is None else chosen.long().contiguous(),
        [row.cached for row in rows],
        [row.recent_first for row in rows],
        [row.kb for row in rows],
        [row.kmean for row in rows],
        [row.vb for row in rows],
        [row.vmean for row in rows],
        [row.sink_k for row in rows],
        [row.sink_v for row in rows],
        [row.recent_k for row in rows],
        [row.recent_v for row in rows],
        cos.float().contiguous(),
        sin.float().contiguous(),
        layout.bits,
        layout.rank_k,
        layout.rank_v,
        layout.exact,
        layout.scale_end,
        layout.k_bytes,
        layout.code_end,
        float(scaling),
    )


def decode_rows_reference(
    queries: torch.Tensor,
    new: tuple[torch.Tensor, torch.Tensor],
    pages: torch.Tensor,
    table: torch.Tensor,
    rows: list[WeaveRow],
    cos: torch.Tensor,
    sin: torch.Tensor,
    layout: Any,
    scaling: float,
    chosen: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`decode_rows` in torch, one row at a time: every stored key and value rebuilt, the exact rows, the
    sinks and the newest partial block laid over them (in that order), then attention with the new token (with
    ``chosen``, over the chosen blocks' tokens of each KV head only)."""
    outs = []
    heads, dim = queries.shape[1], queries.shape[-1]
    block_size = pages.shape[2]
    for r, row in enumerate(rows):
        n = row.cached
        held = -(-n // block_size)
        blocks = pages[table[r, :held].long()]  # [held, H, block_size, slot]
        ck, cv = layout.unpack(blocks)  # [held, block_size, r]
        keys = (ck.flatten(0, 1)[:n] @ row.kb[: layout.rank_k] + row.kmean).view(n, heads, dim)
        values = (cv.flatten(0, 1)[:n] @ row.vb[: layout.rank_v] + row.vmean).view(n, heads, dim)
        keys = apply_rotary(keys.transpose(0, 1), cos[:n], sin[:n]).transpose(0, 1)
        if layout.exact:
            offsets, _, exact_k, exact_v = layout.read_exact(layout.tails(blocks))  # [held, H, E(, D)]
            position = torch.arange(held).view(-1, 1, 1) * block_size + offsets
            valid = (offsets >= 0) & (position < n)
            head = torch.arange(heads).view(1, -1, 1).expand_as(position)
            keys[position[valid], head[valid]] = exact_k[valid].float()
            values[position[valid], head[valid]] = exact_v[valid].float()
        sinks = min(row.sink_k.shape[0], n)
        keys[:sinks], values[:sinks] = row.sink_k[:sinks], row.sink_v[:sinks]
        if row.recent_first < n:
            span = n - row.recent_first
            keys[row.recent_first :] = row.recent_k[:, :span].transpose(0, 1)
            values[row.recent_first :] = row.recent_v[:, :span].transpose(0, 1)
        keys = torch.cat([keys, new[0][r].float().unsqueeze(0)])  # [n + 1, H, D]
        values = torch.cat([values, new[1][r].float().unsqueeze(0)])
        logits = torch.einsum("hgd,thd->hgt", queries[r].float(), keys) * scaling
        if chosen is not None and held:
            picked = chosen[r].long()  # [H, K]
            seen = torch.zeros(heads, held + 1, dtype=torch.bool)  # the last column: padding
            seen.scatter_(1, torch.where(picked < 0, held, picked.clamp(max=held)), True)
            visible = seen[:, (torch.arange(n + 1) // block_size).clamp(max=held - 1)]  # [H, n + 1]
            visible[:, n] = True  # the new token
            logits = logits.masked_fill(~visible.unsqueeze(1), float("-inf"))
        outs.append(torch.einsum("hgt,thd->hgd", logits.softmax(-1), values))
    return torch.stack(outs)


def store_rows(
    flat: tuple[torch.Tensor, torch.Tensor],
    exact: tuple[torch.Tensor, torch.Tensor],
    pages: torch.Tensor,
    blocks: list[int],
    offsets: list[int],
    bases: tuple[list[Any], list[Any]],
    layout: Any,
    residual: tuple[torch.Tensor, torch.Tensor],
    residual_rows: tuple[list[int], list[int]],
) -> None:
    """The write hook for a step's decode rows in one call: token ``n`` (``flat``: its pre-RoPE key and its value
    ``[R, H·D]``; ``exact``: its exact key and value ``[R, H, D]``, the residuals' dtype) stored in slot
    ``offsets[n]`` of block ``blocks[n]`` of ``pages: [NB, H, block_size, slot]`` uint8 (distinct blocks) on the
    bases ``bases[0][n], bases[1][n]`` (``kvweave.vllm.config.Basis``) as :func:`store_rows_reference` stores it,
    and its exact rows copied into slot ``offsets[n]`` of rows ``residual_rows[0][n]``,
    ``residual_rows[1][n]`` of ``residual: [X, H, block_size, D]`` (-1: not kept)."""
    module = load()
    assert module is not None, unavailable_reason()
    k_bases, v_bases = bases
    module.vllm_weave_store_rows(
        flat[0].float().contiguous(),
        flat[1].float().contiguous(),
        exact[0].contiguous(),
        exact[1].contiguous(),
        pages,
        blocks,
        offsets,
        [b.rows.contiguous() for b in k_bases],
        [b.mean.float().contiguous() for b in k_bases],
        [b.scale.float().contiguous() for b in k_bases],
        [b.rows.contiguous() for b in v_bases],
        [b.mean.float().contiguous() for b in v_bases],
        [b.scale.float().contiguous() for b in v_bases],
        residual[0],
        residual[1],
        residual_rows[0],
        residual_rows[1],
        layout.bits,
        layout.rank_k,
        layout.rank_v,
        layout.exact,
        layout.k_bytes,
        layout.code_end,
        layout.scale_end,
        layout.exact_bytes,
    )


def store_rows_reference(
    flat: tuple[torch.Tensor, torch.Tensor],
    exact: tuple[torch.Tensor, torch.Tensor],
    pages: torch.Tensor,
    blocks: list[int],
    offsets: list[int],
    bases: tuple[list[Any], list[Any]],
    layout: Any,
) -> None:
    """:func:`store_rows`' pages in torch (the backend's own path): ``WeaveSlot.store`` of the coordinates on the
    rows' bases."""
    from kvweave.vllm.config import decode_rows, encode_rows

    k_bases, v_bases = bases
    coords = (encode_rows(k_bases, flat[0]), encode_rows(v_bases, flat[1]))
    decoders = (lambda c: decode_rows(k_bases, c), lambda c: decode_rows(v_bases, c))
    layout.store(pages, torch.tensor(blocks), torch.tensor(offsets), flat, exact, coords, decoders)


def choose_rows(
    queries: torch.Tensor,
    pages: torch.Tensor,
    table: torch.Tensor,
    cached: list[int],
    layout: Any,
    decode_tokens: int,
    sinks: int,
) -> torch.Tensor:
    """Selective decode's block choice for decode rows ``queries: [R, H, G, D]`` (blocks ``table: [R, W]``,
    ``cached[r]`` stored tokens) in one call: ``[R, H, K]`` indices into each row's table, sorted, -1 padding —
    the blocks :func:`choose_rows_reference` chooses, every block of a row that has no more than the budget."""
    module = load()
    assert module is not None, unavailable_reason()
    block_size = pages.shape[2]
    return module.vllm_weave_choose_rows(
        queries.float().contiguous(),
        pages.contiguous(),
        table.contiguous(),
        cached,
        max(1, decode_tokens // block_size),
        max(1, -(-sinks // block_size)),
        layout.scale_end,
        layout.exact_bytes,
    )


def choose_rows_reference(
    queries: torch.Tensor,
    pages: torch.Tensor,
    table: torch.Tensor,
    cached: list[int],
    layout: Any,
    decode_tokens: int,
    sinks: int,
) -> torch.Tensor:
    """:func:`choose_rows` in torch (the backend's own path, ``WeaveSlot.choose_blocks``), padded the same way."""
    block_size, heads = pages.shape[2], queries.shape[1]
    helds = [-(-n // block_size) for n in cached]
    ids = [table[r, :held].long() for r, held in enumerate(helds)]
    picks, _ = layout.choose_blocks(queries, pages, ids, cached, decode_tokens, sinks)
    choices = [
        torch.arange(held).expand(heads, held) if pick is None else pick
        for held, pick in zip(helds, picks, strict=True)
    ]
    width = max(choice.shape[1] for choice in choices)
    return torch.stack([torch.nn.functional.pad(c, (0, width - c.shape[1]), value=-1) for c in choices])
