"""Storage of one batch row of one group (:class:`RowStore`): per-layer coefficients, ragged coordinate segments,
exact residual rows, and what they cost in bytes. How the bases are found and refreshed: :mod:`.factorize`."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from kvweave.cache import tensors_nbytes
from kvweave.methods.depthweave.chunk import EXACT, HI, LO, MID, Chunk, Plan
from kvweave.methods.depthweave.parts import DensePart, FactorPart
from kvweave.ops.pages import PageBounds
from kvweave.ops.quantize import Packed, pack, packed_bytes
from kvweave.state import Stateful

if TYPE_CHECKING:
    from kvweave.methods.depthweave import DepthWeave
    from kvweave.ops.rope import Rotary

COORD_GROUP = 64  # rows sharing one scale per column in quantized token-side coordinates


@dataclasses.dataclass
class Segment(Stateful):
    """Tokens stored at one coordinate width pair: ``coords_k: [n, w_k]``, ``coords_v: [n, w_v]``."""

    state_name = "depthweave.Segment"

    coords_k: Packed
    coords_v: Packed
    slots: torch.Tensor  # [n] int32
    positions: torch.Tensor | None  # [n] int32 (pre-RoPE keys only)
    bounds: dict[int, PageBounds] = dataclasses.field(default_factory=dict)  # layer -> page summaries

    def tensors(self) -> list[torch.Tensor]:
        extra = [self.slots] + ([self.positions] if self.positions is not None else [])
        return self.coords_k.tensors() + self.coords_v.tensors() + extra + self.bound_tensors()

    def bound_tensors(self) -> list[torch.Tensor]:
        return [t for bounds in self.bounds.values() for t in bounds.tensors()]


class RowStore(Stateful):
    """One batch row of one group: bases, per-layer coefficients, ragged coordinate segments, exact rows.

    Saved whole (``state_fields``); ``method`` is saved as a reference to the loading cache's method.
    """

    state_name = "depthweave.RowStore"

    state_fields = (
        "method",
        "members",
        "heads",
        "dim",
        "dtype",
        "basis",
        "rank",
        "segments",
        "exact_slots",
        "exact_keys",
        "exact_values",
        "token_counts",
        "log",
        "probe_reference",
    )

    def __init__(
        self, method: DepthWeave, members: list[int], heads: int, dim: int, dtype: torch.dtype
    ) -> None:
        self.method = method
        self.members = list(members)
        self.heads, self.dim, self.dtype = heads, dim, dtype
        self.basis: dict[str, dict[int, Packed]] = {"k": {}, "v": {}}  # side -> layer -> R_l [r, H·D]
        self.rank = {"k": 0, "v": 0}  # base rank of new tokens
        self.segments: dict[tuple[int, int], Segment] = {}
        self.exact_slots: torch.Tensor | None = None  # [n_e] int32
        self.exact_keys: dict[int, Packed] = {}  # layer -> [H, n_e, D] post-RoPE
        self.exact_values: dict[int, Packed] = {}
        self.token_counts = {"hi": 0, "mid": 0, "lo": 0, "evicted": 0, "exact": 0}
        self.log: dict[str, Any] = {"folds": 0, "refreshes": 0}
        self.probe_reference: float | None = None

    # -- sizes
    @property
    def width(self) -> int:
        return self.heads * self.dim

    def total_rank(self, side: str) -> int:
        first = self.basis[side].get(self.members[0])
        return 0 if first is None else first.rows

    def tokens(self) -> int:
        held = sum(s.slots.numel() for s in self.segments.values())
        return held + (0 if self.exact_slots is None else int(self.exact_slots.numel()))

    def layer_tensors(self, layer: int) -> list[torch.Tensor]:
        tensors: list[torch.Tensor] = []
        for packed in (
            self.basis["k"].get(layer),
            self.basis["v"].get(layer),
            self.exact_keys.get(layer),
            self.exact_values.get(layer),
        ):
            if packed is not None:
                tensors += packed.tensors()
        return tensors

    def shared_tensors(self) -> list[torch.Tensor]:
        tensors = [t for s in self.segments.values() for t in s.tensors()]
        return tensors + ([self.exact_slots] if self.exact_slots is not None else [])

    def part_bytes(self, members: list[int]) -> dict[str, tuple[int, int]]:
        """``part -> (bytes held, bytes if every stored value were 16-bit)``."""
        coords = [p for s in self.segments.values() for p in (s.coords_k, s.coords_v)]
        coefs = [p for side in ("k", "v") for p in self.basis[side].values()]
        exact = list(self.exact_keys.values()) + list(self.exact_values.values())
        indices = [
            t
            for s in self.segments.values()
            for t in ([s.slots] + ([s.positions] if s.positions is not None else []))
        ]
        indices += [self.exact_slots] if self.exact_slots is not None else []

        def sizes(packs: list[Packed]) -> tuple[int, int]:
            return sum(p.nbytes() for p in packs), sum(2 * p.logical_elements() for p in packs)

        index_bytes = tensors_nbytes(indices)
        bound_bytes = tensors_nbytes([t for s in self.segments.values() for t in s.bound_tensors()])
        return {
            "page_bounds": (bound_bytes, bound_bytes),
            "coordinates": sizes(coords),
            "coefficients": sizes(coefs),
            "exact_rows": sizes(exact),
            "indices": (index_bytes, index_bytes),
        }

    # -- attention
    def attention_parts(self, layer: int, rotary: Rotary | None) -> list[Any]:
        """The parts :func:`attend_parts` combines for ``layer``: factorized segments and exact rows."""
        parts: list[Any] = []
        if self.segments:
            segments = list(self.segments.values())
            r_k = self.basis["k"][layer].dequantize().view(-1, self.heads, self.dim)  # [r, H, D]
            r_v = self.basis["v"][layer].dequantize().view(-1, self.heads, self.dim)
            coords_k = [s.coords_k.dequantize() for s in segments]  # [n_s, w_s]
            coords_v = [s.coords_v.dequantize() for s in segments]
            slots = torch.cat([s.slots for s in segments]).long()
            keys = None
            if rotary is not None:  # pre-RoPE: reconstruct this layer's keys, rotate them to their positions
                flat = r_k.flatten(1)
                recon = torch.cat([c @ flat[: c.shape[1]] for c in coords_k]).view(-1, self.heads, self.dim)
                positions = torch.cat([s.positions for s in segments]).long()  # type: ignore[misc]
                keys = rotary.rotate(recon.transpose(0, 1).unsqueeze(0), positions.view(1, -1))[
                    0
                ]  # [H, N, D]
            parts.append(FactorPart(coords_k, coords_v, r_k, r_v, slots, keys))
        if self.exact_slots is not None and self.exact_slots.numel():
            parts.append(
                DensePart(
                    self.exact_keys[layer].dequantize(),
                    self.exact_values[layer].dequantize(),
                    self.exact_slots.long(),
                    exact_rows=True,
                )
            )
        return parts

    def basis_matrix(self, side: str) -> torch.Tensor:
        """``R: [r, G·H·D]`` float32 (all group layers side by side)."""
        return torch.cat([self.basis[side][layer].dequantize() for layer in self.members], dim=1)

    def set_basis(self, side: str, r: torch.Tensor) -> None:
        """Store ``R: [r, G·H·D]`` as per-layer coefficients ``R_l: [r, H·D]``."""
        bits = self.method.coefficient_bits
        for i, layer in enumerate(self.members):
            block = r[:, i * self.width : (i + 1) * self.width]
            self.basis[side][layer] = pack(block, bits, max(block.shape[0], 1), self.dtype)

    def coordinates(self, side: str, x: torch.Tensor) -> torch.Tensor:
        """Least-squares coordinates ``[n, r]`` of ``x: [n, G·H·D]`` in the stored (maybe quantized) basis."""
        return x @ torch.linalg.pinv(self.basis_matrix(side))

    def store(self, chunk: Chunk, plan: Plan) -> None:
        """Append the chunk's tokens: bucket coordinates to the segments, exact rows, counts."""
        method = self.method
        coords = {s: self.coordinates(s, x) for s, x in (("k", chunk.x_k), ("v", chunk.x_v))}
        widths = {s: method.bucket_widths(self.rank[s], self.total_rank(s)) for s in ("k", "v")}
        pre_rope = method.keys == "pre_rope"
        for kind in (HI, MID, LO):
            index = plan.index(kind)
            if index.numel() == 0:
                continue
            wk, wv = widths["k"][kind], widths["v"][kind]
            ck, cv = coords["k"][index, :wk], coords["v"][index, :wv]
            slots = chunk.slots[index].to(torch.int32)
            positions = chunk.positions[index].to(torch.int32) if pre_rope else None
            segment = self.segments.get((wk, wv))
            if segment is None:
                self.segments[(wk, wv)] = Segment(
                    pack(ck, method.bits, COORD_GROUP, self.dtype),
                    pack(cv, method.bits, COORD_GROUP, self.dtype),
                    slots,
                    positions,
                )
            else:
                segment.coords_k = segment.coords_k.append_rows(ck)
                segment.coords_v = segment.coords_v.append_rows(cv)
                segment.slots = torch.cat([segment.slots, slots])
                if positions is not None:
                    segment.positions = torch.cat([segment.positions, positions])  # type: ignore[list-item]
        exact = plan.index(EXACT)
        if exact.numel():
            slots = chunk.slots[exact].to(torch.int32)
            self.exact_slots = slots if self.exact_slots is None else torch.cat([self.exact_slots, slots])
            for layer, k, v in zip(self.members, chunk.keys, chunk.values, strict=True):
                for target, x in ((self.exact_keys, k[:, exact]), (self.exact_values, v[:, exact])):
                    target[layer] = (
                        pack(x, method.residual_bits, 0, self.dtype)
                        if layer not in target
                        else target[layer].append_rows(x)
                    )
        for name, value in plan.counts().items():
            self.token_counts[name] += value

    def exact_bytes_estimate(self, count: int, element: int) -> int:
        """Bytes of ``count`` exact rows in every group layer (keys and values)."""
        per_layer = packed_bytes(self.heads * count, self.dim, self.method.residual_bits, 0, element)
        return 2 * len(self.members) * per_layer
