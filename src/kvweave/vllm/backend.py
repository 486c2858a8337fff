"""The kvweave attention backend for vLLM (v1, 0.32): ``quant``, ``pages`` and ``depthweave`` over vLLM's paged
KV cache.

Imported by vLLM only (through :data:`kvweave.vllm.BACKEND_PATH`). The method comes from ``KVWEAVE_VLLM_METHOD``
(:class:`~kvweave.vllm.config.VllmMethod`). Storage is vLLM's: :meth:`KvweaveAttentionBackend.customize_spec`
declares the real bytes of one slot (``state_content_bytes``), so vLLM's allocator sizes the cache — and the
token capacity it reports — from them; each layer's cache is vLLM's ``[blocks, H, block_size, C]`` page view,
read here as bytes.

Storage (:mod:`kvweave.vllm.config`): ``quant`` writes values per token at once and keys through
:class:`KeyResidual` — exact until their ``key_group`` of tokens is complete, then per channel into the page
(KIVI); ``pages`` writes exact K/V and refreshes the written blocks' key summaries; ``depthweave`` (per layer,
fixed basis) fits a basis to a request's first prefill chunk (:class:`WeaveBases`, beside the pages), stores
every token's de-rotated key and its value as coordinates on it, keeps each block's worst-represented tokens
exact in the block's tails and the request's newest partial block exact beside the pages (two
:class:`KeyResidual`), and rebuilds, re-rotates and overlays them at attention time (every stored token read).

Attention:

- a ``quant`` decode step (one new token) reads the request's blocks in a fused C++ kernel
  (:mod:`kvweave.kernels.cpu_vllm_quant`: codes and scales read once, an online softmax, no dequantized copy),
  merged with the new token's exact key and value by log-sum-exp; ``KVWEAVE_VLLM_KERNEL=torch`` (or a machine
  where the kernel does not build) takes the torch path below instead, which the kernel is tested against;
- new tokens (prefill chunks and decode steps) attend to themselves exactly, as given by the model, and to the
  request's earlier tokens as stored (dequantized for ``quant``, the unfinished key group exact) — kvweave's
  transformers path also runs the prompt's attention exact and quantizes as it stores;
- ``pages`` decode steps read only the sink blocks, the newest ``core_blocks`` blocks and, per KV head, the
  ``top_blocks`` far blocks with the largest Quest upper bound ``Σ_d max(q_d·min_d, q_d·max_d)`` (the maximum
  over the head's query group), from the per-block key summaries kept in the page tails. :data:`STATS` counts
  the blocks read against the blocks held.

Prefix caching and chunked prefill work: vLLM caches only full blocks, and a full block's codes, scales and
summary depend on its own tokens only (for ``depthweave``, also on the basis of the request's first block,
which every request reusing that block shares); a chunk reads the request's earlier blocks back from the cache.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from dataclasses import replace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from kvweave.kernels.registry import Kernel, choose
from kvweave.ops.attention import attention_with_lse
from kvweave.ops.rope import apply_rotary, remove_rotary
from kvweave.vllm.config import (
    ENV_METHOD,
    Basis,
    PageSlot,
    QuantSlot,
    VllmMethod,
    WeaveSlot,
    choice_span,
    decode_rows,
    encode_rows,
    rope_cos_sin,
)

ENV_STATS = "KVWEAVE_VLLM_STATS"
ENV_KERNEL = "KVWEAVE_VLLM_KERNEL"
"""``auto`` (default: the fused C++ decode kernels for ``quant`` and ``depthweave`` when they build; without
them ``depthweave`` decode rows weight value coordinates in torch) or ``torch`` (the reference: dequantize, resp.
rebuild, every stored token, then attend)."""
QUANT_DECODE = Kernel("vllm quant decode attention", cpp="kvweave.kernels.cpu_vllm_quant")
WEAVE_DECODE = Kernel("vllm depthweave decode attention", cpp="kvweave.kernels.cpu_vllm_weave")
_FEW = 64  # tokens or rows up to which a step's bookkeeping runs on Python ints instead of small tensor ops
QUERY_CHUNK = 1024  # query rows per SDPA call in prefill chunks that read cached tokens (bounds the mask)

STATS: dict[str, int] = {
    "decode_rows": 0,
    "blocks_read": 0,
    "blocks_held": 0,
    "summary_blocks_read": 0,
    "fused_decode_rows": 0,
    "weave_decode_rows": 0,
    "weave_bases": 0,
    "weave_side_bytes": 0,
}
"""Per process, summed over layers, decode rows and KV heads: blocks of K/V read by decode attention,
blocks the requests held, and blocks whose summary was read (``pages``, and ``depthweave``'s key bounds with
``decode_tokens``); for ``depthweave`` the bases held and
their bytes beside vLLM's pages (``weave_bases``, ``weave_side_bytes``, summed over layers), decode rows that
ran a fused C++ kernel (``fused_decode_rows``: quant's or depthweave's) and depthweave decode rows that weighted
value coordinates (``weave_decode_rows``: fused or in torch). ``KVWEAVE_VLLM_STATS=path``
writes them there as JSON every 256 decode calls and at the end of each call that crosses that count."""
_STATS_LOCK = threading.Lock()
_calls = 0


def current_method() -> VllmMethod:
    """The method ``KVWEAVE_VLLM_METHOD`` names (``quant:bits=4`` when unset, e.g. ``--attention-backend CUSTOM``)."""
    return VllmMethod.parse(os.environ.get(ENV_METHOD, "").strip() or "quant:bits=4")


class KvweaveAttentionBackend(AttentionBackend):
    """vLLM attention backend: kvweave's ``quant`` or ``pages`` over vLLM's paged cache."""

    forward_includes_kv_cache_update: bool = False  # vLLM calls do_kv_cache_update first
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)  # [blocks, H, block_size, C]: a block's slots of a head are contiguous

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """Declare the bytes of one slot, so vLLM's allocator fits ``16 / bits`` times the tokens (``quant``)."""
        if spec.state_content_bytes is not None:
            return spec
        method = current_method()
        return replace(
            spec,
            state_content_bytes=method.slot_bytes(
                spec.head_size, spec.dtype, spec.block_size, getattr(spec, "num_kv_heads", 1)
            ),
        )

    @staticmethod
    def get_impl_cls() -> type[KvweaveAttentionImpl]:
        return KvweaveAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KvweaveMetadataBuilder]:
        return KvweaveMetadataBuilder


@dataclasses.dataclass
class KvweaveMetadata(AttentionMetadata):
    """What one forward needs: per request, where its new tokens are and how long it is; its block table."""

    num_actual_tokens: int
    query_start: list[int]  # [R + 1], host
    seq_lens: list[int]  # [R], host: tokens of each request including the new ones
    block_table: torch.Tensor  # [R, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64


class KvweaveMetadataBuilder(AttentionMetadataBuilder[KvweaveMetadata]):
    """Builds :class:`KvweaveMetadata` from vLLM's common metadata (host copies taken once per step)."""

    def __init__(
        self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> KvweaveMetadata:
        common = common_attn_metadata
        return KvweaveMetadata(
            num_actual_tokens=common.num_actual_tokens,
            query_start=common.query_start_loc_cpu[: common.num_reqs + 1].tolist(),
            seq_lens=common.seq_lens[: common.num_reqs].cpu().tolist(),
            block_table=common.block_table_tensor,
            slot_mapping=common.slot_mapping,
        )


class KvweaveAttentionImpl(AttentionImpl[KvweaveMetadata]):
    """Stores K/V in the method's slot layout and attends over the request's blocks (module docstring)."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> None:
        refused = {
            "ALiBi": alibi_slopes is not None,
            "sliding-window attention": sliding_window is not None,
            "logit soft-capping": bool(logits_soft_cap),
            "attention sinks (learned)": sinks is not None,
            f"attention type {attn_type!r}": attn_type != AttentionType.DECODER,
            "a shared KV cache (kv_sharing_target_layer_name)": kv_sharing_target_layer_name is not None,
            f"kv_cache_dtype={kv_cache_dtype!r}": kv_cache_dtype != "auto",
        }
        bad = [what for what, present in refused.items() if present]
        if bad:
            raise ValueError(
                f"kvweave vLLM backend: {', '.join(bad)} not supported; unset {ENV_METHOD} to run vLLM's own "
                "backend for this model (and leave kv_cache_dtype at 'auto')"
            )
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.group_size = num_heads // self.num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.method = current_method()
        self.layout: QuantSlot | PageSlot | WeaveSlot | None = (
            None  # built on first use (needs the dtype and block size)
        )
        self.residual: KeyResidual | None = None  # quant: exact keys of the key groups not yet quantized
        self.max_requests = _max_requests()
        self.fused_choice: dict[tuple[str, str], bool] = {}  # (kernel, device type) -> decode runs it fused
        self.weave_factored: bool | None = None  # depthweave decode weights value coordinates (read once)
        # depthweave: the requests' bases and sinks, the newest (partial) block of each request exact, and the
        # model's rotary frequencies (read from vLLM's model config on first use; tests may set them)
        self.bases: WeaveBases | None = None
        self.recent: tuple[KeyResidual, KeyResidual] | None = None
        self.inv_freq: torch.Tensor | None = None
        self.rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [positions, D]
        if self.method.name == "depthweave":
            self.inv_freq = _rope_inv_freq(head_size)

    # ----------------------------------------------------------------------------------------- layout
    def _layout(self, kv_cache: torch.Tensor, dtype: torch.dtype) -> QuantSlot | PageSlot | WeaveSlot:
        if self.layout is None:
            block_size, nbytes = kv_cache.shape[2], kv_cache.shape[3] * kv_cache.element_size()
            if self.method.name == "quant":
                self.layout = QuantSlot.of(self.method, self.head_size, block_size)
            elif self.method.name == "depthweave":
                self.layout = WeaveSlot.of(self.method, self.head_size, self.num_kv_heads, block_size)
            else:
                self.layout = PageSlot.of(self.head_size, dtype, block_size)
            if self.layout.nbytes != nbytes:
                raise ValueError(
                    f"kvweave vLLM backend: the cache has {nbytes} bytes per slot but {self.method.spec()} needs "
                    f"{self.layout.nbytes} at block_size={block_size}; keep one {ENV_METHOD} for the whole run "
                    "and a block size that vLLM does not split into kernel blocks"
                )
        return self.layout

    # ----------------------------------------------------------------------------------------- store
    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write ``key, value: [N, H, D]`` into their slots (``slot_mapping: [N]``, -1 = padding).

        ``depthweave`` stores in :meth:`forward` instead: de-rotating keys needs the tokens' positions, which
        the attention metadata gives and this hook does not."""
        layout = self._layout(kv_cache, key.dtype)
        if isinstance(layout, WeaveSlot):
            return
        pages = kv_cache.view(torch.uint8)  # [blocks, H, block_size, C]
        count = min(slot_mapping.shape[0], key.shape[0])
        if count == 0:
            return
        key, value = key[:count], value[:count]
        if (
            isinstance(layout, QuantSlot)
            and count <= _FEW
            and self._fused_decode(value.device)
            and pages.is_contiguous()
        ):
            self._write_few(key, value, slot_mapping[:count].tolist(), pages, layout)
            return
        slots = slot_mapping[:count].long()
        if int(slots.min()) < 0:  # padding slots (-1): dropped; a step without any skips the masking
            keep = slots >= 0
            slots, key, value = slots[keep], key[keep], value[keep]
            if slots.numel() == 0:
                return
        block_size = pages.shape[2]
        blocks, offsets = slots // block_size, slots % block_size
        if isinstance(layout, PageSlot):
            pages[blocks, :, offsets, : layout.kv_bytes] = layout.pack(key, value)
            self._update_summaries(pages, layout, blocks, offsets)
            return
        code = layout.code_bytes
        if self._fused_decode(value.device) and pages.is_contiguous():  # the C++ kernels run: one call
            from kvweave.kernels import cpu_vllm_quant

            cpu_vllm_quant.write_values(value, pages, blocks, offsets, layout)
        else:
            pages[blocks, :, offsets, code : code + layout.value_bytes] = layout.pack_values(value)
        residual = self._key_residual(key, block_size)
        kept = residual.store(blocks, offsets, key)
        if kept is not None:
            blocks, offsets = blocks[kept], offsets[kept]
        self._quantize_finished_groups(pages, layout, residual, blocks, offsets)

    def _write_few(
        self, key: torch.Tensor, value: torch.Tensor, slots: list[int], pages: torch.Tensor, layout: QuantSlot
    ) -> None:
        """:meth:`do_kv_cache_update` for a handful of tokens (a decode step) with the C++ kernels: the slots
        as Python ints, values and residual keys written in one call."""
        from kvweave.kernels import cpu_vllm_quant

        if min(slots) < 0:  # padding slots (-1): dropped
            keep = [i for i, slot in enumerate(slots) if slot >= 0]
            if not keep:
                return
            at = torch.tensor(keep)
            key, value, slots = key[at], value[at], [slots[i] for i in keep]
        block_size = pages.shape[2]
        blocks, offsets = [s // block_size for s in slots], [s % block_size for s in slots]
        residual = self._key_residual(key, block_size)
        rows = residual.take_rows(blocks, offsets)
        cpu_vllm_quant.write_step(key, value, pages, residual.keys, blocks, offsets, rows, layout)
        size = layout.key_group
        done = [
            i for i, (o, r) in enumerate(zip(offsets, rows, strict=True)) if r >= 0 and o % size == size - 1
        ]
        if done:  # a key group finished: quantize it (the tensor path, once per key_group steps)
            self._quantize_finished_groups(
                pages,
                layout,
                residual,
                torch.tensor([blocks[i] for i in done]),
                torch.tensor([offsets[i] for i in done]),
            )

    def _key_residual(self, key: torch.Tensor, block_size: int) -> KeyResidual:
        if self.residual is None:
            self.residual = KeyResidual(
                self.num_kv_heads, block_size, self.head_size, key.dtype, self.max_requests
            )
        return self.residual

    @staticmethod
    def _quantize_finished_groups(
        pages: torch.Tensor,
        layout: QuantSlot,
        residual: KeyResidual,
        blocks: torch.Tensor,
        offsets: torch.Tensor,
    ) -> None:
        """Quantize (per channel) every key group whose last token was just written, from the residual's exact
        keys; free the residual row of every block that is now full."""
        size = layout.key_group
        if offsets.numel() <= _FEW and all(o % size != size - 1 for o in offsets.tolist()):
            return  # the common decode step: no group finished (Python on a few ints beats tensor ops)
        last = offsets % size == size - 1
        if not bool(last.any()):
            return
        done_blocks, done_groups = blocks[last], offsets[last] // size  # [U]
        rows = residual.rows_of(done_blocks)
        span = done_groups.unsqueeze(1) * size + torch.arange(size, device=blocks.device)  # [U, key_group]
        exact = residual.keys[rows.unsqueeze(1), :, span].transpose(1, 2)  # [U, H, key_group, D]
        codes, header = layout.quantize_keys(exact.float())
        pages[done_blocks.unsqueeze(1), :, span, : layout.code_bytes] = codes.transpose(1, 2)
        start, group_bytes = layout.code_bytes + layout.value_bytes, header.shape[-1]
        for group in done_groups.unique().tolist():  # one block at most once per pass: no lost header writes
            pick = done_groups == group
            tails = pages[done_blocks[pick], :, :, start:].flatten(-2)  # [u, H, block_size * tail] (a copy)
            tails[..., group * group_bytes : (group + 1) * group_bytes] = header[pick]
            pages[done_blocks[pick], :, :, start:] = tails.unflatten(-1, (pages.shape[2], -1))
        full = offsets[last] == pages.shape[2] - 1
        residual.release(done_blocks[full])

    @staticmethod
    def _update_summaries(
        pages: torch.Tensor, layout: PageSlot, blocks: torch.Tensor, offsets: torch.Tensor
    ) -> None:
        """Recompute the key (min, max) of every block just written from its stored keys up to the last slot
        written (a block's slots are written in order)."""
        touched, inverse = torch.unique(blocks, return_inverse=True)
        last = torch.full_like(touched, -1).scatter_reduce(0, inverse, offsets, reduce="amax")  # [U]
        keys, _ = layout.unpack(pages[touched])  # [U, H, block_size, D]
        filled = (torch.arange(pages.shape[2], device=pages.device) <= last.unsqueeze(1))[:, None, :, None]
        low = keys.masked_fill(~filled, float("inf")).amin(2)
        high = keys.masked_fill(~filled, float("-inf")).amax(2)
        pages[touched, :, :, layout.kv_bytes :] = layout.summary_tails(low, high)

    # ----------------------------------------------------------------------------------------- attend
    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: KvweaveMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``query: [N, Hq, D]``, ``key, value: [N, H, D]`` (already stored) -> ``output: [N, Hq, D]``."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kvweave vLLM backend: fused output quantization is not supported")
        if attn_metadata is None:  # profiling / warm-up run
            return output
        layout = self._layout(kv_cache, query.dtype)
        pages = kv_cache.view(torch.uint8)
        meta = attn_metadata
        if isinstance(layout, WeaveSlot):
            self._weave_store(key, value, pages, layout, meta)
        decode_calls = 0
        fused: list[int] = []  # decode rows, attended together in one kernel call after the loop
        if isinstance(layout, QuantSlot):
            fuse = self._fused_decode(query.device)
        else:
            fuse = (
                isinstance(layout, WeaveSlot)
                and self._weave_factored()
                and self._fused_decode(query.device, WEAVE_DECODE)
            )
        for row, seq_len in enumerate(meta.seq_lens):
            start, end = meta.query_start[row], meta.query_start[row + 1]
            if end <= start:
                continue
            if fuse and end - start == 1 and seq_len > 1:
                fused.append(row)
                continue
            q, k_new, v_new = query[start:end], key[start:end], value[start:end]
            table = meta.block_table[row]
            if end - start == 1 and isinstance(layout, PageSlot):
                out = self._retrieval_decode(q, pages, layout, table, seq_len)
                decode_calls += 1
            else:
                out = self._attend(q, k_new, v_new, pages, layout, table, seq_len)
                decode_calls += end - start == 1
            output[start:end] = out.to(output.dtype)
        if fused and isinstance(layout, WeaveSlot):
            self._fused_weave_decode(query, key, value, pages, layout, meta, fused, output)
            decode_calls += len(fused)
        elif fused:
            assert isinstance(layout, QuantSlot)
            self._fused_quant_decode(query, key, value, pages, layout, meta, fused, output)
            decode_calls += len(fused)
        if decode_calls:
            _count_calls(decode_calls)
        return output

    def _attend(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        pages: torch.Tensor,
        layout: QuantSlot | PageSlot | WeaveSlot,
        table: torch.Tensor,
        seq_len: int,
    ) -> torch.Tensor:
        """Causal attention of ``q: [n, Hq, D]`` (the last ``n`` tokens) over the request's stored earlier tokens
        and its new tokens (exact)."""
        n = q.shape[0]
        cached = seq_len - n
        selected: torch.Tensor | None = None  # [1, Hq, 1, seq_len]: a decode row's selective-decode mask
        if n == 1 and cached > 0 and isinstance(layout, WeaveSlot) and self._weave_factored():
            return self._weave_decode(q, k_new, v_new, pages, layout, table, cached)
        keys, values = k_new.transpose(0, 1).float(), v_new.transpose(0, 1).float()  # [H, n, D]
        if cached > 0:
            block_size = pages.shape[2]
            held = -(-cached // block_size)
            old_keys, old_values = self._stored(pages, layout, table[:held].long(), cached, seq_len)
            keys = torch.cat([old_keys.float(), keys], dim=1)
            values = torch.cat([old_values.float(), values], dim=1)
            if n == 1:
                read = held * self.num_kv_heads
                if isinstance(layout, WeaveSlot) and layout.bounds:  # selective decode, on the rebuilt tokens
                    heads = self.num_kv_heads
                    queries_h = q[0].float().view(heads, self.group_size, -1)
                    chosen = self._weave_choose(queries_h, pages, layout, table[:held].long(), cached)
                    if chosen is not None:
                        picked = torch.zeros(heads, held, dtype=torch.bool).scatter_(1, chosen, True)
                        visible = torch.ones(heads, seq_len, dtype=torch.bool)
                        visible[:, :cached] = picked[:, torch.arange(cached) // block_size]
                        selected = visible.repeat_interleave(self.group_size, 0).view(1, -1, 1, seq_len)
                        read = chosen.numel()
                _add_stats(blocks_read=read, blocks_held=held * self.num_kv_heads)
        # 4-D operands ([1, heads, tokens, D]): with 3-D ones torch's CPU SDPA takes its math path, which builds
        # the whole [Hq, n, T] weights (the load rows of docs/data/vllm/load-2k-before/ ran that path)
        queries = q.transpose(0, 1).float().unsqueeze(0)  # [1, Hq, n, D]
        keys, values = keys.unsqueeze(0), values.unsqueeze(0)
        if cached == 0:
            out = F.scaled_dot_product_attention(
                queries, keys, values, is_causal=True, scale=self.scale, enable_gqa=True
            )
            return out[0].transpose(0, 1)
        pieces = []
        positions = torch.arange(seq_len, device=q.device)
        for first in range(0, n, QUERY_CHUNK):
            rows = torch.arange(first, min(n, first + QUERY_CHUNK), device=q.device) + cached
            mask = positions[None, :] <= rows[:, None]  # [rows, seq_len]: bottom-right causal
            if selected is not None:
                mask = mask & selected
            pieces.append(
                F.scaled_dot_product_attention(
                    queries[:, :, first : first + QUERY_CHUNK],
                    keys,
                    values,
                    attn_mask=mask,
                    scale=self.scale,
                    enable_gqa=True,
                )
            )
        return torch.cat(pieces, dim=2)[0].transpose(0, 1)

    def _fused_decode(self, device: torch.device, kernel: Kernel = QUANT_DECODE) -> bool:
        """Whether decode steps run ``kernel`` (``quant``'s or ``depthweave``'s fused C++ kernel;
        ``KVWEAVE_VLLM_KERNEL``, the machine): read once per layer, kernel and device, not per decode row."""
        known, at = self.fused_choice, (kernel.name, device.type)
        if at not in known:
            choice = os.environ.get(ENV_KERNEL, "auto").strip() or "auto"
            if choice not in ("auto", "cpp", "torch"):
                raise ValueError(f"{ENV_KERNEL}={choice!r}; allowed: auto, cpp, torch")
            known[at] = choose(kernel, choice, device) == "cpp"
        return bool(known[at])

    def _weave_factored(self) -> bool:
        """Whether depthweave decode rows weight the value coordinates (:meth:`_weave_decode`) instead of
        rebuilding every stored value: ``KVWEAVE_VLLM_KERNEL=torch`` keeps the rebuilding reference path."""
        if self.weave_factored is None:
            self.weave_factored = os.environ.get(ENV_KERNEL, "auto").strip() != "torch"
        return self.weave_factored

    def pin_decode(self, device: torch.device | str, *, fused: bool, factored: bool) -> None:
        """Fix the decode paths ``KVWEAVE_VLLM_KERNEL`` would choose on ``device``: the fused kernels (quant's, and
        depthweave's when ``factored``) or their torch paths, depthweave's factored read or its rebuild (benchmarks
        time each path in one process)."""
        kind = torch.device(device).type
        self.fused_choice = {(QUANT_DECODE.name, kind): fused, (WEAVE_DECODE.name, kind): fused}
        self.weave_factored = factored

    def _fused_quant_decode(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        pages: torch.Tensor,
        layout: QuantSlot,
        meta: KvweaveMetadata,
        rows: list[int],
        output: torch.Tensor,
    ) -> None:
        """The decode ``rows`` of this step (one new token each, stored tokens before it) in one call of the
        fused kernel: each row's stored tokens from its blocks, its new token exact, merged in the kernel."""
        from kvweave.kernels import cpu_vllm_quant

        heads, block_size, size = self.num_kv_heads, pages.shape[2], layout.key_group
        starts = [meta.query_start[r] for r in rows]
        seq_lens = [meta.seq_lens[r] for r in rows]
        cached = [n - 1 for n in seq_lens]
        quantized = [n // size * size for n in seq_lens]  # tokens in finished key groups
        # decode rows come first in vLLM's batch and are usually contiguous: slices, not gathers
        run = rows == list(range(rows[0], rows[0] + len(rows))) and starts == list(
            range(rows[0], rows[0] + len(rows))
        )
        at: slice | torch.Tensor = slice(starts[0], starts[0] + len(rows)) if run else torch.tensor(starts)
        table = (
            meta.block_table[rows[0] : rows[0] + len(rows)] if run else meta.block_table[torch.tensor(rows)]
        )
        res_rows = [-1] * len(rows)
        unfinished = [i for i in range(len(rows)) if quantized[i] < cached[i]]  # newest key group waits exact
        residual = None
        if unfinished:
            assert self.residual is not None
            at_block = [quantized[i] // block_size for i in unfinished]
            if len(unfinished) <= 4:  # a handful of rows: Python ints beat an advanced-indexing gather
                blocks = [int(table[i, b]) for i, b in zip(unfinished, at_block, strict=True)]
            else:
                blocks = table[unfinished, at_block].tolist()
            held_rows = [self.residual.row_of[b] for b in blocks]
            if self.residual.keys.dtype == torch.float32:  # the kernel reads the residual's rows in place
                residual = self.residual.keys
                for i, row in zip(unfinished, held_rows, strict=True):
                    res_rows[i] = row
            else:  # a float32 copy of only these rows
                residual = self.residual.keys[held_rows]  # [U, H, block_size, D]
                for j, i in enumerate(unfinished):
                    res_rows[i] = j
        queries = query[at].view(len(rows), heads, self.group_size, -1)
        out, _ = cpu_vllm_quant.decode_rows(
            queries,
            (key[at], value[at]),
            pages,
            table,
            cached,
            quantized,
            residual,
            res_rows,
            layout,
            self.scale,
        )
        output[at] = out.reshape(len(rows), self.num_heads, -1).to(output.dtype)
        held = sum((n + block_size - 1) // block_size for n in cached)
        _add_stats(blocks_read=held * heads, blocks_held=held * heads, fused_decode_rows=len(rows))

    def _fused_weave_decode(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        pages: torch.Tensor,
        layout: WeaveSlot,
        meta: KvweaveMetadata,
        rows: list[int],
        output: torch.Tensor,
    ) -> None:
        """The depthweave decode ``rows`` of this step in one call of the fused kernel: each row's stored tokens
        from its blocks (keys rebuilt and rotated in the kernel, value coordinates weighted), its exact rows, sinks
        and newest partial block as :meth:`_weave_read` lays them over, its new token exact."""
        from kvweave.kernels import cpu_vllm_weave

        assert self.bases is not None and self.recent is not None
        heads, block_size = self.num_kv_heads, pages.shape[2]
        starts = [meta.query_start[r] for r in rows]
        at = torch.tensor(starts)
        table = meta.block_table[torch.tensor(rows)]
        queries = query[at].view(len(rows), heads, self.group_size, -1)
        lengths = [meta.seq_lens[r] - 1 for r in rows]
        helds = [-(-n // block_size) for n in lengths]
        selected = None
        if layout.bounds:  # every row's blocks per KV head, -1 padding
            method = self.method
            selected = cpu_vllm_weave.choose_rows(
                queries, pages, table, lengths, layout, method.decode_tokens, method.sinks
            )
            budget = max(1, method.decode_tokens // block_size)
            counts = [
                end - first for first, end in (choice_span(n, block_size, method.sinks) for n in lengths)
            ]
            scored = sum(count for count in counts if count > budget)
            if scored:
                _add_stats(summary_blocks_read=scored * heads)
        reads = []
        read_total = int((selected[:, 0] >= 0).sum()) if selected is not None else sum(helds)
        held_total = sum(helds)
        for i, (cached, held) in enumerate(zip(lengths, helds, strict=True)):
            owner, last = table[i, [0, held - 1]].tolist()
            entry = self.bases.get(owner)
            kb, kmean, vb, vmean, sink_k, sink_v = entry.kernel_view()
            first, recent = self._newest_block(last, held, block_size, cached)
            recent_k, recent_v = (
                (torch.empty(0), torch.empty(0))
                if recent is None
                else (recent[0].float().contiguous(), recent[1].float().contiguous())
            )
            reads.append(
                cpu_vllm_weave.WeaveRow(
                    cached, kb, kmean, vb, vmean, sink_k, sink_v, first, recent_k, recent_v
                )
            )
        cos, sin = self._rope(0, max(read.cached for read in reads))
        out = cpu_vllm_weave.decode_rows(
            queries, (key[at], value[at]), pages, table, reads, cos, sin, layout, self.scale, selected
        )
        output[at] = out.reshape(len(rows), self.num_heads, -1).to(output.dtype)
        _add_stats(
            blocks_read=read_total * heads,
            blocks_held=held_total * heads,
            weave_decode_rows=len(rows),
            fused_decode_rows=len(rows),
        )

    def _stored(
        self,
        pages: torch.Tensor,
        layout: QuantSlot | PageSlot | WeaveSlot,
        ids: torch.Tensor,
        cached: int,
        seq_len: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``cached`` tokens of a request as stored: ``keys, values: [H, cached, D]``."""
        blocks = pages[ids]  # [held, H, block_size, C]
        if isinstance(layout, WeaveSlot):
            return self._weave_stored(blocks, layout, ids, cached)
        if isinstance(layout, PageSlot):
            keys, values = layout.unpack(blocks.transpose(0, 1).flatten(1, 2)[:, :cached])
            return keys, values
        keys, values = (x.transpose(0, 1).flatten(1, 2)[:, :cached] for x in layout.unpack(blocks))
        quantized = seq_len // layout.key_group * layout.key_group  # tokens in finished key groups
        if quantized < cached:  # the rest of the prefix: exact keys from the residual
            assert self.residual is not None
            block_size = pages.shape[2]
            block = ids[quantized // block_size : quantized // block_size + 1]
            row = self.residual.rows_of(block)[0]
            keys = keys.clone()
            span = slice(quantized % block_size, (cached - 1) % block_size + 1)
            keys[:, quantized:cached] = self.residual.keys[row, :, span].float()
        return keys, values

    def _retrieval_decode(
        self, q: torch.Tensor, pages: torch.Tensor, layout: PageSlot, table: torch.Tensor, seq_len: int
    ) -> torch.Tensor:
        """One decode row ``q: [1, Hq, D]`` over the sink, core and top-k far blocks of each KV head."""
        method, heads, block_size = self.method, self.num_kv_heads, pages.shape[2]
        held = -(-seq_len // block_size)
        ids = table[:held].long()
        queries = q[0].float().view(heads, self.group_size, -1)  # [H, g, D]
        near = method.sink_blocks + method.core_blocks
        if held <= near + method.top_blocks:
            chosen = torch.arange(held, device=q.device).expand(heads, held)  # [H, held]: every block
        else:
            far = torch.arange(method.sink_blocks, held - method.core_blocks, device=q.device)  # [F]
            low, high = layout.summaries(pages[ids[far]])  # [F, H, D] each
            bounds = (
                queries.clamp(min=0) @ high.float().permute(1, 2, 0)
                + queries.clamp(max=0) @ low.float().permute(1, 2, 0)
            ).amax(1)  # [H, F]: Quest bound, the maximum over the head's query group
            top = far[bounds.topk(method.top_blocks, dim=-1).indices]  # [H, k]
            sinks = torch.arange(method.sink_blocks, device=q.device)
            core = torch.arange(held - method.core_blocks, held, device=q.device)
            chosen = torch.cat([sinks.expand(heads, -1), top, core.expand(heads, -1)], dim=1)  # [H, m]
            _add_stats(summary_blocks_read=far.numel() * heads)
        _add_stats(blocks_read=chosen.numel(), blocks_held=held * heads)
        head_index = torch.arange(heads, device=q.device).unsqueeze(1)
        blocks = pages[ids[chosen], head_index]  # [H, m, block_size, C]
        keys, values = layout.unpack(blocks.flatten(1, 2))  # [H, m * block_size, D]
        token = (chosen.unsqueeze(-1) * block_size + torch.arange(block_size, device=q.device)).flatten(1)
        visible = (token < seq_len).unsqueeze(1)  # [H, 1, T]
        out, _ = attention_with_lse(queries, keys, values, visible, self.scale)  # [H, g, D]
        return out.reshape(1, self.num_heads, -1)

    # ----------------------------------------------------------------------------------------- depthweave
    def _rope(self, first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin: [end - first, D]`` of positions ``first ... end - 1``, sliced from a table this layer
        grows (doubling) when a request goes past it, so a decode step computes no angles."""
        if self.inv_freq is None:
            raise RuntimeError(
                "kvweave depthweave: the model's rotary frequencies are unknown (no vLLM config)"
            )
        if self.rope_table is None or self.rope_table[0].shape[0] < end:
            size = max(end, 2 * (0 if self.rope_table is None else self.rope_table[0].shape[0]), 1024)
            self.rope_table = rope_cos_sin(self.inv_freq, torch.arange(size))
        cos, sin = self.rope_table
        return cos[first:end], sin[first:end]

    def _weave_store(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        pages: torch.Tensor,
        layout: WeaveSlot,
        meta: KvweaveMetadata,
    ) -> None:
        """Store each request's new tokens: coordinates on its basis (fitted here from a request's first chunk),
        the block's worst-represented tokens exact in the tails, the newest partial block exact beside."""
        if self.bases is None:
            self.bases = WeaveBases(max(64, 8 * self.max_requests))
            rows = (self.num_kv_heads, pages.shape[2], self.head_size, key.dtype, self.max_requests)
            self.recent = (KeyResidual(*rows), KeyResidual(*rows))
        assert self.recent is not None
        changed = False  # a basis put (or dropped) or sinks added: the side bytes to count again
        decode: list[int] = []  # rows of one new token past the sinks: stored together below
        for row, seq_len in enumerate(meta.seq_lens):
            start, end = meta.query_start[row], meta.query_start[row + 1]
            if end <= start:
                continue
            if end - start == 1 and seq_len - 1 >= self.method.sinks and seq_len > 1:
                decode.append(row)
                continue
            slots = meta.slot_mapping[start:end].long()
            if bool((slots < 0).any()):
                raise RuntimeError(
                    "kvweave depthweave: a request's new token has no slot (-1 in the slot mapping)"
                )
            first = seq_len - (end - start)
            k_exact, v_exact = key[start:end], value[start:end]  # [n, H, D], post-RoPE keys
            cos, sin = self._rope(first, seq_len)  # [n, D]: broadcast over the heads of [H, n, D]
            k_pre = remove_rotary(k_exact.float().transpose(0, 1), cos, sin).transpose(0, 1).flatten(1)
            v_flat = v_exact.float().flatten(1)
            owner = int(meta.block_table[row, 0])
            if first == 0:
                entry = WeaveEntry(
                    Basis.fit(k_pre, layout.rank_k), Basis.fit(v_flat, layout.rank_v), self.method.sinks
                )
                self.bases.put(owner, entry)
                changed = True
            else:
                entry = self.bases.get(owner)
            changed |= entry.add_sinks(first, k_exact, v_exact)
            coords = (entry.k.encode(k_pre), entry.v.encode(v_flat))
            self._weave_write(
                pages,
                layout,
                slots,
                (k_pre, v_flat),
                (k_exact, v_exact),
                coords,
                (entry.k.decode, entry.v.decode),
            )
            if layout.bounds:
                filled = (slots % pages.shape[2] == pages.shape[2] - 1).nonzero().squeeze(1)
                positions = (first + filled - (pages.shape[2] - 1)).tolist()
                self._weave_bounds(
                    pages, layout, (slots[filled] // pages.shape[2]).tolist(), positions, entry
                )
        if decode:
            self._weave_store_decode(key, value, pages, layout, meta, decode)
        if changed:
            _weave_side(id(self), len(self.bases.entries), self.bases.nbytes())

    def _weave_store_decode(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        pages: torch.Tensor,
        layout: WeaveSlot,
        meta: KvweaveMetadata,
        rows: list[int],
    ) -> None:
        """:meth:`_weave_store` for decode ``rows`` (one new token each, past the sinks, on a basis fitted
        already), all rows at once: one de-rotation, one batched projection on the rows' own bases, one pack,
        one exact-row choice and one residual write for the step, instead of a dozen small calls per row."""
        assert self.bases is not None and self.recent is not None
        starts = [meta.query_start[r] for r in rows]
        at = torch.tensor(starts)
        slots = meta.slot_mapping[at].long()
        if bool((slots < 0).any()):
            raise RuntimeError(
                "kvweave depthweave: a request's new token has no slot (-1 in the slot mapping)"
            )
        positions = [meta.seq_lens[r] - 1 for r in rows]
        cos, sin = self._rope(0, max(positions) + 1)
        where = torch.tensor(positions)
        k_exact, v_exact = key[at], value[at]  # [R, H, D], post-RoPE keys
        k_pre = (
            remove_rotary(k_exact.float().transpose(0, 1), cos[where], sin[where]).transpose(0, 1).flatten(1)
        )
        v_flat = v_exact.float().flatten(1)
        table = meta.block_table[torch.tensor(rows), 0].tolist()
        entries = [self.bases.get(int(owner)) for owner in table]
        k_bases, v_bases = [entry.k for entry in entries], [entry.v for entry in entries]
        if self._fused_decode(key.device, WEAVE_DECODE) and pages.is_contiguous():
            self._weave_write_rows(
                pages, layout, slots.tolist(), (k_pre, v_flat), (k_exact, v_exact), (k_bases, v_bases)
            )
        else:
            coords = (encode_rows(k_bases, k_pre), encode_rows(v_bases, v_flat))
            decoders = (lambda c: decode_rows(k_bases, c), lambda c: decode_rows(v_bases, c))
            self._weave_write(pages, layout, slots, (k_pre, v_flat), (k_exact, v_exact), coords, decoders)
        if layout.bounds:
            block_size = pages.shape[2]
            for i, (slot, position) in enumerate(zip(slots.tolist(), positions, strict=True)):
                if slot % block_size == block_size - 1:  # this token filled its block
                    self._weave_bounds(
                        pages, layout, [slot // block_size], [position - block_size + 1], entries[i]
                    )

    def _weave_bounds(
        self, pages: torch.Tensor, layout: WeaveSlot, blocks: list[int], firsts: list[int], entry: WeaveEntry
    ) -> None:
        """Write the key bounds of full ``blocks`` (their first tokens at positions ``firsts``; stored on
        ``entry``'s basis) into their tails: the per-channel minimum and maximum over each KV head of the keys
        as a decode step reads them (rebuilt from the coordinates, rotated, the exact rows laid over). The sinks
        are not laid over: the blocks that hold them are read every step whatever their bounds."""
        if not blocks:
            return
        block_size, heads = pages.shape[2], self.num_kv_heads
        ids = torch.tensor(blocks)
        stored = pages[ids]  # [nb, H, block_size, C]
        ck, _ = layout.unpack(stored)  # [nb, block_size, rank_k]
        keys = entry.k.decode(ck.flatten(0, 1)).view(len(blocks), block_size, heads, -1)
        cos, sin = self._rope(0, max(firsts) + block_size)
        where = torch.tensor(firsts).view(-1, 1) + torch.arange(block_size)  # [nb, block_size]
        keys = apply_rotary(
            keys.transpose(1, 2), cos[where].unsqueeze(1), sin[where].unsqueeze(1)
        )  # [nb, H, T, D]
        if layout.exact:
            offsets, _, exact_keys, _ = layout.read_exact(layout.tails(stored))  # [nb, H, E(, D)]
            valid = offsets >= 0
            block = torch.arange(len(blocks)).view(-1, 1, 1).expand_as(offsets)
            head = torch.arange(heads).view(1, -1, 1).expand_as(offsets)
            keys[block[valid], head[valid], offsets[valid]] = exact_keys[valid].float()
        pages[ids, :, :, layout.scale_end :] = layout.write_bounds(stored, keys.amin(2), keys.amax(2))

    def _weave_choose(
        self, queries: torch.Tensor, pages: torch.Tensor, layout: WeaveSlot, ids: torch.Tensor, cached: int
    ) -> torch.Tensor | None:
        """Selective decode (``decode_tokens``) for one decode row ``queries: [H, g, D]`` over the request's
        blocks ``ids``: :meth:`_weave_choose_rows` for one row."""
        return self._weave_choose_rows(queries.unsqueeze(0), pages, layout, [ids], [cached])[0]

    def _weave_choose_rows(
        self,
        queries: torch.Tensor,
        pages: torch.Tensor,
        layout: WeaveSlot,
        ids: list[torch.Tensor],
        cached: list[int],
    ) -> list[torch.Tensor | None]:
        """Selective decode (``decode_tokens``) in torch: :meth:`WeaveSlot.choose_blocks` for decode rows
        ``queries: [R, H, g, D]`` over their blocks ``ids``, counted in the stats."""
        picks, scored = layout.choose_blocks(
            queries, pages, ids, cached, self.method.decode_tokens, self.method.sinks
        )
        if scored:
            _add_stats(summary_blocks_read=scored * queries.shape[1])
        return picks

    def _weave_write(
        self,
        pages: torch.Tensor,
        layout: WeaveSlot,
        slots: torch.Tensor,
        flat: tuple[torch.Tensor, torch.Tensor],
        exact: tuple[torch.Tensor, torch.Tensor],
        coords: tuple[torch.Tensor, torch.Tensor],
        decoders: tuple[Any, Any],
    ) -> None:
        """Write tokens at ``slots: [n]``: their coordinates ``coords`` packed into the pages, the blocks' worst
        represented tokens exact in the tails (error of ``decoders`` applied to the stored coordinates against
        ``flat``: pre-RoPE keys and values ``[n, H·D]``), the exact rows ``exact: [n, H, D]`` in the residual of
        each block still being filled."""
        assert self.recent is not None
        block_size = pages.shape[2]
        blocks, offsets = slots // block_size, slots % block_size
        layout.store(pages, blocks, offsets, flat, exact, coords, decoders)
        for residual, rows in zip(self.recent, exact, strict=True):
            kept = residual.store(blocks, offsets, rows)
            full = offsets == block_size - 1
            if kept is not None:
                full &= kept
            residual.release(blocks[full])

    def _weave_write_rows(
        self,
        pages: torch.Tensor,
        layout: WeaveSlot,
        slots: list[int],
        flat: tuple[torch.Tensor, torch.Tensor],
        exact: tuple[torch.Tensor, torch.Tensor],
        bases: tuple[list[Basis], list[Basis]],
    ) -> None:
        """:meth:`_weave_write` for decode rows (one token each, in distinct blocks) with the C++ kernel: the
        pages, the exact rows and the residual rows written in one call."""
        from kvweave.kernels import cpu_vllm_weave

        assert self.recent is not None
        block_size = pages.shape[2]
        blocks, offsets = [s // block_size for s in slots], [s % block_size for s in slots]
        k_res, v_res = self.recent
        if k_res.keys.dtype != exact[0].dtype:
            exact = exact[0].to(k_res.keys.dtype), exact[1].to(k_res.keys.dtype)
        rows = (k_res.take_rows(blocks, offsets), v_res.take_rows(blocks, offsets))
        cpu_vllm_weave.store_rows(
            flat, exact, pages, blocks, offsets, bases, layout, (k_res.keys, v_res.keys), rows
        )
        for residual, kept in zip(self.recent, rows, strict=True):
            full = [
                b for b, o, r in zip(blocks, offsets, kept, strict=True) if o == block_size - 1 and r >= 0
            ]
            if full:
                residual.release(torch.tensor(full))

    def _weave_read(
        self, blocks: torch.Tensor, layout: WeaveSlot, ids: torch.Tensor, cached: int
    ) -> WeaveRead:
        """The first ``cached`` tokens as stored (``blocks: [held, H, block_size, C]``): their keys rebuilt from
        the coordinates and rotated to their positions, with the exact rows, the sinks and the newest partial
        block laid over them (in that order); the values left as coordinates beside what overrides them."""
        assert self.bases is not None and self.recent is not None
        heads, block_size = self.num_kv_heads, blocks.shape[2]
        entry = self.bases.get(int(ids[0]))
        ck, cv = layout.unpack(blocks)  # [held, block_size, r]
        keys = entry.k.decode(ck.flatten(0, 1)[:cached]).view(cached, heads, -1)
        cos, sin = self._rope(0, cached)  # [cached, D]: broadcast over the heads of [H, cached, D]
        keys = apply_rotary(keys.transpose(0, 1), cos, sin).transpose(0, 1)  # [cached, H, D]
        empty = torch.empty(0, dtype=torch.long)
        pairs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = (
            empty,
            empty,
            keys.new_empty(0, keys.shape[-1]),
        )
        sinks = min(entry.sinks_held, cached)
        first, recent = self._newest_block(int(ids[-1]), ids.shape[0], block_size, cached)
        if layout.exact:
            offsets, _, exact_keys, exact_values = layout.read_exact(
                layout.tails(blocks)
            )  # [held, H, E, ...]
            position = torch.arange(blocks.shape[0]).view(-1, 1, 1) * block_size + offsets
            valid = (offsets >= 0) & (position < cached)
            head = torch.arange(heads).view(1, -1, 1).expand_as(position)
            keys[position[valid], head[valid]] = exact_keys[valid].float()
            shown = valid & (position >= sinks) & (position < first)  # the values no range overrides
            pairs = (position[shown], head[shown], exact_values[shown].float())
        keys[:sinks] = entry.sink_k[:sinks].float()
        spans = [(0, min(sinks, first), entry.sink_v[: min(sinks, first)].float())]
        if recent is not None:
            span = slice(0, cached - first)
            keys[first:cached] = recent[0][:, span].transpose(0, 1).float()
            spans.append((first, cached, recent[1][:, span].transpose(0, 1).float()))
        return WeaveRead(entry, keys, cv.flatten(0, 1)[:cached], pairs, spans)

    def _newest_block(
        self, last: int, held: int, block_size: int, cached: int
    ) -> tuple[int, tuple[torch.Tensor, torch.Tensor] | None]:
        """The first token of a request's newest block ``last`` (its ``held``-th) when that block is partial, and
        its exact keys and values ``[H, block_size, D]``; ``(cached, None)`` when the block is full."""
        assert self.recent is not None
        if last not in self.recent[0].row_of:
            return cached, None
        k_row, v_row = (residual.row_of[last] for residual in self.recent)
        return (held - 1) * block_size, (self.recent[0].keys[k_row], self.recent[1].keys[v_row])

    def _weave_stored(
        self, blocks: torch.Tensor, layout: WeaveSlot, ids: torch.Tensor, cached: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``cached`` tokens as stored, every value rebuilt: ``keys, values: [H, cached, D]`` float32."""
        read = self._weave_read(blocks, layout, ids, cached)
        values = read.entry.v.decode(read.v_coords).view(cached, self.num_kv_heads, -1)
        position, head, exact = read.pairs
        values[position, head] = exact
        for first, end, rows in read.spans:
            values[first:end] = rows
        return read.keys.transpose(0, 1), values.transpose(0, 1)

    def _weave_decode(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        pages: torch.Tensor,
        layout: WeaveSlot,
        table: torch.Tensor,
        cached: int,
    ) -> torch.Tensor:
        """One decode row ``q: [1, Hq, D]``: scores against the rebuilt keys, and the values never rebuilt —
        the attention weights weight the value coordinates (``r_v`` numbers a token instead of ``H·D``), then
        one projection through the basis per query head; the exact rows, sinks and newest block add their
        own values. The same output as attention over :meth:`_weave_stored` (tested)."""
        heads, block_size = self.num_kv_heads, pages.shape[2]
        held = -(-cached // block_size)
        ids = table[:held].long()
        read = self._weave_read(pages[ids], layout, ids, cached)
        queries = q[0].float().view(heads, self.group_size, -1)  # [H, g, D]
        scores = torch.einsum("hgd,thd->hgt", queries, read.keys) * self.scale  # [H, g, cached]
        chosen = self._weave_choose(queries, pages, layout, ids, cached) if layout.bounds and held else None
        if chosen is not None:  # selective decode: the tokens of the blocks not chosen get no weight
            picked = torch.zeros(heads, held, dtype=torch.bool).scatter_(1, chosen, True)
            visible = picked[:, torch.arange(cached) // block_size]  # [H, cached]
            scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
        new = (queries * k_new[0].float().unsqueeze(1)).sum(-1, keepdim=True) * self.scale  # [H, g, 1]
        weights = torch.softmax(torch.cat([scores, new], dim=-1), dim=-1)
        stored, newest = weights[..., :cached], weights[..., cached:]
        position, head, exact = read.pairs
        overridden = torch.zeros(cached, heads, dtype=torch.bool)
        overridden[position, head] = True
        for first, end, _ in read.spans:
            overridden[first:end] = True
        coord = stored.masked_fill(overridden.T.unsqueeze(1), 0.0)  # [H, g, cached]
        basis = read.entry.v
        mixed = torch.einsum("hgt,tr->hgr", coord, read.v_coords) * basis.scale  # [H, g, r_v]
        rows = basis.rows.float().view(-1, heads, queries.shape[-1])  # [r_v, H, D]
        out = torch.einsum("hgr,rhd->hgd", mixed, rows)
        out += basis.mean.view(heads, 1, -1) * coord.sum(-1, keepdim=True)
        out.index_add_(0, head, stored[head, :, position].unsqueeze(-1) * exact.unsqueeze(1))
        for first, end, values in read.spans:
            out += torch.einsum("hgt,thd->hgd", stored[..., first:end], values)
        out += newest * v_new[0].float().unsqueeze(1)
        read_blocks = held * heads if chosen is None else chosen.numel()
        _add_stats(blocks_read=read_blocks, blocks_held=held * heads, weave_decode_rows=1)
        return out.reshape(1, self.num_heads, -1)


@dataclasses.dataclass
class WeaveRead:
    """A request's stored tokens in one layer as :meth:`KvweaveAttentionImpl._weave_read` gives them: ``keys:
    [cached, H, D]`` final (rotated, overrides laid over), the values' ``v_coords: [cached, r_v]`` on
    ``entry.v`` and what overrides them: ``pairs`` (position, head, value ``[N, D]``: exact rows) and
    ``spans`` (first, end, values ``[end - first, H, D]``: the sinks, the newest partial block)."""

    entry: WeaveEntry
    keys: torch.Tensor
    v_coords: torch.Tensor
    pairs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    spans: list[tuple[int, int, torch.Tensor]]


class KeyResidual:
    """Exact keys of the key groups not yet quantized, one row ``[H, block_size, D]`` per vLLM block that has
    one (at most one block per running request: its last, partial block).

    Outside vLLM's allocator: it grows on demand to ``max_rows`` rows (twice vLLM's ``max_num_seqs``), then
    reuses the least recently written row — a request that stopped mid-block leaves its row behind, and a
    running request writes its row every step, so the oldest row is a stale one."""

    def __init__(
        self, heads: int, block_size: int, head_size: int, dtype: torch.dtype, max_requests: int
    ) -> None:
        self.keys = torch.empty(0, heads, block_size, head_size, dtype=dtype)
        self.row_of: dict[int, int] = {}
        self.last_write: dict[int, int] = {}  # row -> step
        self.free: list[int] = []
        self.evicted: set[int] = set()  # blocks whose row was reused while unfinished
        self.max_rows = 2 * max_requests
        self.step = 0

    def store(self, blocks: torch.Tensor, offsets: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
        """Keep ``key: [N, H, D]`` of tokens at ``(blocks, offsets)``; a block's first write (offset 0) takes
        a new row. Returns the mask of tokens kept, ``None`` if all were: a write into a block with no row that
        does not start it is vLLM recomputing a token of a full, prefix-cached block (its last prompt token),
        already quantized."""
        skipped = self._assign(*_first_offsets(blocks, offsets))
        if not skipped:
            self.keys[self.rows_of(blocks), :, offsets] = key.to(self.keys.dtype)
            return None
        kept = ~torch.isin(blocks, torch.tensor(sorted(skipped), dtype=blocks.dtype))
        rows = self.rows_of(blocks[kept])
        self.keys[rows, :, offsets[kept]] = key[kept].to(self.keys.dtype)
        return kept

    def take_rows(self, blocks: list[int], offsets: list[int]) -> list[int]:
        """:meth:`store`'s bookkeeping for a few tokens as Python ints: the residual row each token's key goes
        to, -1 for a token that is not kept (the caller writes the keys)."""
        skipped = self._assign(*_first_offsets_of(blocks, offsets))
        return [-1 if block in skipped else self.row_of[block] for block in blocks]

    def _assign(self, touched: list[int], firsts: list[int]) -> set[int]:
        """Rows for the blocks written this step (``touched``, each from slot ``firsts``): a block written from
        its first slot takes a new row; returns the blocks with no row that are not kept (see :meth:`store`)."""
        self.step += 1
        skipped: set[int] = set()
        for block, first in zip(touched, firsts, strict=True):
            if first == 0:
                self._release_one(block)
                self.evicted.discard(block)
                self.row_of[block] = self._take_row()
            elif block not in self.row_of:
                if block in self.evicted:
                    raise RuntimeError(
                        f"kvweave quant: block {block} continues at slot {first} but its exact keys were evicted "
                        f"(more than {self.max_rows} blocks in flight); lower max_num_seqs"
                    )
                skipped.add(block)
                continue
            self.last_write[self.row_of[block]] = self.step
        return skipped

    def rows_of(self, blocks: torch.Tensor) -> torch.Tensor:
        return torch.tensor([self.row_of[int(b)] for b in blocks.tolist()], dtype=torch.long)

    def release(self, blocks: torch.Tensor) -> None:
        for block in blocks.tolist():
            self._release_one(int(block))

    def _release_one(self, block: int) -> None:
        row = self.row_of.pop(block, None)
        if row is not None:
            self.free.append(row)
            self.last_write.pop(row, None)

    def _take_row(self) -> int:
        if self.free:
            return self.free.pop()
        stale = [row for row, step in self.last_write.items() if step < self.step]
        if self.keys.shape[0] < self.max_rows or not stale:
            # also past max_rows when every row was written this step: one prefill chunk writes many blocks at
            # once (a 1K-token prompt spans 9 blocks of 128), and their rows are freed once their groups are
            # quantized; evicting one of them would lose keys written a moment ago
            grown = max(4, self.keys.shape[0])
            first = self.keys.shape[0]
            self.keys = torch.cat([self.keys, self.keys.new_empty(grown, *self.keys.shape[1:])])
            self.free.extend(range(first + grown - 1, first, -1))
            return first
        oldest = min(stale, key=self.last_write.__getitem__)  # least recently written row
        block = next(b for b, r in self.row_of.items() if r == oldest)
        self.release(torch.tensor([block]))
        self.evicted.add(block)
        return self.free.pop()


@dataclasses.dataclass
class WeaveEntry:
    """One request's DepthWeave state in one layer: the key and value bases and its first ``sinks`` tokens."""

    k: Basis
    v: Basis
    sinks: int
    sink_k: torch.Tensor = dataclasses.field(default_factory=lambda: torch.empty(0))
    sink_v: torch.Tensor = dataclasses.field(default_factory=lambda: torch.empty(0))

    def kernel_view(self) -> tuple[torch.Tensor, ...]:
        """What the fused decode kernel reads, float32 and contiguous (made per call, not held: the side bytes
        stay what :attr:`nbytes` counts): the bases' rows times their scales and their means (``kb, kmean, vb,
        vmean``), the sinks (``sink_k, sink_v``)."""
        return (
            (self.k.rows.float() * self.k.scale.unsqueeze(1)).contiguous(),
            self.k.mean.float().contiguous(),
            (self.v.rows.float() * self.v.scale.unsqueeze(1)).contiguous(),
            self.v.mean.float().contiguous(),
            self.sink_k.float().contiguous(),
            self.sink_v.float().contiguous(),
        )

    @property
    def sinks_held(self) -> int:
        return int(self.sink_k.shape[0])

    def add_sinks(self, first: int, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Keep the exact (post-RoPE) rows of positions ``first ...`` that fall among the first ``sinks``;
        whether any were added."""
        take = min(self.sinks, first + keys.shape[0]) - first
        if take <= 0 or first != self.sinks_held:
            return False
        new_k, new_v = keys[:take].half(), values[:take].half()
        self.sink_k = new_k if first == 0 else torch.cat([self.sink_k, new_k])
        self.sink_v = new_v if first == 0 else torch.cat([self.sink_v, new_v])
        return True

    @property
    def nbytes(self) -> int:
        exact = sum(t.numel() * t.element_size() for t in (self.sink_k, self.sink_v))
        return self.k.nbytes + self.v.nbytes + exact


class WeaveBases:
    """The requests' :class:`WeaveEntry` of one layer, keyed by the request's first block: a request that
    reuses prefix-cached blocks reuses the first block, whose basis those blocks were written with.

    Outside vLLM's allocator (:data:`STATS` ``weave_side_bytes``, summed over layers by the caller), at most
    ``max_entries`` (eight times ``max_num_seqs``, at least 64); the least recently used entry goes first. A
    request reusing (by prefix caching) a first block whose entry went first fails with a line naming the way out."""

    def __init__(self, max_entries: int) -> None:
        self.entries: dict[int, WeaveEntry] = {}
        self.max_entries = max_entries

    def put(self, block: int, entry: WeaveEntry) -> None:
        self.entries.pop(block, None)
        self.entries[block] = entry
        while len(self.entries) > self.max_entries:
            self.entries.pop(next(iter(self.entries)))

    def get(self, block: int) -> WeaveEntry:
        entry = self.entries.pop(block, None)
        if entry is None:
            raise RuntimeError(
                f"kvweave depthweave: no basis for the request whose first block is {block} (more than "
                f"{self.max_entries} requests since it was written, through prefix caching); run with "
                "--no-enable-prefix-caching or a larger max_num_seqs"
            )
        self.entries[block] = entry  # most recently used last
        return entry

    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self.entries.values())


def _rope_inv_freq(head_size: int) -> torch.Tensor | None:
    """The model's rotary frequencies from vLLM's model config (default RoPE, the whole head rotated); None
    outside an engine (unit tests set them)."""
    from vllm.config import get_current_vllm_config

    try:
        config = get_current_vllm_config().model_config.hf_config
    except (AssertionError, AttributeError):
        return None
    text = getattr(config, "get_text_config", lambda: config)()
    parameters = dict(getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {})
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    theta = parameters.get("rope_theta", getattr(text, "rope_theta", None))
    partial = float(parameters.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", 1.0)))
    if kind != "default" or theta is None or partial != 1.0:
        raise ValueError(
            f"kvweave depthweave in vLLM: rotary embedding {kind!r} (theta {theta}, partial {partial}) is not "
            f"supported, only the default RoPE over the whole head; unset {ENV_METHOD} or use quant/pages"
        )
    return 1.0 / (float(theta) ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size)).float()


def _first_offsets(blocks: torch.Tensor, offsets: torch.Tensor) -> tuple[list[int], list[int]]:
    """The distinct blocks written (ascending) and the smallest offset written in each."""
    if blocks.numel() <= _FEW:  # a decode step: a few Python ints beat unique + scatter
        return _first_offsets_of(blocks.tolist(), offsets.tolist())
    touched, inverse = torch.unique(blocks, return_inverse=True)
    first = torch.full_like(touched, 1 << 30).scatter_reduce(0, inverse, offsets, reduce="amin")
    return touched.tolist(), first.tolist()


def _first_offsets_of(blocks: list[int], offsets: list[int]) -> tuple[list[int], list[int]]:
    """:func:`_first_offsets` on Python ints."""
    smallest: dict[int, int] = {}
    for block, offset in zip(blocks, offsets, strict=True):
        smallest[block] = min(offset, smallest.get(block, offset))
    touched = sorted(smallest)
    return touched, [smallest[b] for b in touched]


def _max_requests() -> int:
    try:
        from vllm.config import get_current_vllm_config

        return int(get_current_vllm_config().scheduler_config.max_num_seqs)
    except Exception:  # outside an engine (unit tests): a small pool
        return 8


def _add_stats(**counts: int) -> None:
    with _STATS_LOCK:
        for name, value in counts.items():
            STATS[name] += value


_WEAVE_SIDE: dict[int, tuple[int, int]] = {}  # impl (layer) -> (entries, bytes) held beside the pages


def _weave_side(layer: int, entries: int, nbytes: int) -> None:
    """Record one layer's DepthWeave side state; :data:`STATS` holds the sums over layers."""
    with _STATS_LOCK:
        _WEAVE_SIDE[layer] = (entries, nbytes)
        STATS["weave_bases"] = sum(e for e, _ in _WEAVE_SIDE.values())
        STATS["weave_side_bytes"] = sum(b for _, b in _WEAVE_SIDE.values())


def _count_calls(rows: int) -> None:
    """Count decode rows; every 256 calls, write :data:`STATS` to ``KVWEAVE_VLLM_STATS`` if set."""
    global _calls
    with _STATS_LOCK:
        STATS["decode_rows"] += rows
        _calls += 1
        due = _calls % 256 == 0
        snapshot = dict(STATS) if due else None
    if snapshot is None:  # the environment is read only when a write is due (a one-row step is ~0.3 ms)
        return
    path = os.environ.get(ENV_STATS)
    if path:
        with open(path, "w") as handle:
            json.dump(snapshot, handle)
