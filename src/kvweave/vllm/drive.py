"""One request through one kvweave backend layer without an engine, called as vLLM's model runner calls it:
per chunk of new tokens, :meth:`do_kv_cache_update` and then :meth:`forward` with that chunk's metadata.

The vLLM tests and ``benchmarks/vllm_decode_op.py`` write their requests through :func:`feed`, so the metadata
they build is the one the engine would (query start, sequence length, block table, slot of every token)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from kvweave.vllm.backend import KvweaveMetadata


def slots_of(table: torch.Tensor, block_size: int, tokens: int) -> torch.Tensor:
    """``[tokens]`` int64 slots of the first ``tokens`` tokens of a request whose blocks are ``table: [blocks]``."""
    blocks = table.long().repeat_interleave(block_size) * block_size
    return (blocks + torch.arange(block_size).repeat(len(table)))[:tokens]


def feed(
    impl: Any,
    kv_cache: torch.Tensor,
    table: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    chunks: Iterable[int],
    query: Callable[[int], torch.Tensor],
) -> list[torch.Tensor]:
    """Write ``keys, values: [T, H, D]`` (keys rotated, as the model hands them over) of one request through
    ``impl`` in ``chunks`` of new tokens (prefill chunks, then 1-token decode steps); ``query(count)`` gives each
    chunk's ``[count, Hq, D]`` queries. Returns each chunk's attention output."""
    block_size = kv_cache.shape[2]
    slots = slots_of(table, block_size, keys.shape[0])
    outputs, written = [], 0
    for count in chunks:
        if written + count > keys.shape[0]:
            raise ValueError(f"chunks add up to more than the {keys.shape[0]} tokens given")
        meta = KvweaveMetadata(
            num_actual_tokens=count,
            query_start=[0, count],
            seq_lens=[written + count],
            block_table=table.unsqueeze(0),
            slot_mapping=slots[written : written + count],
        )
        k, v = keys[written : written + count], values[written : written + count]
        impl.do_kv_cache_update(None, k, v, kv_cache, meta.slot_mapping)
        q = query(count)
        out = torch.empty(count, q.shape[1], values.shape[-1], dtype=q.dtype)
        outputs.append(impl.forward(None, q, k, v, kv_cache, meta, out))
        written += count
    return outputs
