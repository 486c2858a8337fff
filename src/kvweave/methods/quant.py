"""``quant``: KIVI-style asymmetric KV quantization (Liu et al., ICML 2024, arXiv:2402.02750).

Keys are quantized per channel (min/max over a block of ``group`` tokens, for each channel), values per
token (min/max over groups of ``group`` channels), because key outliers sit in fixed channels while value
errors must stay local to a token. The newest ``residual`` tokens stay exact; whenever ``group`` more
tokens have left that window they are quantized as one block, so the exact tail holds between
``residual`` and ``residual + group - 1`` tokens. Codes are packed into ``uint8`` (one 8-bit, two 4-bit or
four 2-bit codes per byte) with ``float16`` scales and minima, and ``nbytes`` counts exactly that storage.

Attention never materialises the dequantized cache. On CUDA a Triton kernel (:mod:`kvweave.kernels.triton_quant`,
``kernel="triton"``, the default there) reads the packed codes and scales once and dequantizes in registers,
returning each chunk's output and log-sum-exp. During decoding, on the CPU, a fused C++ kernel
(:mod:`kvweave.kernels.cpu_quant`, ``kernel="cpp"``, built on first use) scores the query against the packed
key codes with the per-channel scales and minima folded into the query, and sums the softmax weights times
the values decoded row by row; the softmax runs in torch between the two. The torch path (``kernel="torch"``,
and the fallback of ``"auto"`` where no compiler is available or the cache is on an accelerator) unpacks a
chunk (``chunk`` tokens) at a time and combines chunks with an online softmax (running max and sum, as in
FlashAttention); it is the reference the kernel is tested against. Either way the exact tail is added the
same way, and prefill attention is exact; quantization happens as the prompt is stored. Speed against
``full`` and transformers' ``QuantizedCache``: ``benchmarks/quant_vs_transformers.py`` (docs/findings.md).

Batches: each row's blocks start at its first real token (left padding is dropped when the prompt is
stored), so a padded batch row quantizes exactly the blocks of its single-row run. Blocks are unordered
slots (softmax does not care about order) that record the token index they start at, for the mask.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvweave.cache import CompressedLayer, tensors_nbytes
from kvweave.kernels import cpu_quant
from kvweave.kernels.registry import BACKENDS, Kernel, choose
from kvweave.ops.attention import OnlineSoftmax
from kvweave.ops.kivi import Blocks, block_logits, dequantize_blocks, dequantize_values, quantize_blocks
from kvweave.ops.masking import prompt_padding, visible_mask
from kvweave.ops.storage import STORAGE_CHOICES, STORAGE_HELP
from kvweave.registry import Method, option, register

if TYPE_CHECKING:
    from kvweave.cache import KVCache


@register("quant")
@dataclasses.dataclass
class Quant(Method):
    """KIVI quantization: keys per channel, values per token, exact recent residual."""

    vllm: ClassVar[str] = (
        "served by the vLLM plugin as KVWEAVE_VLLM_METHOD=quant:bits=8|4|2 (keys per channel over 64-token "
        "groups, values per token, no exact recent window beyond the open key group: docs/vllm.md)"
    )

    bits: int = option(4, "bits per code: 8, 4 or 2")
    group: int = option(32, "tokens per key block and channels per value group")
    residual: int = option(128, "most recent tokens kept exact")
    chunk: int = option(4096, "tokens dequantized at a time during attention", tuning=True)
    kernel: str = option(
        "auto",
        "decode attention: 'cpp' (fused C++ CPU kernel, built on first use), 'triton' (fused Triton kernel on "
        "CUDA), 'torch' (the reference), or 'auto' (triton on CUDA, cpp on CPU when it builds, else torch)",
        tuning=True,
    )
    storage: str = option("auto", STORAGE_HELP)

    budget_options = {"bits": "bits"}
    test_options = {"bits": 4, "group": 8, "residual": 8, "chunk": 16}
    invalid_options = (
        ({"bits": 3}, "bits"),
        ({"group": 0}, "group"),
        ({"residual": -1}, "residual"),
        ({"chunk": 0}, "chunk"),
    )

    def __post_init__(self) -> None:
        self.check_choice("bits", [8, 4, 2])
        self.check_range("group", 1)
        self.check_range("residual", 0)
        self.check_range("chunk", 1)
        self.check_choice("kernel", BACKENDS)
        self.check_choice("storage", STORAGE_CHOICES)

    def make_layer(self, cache: KVCache, layer_idx: int) -> QuantLayer:
        head_dim = cache.head_dim
        channel_group = min(self.group, head_dim)
        if self.group % (8 // self.bits):
            raise ValueError(
                f"{self.name}: option group={self.group!r} with bits={self.bits} must be a multiple of "
                f"{8 // self.bits} (key codes are packed {8 // self.bits} tokens per byte)"
            )
        if head_dim % channel_group or head_dim % (8 // self.bits):
            raise ValueError(
                f"{self.name}: option group={self.group!r} with bits={self.bits} does not fit head_dim "
                f"{head_dim}; use a group that divides it (e.g. 32, 64 or {head_dim})"
            )
        return QuantLayer(cache, layer_idx)


QUANT_DECODE = Kernel(
    "quant decode attention", cpp="kvweave.kernels.cpu_quant", triton="kvweave.kernels.triton_quant"
)


def _triton_attention(
    query: torch.Tensor, blocks: Blocks, bits: int, scaling: float, visible: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``query: [B, H, R, D]`` over ``blocks`` in the Triton kernel -> ``out [B, H, R, D]``, ``lse [B, H, R]``."""
    from kvweave.kernels import triton_quant

    b = blocks
    return triton_quant.quant_attention(
        query,
        b.key_codes,
        b.key_scale,
        b.key_min,
        b.value_codes,
        b.value_scale,
        b.value_min,
        bits,
        scaling,
        visible,
    )


def _fused_values(weights: torch.Tensor, blocks: Blocks, bits: int) -> torch.Tensor:
    """``weights @ values`` of ``blocks`` in the C++ kernel."""
    return cpu_quant.weighted_values(weights, blocks.value_codes, blocks.value_scale, blocks.value_min, bits)


# ---------------------------------------------------------------------------------------------- cache layer


class QuantLayer(CompressedLayer):
    """Quantized blocks + an exact recent tail, per batch row.

    - ``recent_keys, recent_values: [B, H, E, D]``: exact tail, aligned at the end (the newest token is last
      in every row); row ``b``'s valid entries are its last ``recent_count[b]`` ones.
    - ``segments``: list of :class:`Blocks`, each up to ``chunk // group`` blocks (one attention chunk).
    - ``block_start: [B, nblocks]`` int64: token index of each block's first token in row ``b``, -1 if the
      slot is empty for that row.
    """

    batch_fields = CompressedLayer.batch_fields + (
        "recent_keys",
        "recent_values",
        "recent_count",
        "block_start",
    )
    state_fields = CompressedLayer.state_fields + (
        "block_start",
        "recent_count",
        "recent_keys",
        "recent_values",
        "segments",
        "kernel_used",
    )

    def __init__(self, cache: KVCache, layer_idx: int) -> None:
        super().__init__(cache, layer_idx)
        method = typing.cast(Quant, cache.method)
        self.bits, self.group, self.residual = method.bits, method.group, method.residual
        self.channel_group = min(method.group, cache.head_dim)
        self.blocks_per_segment = max(1, method.chunk // method.group)
        self.kernel_choice = method.kernel
        self.kernel_used: str | None = None
        self.segments: list[Blocks] = []
        # shaped for the batch in lazy_initialization (first update)
        self.recent_keys = self.recent_values = torch.empty(0)
        self.recent_count = torch.empty(0, dtype=torch.int64)  # [B]
        self.block_start = torch.empty(0, dtype=torch.int64)  # [B, nblocks]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        b, h, _, d = key_states.shape
        self.recent_keys = key_states.new_empty(b, h, 0, d, dtype=self.store_dtype)
        self.recent_values = value_states.new_empty(b, h, 0, value_states.shape[-1], dtype=self.store_dtype)
        self.recent_count = torch.zeros(b, dtype=torch.int64, device=self.device)
        self.block_start = torch.zeros(b, 0, dtype=torch.int64, device=self.device)

    # -- storage
    def append(self, key: torch.Tensor, value: torch.Tensor, position_ids: torch.Tensor | None) -> None:
        self.recent_keys = torch.cat([self.recent_keys, self.stored(key)], dim=2)
        self.recent_values = torch.cat([self.recent_values, self.stored(value)], dim=2)
        self.recent_count = self.recent_count + key.shape[2]

    def drop_padding(self, pad_count: torch.Tensor) -> None:
        """After the prompt is stored: left padding is not part of any row's tokens."""
        self.recent_count = self.recent_count - pad_count

    def quantize_full_blocks(self) -> None:
        """Quantize, per row, every full block of ``group`` tokens that has left the residual window."""
        while True:
            due = ((self.recent_count - self.residual) // self.group).clamp(min=0)
            if int(due.max()) == 0:
                break
            common = int(due.min())
            if common > 0:  # every row has `common` blocks due: one batched step
                self.store_blocks(self.take_oldest(common), torch.ones_like(due, dtype=torch.bool))
            else:  # rows out of phase (different left padding): one block for the rows that have one due
                self.store_blocks(self.take_oldest(1), due > 0)
        self.trim_recent()

    def take_oldest(self, blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The oldest ``blocks * group`` exact tokens of every row as ``[B, H, blocks, G, D]`` + start tokens.

        Rows with fewer exact tokens give garbage (the caller only stores rows that have them).
        """
        b, h, e, d = self.recent_keys.shape
        oldest = (e - self.recent_count).clamp(min=0)  # [B] buffer index of each row's oldest exact token
        count = blocks * self.group
        index = (oldest.view(-1, 1) + torch.arange(count, device=self.device)).clamp(max=e - 1)
        gather = index.view(b, 1, count, 1).expand(-1, h, -1, d)
        keys = self.computed(self.recent_keys.gather(2, gather)).view(b, h, blocks, self.group, d)
        values = self.computed(self.recent_values.gather(2, gather)).view(b, h, blocks, self.group, d)
        start_token = self.seen - self.recent_count  # [B] token index of each row's oldest exact token
        return keys, values, start_token

    def store_blocks(
        self, taken: tuple[torch.Tensor, torch.Tensor, torch.Tensor], rows: torch.Tensor
    ) -> None:
        """Quantize ``taken`` blocks and store them for the rows where ``rows: [B]`` is True."""
        keys, values, start_token = taken
        blocks = quantize_blocks(keys, values, self.bits, self.channel_group)
        n = keys.shape[2]
        starts = start_token.view(-1, 1) + torch.arange(n, device=self.device) * self.group  # [B, n]
        starts = torch.where(rows.view(-1, 1), starts, -1)
        free = self.block_start < 0
        if n == 1 and bool((free.any(dim=1) | ~rows).all()):  # every storing row has an empty slot: fill it
            slot = free.to(torch.int64).argmax(dim=1)  # first empty slot per row
            for row in rows.nonzero().flatten().tolist():
                self.write_slot(row, int(slot[row]), blocks.map(lambda t, r=row: t[r]))
                self.block_start[row, slot[row]] = starts[row, 0]
        else:
            self.add_slots(blocks, starts)
        self.recent_count = self.recent_count - rows.to(torch.int64) * n * self.group

    def add_slots(self, blocks: Blocks, starts: torch.Tensor) -> None:
        """Append ``blocks`` (``n`` new slots for all rows, ``starts: [B, n]``) to the segments."""
        self.block_start = torch.cat([self.block_start, starts], dim=1)
        done = 0
        while done < blocks.count:
            if self.segments and self.segments[-1].count < self.blocks_per_segment:
                room = self.blocks_per_segment - self.segments[-1].count
                part = blocks.map(lambda t, a=done, z=done + room: t[:, :, a:z])
                self.segments[-1] = Blocks.cat([self.segments[-1], part])
            else:
                part = blocks.map(lambda t, a=done, z=done + self.blocks_per_segment: t[:, :, a:z].clone())
                self.segments.append(part)
            done += part.count

    def write_slot(self, row: int, slot: int, block: Blocks) -> None:
        """Overwrite slot ``slot`` of row ``row`` with one block (tensors without the row dimension)."""
        segment = self.segments[slot // self.blocks_per_segment]
        offset = slot % self.blocks_per_segment
        for target, source in zip(segment.tensors(), block.tensors(), strict=True):
            target[row, :, offset] = source[:, 0]

    def trim_recent(self) -> None:
        """Drop buffer columns no row needs any more (quantized or padding)."""
        keep = int(self.recent_count.max())
        e = self.recent_keys.shape[2]
        if keep < e:  # clone: a slice would keep the whole old buffer alive
            self.recent_keys = self.recent_keys[:, :, e - keep :].clone()
            self.recent_values = self.recent_values[:, :, e - keep :].clone()

    def segment_starts(self, index: int) -> torch.Tensor:
        """``[B, n]`` first token of each block of segment ``index`` (-1: empty slot for that row)."""
        first = index * self.blocks_per_segment
        return self.block_start[:, first : first + self.segments[index].count]

    def recent_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Token index ``[B, E]`` of each exact-tail entry and whether the row holds it ``[B, E]``."""
        e = self.recent_keys.shape[2]
        slots = torch.arange(self.seen - e, self.seen, device=self.device).view(1, -1).expand(self.rows, -1)
        valid = torch.arange(e, device=self.device).view(1, -1) >= (e - self.recent_count).view(-1, 1)
        return slots, valid

    # -- attention
    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Exact attention at prefill; chunked attention over the blocks + exact tail afterwards."""
        q_len, first = key.shape[2], self.seen
        self.append(key, value, kwargs.get("position_ids"))
        self.seen += q_len
        if first == 0:
            self.pad_count = prompt_padding(attention_mask, self.rows, self.seen, self.device)
            out = self.prompt_attention(module, query, key, value, attention_mask, **kwargs)
            self.drop_padding(self.pad_count)
        else:
            out = self.chunked_attention(query, attention_mask, first, kwargs.get("scaling"))
        self.quantize_full_blocks()
        return out

    def chunked_attention(
        self, query: torch.Tensor, attention_mask: torch.Tensor | None, first: int, scaling: float | None
    ) -> torch.Tensor:
        """``query: [B, Hq, q, D]`` over every held token, one chunk of blocks at a time -> ``[B, q, Hq, D]``."""
        b, hq, q_len, d = query.shape
        h, groups = self.recent_keys.shape[1], hq // self.recent_keys.shape[1]
        packed = query.reshape(b, h, groups * q_len, d).float()  # query heads of a group along the rows
        softmax = OnlineSoftmax(packed, scaling if scaling is not None else d**-0.5)
        offsets = torch.arange(self.group, device=self.device)
        backend = self.use_kernel()
        fused = backend == "cpp"
        for index, segment in enumerate(self.segments):
            starts = self.segment_starts(index)
            slots = (starts.unsqueeze(-1) + offsets).view(b, -1)  # [B, n*G] token index of each entry
            valid = (starts >= 0).repeat_interleave(self.group, dim=1)
            if backend == "triton":  # codes and scales read once, dequantized in registers
                everything = attention_mask is None and q_len == 1 and bool(valid.all())
                seen = (
                    None if everything else self.visible(attention_mask, slots, valid, first, q_len, groups)
                )
                softmax.add_part(*_triton_attention(packed, segment, self.bits, softmax.scaling, seen))
                continue
            if fused:
                everything = attention_mask is None and q_len == 1 and bool(valid.all())
                seen = (
                    None if everything else self.visible(attention_mask, slots, valid, first, q_len, groups)
                )
                logits = cpu_quant.block_logits(
                    packed, segment.key_codes, segment.key_scale, segment.key_min, self.bits, softmax.scaling
                )
                softmax.add_scaled(
                    logits, seen, functools.partial(_fused_values, blocks=segment, bits=self.bits)
                )
                continue
            softmax.add_logits(
                block_logits(packed, segment, self.bits),
                dequantize_values(segment, self.bits),
                self.visible(attention_mask, slots, valid, first, q_len, groups),
            )
        slots, valid = self.recent_slots()
        softmax.add(
            self.recent_keys,
            self.recent_values,
            self.visible(attention_mask, slots, valid, first, q_len, groups),
        )
        out = softmax.result().view(b, hq, q_len, d)
        return out.transpose(1, 2).contiguous().to(query.dtype)

    def use_kernel(self) -> str:
        """The backend of attention over the blocks: ``cpp``, ``triton`` or ``torch`` (``kernel`` option,
        :func:`kvweave.kernels.registry.choose`); recorded in ``kernel_used``."""
        self.kernel_used = choose(QUANT_DECODE, self.kernel_choice, self.device)
        return self.kernel_used

    def visible(
        self,
        attention_mask: torch.Tensor | None,
        slots: torch.Tensor,
        valid: torch.Tensor,
        first: int,
        q_len: int,
        groups: int,
    ) -> torch.Tensor:
        """``[B, 1, groups*q, T]``: which entries (token ``slots: [B, T]``, ``valid: [B, T]``) each packed row sees."""
        seen = visible_mask(attention_mask, slots.clamp(min=0).unsqueeze(1), first, q_len)  # [B, 1, q, T]
        seen = seen & valid.view(valid.shape[0], 1, 1, -1)
        return seen.unsqueeze(2).expand(-1, -1, groups, -1, -1).reshape(seen.shape[0], 1, groups * q_len, -1)

    # -- inspection
    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Everything held, dequantized (reference for tests): ``keys, values: [B, H, T, D]`` float32,
        ``slots: [B, T]`` token index of each entry and ``valid: [B, T]``."""
        parts_k, parts_v, parts_s, parts_ok = [], [], [], []
        offsets = torch.arange(self.group, device=self.device)
        for index, segment in enumerate(self.segments):
            starts = self.segment_starts(index)
            keys, values = dequantize_blocks(segment, self.bits)
            parts_k.append(keys)
            parts_v.append(values)
            parts_s.append((starts.unsqueeze(-1) + offsets).view(self.rows, -1))
            parts_ok.append((starts >= 0).repeat_interleave(self.group, dim=1))
        slots, valid = self.recent_slots()
        parts_k.append(self.recent_keys.float())
        parts_v.append(self.recent_values.float())
        parts_s.append(slots)
        parts_ok.append(valid)
        return torch.cat(parts_k, 2), torch.cat(parts_v, 2), torch.cat(parts_s, 1), torch.cat(parts_ok, 1)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.segments = [
            segment.map(lambda t: t.index_select(0, rows.to(t.device))) for segment in self.segments
        ]
        super().select_rows(rows)

    def nbytes(self) -> int:
        """Bytes held: packed codes, float16 scales and minima, the exact tail and the bookkeeping."""
        tensors = [t for segment in self.segments for t in segment.tensors()]
        tensors += [self.recent_keys, self.recent_values, self.recent_count, self.block_start]
        return tensors_nbytes(tensors + ([self.pad_count] if self.pad_count is not None else []))

    def entries(self) -> int:
        """Tokens held per row (quantized + exact), the largest over rows."""
        if self.recent_count.numel() == 0:
            return 0
        quantized = (self.block_start >= 0).sum(dim=1) * self.group
        return int((quantized + self.recent_count).max())

    def layer_stats(self) -> dict[str, Any]:
        blocks = int((self.block_start >= 0).sum(dim=1).max()) if self.block_start.numel() else 0
        exact = int(self.recent_count.max()) if self.recent_count.numel() else 0
        return {
            "entries": self.entries(),
            "quantized_tokens": blocks * self.group,
            "exact_tokens": exact,
            "bits": self.bits,
            "kernel": self.kernel_used,
        }
