"""The kvweave method a vLLM run uses, and the byte layout of one KV slot (one token of one KV head).

Torch only (no vLLM import), so the layouts are tested against kvweave's own quantizers without an engine.

- ``quant`` (KIVI, asymmetric min/max codes of :func:`kvweave.ops.quantize.quantize`, packed ``8 // bits`` per
  byte by :func:`~kvweave.ops.quantize.pack_codes`): keys per channel over groups of ``key_group`` tokens of a
  block (the groups' scales in a per-block header spread over the slots' tails), values per token. A per-channel
  scale needs its whole group, and vLLM writes a block slot by slot as decode proceeds, so a group's exact keys
  wait outside the page until its last token arrives (docs/vllm.md, "quant").
- ``pages`` (DK-Cache's far-tier page retrieval alone, Quest's bound; named ``dkcache`` before): each slot holds the exact key and value in the model's dtype, plus a
  small tail; the tails of a block's ``block_size`` slots, read together, hold that block's per-channel key
  minimum and maximum in the model's dtype (the Quest summary, :mod:`kvweave.ops.pages`). The summaries live in
  vLLM's own pages, so the allocator accounts for them.
- ``depthweave`` (DepthWeave's per-layer form, fixed basis): each token's keys (de-rotated, pre-RoPE) and values
  are stored as ``rank_k`` / ``rank_v`` coordinates on a per-request, per-layer basis fitted to the request's
  first prefill chunk (centred, columns normalised, INT4/INT8 with one float16 scale per slot and side); the
  coordinates of the ``H·D``-wide row are split over the token's ``H`` slots. Each block keeps up to ``exact``
  tokens per KV head exact (the ones the basis represents worst), in float16, in its slots' tails. The basis,
  the column scales and the request's first ``sinks`` tokens (exact) live beside the pages
  (:class:`~kvweave.vllm.backend.WeaveBases`); nothing refits, so a full block never changes. With
  ``decode_tokens`` (selective decode) the tails also hold, per KV head, the float16 per-channel minimum and
  maximum of the block's keys as a decode step rebuilds them (rotated, exact rows laid over), written when the
  block fills: a decode row scores those bounds and reads only the blocks that could score highest.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch

from kvweave.ops.quantize import pack_codes, quantize, unpack_codes

ENV_METHOD = "KVWEAVE_VLLM_METHOD"
METHODS = ("quant", "pages", "depthweave")
_SCALE_BYTES = 2  # float16 scale and minimum
_ALIGN = 4  # slot bytes stay a multiple of 4 so float32 models can view the page too


@dataclasses.dataclass(frozen=True)
class VllmMethod:
    """A kvweave method for vLLM: ``quant`` (``bits``; ``key_group``: tokens per per-channel key scale;
    ``group``: channels per value scale, 0 = the whole head), ``pages`` (``sink_blocks``, ``core_blocks``,
    ``top_blocks``) or ``depthweave`` (``bits`` 8 or 4; ``rank_k``, ``rank_v``: coordinates per token over all
    KV heads; ``exact``: exact tokens per block and KV head; ``sinks``: the request's first tokens kept exact;
    ``decode_tokens``: stored tokens a decode row reads per KV head beside its first and newest blocks, in whole
    blocks chosen by their key bounds, 0 = every block)."""

    name: str
    bits: int = 4
    group: int = 0
    key_group: int = 64
    sink_blocks: int = 1
    core_blocks: int = 4
    top_blocks: int = 8
    rank_k: int = 32
    rank_v: int = 48
    exact: int = 2
    sinks: int = 4
    decode_tokens: int = 0

    def __post_init__(self) -> None:
        if self.name == "dkcache":
            raise ValueError(
                f"{ENV_METHOD}: vLLM does not serve dkcache (its tiers, key decoupling and compensation are not "
                "ported); its far-tier page retrieval alone is the method 'pages', e.g. pages:top_blocks=8"
            )
        if self.name not in METHODS:
            raise ValueError(
                f"{ENV_METHOD}: method {self.name!r} is not available in vLLM; choose from {METHODS}"
            )
        if self.bits not in (8, 4, 2):
            raise ValueError(
                f"{ENV_METHOD}: quant option bits={self.bits} is not supported; choose 8, 4 or 2"
            )
        if self.name == "depthweave" and self.bits not in (8, 4):
            raise ValueError(
                f"{ENV_METHOD}: depthweave option bits={self.bits} is not supported; choose 8 or 4"
            )
        for option in ("rank_k", "rank_v"):
            if getattr(self, option) < 1:
                raise ValueError(
                    f"{ENV_METHOD}: depthweave option {option}={getattr(self, option)} must be >= 1"
                )
        for option in ("exact", "sinks", "decode_tokens"):
            if getattr(self, option) < 0:
                raise ValueError(
                    f"{ENV_METHOD}: depthweave option {option}={getattr(self, option)} must be >= 0"
                )
        if self.key_group < 1:
            raise ValueError(
                f"{ENV_METHOD}: option key_group={self.key_group} must be >= 1 (tokens per key scale)"
            )
        if self.group < 0:
            raise ValueError(f"{ENV_METHOD}: option group={self.group} must be >= 0 (0: one group per head)")
        for option in ("sink_blocks", "core_blocks", "top_blocks"):
            if getattr(self, option) < (1 if option == "core_blocks" else 0):
                raise ValueError(
                    f"{ENV_METHOD}: pages option {option}={getattr(self, option)} is out of range "
                    f"(core_blocks >= 1, the others >= 0)"
                )

    @classmethod
    def parse(cls, spec: str) -> VllmMethod:
        """``"quant:bits=4,group=32"`` -> :class:`VllmMethod` (a one-line ``ValueError`` names a bad part)."""
        return _parse(spec.strip())

    def spec(self) -> str:
        """The canonical spec string (the options that apply to this method)."""
        if self.name == "quant":
            return f"quant:bits={self.bits},group={self.group},key_group={self.key_group}"
        if self.name == "depthweave":
            return (
                f"depthweave:bits={self.bits},rank_k={self.rank_k},rank_v={self.rank_v},exact={self.exact},"
                f"sinks={self.sinks}" + (f",decode_tokens={self.decode_tokens}" if self.decode_tokens else "")
            )
        return f"pages:sink_blocks={self.sink_blocks},core_blocks={self.core_blocks},top_blocks={self.top_blocks}"

    def slot_bytes(self, head_size: int, dtype: torch.dtype, block_size: int, heads: int = 1) -> int:
        """Bytes of one KV slot (what vLLM's ``AttentionSpec.state_content_bytes`` declares)."""
        if self.name == "quant":
            return QuantSlot.of(self, head_size, block_size).nbytes
        if self.name == "depthweave":
            return WeaveSlot.of(self, head_size, heads, block_size).nbytes
        return PageSlot.of(head_size, dtype, block_size).nbytes


@functools.lru_cache(maxsize=32)
def _parse(spec: str) -> VllmMethod:
    """A spec read as kvweave reads every spec (:func:`kvweave.registry.split_spec`), options checked here."""
    from kvweave.registry import split_spec

    fields = {f.name: f.type for f in dataclasses.fields(VllmMethod) if f.name != "name"}
    try:
        name, texts = split_spec(spec)
    except ValueError as error:
        raise ValueError(f"{ENV_METHOD}: {error}") from None
    options: dict[str, int] = {}
    for key, value in texts.items():
        if key not in fields:
            raise ValueError(
                f"{ENV_METHOD}: cannot read {key}={value} in {spec!r}; write name:option=value,... with options "
                f"from {sorted(fields)}"
            )
        try:
            options[key] = int(value)
        except ValueError:
            raise ValueError(f"{ENV_METHOD}: option {key}={value!r} must be an integer") from None
    return VllmMethod(name, **options)  # type: ignore[arg-type]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


# ----------------------------------------------------------------------------------------------- quant


@dataclasses.dataclass(frozen=True)
class QuantSlot:
    """``[key codes | value codes | value scale, value min | header tail]`` (bytes), KIVI's split:

    - keys **per channel** over groups of ``key_group`` consecutive tokens of a block: codes packed along
      channels in the slot; each group's float16 ``(scale [D], minimum [D])`` live in the block's header — the
      tails of its ``block_size`` slots read together (``block_size / key_group`` groups of ``4·D`` bytes);
    - values **per token**, one float16 (scale, minimum) per ``group`` channels, in the slot.

    A key group is quantized when its last token is written; until then its tokens' exact keys wait in the
    backend's residual (:class:`~kvweave.vllm.backend.KeyResidual`)."""

    head_size: int
    bits: int
    group: int
    key_group: int
    block_size: int

    @classmethod
    def of(cls, method: VllmMethod, head_size: int, block_size: int) -> QuantSlot:
        group = method.group or head_size
        if head_size % group or group % (8 // method.bits):
            raise ValueError(
                f"{ENV_METHOD}: quant option group={method.group} does not fit head_size {head_size} at "
                f"bits={method.bits}; use 0 (one group per head) or a divisor of {head_size}"
            )
        if block_size % method.key_group:
            raise ValueError(
                f"{ENV_METHOD}: quant option key_group={method.key_group} must divide vLLM's block size "
                f"{block_size}; pick a divisor (e.g. 64) or set --block-size"
            )
        return cls(head_size, method.bits, group, method.key_group, block_size)

    @property
    def code_bytes(self) -> int:
        return self.head_size * self.bits // 8

    @property
    def value_groups(self) -> int:
        return self.head_size // self.group

    @property
    def value_bytes(self) -> int:
        """Value codes + their scales and minima."""
        return self.code_bytes + 2 * self.value_groups * _SCALE_BYTES

    @property
    def header_bytes(self) -> int:
        """Per block and head: ``(scale, minimum)`` of every key group, ``[groups, 2, D]`` float16."""
        return self.block_size // self.key_group * 2 * self.head_size * _SCALE_BYTES

    @property
    def tail_bytes(self) -> int:
        used = self.code_bytes + self.value_bytes
        return _aligned(used + math.ceil(self.header_bytes / self.block_size)) - used

    @property
    def nbytes(self) -> int:
        return self.code_bytes + self.value_bytes + self.tail_bytes

    def pack_values(self, value: torch.Tensor) -> torch.Tensor:
        """``value: [N, H, D]`` -> ``[N, H, value_bytes]`` uint8 (codes, then scales and minima)."""
        grouped = value.reshape(*value.shape[:-1], self.value_groups, self.group)
        codes, scale, minimum = quantize(grouped, -1, self.bits)  # per token, per channel group
        meta = torch.cat([scale.squeeze(-1), minimum.squeeze(-1)], dim=-1).contiguous().view(torch.uint8)
        return torch.cat([pack_codes(codes.flatten(-2), self.bits), meta], dim=-1)

    def quantize_keys(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole key groups ``keys: [U, H, key_group, D]`` -> packed codes ``[U, H, key_group, code_bytes]`` and
        the groups' header bytes ``[U, H, 4·D]`` (per channel over the group's tokens, KIVI)."""
        codes, scale, minimum = quantize(keys, 2, self.bits)  # scale, minimum: [U, H, 1, D]
        header = torch.cat([scale, minimum], dim=2).flatten(-2).contiguous().view(torch.uint8)
        return pack_codes(codes, self.bits), header

    def header_view(self, blocks: torch.Tensor) -> torch.Tensor:
        """Blocks ``[nb, H, block_size, nbytes]`` -> their key headers' bytes ``[nb, H, header_bytes]``."""
        start = self.code_bytes + self.value_bytes
        return blocks[..., start:].flatten(-2)[..., : self.header_bytes]

    def unpack(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks ``[nb, H, block_size, nbytes]`` uint8 -> float32 ``keys, values: [nb, H, block_size, D]``.

        Keys of a key group not yet quantized are meaningless here (the caller takes them from the residual)."""
        c, d = self.code_bytes, self.head_size
        header = self.header_view(blocks).contiguous().view(torch.float16).float()
        header = header.unflatten(-1, (-1, 2, d))  # [nb, H, groups, 2, D]
        scale = header[..., 0, :].repeat_interleave(self.key_group, dim=2)  # [nb, H, block_size, D]
        minimum = header[..., 1, :].repeat_interleave(self.key_group, dim=2)
        keys = unpack_codes(blocks[..., :c].contiguous(), self.bits).float() * scale + minimum
        meta = blocks[..., 2 * c : c + self.value_bytes].contiguous().view(torch.float16).float()
        value_scale, value_min = meta.split(self.value_groups, dim=-1)
        codes = unpack_codes(blocks[..., c : 2 * c].contiguous(), self.bits).float()
        codes = codes.unflatten(-1, (self.value_groups, self.group))
        values = (codes * value_scale.unsqueeze(-1) + value_min.unsqueeze(-1)).flatten(-2)
        return keys, values


# ----------------------------------------------------------------------------------------------- pages


@dataclasses.dataclass(frozen=True)
class PageSlot:
    """``[key | value | summary tail]`` (bytes): exact key and value in ``dtype``; the tails of a block's
    slots, concatenated in slot order, start with the block's key summary ``[2, D]`` (min, max) in ``dtype``."""

    head_size: int
    dtype: torch.dtype
    block_size: int

    @classmethod
    def of(cls, head_size: int, dtype: torch.dtype, block_size: int) -> PageSlot:
        return cls(head_size, dtype, block_size)

    @property
    def element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def kv_bytes(self) -> int:
        return 2 * self.head_size * self.element_size

    @property
    def summary_bytes(self) -> int:
        return 2 * self.head_size * self.element_size

    @property
    def tail_bytes(self) -> int:
        return _aligned(math.ceil(self.summary_bytes / self.block_size))

    @property
    def nbytes(self) -> int:
        return self.kv_bytes + self.tail_bytes

    def pack(self, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """``key, value: [N, H, D]`` -> the key/value part of the slots, ``[N, H, kv_bytes]`` uint8."""
        kv = torch.cat([key.to(self.dtype), value.to(self.dtype)], dim=-1).contiguous()
        return kv.view(torch.uint8)

    def unpack(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots ``[..., nbytes]`` uint8 -> ``key, value: [..., D]`` in ``dtype``."""
        kv = slots[..., : self.kv_bytes].contiguous().view(self.dtype)
        return kv[..., : self.head_size], kv[..., self.head_size :]

    def summaries(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks ``[nb, H, block_size, nbytes]`` uint8 -> key ``(min, max)``, each ``[nb, H, D]`` in ``dtype``."""
        tails = blocks[..., self.kv_bytes :].flatten(-2)[..., : self.summary_bytes].contiguous()
        low_high = tails.view(self.dtype).unflatten(-1, (2, self.head_size))
        return low_high[..., 0, :], low_high[..., 1, :]

    def summary_tails(self, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
        """Summaries ``low, high: [U, H, D]`` -> the tails of the blocks' slots, ``[U, H, block_size, tail]``."""
        data = torch.cat([low.to(self.dtype), high.to(self.dtype)], dim=-1).contiguous().view(torch.uint8)
        padded = torch.nn.functional.pad(data, (0, self.block_size * self.tail_bytes - self.summary_bytes))
        return padded.unflatten(-1, (self.block_size, self.tail_bytes))


# ----------------------------------------------------------------------------------------------- depthweave

_EXACT_META = 4  # per exact row: its slot offset (int16) and its error (float16)


@dataclasses.dataclass(frozen=True)
class WeaveSlot:
    """``[key codes | value codes | key scale, value scale | tail]`` (bytes) of one token and KV head.

    - codes: this head's share (``rank / H`` consecutive coordinates) of the token's key and value coordinates,
      symmetric integers offset by ``2^(bits-1)``, packed by :func:`~kvweave.ops.quantize.pack_codes`; one
      float16 scale per side;
    - the tails of a block's slots, read together per KV head, hold its ``exact`` exact rows:
      ``offsets int16 [E] | errors float16 [E] | keys float16 [E, D] | values float16 [E, D]`` (offset -1: empty),
      then with ``bounds`` the block's key bounds ``minimum float16 [D] | maximum float16 [D]``.
    """

    head_size: int
    heads: int
    rank_k: int
    rank_v: int
    bits: int
    exact: int
    block_size: int
    bounds: bool = False

    @classmethod
    def of(cls, method: VllmMethod, head_size: int, heads: int, block_size: int) -> WeaveSlot:
        per = 8 // method.bits
        for option in ("rank_k", "rank_v"):
            rank = getattr(method, option)
            if rank > heads * head_size or rank % (heads * per):
                raise ValueError(
                    f"{ENV_METHOD}: depthweave option {option}={rank} must be a multiple of {heads * per} "
                    f"(KV heads x codes per byte) and at most {heads * head_size} (KV heads x head size)"
                )
        if method.exact >= block_size:
            raise ValueError(
                f"{ENV_METHOD}: depthweave option exact={method.exact} must be below the block size {block_size}"
            )
        return cls(
            head_size,
            heads,
            method.rank_k,
            method.rank_v,
            method.bits,
            method.exact,
            block_size,
            method.decode_tokens > 0,
        )

    @property
    def k_share(self) -> int:
        return self.rank_k // self.heads

    @property
    def v_share(self) -> int:
        return self.rank_v // self.heads

    @property
    def k_bytes(self) -> int:
        return self.k_share * self.bits // 8

    @property
    def v_bytes(self) -> int:
        return self.v_share * self.bits // 8

    @property
    def code_end(self) -> int:
        return self.k_bytes + self.v_bytes

    @property
    def scale_end(self) -> int:
        return self.code_end + 2 * _SCALE_BYTES

    @property
    def exact_bytes(self) -> int:
        """Per block and KV head: the exact rows with their offsets and errors."""
        return self.exact * (_EXACT_META + 4 * self.head_size)

    @property
    def bounds_bytes(self) -> int:
        """Per block and KV head: the key bounds (float16 minimum and maximum per channel), with ``bounds``."""
        return 4 * self.head_size if self.bounds else 0

    @property
    def tail_bytes(self) -> int:
        used = self.exact_bytes + self.bounds_bytes
        return _aligned(self.scale_end + math.ceil(used / self.block_size)) - self.scale_end

    @property
    def nbytes(self) -> int:
        return self.scale_end + self.tail_bytes

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def pack(self, k_coords: torch.Tensor, v_coords: torch.Tensor) -> torch.Tensor:
        """Coordinates ``[N, rank_k]``, ``[N, rank_v]`` -> the slots' code and scale bytes ``[N, H, scale_end]``."""
        codes, scales = [], []
        offset = self.qmax + 1
        for coords, share in ((k_coords, self.k_share), (v_coords, self.v_share)):
            x = coords.float().reshape(coords.shape[0], self.heads, share)
            scale = (x.abs().amax(-1, keepdim=True) / self.qmax).clamp(1e-8, 6e4).half()
            code = (x / scale.float()).round().clamp(-self.qmax, self.qmax) + offset
            codes.append(pack_codes(code.to(torch.uint8), self.bits))
            scales.append(scale)
        meta = torch.cat(scales, dim=-1).contiguous().view(torch.uint8)
        return torch.cat([*codes, meta], dim=-1)

    def unpack(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots ``[..., H, T, nbytes]`` -> coordinates ``[..., T, rank_k]``, ``[..., T, rank_v]`` in float32
        (for packed tokens ``[N, H, scale_end]`` pass ``packed.transpose(0, 1)``)."""
        offset = self.qmax + 1
        scales = slots[..., self.code_end : self.scale_end].contiguous().view(torch.float16).float()
        k = unpack_codes(slots[..., : self.k_bytes].contiguous(), self.bits).float() - offset
        v = unpack_codes(slots[..., self.k_bytes : self.code_end].contiguous(), self.bits).float() - offset
        k, v = k * scales[..., :1], v * scales[..., 1:]
        # [..., H, T, share] -> [..., T, H·share]: the head's share is its block of the coordinates
        return k.transpose(-3, -2).flatten(-2), v.transpose(-3, -2).flatten(-2)

    def tails(self, blocks: torch.Tensor) -> torch.Tensor:
        """Blocks ``[nb, H, block_size, nbytes]`` -> their exact-row bytes ``[nb, H, exact_bytes]`` (a copy)."""
        return blocks[..., self.scale_end :].flatten(-2)[..., : self.exact_bytes].contiguous()

    @property
    def bounds_slots(self) -> slice:
        """The slots of a block whose tails hold its key bounds (a decode step reads only these)."""
        first = self.exact_bytes // self.tail_bytes
        return slice(first, -(-(self.exact_bytes + self.bounds_bytes) // self.tail_bytes))

    def read_bounds(self, tails: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tails of the bounds' slots, ``blocks[:, :, layout.bounds_slots, layout.scale_end:]`` (``[nb, H,
        slots, tail_bytes]``) -> the blocks' key ``minimum, maximum: [nb, H, D]`` float32."""
        assert self.bounds, "this layout holds no key bounds (decode_tokens=0)"
        at = self.exact_bytes - self.bounds_slots.start * self.tail_bytes
        data = tails.flatten(-2)[..., at : at + self.bounds_bytes].contiguous()
        bounds = data.view(torch.float16).float().unflatten(-1, (2, self.head_size))
        return bounds[..., 0, :], bounds[..., 1, :]

    def write_bounds(self, blocks: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
        """``blocks: [nb, H, block_size, nbytes]`` with ``low, high: [nb, H, D]`` written as their key bounds
        (rounded outward to float16, so they still bound the keys): the blocks' new tail bytes
        ``[nb, H, block_size, tail_bytes]`` (the exact rows kept)."""
        assert self.bounds, "this layout holds no key bounds (decode_tokens=0)"
        tails = blocks[..., self.scale_end :].flatten(-2).clone()
        down, up = low.half(), high.half()
        down = torch.where(down.float() > low, torch.nextafter(down, torch.full_like(down, -torch.inf)), down)
        up = torch.where(up.float() < high, torch.nextafter(up, torch.full_like(up, torch.inf)), up)
        data = torch.stack([down, up], dim=-2).flatten(-2).contiguous().view(torch.uint8)
        tails[..., self.exact_bytes : self.exact_bytes + self.bounds_bytes] = data
        return tails.unflatten(-1, (self.block_size, self.tail_bytes))

    def read_exact(
        self, tails: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tail bytes ``[..., exact_bytes]`` -> ``offsets`` (long, -1 empty), ``errors`` (float32; -inf empty),
        ``keys, values`` (float16) ``[..., E(, D)]``."""
        e, d = self.exact, self.head_size
        offsets = tails[..., : 2 * e].contiguous().view(torch.int16).long()
        errors = tails[..., 2 * e : 4 * e].contiguous().view(torch.float16).float()
        rows = tails[..., 4 * e :].contiguous().view(torch.float16).unflatten(-1, (2, e, d))
        errors = errors.masked_fill(offsets < 0, float("-inf"))
        return offsets, errors, rows[..., 0, :, :], rows[..., 1, :, :]

    def write_exact(
        self, offsets: torch.Tensor, errors: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        """The inverse of :meth:`read_exact`, padded to the blocks' slots: ``[U, H, block_size, tail_bytes]``."""
        data = torch.cat(
            [
                offsets.to(torch.int16).contiguous().view(torch.uint8),
                errors.clamp(-6e4, 6e4).half().contiguous().view(torch.uint8),
                torch.stack([keys.half(), values.half()], dim=-3).flatten(-3).contiguous().view(torch.uint8),
            ],
            dim=-1,
        )
        padded = torch.nn.functional.pad(data, (0, self.block_size * self.tail_bytes - self.exact_bytes))
        return padded.unflatten(-1, (self.block_size, self.tail_bytes))

    def choose_blocks(
        self,
        queries: torch.Tensor,
        pages: torch.Tensor,
        ids: list[torch.Tensor],
        cached: list[int],
        decode_tokens: int,
        sinks: int,
    ) -> tuple[list[torch.Tensor | None], int]:
        """Selective decode (``decode_tokens``): per decode row ``queries[r]: [H, g, D]`` (its request's blocks
        ``ids[r]``, ``cached[r]`` stored tokens), the blocks it reads per KV head, ``[H, K]`` indices into
        ``ids[r]``, sorted: the blocks holding the ``sinks``, the newest full block, the newest partial one, and
        the ``decode_tokens / block_size`` other full blocks whose key bounds give the largest upper bound of
        ``q·k`` over the head's query group (Quest's bound). ``None`` for a row with no more blocks than that:
        it reads every block. The rows' bounds are scored together; also returns how many blocks' bounds were
        scored per KV head. ``kvweave.kernels.cpu_vllm_weave.choose_rows`` is this in one C++ call."""
        block_size, heads = pages.shape[2], queries.shape[1]
        budget = max(1, decode_tokens // block_size)
        spans = [  # per row: (first candidate, end of candidates, held)
            (*choice_span(n, block_size, sinks), row_ids.shape[0])
            for row_ids, n in zip(ids, cached, strict=True)
        ]
        choosing = [r for r, (first, end, _) in enumerate(spans) if end - first > budget]
        out: list[torch.Tensor | None] = [None] * len(ids)
        if not choosing:
            return out, 0
        width = max(spans[r][1] - spans[r][0] for r in choosing)
        offset = torch.arange(width)
        index = torch.stack(
            [ids[r][(spans[r][0] + offset).clamp(max=spans[r][1] - 1)] for r in choosing]
        )  # [C, width] block ids (a short row repeats its last candidate: masked below)
        low, high = self.read_bounds(pages[index, :, self.bounds_slots, self.scale_end :])  # [C, w, H, D]
        q = queries[choosing].float()  # [C, H, g, D]
        bound = (q.clamp(min=0) @ high.permute(0, 2, 3, 1) + q.clamp(max=0) @ low.permute(0, 2, 3, 1)).amax(
            2
        )  # [C, H, w]
        lengths = torch.tensor([spans[r][1] - spans[r][0] for r in choosing])
        bound = bound.masked_fill((offset >= lengths.view(-1, 1)).unsqueeze(1), float("-inf"))
        top = bound.topk(budget, dim=-1).indices  # [C, H, budget]
        for i, r in enumerate(choosing):
            first, end, held = spans[r]
            fixed = torch.cat([torch.arange(first), torch.arange(end, held)])
            chosen = torch.cat([fixed.expand(heads, -1), top[i] + first], dim=1)
            out[r] = chosen.sort(dim=1).values
        return out, int(lengths.sum())

    def store(
        self,
        pages: torch.Tensor,
        blocks: torch.Tensor,
        offsets: torch.Tensor,
        flat: tuple[torch.Tensor, torch.Tensor],
        exact: tuple[torch.Tensor, torch.Tensor],
        coords: tuple[torch.Tensor, torch.Tensor],
        decoders: tuple[Any, Any],
    ) -> None:
        """Write tokens into slots ``(blocks, offsets): [n]`` of ``pages: [NB, H, block_size, nbytes]``: their
        coordinates ``coords`` packed, the blocks' worst represented tokens exact in the tails (the error of
        ``decoders`` applied to the stored coordinates against ``flat``: pre-RoPE keys and values ``[n, H·D]``;
        ``exact: [n, H, D]`` the tokens' exact rows). ``kvweave.kernels.cpu_vllm_weave.store_rows`` is this for
        decode rows in one C++ call."""
        packed = self.pack(*coords)  # [n, H, scale_end]
        pages[blocks, :, offsets, : self.scale_end] = packed
        if self.exact:
            (k_decode, v_decode), (ck, cv), (k_pre, v_flat) = (
                decoders,
                self.unpack(packed.transpose(0, 1)),
                flat,
            )
            error = relative_error(k_decode(ck), k_pre, self.heads) + relative_error(
                v_decode(cv), v_flat, self.heads
            )  # [n, H]: how badly the stored form represents each token
            self.keep_worst_exact(pages, blocks, offsets, error, *exact)

    def keep_worst_exact(
        self,
        pages: torch.Tensor,
        blocks: torch.Tensor,
        offsets: torch.Tensor,
        error: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        """Per block and KV head, keep exact the ``self.exact`` tokens with the largest error among those already
        exact and the ones just written (``error: [N, H]``; ``keys, values: [N, H, D]`` exact). A block written
        from its first slot starts with none; a token written again (vLLM recomputing a cached block's last token)
        replaces its own entry."""
        e, block_size = self.exact, pages.shape[2]
        touched, inverse = torch.unique(blocks, return_inverse=True)
        u, heads = touched.shape[0], error.shape[1]
        old_off, old_err, old_k, old_v = self.read_exact(self.tails(pages[touched]))  # [U, H, E(, D)]
        fresh = torch.zeros(u, dtype=torch.bool).index_fill_(0, inverse[offsets == 0], True)
        written = torch.zeros(u, block_size, dtype=torch.bool)
        written[inverse, offsets] = True
        rewritten = written.gather(1, old_off.clamp(min=0).flatten(1)).view_as(old_off)
        old_err = old_err.masked_fill(fresh.view(-1, 1, 1) | rewritten | (old_off < 0), float("-inf"))
        candidates = torch.full((u, heads, e + block_size), float("-inf"))
        candidates[:, :, :e] = old_err
        head = torch.arange(heads)
        candidates[inverse.unsqueeze(1), head, (e + offsets).unsqueeze(1)] = error.float()
        rows = torch.zeros(u, heads, e + block_size, 2, keys.shape[-1], dtype=torch.float16)
        rows[:, :, :e, 0], rows[:, :, :e, 1] = old_k, old_v
        rows[inverse.unsqueeze(1), head, (e + offsets).unsqueeze(1)] = torch.stack(
            [keys, values], dim=2
        ).half()
        best_err, best = candidates.topk(e, dim=-1)  # [U, H, E]
        from_old = best < e
        offset = torch.where(from_old, old_off.gather(2, best.clamp(max=e - 1)), best - e)
        offset = offset.masked_fill(best_err == float("-inf"), -1)
        chosen = rows.gather(2, best[..., None, None].expand(-1, -1, -1, 2, keys.shape[-1]))
        chosen = chosen.masked_fill((best_err == float("-inf"))[..., None, None], 0.0)  # empty entries: zeros
        tails = self.write_exact(offset, best_err, chosen[..., 0, :], chosen[..., 1, :])
        pages[touched, :, :, self.scale_end :] = tails


@dataclasses.dataclass
class Basis:
    """One side (keys pre-RoPE, or values) of one request and layer: ``x ≈ (c ⊙ scale) · rows + mean``.

    ``rows: [r, H·D]`` orthonormal (float16), the top eigenvectors of the centred rows' Gram; ``scale: [r]`` the
    coordinates' RMS over the fitted rows, so stored coordinates are about unit-sized in every column."""

    mean: torch.Tensor  # [H·D] float32
    rows: torch.Tensor  # [r, H·D] float16
    scale: torch.Tensor  # [r] float32

    @classmethod
    def fit(cls, x: torch.Tensor, rank: int) -> Basis:
        """The rank-``rank`` basis of ``x: [n, H·D]`` (any ``n >= 1``: few rows leave arbitrary orthonormal
        directions, whose column scales fall back to a floor)."""
        x = x.float()
        mean = x.mean(0)
        centred = (x - mean).double()
        _, vectors = torch.linalg.eigh(centred.T @ centred)
        rows = vectors[:, -rank:].flip(-1).T.float()  # [r, H·D], largest first
        coords = (x - mean) @ rows.T
        floor = 1e-2 * float(x.pow(2).mean().sqrt()) + 1e-6
        scale = coords.pow(2).mean(0).sqrt().clamp(min=floor)
        return cls(mean, rows.half(), scale)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [N, H·D]`` -> normalised coordinates ``[N, r]``."""
        return (x.float() - self.mean) @ self.rows.float().T / self.scale

    def decode(self, coords: torch.Tensor) -> torch.Tensor:
        """Normalised coordinates ``[N, r]`` -> rows ``[N, H·D]`` float32."""
        return (coords * self.scale) @ self.rows.float() + self.mean

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.mean, self.rows, self.scale))


def choice_span(cached: int, block_size: int, sinks: int) -> tuple[int, int]:
    """Selective decode's candidates for a row of ``cached`` stored tokens: the blocks ``first .. end - 1``
    between the blocks holding the ``sinks`` (always read) and the newest full block (always read; a partial
    newest block is read exact)."""
    full = cached // block_size  # blocks with bounds
    first = min(max(1, -(-sinks // block_size)), full)
    return first, max(full - 1, first)


def encode_rows(bases: list[Basis], x: torch.Tensor) -> torch.Tensor:
    """Row ``i`` of ``x: [R, H·D]`` on ``bases[i]`` (:meth:`Basis.encode` of each, batched) -> ``[R, r]``."""
    mean = torch.stack([b.mean for b in bases])
    rows = torch.stack([b.rows for b in bases]).float()  # [R, r, H·D]
    scale = torch.stack([b.scale for b in bases])
    return torch.bmm(rows, (x.float() - mean).unsqueeze(-1)).squeeze(-1) / scale


def decode_rows(bases: list[Basis], coords: torch.Tensor) -> torch.Tensor:
    """Row ``i`` of ``coords: [R, r]`` through ``bases[i]`` (:meth:`Basis.decode` of each, batched)."""
    rows = torch.stack([b.rows for b in bases]).float()
    scale = torch.stack([b.scale for b in bases])
    mean = torch.stack([b.mean for b in bases])
    return torch.bmm((coords * scale).unsqueeze(1), rows).squeeze(1) + mean


def relative_error(stored: torch.Tensor, exact: torch.Tensor, heads: int) -> torch.Tensor:
    """``[n, H·D]`` rows -> ``[n, H]`` squared error over squared norm, per KV head."""
    error = (stored - exact).view(exact.shape[0], heads, -1).pow(2).sum(-1)
    return error / exact.view(exact.shape[0], heads, -1).pow(2).sum(-1).clamp(min=1e-12)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin: [T, D]`` float32 of the ``rotate_half`` rotary embedding at ``positions: [T]``."""
    freqs = positions.float().unsqueeze(-1) * inv_freq.float()
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos(), angles.sin()
