"""Plumbing shared by the score-based evicting baselines (``h2o``, ``snapkv``, ``keyformer``, ``keydiff``).

A method computes a priority per held entry (``[B, H, T]``, higher = keep) and :meth:`EvictingLayer.evict`
keeps each row's top entries, per KV head. Budgets are per batch row: ``ratio`` of the row's *real* prompt
tokens (left padding does not count) or a fixed ``budget``; storage stays rectangular, so a row whose budget
is smaller than the batch's largest fills the difference with its own padding entries (masked in attention,
never chosen over a real token). That keeps every batch row equal to its own single-row run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvweave.cache import CompressedLayer
from kvweave.ops.attention import masked_softmax
from kvweave.ops.masking import visible_mask
from kvweave.registry import Method

if TYPE_CHECKING:
    from kvweave.cache import KVCache

# Elements of one chunk of attention logits when scores are computed from many queries (prefill):
# [B, Hq, rows, T] float32 stays under ~128 MiB.
CHUNK_ELEMENTS = 1 << 25


def check_budget(method: Method) -> None:
    """Validate the shared ``budget`` / ``ratio`` options of an evicting method."""
    method.check_range("budget", 1)
    if getattr(method, "ratio", None) is not None:
        method.check_range("ratio", 1e-6, 1.0)


def budget_per_row(ratio: float | None, budget: int, real_tokens: torch.Tensor) -> torch.Tensor:
    """``[B]`` entries each row may keep: ``ratio`` of its real tokens (at least 1), else ``budget``."""
    if ratio is None:
        return torch.full_like(real_tokens, budget)
    return (real_tokens.double() * ratio).floor().to(real_tokens.dtype).clamp(min=1)


def select_keep(
    priority: torch.Tensor,
    pad: torch.Tensor,
    budget: torch.Tensor,
    count: int,
    protected: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B, H, count]`` indices of the entries to keep.

    ``priority: [B, H, T]`` (higher = keep), ``pad: [B, H, T]`` True for padding entries, ``budget: [B]`` real
    entries row ``b`` keeps, ``protected: [B, H, T]`` entries kept before any other (the latest first when
    they exceed the budget). Each row keeps its top ``budget`` real entries, then padding entries, then (only
    if it has too little padding to fill ``count``) its next-best real entries. Ties keep the earlier entry.
    """
    t = priority.shape[-1]
    position = torch.arange(t, device=priority.device)
    score = priority.float().masked_fill(pad, float("-inf"))
    order = score.argsort(dim=-1, descending=True, stable=True)
    if protected is not None:
        protected = protected.expand_as(score) & ~pad
        # protected entries first, the latest of them first
        key = torch.where(protected, position.to(score.dtype), float("-inf")).gather(-1, order)
        order = order.gather(-1, key.argsort(dim=-1, descending=True, stable=True))
    rank = torch.empty_like(order).scatter_(-1, order, position.expand_as(order))
    chosen = ~pad & (rank < budget.view(-1, 1, 1))
    tier = torch.where(chosen, 0, torch.where(pad, 1, 2))
    return (tier * t + rank).argsort(dim=-1, stable=True)[..., :count]


def gumbel_noise(
    seed: int, layer: int, head: torch.Tensor, query_index: torch.Tensor, key_index: torch.Tensor
) -> torch.Tensor:
    """Gumbel(0, 1) noise from a counter-based hash of (seed, layer, query head, query token, key token).

    Indices are broadcast together (non-negative ints). The same token pair gets the same noise whatever
    the batch layout, so a padded batch row equals its single-row run and reruns are reproducible.
    """
    x = _mix(
        torch.tensor((seed * 1_000_003 + layer) & 0xFFFFFFFF, dtype=torch.int64, device=key_index.device)
    )
    x = _mix(x ^ head.to(torch.int64))
    x = _mix(x ^ query_index.to(torch.int64))
    x = _mix(x ^ key_index.to(torch.int64))  # the only full-size step: in-place ops below
    uniform = (
        (x >> 8).to(torch.float32).add_(0.5).mul_(1.0 / (1 << 24))
    )  # 24 bits: exact in float32, in (0, 1)
    return uniform.log_().neg_().log_().neg_()


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (products stay below 2**63 in int64); works in place on a fresh tensor."""
    mask = 0xFFFFFFFF
    x = x & mask
    x.bitwise_xor_(x >> 16).mul_(0x45D9F3B).bitwise_and_(mask)
    x.bitwise_xor_(x >> 16).mul_(0x45D9F3B).bitwise_and_(mask)
    return x.bitwise_xor_(x >> 16)


class EvictingLayer(CompressedLayer):
    """Exact entries, evicted per (row, KV head) by a method-specific priority.

    ``entry_state`` names ``[B, H, T]`` tensors that follow the held entries (e.g. accumulated scores).
    """

    entry_state: ClassVar[tuple[str, ...]] = ()
    state_fields = CompressedLayer.state_fields + ("budget", "scaling")
    batch_fields = CompressedLayer.batch_fields + ("budget",)

    def __init__(self, cache: KVCache, layer_idx: int) -> None:
        super().__init__(cache, layer_idx)
        self.method: Any = cache.method
        self.budget = torch.empty(0, dtype=torch.int64)  # [B] real entries each row keeps (set at prefill)
        self.scaling: float = cache.head_dim**-0.5  # the model's own, from the first attention call

    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> torch.Tensor:
        self.scaling = kwargs.get("scaling") or self.scaling
        return super().attend(module, query, key, value, attention_mask, **kwargs)

    # -- bookkeeping
    def pad_entries(self) -> torch.Tensor:
        """``[B, H, T]`` True where a held entry is left padding."""
        slots = self.held_slots().to(torch.int64)
        if self.pad_count is None:
            return torch.zeros_like(slots, dtype=torch.bool)
        return slots < self.pad_count.view(-1, 1, 1)

    def set_budget(self) -> None:
        """Fix each row's budget from its real prompt tokens (called at prefill)."""
        real = (~self.pad_entries()[:, 0]).sum(-1)
        self.budget = budget_per_row(self.method.ratio, self.method.budget, real)

    def recent(self, fraction: float) -> torch.Tensor:
        """``[B, 1, T]`` True for each row's latest ``fraction`` of its budget (held in token order)."""
        t = self.entries()
        count = (self.budget.double() * fraction).floor().to(torch.int64)
        return torch.arange(t, device=self.device).view(1, 1, -1) >= (t - count).view(-1, 1, 1)

    def over_budget(self) -> bool:
        """Whether any row holds more than the batch's largest budget."""
        return self.budget.numel() > 0 and self.entries() > int(self.budget.max())

    def evict(self, priority: torch.Tensor, protected: torch.Tensor | None = None) -> None:
        """Keep each row's budget of entries by ``priority: [B, H, T]`` (no-op while within budget)."""
        if not self.over_budget():
            return
        index = select_keep(priority, self.pad_entries(), self.budget, int(self.budget.max()), protected)
        self.keep(index)

    def keep(self, index: torch.Tensor) -> None:
        index = index.sort(dim=-1).values
        for name in self.entry_state:
            state = getattr(self, name)
            if state is not None:
                setattr(self, name, state.gather(2, index.to(torch.int64)).contiguous())
        super().keep(index)

    # -- attention weights over the held entries
    def query_is_real(self, first: int, q_len: int) -> torch.Tensor:
        """``[B, q]`` True where new query ``first + i`` is a real token (not left padding)."""
        index = torch.arange(first, first + q_len, device=self.device).view(1, -1)
        pads = self.pad_count if self.pad_count is not None else torch.zeros(self.rows, device=self.device)
        return index >= pads.view(-1, 1)

    def attention_received(
        self,
        query: torch.Tensor,
        attention_mask: torch.Tensor | None,
        first: int,
        logits_hook: Callable[[torch.Tensor, int, int], torch.Tensor] | None = None,
        elements: int = CHUNK_ELEMENTS,
    ) -> torch.Tensor:
        """``[B, H, T]`` float32: attention each held entry receives from the real queries ``query``.

        ``query: [B, Hq, q, D]`` are tokens ``first .. first+q-1``; the weights are summed over the queries
        and over the query heads of each KV head's group (GQA). Computed in chunks of query rows so the
        prefill never holds a ``[q, T]`` matrix per head. ``logits_hook(logits, start, rows)`` may change the
        ``[B, H, G, rows, T']`` logits of the first ``T' <= T`` entries before the softmax (Keyformer adds
        Gumbel noise); ``elements`` bounds the logits of one chunk.
        """
        b, hq, q_len, d = query.shape
        keys: torch.Tensor = self.keys  # [B, H, T, D]
        h, t = keys.shape[1], keys.shape[2]
        grouped = query.view(b, h, hq // h, q_len, d)
        slots = self.held_slots()
        real = self.query_is_real(first, q_len)
        # While nothing was evicted, entry i is token i: a chunk of queries sees only a prefix of the keys
        # (causal), so the logits of the rest (half the work of a prefill) are never computed.
        ordered = self.slots is None
        total = torch.zeros(b, h, t, dtype=torch.float32, device=self.device)
        rows = max(1, elements // max(1, b * hq * t))
        for start in range(0, q_len, rows):
            stop = min(q_len, start + rows)
            width = min(t, first + stop) if ordered else t
            logits = (
                torch.einsum(
                    "bhgqd,bhtd->bhgqt", grouped[:, :, :, start:stop].float(), keys[:, :, :width].float()
                )
                * self.scaling
            )
            if logits_hook is not None:
                logits = logits_hook(logits, start, stop - start)
            mask = attention_mask[:, :, start:stop] if attention_mask is not None else None
            visible = visible_mask(mask, slots[..., :width], first + start, stop - start).unsqueeze(2)
            weights = masked_softmax(logits, visible)  # [B, H, G, rows, width]
            weights = torch.where(visible & real[:, start:stop].view(b, 1, 1, -1, 1), weights, 0.0)
            total[..., :width] += weights.sum(dim=(2, 3))
        return total

    def layer_stats(self) -> dict[str, Any]:
        budget = self.budget.tolist() if self.budget.numel() else None
        return {"entries": self.entries(), "budget": budget}
