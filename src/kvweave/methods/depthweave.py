"""``depthweave``: DepthWeave-KV, token-adaptive cross-layer residual factorization (seed ``002_*.txt``).

What it stores, for each group of ``group`` adjacent full-attention layers and each of K and V separately::

    X = [X_l1 | ... | X_lG]            [n, G·H·D]   keys pre-RoPE (de-rotated) by default, or post-RoPE
    X ≈ C · R,  R = [R_l1 | ... | R_lG]        C: [n, r] token-side base ("B" in the seed), R_l: [r, H·D]

- ``R`` comes from a truncated SVD of the group's prefill KV (``lowrank.top_basis``), computed when the
  group's last layer has stored its KV ("compress on group complete"); that group's exact KV is then freed.
  Rows are weighted by the attention the prompt's last queries pay them (``weighting``).
- Exact residual rows (``E_l = K_l - C·R_l`` with an empty base row, i.e. the exact post-RoPE rows, 16-bit or
  INT8) always for the attention sinks; with ``router=True`` also for the router's top ``residual_tokens``.
  Exact-row tokens are left out of the SVD: sink keys/values are outliers that would spend the basis.
- ``router=True``: a calibration-free router scores tokens by the attention the last prompt queries pay them
  (max-pooled over neighbours, SnapKV-style), the novelty of their KV (energy outside a provisional low-rank
  basis: numbers, UUIDs, names and rare words are what a shared basis represents worst, whatever their
  characters) and, when the caller fills ``cache.shared["token_ids"]`` (and ``cache.shared["tokenizer"]``)
  before prefill, token content (in-prompt rarity, digits, capitalised tokens). Each signal becomes a
  percentile and a token takes its best one, so one signal is enough (a needle needs no attention from the
  prompt's end). Buckets are ragged, each its own ``[n_b, w_b]`` coordinate tensor (no zero padding):
  top -> exact rows, next ``hi_tokens`` -> width ``r·spread``, ``lo_tokens`` -> ``r/spread``, rest -> ``r``;
  the lowest ``evict`` fraction can be dropped (eviction, then factorize what is kept).
- Ranks: attention-output probes (the last ``probe`` prompt queries of every layer attend over the chunk with
  exact vs stored KV; relative output error) pick ``r_K`` and ``r_V`` per group and batch row: the cheapest
  pair meeting ``target_error``, or the best pair inside the byte budget of ``target_ratio`` (everything the
  group holds, recent buffer, exact rows and indices included, against a 16-bit full cache of the group).
- Decoding: new tokens stay exact in a recent buffer; at ``recent + block`` tokens the oldest are folded in
  (projected onto the basis). The current queries probe the folded chunk; an error above ``drift`` x the
  group's reference refreshes the basis (top directions of the stored reconstruction plus the new chunk;
  old coordinates are re-expressed, never recomputed from exact KV). With ``target_error`` the probe also
  raises or lowers the rank of later chunks. Memory per token stays at the compressed rate.
- Attention never materialises values: ``P·V ≈ (P·C_v)·R_v`` per bucket. Post-RoPE keys use latent scores
  ``q·(C R_k)ᵀ = (q R_kᵀ)·Cᵀ``; pre-RoPE keys must be reconstructed (the rotation depends on the token and
  does not commute with a token-side base), so one layer's compressed keys exist transiently during its
  attention step (the size of that layer's exact keys; never all layers at once). Post-RoPE keys trade
  quality (below) for that.
- ``bits=8|4`` stores the token-side coordinates as integers, scales per column over groups of 64 rows;
  coefficients ``R`` (shared by every token) at 8 bits. 16-bit storage is float16 for float32 models.

Measured (``benchmarks/depthweave_probe.py``; qwen2.5-coder-0.5b, 2 KV heads x 64, 24 layers; 2048 tokens of
wikitext-2 valid; "held-out": relative attention-output error of the next 128 tokens' queries over the
compressed tokens, exact vs stored, mean over layers; "KL": next-token KL of those 128 tokens vs the full
cache; every row 8.0x against a 16-bit full cache unless noted):

    setting                                                      held-out error   KL      top-1
    plain truncated SVD, G=1 r=16 (no recent, 16-bit; 6.7x)        71%            0.89    56%
    plain truncated SVD, G=4 r=64 (no recent, 16-bit; 6.2x)        67%            0.42    71%
    defaults: G=8, INT4, recent=32, uniform rank, sinks exact        16%            0.033   91%
      group=1 / 2 / 4                                                27 / 21 / 18%  0.10 / 0.043 / 0.042
      bits=16 / 8                                                    26 / 16%       0.17 / 0.038
      recent=128 (half the bytes go to the recent buffer at 2K)      20%            0.076
      residuals=False (sinks factorized too)                         27%            0.078
      router=True (buckets 2r/r/r/2 for 20/50/30%, 2% exact rows)    19%            0.068
      router=True, 0.5% exact rows only (spread=1, no buckets)       16%            0.039
      router=True, evict=0.5                                         26%            0.15
      keys=post_rope                                                 20%            0.047
      weighting=0                                                    17%            0.036
      probes=False, rank=192 (8.6x)                                  16%            0.037
      target_ratio=4 / 16                                            13 / 25%       0.024 / 0.12

What carries the quality: exact sinks, INT4 coordinates (4x the rank for the bytes), a small recent buffer and
larger groups. The router's buckets and 2% exact rows lose at 2K tokens: a high bucket adds coefficient rows
(at n = 2K a basis row costs as much as a coordinate column) and 16-bit exact rows are 8x the price of a
factorized token; so ``router`` is off by default (it may pay on long contexts and needle tasks: measure
with ``kvweave eval``). Passkey at 4K tokens, 7.7x: 5/5 depths with router on, off and without exact rows.
The prefill probe error (queries the router also saw) is within ~10% of the held-out error.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from kvweave._compat import mask_to_bool, sdpa_attention
from kvweave.cache import CompressedLayer, Method, option, register, tensors_nbytes
from kvweave.ops.lowrank import orthonormal_columns, top_basis
from kvweave.ops.masking import prompt_padding, visible_mask
from kvweave.ops.quantize import Packed, fake_quantize, pack, packed_bytes
from kvweave.ops.rope import apply_rotary

if TYPE_CHECKING:
    from kvweave.cache import KVCache
    from kvweave.ops.rope import Rotary

SHARED_KEY = "depthweave"
RANK_GRID = (
    1,
    2,
    3,
    4,
    6,
    8,
    12,
    16,
    24,
    32,
    48,
    64,
    96,
    128,
    192,
    256,
    384,
    512,
    768,
    1024,
    1536,
    2048,
    3072,
    4096,
    6144,
    8192,
)
COORD_GROUP = 64  # rows sharing one scale per column in quantized token-side coordinates
POOL = 5  # router: attention max-pooled over 5 neighbouring tokens so spans survive whole (SnapKV)
HI, MID, LO, EVICTED, EXACT = 0, 1, 2, 3, 4  # token kinds in a plan


@register("depthweave")
@dataclasses.dataclass
class DepthWeave(Method):
    """DepthWeave-KV: cross-layer shared token bases, token-adaptive ranks, exact rows, probe-chosen ranks."""

    group: int = option(8, "adjacent full-attention layers sharing one token-side base (1, 2, 4 or 8)")
    keys: str = option(
        "pre_rope", "factorize keys pre_rope (de-rotated) or post_rope (latent scores, no rotation)"
    )
    target_ratio: float | None = option(
        8.0, "compression vs a 16-bit full cache each group aims for at prefill"
    )
    target_error: float | None = option(
        None, "relative attention-output probe error each group aims for (when set, target_ratio is ignored)"
    )
    rank: int = option(
        32, "base rank when probes=False (and the provisional rank of the router's novelty signal)"
    )
    probes: bool = option(True, "choose ranks with attention-output probes (False: the fixed rank)")
    probe: int = option(16, "last prompt queries used as probes")
    router: bool = option(
        False, "token-adaptive buckets, exact rows and eviction (False: uniform rank, sinks exact)"
    )
    window: int = option(32, "last prompt queries whose attention the router reads")
    sinks: int = option(4, "first tokens kept exact (attention sinks)")
    residuals: bool = option(True, "keep exact residual rows (router top tokens and sinks)")
    residual_tokens: float = option(0.02, "fraction of tokens kept as exact residual rows")
    residual_bits: int = option(
        16, "bits of residual rows: 16 (model dtype) or 8 (INT8, a scale per row and head)"
    )
    hi_tokens: float = option(0.2, "fraction of factorized tokens in the high-rank bucket (rank·spread)")
    lo_tokens: float = option(0.3, "fraction of factorized tokens in the low-rank bucket (rank/spread)")
    spread: float = option(2.0, "rank ratio between buckets: r_hi = r·spread, r_lo = r/spread")
    evict: float = option(0.0, "fraction of tokens dropped, lowest router score first (0: none)")
    bits: int = option(4, "bits of the token-side bases: 16, 8 or 4 (coefficients at 8 when below 16)")
    recent: int = option(32, "newest tokens kept exact")
    block: int = option(64, "tokens folded into the factorization at a time while decoding")
    drift: float = option(1.5, "probe error / reference ratio that refreshes the basis while decoding")
    weighting: float = option(1.0, "attention weighting of the SVD rows: weight 1 + weighting·attention/mean")
    storage: str = option(
        "auto",
        "dtype of 16-bit storage (recent buffer, exact rows, unquantized bases): auto "
        "(the model's if 16-bit, else float16), float16, bfloat16 or model",
    )

    needs_positions = True
    cross_layer = True
    test_options = {
        "recent": 8,
        "block": 8,
        "group": 2,
        "target_ratio": 3.0,
        "probe": 4,
        "window": 8,
        "sinks": 2,
    }
    invalid_options = (
        ({"group": 3}, "group"),
        ({"keys": "middle"}, "keys"),
        ({"target_ratio": 0.5}, "target_ratio"),
        ({"target_error": 0.0}, "target_error"),
        ({"rank": 0}, "rank"),
        ({"probe": 0}, "probe"),
        ({"window": 0}, "window"),
        ({"sinks": -1}, "sinks"),
        ({"residual_tokens": 1.5}, "residual_tokens"),
        ({"residual_bits": 4}, "residual_bits"),
        ({"hi_tokens": -0.1}, "hi_tokens"),
        ({"hi_tokens": 0.7, "lo_tokens": 0.5}, "lo_tokens"),
        ({"spread": 0.5}, "spread"),
        ({"evict": 1.0}, "evict"),
        ({"evict": 0.5, "router": False}, "evict"),
        ({"bits": 5}, "bits"),
        ({"recent": -1}, "recent"),
        ({"block": 0}, "block"),
        ({"drift": 0.9}, "drift"),
        ({"storage": "int8"}, "storage"),
    )

    def __post_init__(self) -> None:
        self.check_choice("group", [1, 2, 4, 8])
        self.check_choice("keys", ["pre_rope", "post_rope"])
        if self.target_ratio is not None:
            self.check_range("target_ratio", 1.0)
        if self.target_error is not None:
            self.check_range("target_error", 1e-6, 10.0)
            if self.target_error < 1e-6:
                raise ValueError(f"{self.name}: option target_error={self.target_error!r} must be > 0")
        self.check_range("rank", 1)
        self.check_range("probe", 1)
        self.check_range("window", 1)
        self.check_range("sinks", 0)
        self.check_range("residual_tokens", 0.0, 1.0)
        self.check_choice("residual_bits", [16, 8])
        self.check_range("hi_tokens", 0.0, 1.0)
        self.check_range("lo_tokens", 0.0, 1.0 - self.hi_tokens)
        self.check_range("spread", 1.0, 64.0)
        self.check_range("evict", 0.0, 0.99)
        if self.evict > 0 and not self.router:
            raise ValueError(
                f"{self.name}: option evict={self.evict!r} needs router=True (eviction follows router "
                "scores); allowed with router=False: 0"
            )
        self.check_choice("bits", [16, 8, 4])
        self.check_range("recent", 0)
        self.check_range("block", 1)
        self.check_range("drift", 1.0)
        self.check_choice("storage", ["auto", "float16", "bfloat16", "model"])
        self.check_range("weighting", 0.0)

    @property
    def coefficient_bits(self) -> int:
        """Bits of the per-layer coefficients ``R_l`` (never below 8: every token of the group uses them)."""
        return 16 if self.bits == 16 else 8

    def bucket_widths(self, rank: int, cap: int) -> tuple[int, int, int]:
        """Coordinate widths ``(hi, mid, lo)`` for base rank ``rank`` (at most ``cap``)."""
        mid = max(1, min(rank, cap))
        if not self.router:
            return mid, mid, mid
        return (
            min(cap, max(mid, math.ceil(rank * self.spread))),
            mid,
            max(1, min(mid, int(rank / self.spread))),
        )

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype of everything stored at 16 bits (``model``: the model's own, also when it is float32)."""
        if self.storage == "model" or (self.storage == "auto" and model_dtype.itemsize == 2):
            return model_dtype
        return torch.bfloat16 if self.storage == "bfloat16" else torch.float16

    def make_layer(self, cache: KVCache, layer_idx: int) -> DepthWeaveLayer:
        return DepthWeaveLayer(cache, layer_idx, self)


# ------------------------------------------------------------------------------------------------- layer


class DepthWeaveLayer(CompressedLayer):
    """One full-attention layer: an exact recent buffer; older tokens live in its group's row stores."""

    def __init__(self, cache: KVCache, layer_idx: int, method: DepthWeave) -> None:
        super().__init__(cache, layer_idx)
        self.method = method
        cache.shared.setdefault(SHARED_KEY, {"layers": set(), "groups": {}})["layers"].add(layer_idx)
        self.recent_keys: torch.Tensor | None = None  # [B, H, m, D] post-RoPE, exact
        self.recent_values: torch.Tensor | None = None  # [B, H, m, D]
        self.recent_positions: torch.Tensor | None = None  # [B, m] int32 RoPE positions
        self.recent_score: torch.Tensor | None = None  # [B, m] float32 attention received (router signal)
        self.scaling: float = 1.0
        self.stash: dict[str, torch.Tensor] = {}  # probe queries, held only until the group folds this step

    # -- group bookkeeping
    @property
    def group(self) -> WeaveGroup:
        """This layer's :class:`WeaveGroup` (groups are formed over the layers built by this method)."""
        state = self.cache.shared[SHARED_KEY]
        layers = sorted(state["layers"])
        index = layers.index(self.layer_idx) // self.method.group
        found = state["groups"].get(index)
        if found is None:
            members = layers[index * self.method.group : (index + 1) * self.method.group]
            found = state["groups"][index] = WeaveGroup(self.cache, self.method, members, index)
        return found  # type: ignore[no-any-return]

    def reset(self) -> None:
        self.cache.shared.get(SHARED_KEY, {}).get("groups", {}).clear()
        self.__init__(self.cache, self.layer_idx, self.method)  # type: ignore[misc]

    def select_rows(self, rows: torch.Tensor) -> None:
        super().select_rows(rows)
        group = self.group
        if self.layer_idx == group.members[-1]:
            group.select_rows(rows)

    # -- attention step
    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """``query: [B, Hq, q, D]``, ``key, value: [B, H, q, D]`` (post-RoPE) -> ``[B, q, Hq, D]``."""
        first, q_len = self.seen, key.shape[2]
        self.scaling = float(kwargs.get("scaling") or query.shape[-1] ** -0.5)
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(first, first + q_len, device=key.device).view(1, -1)
        self.push_recent(key, value, positions.expand(self.rows, -1))
        self.seen += q_len
        group = self.group
        if first == 0:  # prefill: exact attention, like every method; compression happens as the KV is stored
            self.pad_count = prompt_padding(attention_mask, self.rows, q_len, key.device)
            if getattr(self.cache, "replaying", False):  # shared-prefill replay: only the store matters
                out = query.new_empty(0)
            else:
                out, _ = sdpa_attention(module, query, key, value, attention_mask, **kwargs)
            if self.method.router or self.method.weighting > 0:
                self.recent_score = observed_attention(
                    query, key, self.pad_count, self.method.window, self.scaling
                )
        else:
            out = self.compressed_attention(query, attention_mask, first)
        count = group.fold_count(self, first)
        if count > 0 and (self.method.probes or first == 0):  # prefill probes also measure fixed ranks
            keep = min(self.method.probe, q_len)
            self.stash = {
                "query": query[:, :, -keep:].clone(),
                "query_slots": torch.arange(first + q_len - keep, first + q_len, device=key.device),
            }
        if count > 0 and self.layer_idx == group.members[-1]:
            group.fold(count, first)
        return out  # type: ignore[no-any-return]

    def push_recent(self, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor) -> None:
        """Append new exact tokens ``[B, H, q, D]`` to the recent buffer."""
        positions = positions.to(torch.int32)
        dtype = self.method.storage_dtype(key.dtype)
        key, value = key.to(dtype), value.to(dtype)
        if dtype != self.dtype and not (torch.isfinite(key).all() and torch.isfinite(value).all()):
            raise ValueError(
                f"{self.method.name}: keys/values overflow storage dtype {dtype} in layer "
                f"{self.layer_idx}; use storage=bfloat16 or storage=model"
            )
        score = torch.zeros(key.shape[0], key.shape[2], dtype=torch.float32, device=key.device)
        if self.recent_keys is None:
            self.recent_keys, self.recent_values = key, value
            self.recent_positions, self.recent_score = positions.contiguous(), score
            return
        self.recent_keys = torch.cat([self.recent_keys, key], dim=2)
        self.recent_values = torch.cat([self.recent_values, value], dim=2)  # type: ignore[list-item]
        self.recent_positions = torch.cat([self.recent_positions, positions], 1)  # type: ignore[list-item]
        self.recent_score = torch.cat([self.recent_score, score], dim=1)  # type: ignore[list-item]

    def drop_recent(self, count: int) -> None:
        """Forget the oldest ``count`` recent tokens (they now live in the group's factorization)."""
        self.recent_keys = self.recent_keys[:, :, count:].clone()  # type: ignore[index]
        self.recent_values = self.recent_values[:, :, count:].clone()  # type: ignore[index]
        self.recent_positions = self.recent_positions[:, count:].clone()  # type: ignore[index]
        self.recent_score = self.recent_score[:, count:].clone()  # type: ignore[index]
        self.stash = {}

    def recent_count(self) -> int:
        return 0 if self.recent_keys is None else int(self.recent_keys.shape[2])

    def compressed_attention(
        self, query: torch.Tensor, attention_mask: torch.Tensor | None, first: int
    ) -> torch.Tensor:
        """Attention of the new queries over the group's stores + the recent buffer, row by row."""
        mask = mask_to_bool(attention_mask)
        m = self.recent_count()
        recent_slots = torch.arange(self.seen - m, self.seen, device=query.device)
        stores = self.group.rows
        rotary = self.cache.rotary_for(self.layer_idx) if self.method.keys == "pre_rope" else None
        outs = []
        for b in range(query.shape[0]):
            store = stores[b] if b < len(stores) else None
            parts = store.attention_parts(self.layer_idx, rotary) if store is not None else []
            keys, values = self.recent_keys[b], self.recent_values[b]  # type: ignore[index]
            parts.append(DensePart(keys.float(), values.float(), recent_slots))
            row_mask = None if mask is None else mask[b : b + 1]
            out, recent_attention = attend_parts(query[b].float(), parts, row_mask, first, self.scaling)
            score = self.recent_score[b]  # type: ignore[index]
            self.recent_score[b] = torch.maximum(score, recent_attention)  # type: ignore[index]
            outs.append(out)
        return torch.stack(outs).to(query.dtype)

    def held_kv(self, row: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``keys, values: [H, N, D]`` float32 post-RoPE and ``slots: [N]``: all that row ``row`` attends to.

        Materialises the whole layer (diagnostics and tests; attention itself never reconstructs values).
        """
        stores = self.group.rows
        store = stores[row] if row < len(stores) else None
        rotary = self.cache.rotary_for(self.layer_idx) if self.method.keys == "pre_rope" else None
        keys, values, slots = [], [], []
        for part in store.attention_parts(self.layer_idx, rotary) if store is not None else []:
            k, v = part.dense()
            keys.append(k)
            values.append(v)
            slots.append(part.slots)
        m = self.recent_count()
        keys.append(self.recent_keys[row].float())  # type: ignore[index]
        values.append(self.recent_values[row].float())  # type: ignore[index]
        slots.append(torch.arange(self.seen - m, self.seen, device=self.device))
        return torch.cat(keys, dim=1), torch.cat(values, dim=1), torch.cat(slots)

    # -- accounting
    def nbytes(self) -> int:
        tensors: list[torch.Tensor] = [
            t
            for t in (
                self.recent_keys,
                self.recent_values,
                self.recent_positions,
                self.recent_score,
                self.pad_count,
            )
            if t is not None
        ]
        tensors += list(self.stash.values())
        group = self.group
        for store in group.rows:
            if store is not None:
                tensors += store.layer_tensors(self.layer_idx)
                if self.layer_idx == group.members[-1]:
                    tensors += store.shared_tensors()
        return tensors_nbytes(tensors)

    def entries(self) -> int:
        """Tokens held (row 0): recent + exact rows + factorized tokens."""
        stores = self.group.rows
        held = stores[0].tokens() if stores and stores[0] is not None else 0
        return self.recent_count() + held

    def layer_stats(self) -> dict[str, Any]:
        group = self.group
        stats = {
            "entries": self.entries(),
            "recent": self.recent_count(),
            "group": group.index,
            "group_layers": list(group.members),
            "group_owner": self.layer_idx == group.members[-1],
        }
        stats.update(group.summary())
        return stats


# ------------------------------------------------------------------------------------------------- group


class WeaveGroup:
    """The layers sharing one token-side base; one :class:`RowStore` per batch row (ranks are per row)."""

    def __init__(self, cache: KVCache, method: DepthWeave, members: list[int], index: int) -> None:
        self.cache, self.method, self.members, self.index = cache, method, members, index
        self.rows: list[RowStore | None] = []

    def layers(self) -> list[DepthWeaveLayer]:
        return [self.cache.layers[i] for i in self.members]  # type: ignore[misc]

    def fold_count(self, layer: DepthWeaveLayer, first: int) -> int:
        """Tokens to fold this step: at prefill all but ``recent``, later whole multiples of ``block``."""
        extra = layer.recent_count() - self.method.recent
        if first == 0:
            return max(extra, 0)
        return extra if extra >= self.method.block else 0

    def fold(self, count: int, first: int) -> None:
        """Move the oldest ``count`` recent tokens of every member layer into the row stores."""
        layers = self.layers()
        owner = layers[-1]
        rows = owner.rows
        if not self.rows:
            self.rows = [None] * rows
        start = owner.seen - owner.recent_count()
        slots = torch.arange(start, start + count, device=owner.device)
        positions = owner.recent_positions[:, :count].long()  # type: ignore[index]
        keys = [layer.recent_keys[:, :, :count] for layer in layers]  # type: ignore[index]
        values = [layer.recent_values[:, :, :count] for layer in layers]  # type: ignore[index]
        rotary = self.cache.rotary_for(self.members[0]) if self.method.keys == "pre_rope" else None
        factor_keys = [rotary.unrotate(k.float(), positions) if rotary else k.float() for k in keys]
        scores = [layer.recent_score[:, :count] for layer in layers]  # type: ignore[index]
        attention = torch.stack(scores).mean(0)
        content = content_scores(self.cache.shared, slots, rows) if first == 0 else None
        pad_count: torch.Tensor = owner.pad_count  # type: ignore[assignment]
        padding = slots.view(1, -1) < pad_count.view(-1, 1)
        heads, dim = keys[0].shape[1], keys[0].shape[3]
        per_token_16bit = len(layers) * 2 * heads * dim * 2  # a 16-bit full cache of this group, per token
        kept_recent = owner.recent_count() - count
        element = owner.recent_keys.element_size()  # type: ignore[union-attr]
        recent_bytes = len(layers) * kept_recent * (2 * heads * dim * element + 8)  # + position, score
        for b in range(rows):
            real = (~padding[b]).nonzero().squeeze(1)
            if real.numel() == 0:
                continue
            chunk = Chunk(
                slots=slots[real],
                positions=positions[b, real],
                x_k=torch.cat([k[b][:, real].transpose(0, 1).flatten(1) for k in factor_keys], dim=1),
                x_v=torch.cat([v[b][:, real].transpose(0, 1).flatten(1).float() for v in values], dim=1),
                keys=[k[b][:, real] for k in keys],
                values=[v[b][:, real] for v in values],
                attention=attention[b, real],
                content=None if content is None else content[b, real],
                sink=(slots[real] - pad_count[b]) < self.method.sinks if first == 0 else None,
            )
            probe = None
            if all("query" in layer.stash for layer in layers):
                probe = Probe(
                    [layer.stash["query"][b].float() for layer in layers],
                    layers[0].stash["query_slots"],
                    chunk,
                    [layer.scaling for layer in layers],
                )
            if self.rows[b] is None:
                self.rows[b] = RowStore(self, heads, dim, self.method.storage_dtype(owner.dtype))
            # the budget counts the row's own tokens, so a padded row compresses as it would alone
            real_tokens = owner.seen - int(pad_count[b])
            budget = Budget(per_token_16bit * real_tokens, recent_bytes)
            self.rows[b].add(chunk, probe, rotary, budget)  # type: ignore[union-attr]
        for layer in layers:
            layer.drop_recent(count)

    def select_rows(self, rows: torch.Tensor) -> None:
        if not self.rows:
            return
        picked, seen = [], set()
        for index in rows.tolist():
            store = self.rows[index]
            picked.append(copy.deepcopy(store) if index in seen else store)
            seen.add(index)
        self.rows = picked

    def summary(self) -> dict[str, Any]:
        """Ranks, probe errors, token kinds and bytes by part, summed over rows (ranks/errors: mean)."""
        stores = [s for s in self.rows if s is not None]
        if not stores:
            return {"compressed": False}
        layers = self.layers()
        parts = {"coordinates": 0, "coefficients": 0, "exact_rows": 0, "indices": 0, "recent": 0}
        parts_16bit = dict(parts)
        for store in stores:
            for key, (held, unquantized) in store.part_bytes(self.members).items():
                parts[key] += held
                parts_16bit[key] += unquantized
        for layer in layers:
            recent = tensors_nbytes(
                [
                    t
                    for t in (
                        layer.recent_keys,
                        layer.recent_values,
                        layer.recent_positions,
                        layer.recent_score,
                    )
                    if t is not None
                ]
            )
            parts["recent"] += recent
            parts_16bit["recent"] += recent
        owner = layers[-1]
        shape = owner.recent_keys.shape  # type: ignore[union-attr]
        full = (
            2 * owner.rows * shape[1] * shape[3] * 2 * owner.seen * len(layers)
        )  # 16-bit full, [B, H, m, D]
        held, unquantized = sum(parts.values()), sum(parts_16bit.values())
        tokens: dict[str, int] = {}
        for store in stores:
            for key, value in store.token_counts.items():
                tokens[key] = tokens.get(key, 0) + value

        def mean(key: str) -> float | None:
            values = [s.log[key] for s in stores if s.log.get(key) is not None]
            return sum(values) / len(values) if values else None

        return {
            "compressed": True,
            "rank_k": mean("rank_k"),
            "rank_v": mean("rank_v"),
            "basis_k": mean("basis_k"),
            "basis_v": mean("basis_v"),
            "probe_error": mean("probe_error"),
            "probe_error_k": mean("probe_error_k"),
            "probe_error_v": mean("probe_error_v"),
            "last_fold_error": mean("last_fold_error"),
            "folds": mean("folds"),
            "refreshes": mean("refreshes"),
            "tokens": tokens,
            "group_bytes": held,
            "group_bytes_unquantized": unquantized,
            "bytes_by_part": parts,
            "group_full_16bit": full,
            "group_compression": full / held if held else None,
            "group_compression_unquantized": full / unquantized if unquantized else None,
        }


@dataclasses.dataclass
class Budget:
    """What a row may spend on a new factorization (``target_ratio``): full 16-bit size, fixed costs."""

    full_16bit: int
    recent_bytes: int


@dataclasses.dataclass
class Chunk:
    """Tokens of one batch row being folded into the factorization (padding already removed)."""

    slots: torch.Tensor  # [n] token indices
    positions: torch.Tensor  # [n] RoPE positions
    x_k: torch.Tensor  # [n, G·H·D] float32 keys in factorization form (pre- or post-RoPE)
    x_v: torch.Tensor  # [n, G·H·D] float32 values
    keys: list[torch.Tensor]  # per layer [H, n, D] exact post-RoPE keys (storage dtype)
    values: list[torch.Tensor]  # per layer [H, n, D]
    attention: torch.Tensor  # [n] attention received (router signal)
    content: torch.Tensor | None  # [n] token-content signal, when token ids were given
    sink: torch.Tensor | None  # [n] bool, attention sinks (prefill only)

    @property
    def size(self) -> int:
        return int(self.slots.numel())


@dataclasses.dataclass
class Segment:
    """Tokens stored at one coordinate width pair: ``coords_k: [n, w_k]``, ``coords_v: [n, w_v]``."""

    coords_k: Packed
    coords_v: Packed
    slots: torch.Tensor  # [n] int32
    positions: torch.Tensor | None  # [n] int32 (pre-RoPE keys only)

    def tensors(self) -> list[torch.Tensor]:
        extra = [self.slots] + ([self.positions] if self.positions is not None else [])
        return self.coords_k.tensors() + self.coords_v.tensors() + extra


@dataclasses.dataclass
class Plan:
    """Kind of each chunk token (:data:`HI`, :data:`MID`, :data:`LO`, :data:`EVICTED`, :data:`EXACT`)."""

    kind: torch.Tensor  # [n] int64

    def index(self, *kinds: int) -> torch.Tensor:
        return torch.isin(self.kind, torch.tensor(kinds, device=self.kind.device)).nonzero().squeeze(1)

    def counts(self) -> dict[str, int]:
        names = {HI: "hi", MID: "mid", LO: "lo", EVICTED: "evicted", EXACT: "exact"}
        return {name: int((self.kind == k).sum()) for k, name in names.items()}


class RowStore:
    """One batch row of one group: bases, per-layer coefficients, ragged coordinate segments, exact rows."""

    def __init__(self, group: WeaveGroup, heads: int, dim: int, dtype: torch.dtype) -> None:
        self.method = group.method
        self.members = list(group.members)
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
        return {
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
                )
            )
        return parts

    # -- compression
    def add(self, chunk: Chunk, probe: Probe | None, rotary: Rotary | None, budget: Budget) -> None:
        """Fold ``chunk`` in: a first chunk creates the bases, later ones are projected onto them."""
        cos_sin = (
            rotary.cos_sin(chunk.positions.view(1, -1), chunk.x_k.device) if rotary is not None else None
        )
        if not self.basis["k"]:
            self.initialize(chunk, probe, cos_sin, budget)
        else:
            self.project(chunk, probe if self.method.probes else None, cos_sin)
        self.log["folds"] += 1

    def initialize(self, chunk: Chunk, probe: Probe | None, cos_sin: Any, budget: Budget) -> None:
        method = self.method
        novelty = None
        if method.router:
            provisional = {s: top_basis(x, method.rank)[0] for s, x in (("k", chunk.x_k), ("v", chunk.x_v))}
            novelty = novelty_score(chunk, provisional["k"].T, provisional["v"].T)
        plan = make_plan(chunk, novelty, method)
        factor = plan.index(HI, MID, LO)
        limit = (
            chunk.x_k.shape[1] if chunk.x_k.shape[1] <= 2048 else 1024
        )  # randomized SVD beyond 2048 columns
        weight = torch.ones(factor.numel(), device=chunk.x_k.device)
        if method.weighting > 0:  # rows the prompt's end attends to count more in the basis
            attention = chunk.attention[factor]
            weight = weight + method.weighting * attention / attention.mean().clamp_min(1e-12)
        rows = weight.sqrt().unsqueeze(1)
        bases = {s: top_basis(x[factor] * rows, limit)[0] for s, x in (("k", chunk.x_k), ("v", chunk.x_v))}
        caps = {s: v.shape[1] for s, v in bases.items()}
        if method.probes and probe is not None:
            ranks = self.choose_ranks(chunk, plan, bases, probe, cos_sin, budget)
        else:
            ranks = {s: min(method.rank, caps[s]) for s in ("k", "v")}
        for side in ("k", "v"):
            self.rank[side] = ranks[side]
            self.set_basis(side, bases[side][:, : method.bucket_widths(ranks[side], caps[side])[0]].T)
        self.store(chunk, plan)
        self.log.update(
            rank_k=ranks["k"], rank_v=ranks["v"], basis_k=self.total_rank("k"), basis_v=self.total_rank("v")
        )
        if probe is not None:
            keys, values = self.stored_chunk(chunk, plan, cos_sin)
            self.probe_reference = probe.error(keys, values, plan.kind != EVICTED)
            self.log["probe_error"] = self.probe_reference

    def project(self, chunk: Chunk, probe: Probe | None, cos_sin: Any) -> None:
        """Decode-time fold: project onto the bases; refresh them or move the rank when the probe says so."""
        method = self.method
        novelty = None
        if method.router:
            novelty = novelty_score(chunk, self.basis_matrix("k"), self.basis_matrix("v"))
        plan = make_plan(chunk, novelty, method)
        if probe is not None:
            keys, values = self.stored_chunk(chunk, plan, cos_sin)
            error = probe.error(keys, values, plan.kind != EVICTED)
            self.log["last_fold_error"] = error
            reference = method.target_error or self.probe_reference or error
            if error > method.drift * reference:
                if method.target_error is not None:  # error-driven: later chunks get the next rank up
                    self.rank = {s: next_rank(r, +1) for s, r in self.rank.items()}
                self.refresh(chunk, plan)
                self.log["refreshes"] += 1
                if method.target_error is None:
                    # what the refreshed basis achieves is the new reference: a probe that reads high for
                    # reasons a basis cannot fix (one query, a short chunk) must not refresh every fold, and
                    # every refresh re-quantizes the old coordinates
                    keys, values = self.stored_chunk(chunk, plan, cos_sin)
                    self.probe_reference = max(reference, probe.error(keys, values, plan.kind != EVICTED))
            elif method.target_error is not None and error * method.drift < reference:
                self.rank = {s: next_rank(r, -1) for s, r in self.rank.items()}
            self.log.update(rank_k=self.rank["k"], rank_v=self.rank["v"])
        self.store(chunk, plan)

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

    def stored_chunk(
        self, chunk: Chunk, plan: Plan, cos_sin: Any
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer ``[H, n, D]`` post-RoPE keys and values of ``chunk`` as they would be stored now."""
        method = self.method
        recon = {}
        for side, x in (("k", chunk.x_k), ("v", chunk.x_v)):
            basis = self.basis_matrix(side)
            coords = x @ torch.linalg.pinv(basis)
            width = torch.zeros(chunk.size, dtype=torch.int64, device=x.device)
            for kind, w in zip(
                (HI, MID, LO), method.bucket_widths(self.rank[side], basis.shape[0]), strict=True
            ):
                width[plan.kind == kind] = w
            coords = coords * (torch.arange(coords.shape[1], device=x.device) < width.unsqueeze(1))
            recon[side] = fake_quantize(coords, method.bits, COORD_GROUP) @ basis
        return self.assemble(chunk, plan, recon["k"], recon["v"], cos_sin)

    def assemble(
        self,
        chunk: Chunk,
        plan: Plan,
        recon_k: torch.Tensor | None,
        recon_v: torch.Tensor | None,
        cos_sin: Any,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Exact rows as stored, factorized rows from ``recon_*: [n, G·H·D]`` (``None``: exact), per layer."""
        factor = plan.index(HI, MID, LO)
        exact = plan.index(EXACT)
        bits = self.method.residual_bits
        keys, values = [], []
        for i, (k, v) in enumerate(zip(chunk.keys, chunk.values, strict=True)):
            k, v = k.float().clone(), v.float().clone()
            if exact.numel() and bits != 16:
                k[:, exact] = fake_quantize(k[:, exact], bits, 0)
                v[:, exact] = fake_quantize(v[:, exact], bits, 0)
            columns = slice(i * self.width, (i + 1) * self.width)
            if recon_k is not None and factor.numel():
                rows = recon_k[factor, columns].view(-1, self.heads, self.dim).transpose(0, 1)  # [H, n_f, D]
                if cos_sin is not None:
                    cos, sin = cos_sin
                    rows = apply_rotary(rows.unsqueeze(0), cos[:, factor], sin[:, factor])[0]
                k[:, factor] = rows
            if recon_v is not None and factor.numel():
                v[:, factor] = recon_v[factor, columns].view(-1, self.heads, self.dim).transpose(0, 1)
            keys.append(k)
            values.append(v)
        return keys, values

    def choose_ranks(
        self,
        chunk: Chunk,
        plan: Plan,
        bases: dict[str, torch.Tensor],
        probe: Probe,
        cos_sin: Any,
        budget: Budget,
    ) -> dict[str, int]:
        """``r_K, r_V`` from probe errors: cheapest meeting ``target_error``, or best within the budget."""
        method = self.method
        factor = plan.index(HI, MID, LO)
        counts = plan.counts()
        bucket_sizes = (counts["hi"], counts["mid"], counts["lo"])
        element = torch.empty(0, dtype=self.dtype).element_size()
        exact_keys = [k.float() for k in chunk.keys]
        exact_values = [v.float() for v in chunk.values]
        keep = plan.kind != EVICTED

        def side_bytes(side: str, rank: int) -> int:
            cap = bases[side].shape[1]
            widths = method.bucket_widths(rank, cap)
            total = sum(
                packed_bytes(n, w, method.bits, COORD_GROUP, element)
                for n, w in zip(bucket_sizes, widths, strict=True)
            )
            return total + len(self.members) * packed_bytes(
                widths[0], self.width, method.coefficient_bits, widths[0], element
            )

        def side_error(side: str, rank: int) -> float:
            basis = bases[side]
            cap = basis.shape[1]
            widths = method.bucket_widths(rank, cap)
            top = widths[0]
            x = chunk.x_k if side == "k" else chunk.x_v
            coords = x[factor] @ basis[:, :top]
            width = torch.tensor(widths, device=x.device)[plan.kind[factor].clamp(max=LO)]
            coords = coords * (torch.arange(top, device=x.device) < width.unsqueeze(1))
            r = fake_quantize(basis[:, :top].T.contiguous(), method.coefficient_bits, top)
            recon = torch.zeros_like(x)
            recon[factor] = fake_quantize(coords, method.bits, COORD_GROUP) @ r
            if side == "k":
                keys, _ = self.assemble(chunk, plan, recon, None, cos_sin)
                return probe.error(keys, exact_values, keep)
            _, values = self.assemble(chunk, plan, None, recon, cos_sin)
            return probe.error(exact_keys, values, keep)

        caps = {s: bases[s].shape[1] for s in ("k", "v")}
        grids = {s: sorted({r for r in RANK_GRID if r < caps[s]} | {caps[s]}) for s in ("k", "v")}
        if method.target_error is None:  # byte budget: only affordable ranks are worth probing
            fixed = budget.recent_bytes + self.exact_bytes_estimate(counts["exact"], element)
            fixed += (int(factor.numel()) * (8 if method.keys == "pre_rope" else 4)) + counts["exact"] * 4
            available = budget.full_16bit / (method.target_ratio or 8.0) - fixed
            for side, other in (("k", "v"), ("v", "k")):
                affordable = [
                    r for r in grids[side] if side_bytes(side, r) + side_bytes(other, 1) <= available
                ]
                grids[side] = affordable or [1]
        errors: dict[str, dict[int, float]] = {"k": {}, "v": {}}
        for side in ("k", "v"):
            for rank in grids[side]:
                errors[side][rank] = side_error(side, rank)
                if method.target_error is not None and errors[side][rank] <= method.target_error / 8:
                    break
        if method.target_error is not None:
            ranks = cheapest_meeting(errors, side_bytes, method.target_error)
        else:
            ranks = best_within(errors, side_bytes, available, caps)
        self.log["probe_error_k"] = interpolate(errors["k"], ranks["k"])
        self.log["probe_error_v"] = interpolate(errors["v"], ranks["v"])
        return ranks

    def exact_bytes_estimate(self, count: int, element: int) -> int:
        """Bytes of ``count`` exact rows in every group layer (keys and values)."""
        per_layer = packed_bytes(self.heads * count, self.dim, self.method.residual_bits, 0, element)
        return 2 * len(self.members) * per_layer

    def refresh(self, chunk: Chunk, plan: Plan) -> None:
        """New bases: top directions of (stored reconstruction + this chunk), old coordinates re-expressed.

        Works in the span of the old basis and the chunk (``Q: [G·H·D, k]``): it needs no exact old KV and
        costs ``O(n·r²)``. Segment widths stay; the total rank may grow to fit a raised rank.
        """
        method = self.method
        factor = plan.index(HI, MID, LO)
        for side in ("k", "v"):
            old = self.basis_matrix(side)  # [r, W]
            x = (chunk.x_k if side == "k" else chunk.x_v)[factor]
            total = max(old.shape[0], method.bucket_widths(self.rank[side], old.shape[1])[0])
            q = orthonormal_columns(torch.cat([old.T, x.T], dim=1))  # [W, k]
            projected = x @ q
            gram = projected.T @ projected
            segments = list(self.segments.values())
            for segment in segments:
                coords = (segment.coords_k if side == "k" else segment.coords_v).dequantize()
                a = old[: coords.shape[1]] @ q  # [w, k]
                gram += a.T @ (coords.T @ coords) @ a
            values, vectors = torch.linalg.eigh(gram.double())
            top = vectors.flip(1)[:, : min(total, q.shape[1])].float()  # [k, r']
            for segment in segments:
                packed = segment.coords_k if side == "k" else segment.coords_v
                coords = packed.dequantize()
                width = coords.shape[1]
                new = coords @ (old[:width] @ q @ top[:, :width])
                repacked = pack(new, method.bits, COORD_GROUP, self.dtype)
                if side == "k":
                    segment.coords_k = repacked
                else:
                    segment.coords_v = repacked
            self.set_basis(side, (q @ top).T)
        self.log.update(basis_k=self.total_rank("k"), basis_v=self.total_rank("v"))


def other_side(side: str) -> str:
    return "v" if side == "k" else "k"


def cheapest_meeting(
    errors: dict[str, dict[int, float]], cost: Callable[[str, int], int], target: float
) -> dict[str, int]:
    """The probed ``(r_K, r_V)`` of fewest bytes whose errors sum to at most ``target`` (else the largest)."""
    best: tuple[int, int, int] | None = None
    for rk, ek in errors["k"].items():
        for rv, ev in errors["v"].items():
            bytes_ = cost("k", rk) + cost("v", rv)
            if ek + ev <= target and (best is None or bytes_ < best[0]):
                best = (bytes_, rk, rv)
    return {"k": best[1], "v": best[2]} if best else {s: max(errors[s]) for s in ("k", "v")}


def best_within(
    errors: dict[str, dict[int, float]],
    cost: Callable[[str, int], int],
    available: float,
    caps: dict[str, int],
) -> dict[str, int]:
    """The probed pair of least summed error inside ``available`` bytes, then filled one rank at a time.

    The fill always grows the side whose (interpolated) error is larger, so the budget ends up used to within
    one rank step: ``target_ratio`` lands close to its target.
    """
    best: tuple[float, int, int] | None = None
    for rk, ek in errors["k"].items():
        for rv, ev in errors["v"].items():
            fits = cost("k", rk) + cost("v", rv) <= available or (rk, rv) == (1, 1)
            if fits and (best is None or ek + ev < best[0]):
                best = (ek + ev, rk, rv)
    ranks = {"k": best[1], "v": best[2]} if best else {"k": 1, "v": 1}
    while True:
        grow = [
            s
            for s in ("k", "v")
            if ranks[s] < caps[s]
            and cost(s, ranks[s] + 1) + cost(other_side(s), ranks[other_side(s)]) <= available
        ]
        if not grow:
            return ranks
        side = max(grow, key=lambda s: interpolate(errors[s], ranks[s]))
        ranks[side] += 1


def next_rank(rank: int, step: int) -> int:
    """The grid rank one step above (``step=+1``) or below (``-1``) ``rank``."""
    if step > 0:
        return next((r for r in RANK_GRID if r > rank), rank * 2)
    return max((r for r in RANK_GRID if r < rank), default=1)


def interpolate(errors: dict[int, float], rank: int) -> float:
    """Probe error at ``rank``, log-linear between the probed ranks (held flat beyond them)."""
    known = sorted(errors)
    if rank <= known[0]:
        return errors[known[0]]
    if rank >= known[-1]:
        return errors[known[-1]]
    upper = next(r for r in known if r >= rank)
    lower = max(r for r in known if r <= rank)
    if upper == lower:
        return errors[upper]
    t = (math.log(rank) - math.log(lower)) / (math.log(upper) - math.log(lower))
    return errors[lower] + t * (errors[upper] - errors[lower])


# -------------------------------------------------------------------------------------------------- router


def observed_attention(
    query: torch.Tensor, key: torch.Tensor, pad_count: torch.Tensor, window: int, scaling: float
) -> torch.Tensor:
    """``[B, n]`` attention the last ``window`` prompt queries pay each token (all heads, max-pooled)."""
    b, hq, n, d = query.shape
    h = key.shape[1]
    w = min(window, n)
    q = query[:, :, -w:].float().reshape(b, h, (hq // h) * w, d)
    logits = q @ key.float().transpose(-1, -2) * scaling  # [B, H, g·w, n]
    slots = torch.arange(n, device=key.device)
    causal = slots.view(1, -1) <= torch.arange(n - w, n, device=key.device).repeat(hq // h).view(-1, 1)
    valid = slots.view(1, -1) >= pad_count.view(-1, 1)  # [B, n]
    visible = causal.view(1, 1, *causal.shape) & valid.view(b, 1, 1, n)
    probs = torch.nan_to_num(logits.masked_fill(~visible, float("-inf")).softmax(-1))
    received = probs.sum(dim=(1, 2)) / (hq * w)  # [B, n]
    return F.max_pool1d(received.unsqueeze(1), POOL, stride=1, padding=POOL // 2).squeeze(1)


def novelty_score(chunk: Chunk, basis_k: torch.Tensor, basis_v: torch.Tensor) -> torch.Tensor:
    """``[n]`` energy of each token's K and V outside the bases ``[r, W]`` (each side over its mean)."""
    score = torch.zeros(chunk.size, device=chunk.x_k.device)
    for x, basis in ((chunk.x_k, basis_k), (chunk.x_v, basis_v)):
        residual = x - (x @ torch.linalg.pinv(basis)) @ basis
        energy = residual.square().sum(1)
        score += energy / energy.mean().clamp_min(1e-12)
    return score


def percentile(x: torch.Tensor) -> torch.Tensor:
    """Rank of each entry in ``[0, 1]``; ties share the lowest rank (so a constant signal says nothing)."""
    ordered = x.sort().values
    return torch.searchsorted(ordered, x.contiguous()).float() / max(x.numel() - 1, 1)


def router_score(chunk: Chunk, novelty: torch.Tensor | None) -> torch.Tensor:
    """``[n]`` importance: the best percentile over the signals; sinks above everything."""
    signals = [percentile(chunk.attention)]
    if novelty is not None:
        signals.append(percentile(novelty))
    if chunk.content is not None:
        signals.append(percentile(chunk.content))
    score = torch.stack(signals).amax(0) + 1e-3 * signals[0]  # attention breaks ties
    if chunk.sink is not None:
        score = torch.where(chunk.sink, torch.full_like(score, 3.0), score)
    return score


def make_plan(chunk: Chunk, novelty: torch.Tensor | None, method: DepthWeave) -> Plan:
    """Assign every chunk token a kind: exact row, high / mid / low rank bucket, or evicted."""
    n = chunk.size
    device = chunk.slots.device
    kind = torch.full((n,), MID, dtype=torch.int64, device=device)
    if not method.router:
        if method.residuals and chunk.sink is not None:
            kind[chunk.sink] = EXACT
        return Plan(kind)
    order = router_score(chunk, novelty).argsort(descending=True, stable=True)
    sinks = int(chunk.sink.sum()) if chunk.sink is not None else 0
    exact = max(round(method.residual_tokens * n), sinks) if method.residuals else 0
    rest = n - exact
    evicted = int(method.evict * rest)
    kept = rest - evicted  # bucket fractions are of the factorized (kept) tokens
    hi = round(method.hi_tokens * kept)
    lo = min(round(method.lo_tokens * kept), kept - hi)
    kind[order[:exact]] = EXACT
    kind[order[exact : exact + hi]] = HI
    if evicted:
        kind[order[n - evicted :]] = EVICTED
    if lo > 0:
        kind[order[n - evicted - lo : n - evicted]] = LO
    return Plan(kind)


def content_scores(shared: dict[str, Any], slots: torch.Tensor, rows: int) -> torch.Tensor | None:
    """``[B, c]`` token-content signal from ``shared["token_ids"]`` (``[B, n]`` prompt ids), else ``None``.

    In-prompt rarity (``1 / count``) everywhere; with ``shared["tokenizer"]`` also +1 for tokens with digits,
    +0.5 for capitalised ones (names, entities). Slots past the given ids score 0.
    """
    ids = shared.get("token_ids")
    if ids is None:
        return None
    ids = torch.as_tensor(ids, device=slots.device)
    ids = ids.view(1, -1).expand(rows, -1) if ids.dim() == 1 or ids.shape[0] == 1 else ids
    tokenizer = shared.get("tokenizer")
    out = torch.zeros(rows, slots.numel(), device=slots.device)
    inside = slots < ids.shape[1]
    for b in range(rows):
        row = ids[b]
        unique, inverse, counts = torch.unique(row, return_inverse=True, return_counts=True)
        score = 1.0 / counts[inverse].float()
        if tokenizer is not None:
            flags = torch.tensor(
                [_content_flag(t) for t in tokenizer.convert_ids_to_tokens(unique.tolist())],
                device=slots.device,
            )
            score = score + flags[inverse]
        out[b, inside] = score[slots[inside]]
    return out


def _content_flag(token: str | None) -> float:
    text = (token or "").lstrip("Ġ▁ ")
    if any(c.isdigit() for c in text):
        return 1.0
    return 0.5 if text[:1].isupper() else 0.0


# ----------------------------------------------------------------------------------------- attention parts


class DensePart:
    """Exact (or dequantized) entries: ``keys, values: [H, n, D]`` float32, ``slots: [n]``."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        self.keys, self.values, self.slots = keys, values, slots

    def logits(self, query: torch.Tensor) -> torch.Tensor:
        """``query: [H, M, D]`` -> ``[H, M, n]``."""
        return query @ self.keys.transpose(-1, -2)

    def output(self, probs: torch.Tensor) -> torch.Tensor:
        """``probs: [H, M, n]`` -> ``[H, M, D]``."""
        return probs @ self.values

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys, self.values


class FactorPart:
    """Factorized segments: values as ``(P·C_v)·R_v`` per segment; keys dense (pre-RoPE, reconstructed and
    rotated) or latent (post-RoPE: ``(q·R_kᵀ)·C_kᵀ``)."""

    def __init__(
        self,
        coords_k: list[torch.Tensor],
        coords_v: list[torch.Tensor],
        r_k: torch.Tensor,
        r_v: torch.Tensor,
        slots: torch.Tensor,
        keys: torch.Tensor | None,
    ) -> None:
        self.coords_k, self.coords_v, self.r_k, self.r_v = coords_k, coords_v, r_k, r_v  # r_*: [r, H, D]
        self.slots, self.keys = slots, keys

    def logits(self, query: torch.Tensor) -> torch.Tensor:
        if self.keys is not None:
            return query @ self.keys.transpose(-1, -2)
        latent = torch.einsum("hmd,rhd->hmr", query, self.r_k)  # [H, M, r]
        return torch.cat([latent[..., : c.shape[1]] @ c.T for c in self.coords_k], dim=-1)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Materialised ``keys, values: [H, n, D]`` (diagnostics only)."""
        h, d = self.r_v.shape[1:]
        keys = self.keys
        if keys is None:
            keys = torch.cat([c @ self.r_k[: c.shape[1]].flatten(1) for c in self.coords_k]).view(-1, h, d)
            keys = keys.transpose(0, 1)
        values = torch.cat([c @ self.r_v[: c.shape[1]].flatten(1) for c in self.coords_v]).view(-1, h, d)
        return keys, values.transpose(0, 1)

    def output(self, probs: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(*probs.shape[:2], self.r_v.shape[-1], device=probs.device)
        start = 0
        for c in self.coords_v:
            weights = probs[..., start : start + c.shape[0]] @ c  # [H, M, w]
            out += torch.einsum("hmw,whd->hmd", weights, self.r_v[: c.shape[1]])
            start += c.shape[0]
        return out


def attend_parts(
    query: torch.Tensor, parts: list[Any], mask: torch.Tensor | None, first: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's attention over ``parts`` (the last one is the recent buffer).

    ``query: [Hq, q, D]`` float32 -> ``([q, Hq, D], [m] max attention each recent token got)``. Query heads
    of a KV head are packed along the query axis (``[H, g·q, D]``) so nothing is repeated per head.
    """
    hq, q_len, d = query.shape
    h = parts[-1].keys.shape[0]
    g = hq // h
    packed = query.reshape(h, g * q_len, d)
    logits = torch.cat([p.logits(packed) for p in parts], dim=-1) * scaling  # [H, g·q, N]
    slots = torch.cat([p.slots for p in parts])
    visible = visible_mask(mask, slots.view(1, 1, -1), first, q_len)[0, 0].repeat(g, 1)  # [g·q, N]
    visible = visible | ~visible.any(dim=-1, keepdim=True)  # padding queries: anything, never used
    probs = logits.masked_fill(~visible, float("-inf")).softmax(-1)
    out = torch.zeros(h, g * q_len, d, device=query.device)
    start = 0
    for part in parts:
        n = part.slots.numel()
        out += part.output(probs[..., start : start + n])
        start += n
    m = parts[-1].slots.numel()
    recent = probs[..., start - m :].sum(0).view(g, q_len, m).sum(0).amax(0)
    return out.view(hq, q_len, d).transpose(0, 1), recent


# -------------------------------------------------------------------------------------------------- probes


class Probe:
    """Attention-output probe of one chunk: queries of every group layer attend over the chunk's tokens.

    ``error(keys, values, keep)`` is the mean over layers of ``‖O − Ô‖ / ‖O‖``, ``O`` being attention over the
    exact chunk and ``Ô`` over the given (stored) keys and values with evicted tokens left out.
    """

    def __init__(
        self, queries: list[torch.Tensor], query_slots: torch.Tensor, chunk: Chunk, scalings: list[float]
    ) -> None:
        h = chunk.keys[0].shape[0]
        self.packed = [q.reshape(h, -1, q.shape[-1]) for q in queries]  # [H, g·p, D]
        g = queries[0].shape[0] // h
        causal = chunk.slots.view(1, -1) <= query_slots.view(-1, 1)  # [p, n]
        self.causal = causal.repeat(g, 1)
        self.scalings = scalings
        self.exact = [
            self.attend(i, k.float(), v.float(), None)
            for i, (k, v) in enumerate(zip(chunk.keys, chunk.values, strict=True))
        ]

    def attend(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor | None
    ) -> torch.Tensor:
        visible = self.causal if keep is None else self.causal & keep.view(1, -1)
        logits = self.packed[layer] @ keys.transpose(-1, -2) * self.scalings[layer]
        probs = torch.nan_to_num(logits.masked_fill(~visible, float("-inf")).softmax(-1))
        return probs @ values

    def error(self, keys: list[torch.Tensor], values: list[torch.Tensor], keep: torch.Tensor) -> float:
        errors = []
        for i, exact in enumerate(self.exact):
            approx = self.attend(i, keys[i], values[i], keep)
            errors.append(((approx - exact).norm() / exact.norm().clamp_min(1e-12)).item())
        return sum(errors) / len(errors)
