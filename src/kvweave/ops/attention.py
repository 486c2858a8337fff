"""Attention over held entries, in one place: the reference and the fast paths tested against it.

- :func:`masked_softmax`: the one masked softmax (a query that sees no key gets zero weights), and
  :func:`attention_with_lse`: attention with its log-sum-exp, the reference every kernel part is tested against.
- :func:`masked_attention`: grouped-query attention with a per-KV-head mask (torch's SDPA), the reference
  every compressed layer's output is tested against.
- :class:`OnlineSoftmax`: attention accumulated over chunks of keys (running max / sum), for stores read
  part by part (quantized blocks).
- :func:`fused_part_attention` + :func:`merge_parts`: attention over one part of the keys in torch's fused CPU
  kernel, returning its log-sum-exp, and the exact softmax over the union of parts from those outputs;
  :func:`merge_splits`: the same merge over the splits of a kernel's grid (stacked partials).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def masked_softmax(logits: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
    """Softmax of ``logits`` over the last axis where ``visible`` (bool, broadcastable; ``None``: all).

    The one rule for a query that sees no key (a padding query, a part with nothing for that row): all its
    weights are 0, so its output is 0 and its log-sum-exp ``-inf`` (:func:`attention_with_lse`,
    :class:`OnlineSoftmax`, :func:`merge_parts`). Such a query's output is never read by a real token."""
    if visible is None:
        return logits.softmax(-1)
    probs = logits.masked_fill(~visible, float("-inf")).softmax(-1)
    return probs.masked_fill(~visible.any(-1, keepdim=True), 0.0)


def attention_with_lse(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor | None,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``query: [B, H, R, D]`` over ``keys: [B, H, T, D]``, ``values: [B, H, T, Dv]``
    where ``visible: [B, H or 1, R, T]`` (``None``: all), in float32: the reference of every kernel part.

    Returns ``out: [B, H, R, Dv]`` and the natural-log ``lse: [B, H, R]`` of the scaled logits (what
    :func:`merge_parts` combines); a row that sees nothing gets ``out = 0`` and ``lse = -inf``.
    """
    logits = (query.float() @ keys.float().transpose(-1, -2)) * scaling
    if visible is not None:
        logits = logits.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [B, H, R]
    safe = torch.where(torch.isinf(lse), 0.0, lse)
    weights = torch.exp(logits - safe.unsqueeze(-1))  # 0 where masked; all 0 for a row that sees nothing
    return weights @ values.float(), lse


def masked_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """Grouped-query attention with a per-KV-head mask.

    ``query: [B, Hq, q, D]``, ``keys, values: [B, H, T, D]``, ``mask: [B, H, q, T]`` -> ``[B, q, Hq, D]``.
    The query heads of a group are packed along the query axis so K and V are never repeated.
    """
    b, hq, q_len, d = query.shape
    h = keys.shape[1]
    groups = hq // h
    packed = query.reshape(b, h, groups * q_len, d)
    packed_mask = (
        mask.unsqueeze(2).expand(b, h, groups, q_len, mask.shape[-1]).reshape(b, h, groups * q_len, -1)
    )
    # A query row with nothing visible (a padding token) would give NaN; let it see everything instead:
    # its output is never used by real tokens.
    packed_mask = packed_mask | ~packed_mask.any(dim=-1, keepdim=True)
    out = F.scaled_dot_product_attention(
        packed, keys.to(query.dtype), values.to(query.dtype), attn_mask=packed_mask, scale=scaling
    )
    return out.view(b, hq, q_len, -1).transpose(1, 2).contiguous()


class OnlineSoftmax:
    """Attention accumulated over chunks of keys: running max, running sum and weighted values.

    ``query: [B, H, R, D]`` (R = query heads of a group x new queries, packed) in float32.
    """

    def __init__(self, query: torch.Tensor, scaling: float) -> None:
        self.query, self.scaling = query, scaling
        b, h, r, d = query.shape
        self.maximum = torch.full((b, h, r, 1), float("-inf"), device=query.device)
        self.total = torch.zeros(b, h, r, 1, device=query.device)
        self.out = torch.zeros(b, h, r, d, device=query.device)

    def add(self, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> None:
        """Attend to ``keys, values: [B, H, T, D]`` where ``visible: [B, H or 1, R, T]``."""
        self.add_logits(self.query @ keys.float().transpose(-1, -2), values, visible)

    def add_logits(self, logits: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> None:
        """Attend with precomputed ``q·k`` logits ``[B, H, R, T]`` (unscaled) to ``values: [B, H, T, D]``."""
        self.add_scaled(logits * self.scaling, visible, lambda weights: weights @ values.float())

    def add_scaled(
        self,
        logits: torch.Tensor,
        visible: torch.Tensor | None,
        weighted: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """Attend with scaled logits ``[B, H, R, T]`` (``visible: [B, H or 1, R, T]``, ``None``: all visible);
        ``weighted(weights)`` returns ``weights @ values`` ``[B, H, R, D]`` for the chunk's values."""
        if visible is not None:
            logits = logits.masked_fill(~visible, float("-inf"))
        maximum = torch.maximum(self.maximum, logits.amax(-1, keepdim=True))
        safe = torch.where(torch.isinf(maximum), 0.0, maximum)  # no visible entry yet: nothing to rescale
        correction = torch.exp(self.maximum - safe)
        weights = torch.exp(logits - safe)
        self.total = self.total * correction + weights.sum(-1, keepdim=True)
        self.out = self.out * correction + weighted(weights)
        self.maximum = maximum

    def add_part(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Merge a part attended elsewhere (a kernel): its normalised output ``out: [B, H, R, D]`` and the
        natural-log log-sum-exp of its scaled logits ``lse: [B, H, R]`` (``-inf`` where it saw nothing)."""
        lse = lse.unsqueeze(-1)
        maximum = torch.maximum(self.maximum, lse)
        safe = torch.where(torch.isinf(maximum), 0.0, maximum)
        correction = torch.exp(self.maximum - safe)
        weight = torch.exp(lse - safe)
        self.total = self.total * correction + weight
        self.out = self.out * correction + weight * out.float()
        self.maximum = maximum

    def result(self) -> torch.Tensor:
        """``[B, H, R, D]`` attention output (zero for a query that saw nothing)."""
        return self.out / self.total.clamp(min=torch.finfo(torch.float32).tiny)


def fused_part_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Attention of ``query: [B, Hq, c, D]`` over ``keys, values: [B, H, S, D]`` (``mask: [c, S]`` bool or
    ``None``) in torch's fused CPU kernel: output ``[B, H, groups*c, D]`` (query heads of a KV head packed
    along the rows) and its log-sum-exp ``[B, H, groups*c]`` (``-inf`` for a row that sees nothing)."""
    b, hq, c, d = query.shape
    h, length = keys.shape[1], keys.shape[2]
    if length == 0:
        return None
    groups = hq // h
    packed = query.reshape(b, h, groups * c, d)
    additive = None
    if mask is not None:
        additive = torch.zeros(mask.shape, dtype=query.dtype, device=query.device)
        additive = additive.masked_fill_(~mask, float("-inf")).repeat(groups, 1)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        packed, keys.to(query.dtype), values.to(query.dtype), 0.0, False, attn_mask=additive, scale=scaling
    )
    if mask is not None:
        lse = lse.masked_fill(~mask.any(-1).repeat(groups), float("-inf"))
    return out, lse


def merge_parts(parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> torch.Tensor:
    """Softmax over the union of the parts' keys, from each part's output and log-sum-exp."""
    real = [p for p in parts if p is not None]
    top = torch.stack([lse for _, lse in real]).amax(0)
    top = torch.where(torch.isinf(top), 0.0, top)
    weights = [torch.exp(lse - top).unsqueeze(-1) for _, lse in real]
    total = sum(weights[1:], weights[0])
    out = sum(
        (w * o.float() for w, (o, _) in zip(weights[1:], real[1:], strict=True)),
        weights[0] * real[0][0].float(),
    )
    return out / total.clamp(min=torch.finfo(torch.float32).tiny)


def merge_splits(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Partials of the splits of the token axis (a flash-decoding kernel's grid), ``out: [..., S, R, D]`` and
    ``lse: [..., S, R]`` (``-inf`` where a split saw nothing), -> ``[..., R, D]`` and ``[..., R]``: the softmax
    over all tokens, as :func:`merge_parts` gives it for parts held apart."""
    if out.shape[-3] == 1:
        return out.squeeze(-3), lse.squeeze(-2)
    total = torch.logsumexp(lse, dim=-2)  # [..., R]; -inf where no split saw anything
    safe = torch.where(torch.isinf(total), 0.0, total)
    weights = torch.exp(lse - safe.unsqueeze(-2)).unsqueeze(-1)  # [..., S, R, 1]
    return (weights * out).sum(-3), total
