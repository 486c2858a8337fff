"""Attention over what a row store holds, part by part: exact rows (:class:`DensePart`), factorized segments
(:class:`FactorPart`, values never materialised) and the recent buffer, combined by :func:`attend_parts`."""

from __future__ import annotations

from typing import Any

import torch

from kvweave.ops.attention import masked_softmax
from kvweave.ops.masking import visible_mask


class DensePart:
    """Exact (or dequantized) entries: ``keys, values: [H, n, D]`` float32, ``slots: [n]``; ``exact_rows``: a
    store's exact rows (written with their whole context), which a rebuilt span never hides."""

    def __init__(
        self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, exact_rows: bool = False
    ) -> None:
        self.keys, self.values, self.slots = keys, values, slots
        self.exact_rows = exact_rows

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


def in_set(values: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """``torch.isin(values, members)`` for integer slots, by a lookup table over ``members``' range: a scatter
    and a gather where ``isin`` sorts (a decode step calls it per layer; ``members`` spans at most the context)."""
    if members.numel() == 0:
        return torch.zeros_like(values, dtype=torch.bool)
    low, high = int(members.min()), int(members.max())
    table = torch.zeros(high - low + 1, dtype=torch.bool, device=values.device)
    table[members.long() - low] = True
    index = values.long() - low
    inside = (index >= 0) & (index <= high - low)
    return inside & table[index.clamp(0, high - low)]


def attend_parts(
    query: torch.Tensor,
    parts: list[Any],
    mask: torch.Tensor | None,
    first: int,
    scaling: float,
    masses: list[torch.Tensor] | None = None,
    recent_parts: int = 1,
    recall_parts: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's attention over ``parts`` (the last ``recent_parts`` hold the recent buffer, the exact tokens
    last; the first ``recall_parts`` hold rebuilt tokens, one contiguous range of slots or the ranges of the first
    part's ``spans``, which the parts between them and the buffer then hide, all but those marked ``exact_rows``: each position is attended once, so the
    rebuilt part's ``valid`` must leave out the slots such parts hold).

    ``query: [Hq, q, D]`` float32 -> ``([q, Hq, D], [m] max attention each recent token got)``. Query heads
    of a KV head are packed along the query axis (``[H, g·q, D]``) so nothing is repeated per head.
    ``masses``, when given, receives per part the attention its entries got, summed over the query rows and
    the query heads of each KV head (``[H, n]``).
    """
    hq, q_len, d = query.shape
    h = parts[-1].keys.shape[0]
    g = hq // h
    packed = query.reshape(h, g * q_len, d)
    logits = torch.cat([p.logits(packed) for p in parts], dim=-1) * scaling  # [H, g·q, N]
    slots = torch.cat(
        [p.slots.expand(h, -1) if p.slots.dim() == 1 else p.slots for p in parts], dim=1
    )  # [H, N]
    visible = visible_mask(mask, slots.unsqueeze(0), first, q_len)[0]  # [H, q, N]
    valid = [getattr(p, "valid", None) for p in parts]
    if any(v is not None for v in valid):  # per-head selections padded to one length
        flags = [
            v if v is not None else torch.ones_like(p.slots.expand(h, -1), dtype=torch.bool)
            for v, p in zip(valid, parts, strict=True)
        ]
        visible = visible & torch.cat(flags, dim=1).unsqueeze(1)
    if recall_parts:
        rebuilt = sum(p.slots.shape[-1] for p in parts[:recall_parts])
        stored = slots.shape[1] - sum(p.slots.shape[-1] for p in parts[len(parts) - recent_parts :])
        between = slots[:, rebuilt:stored]
        spans = getattr(parts[0], "spans", None) if recall_parts == 1 else None
        if spans:  # a question's quotes: several ranges, given as ints
            hidden = torch.zeros_like(between, dtype=torch.bool)
            for low, high in spans:
                hidden |= (between >= low) & (between < high)
        else:  # one contiguous range
            hidden = (between >= slots[0, 0]) & (between <= slots[0, rebuilt - 1])  # [H, n], no sync
        start = 0
        for part in parts[recall_parts : len(parts) - recent_parts]:
            n = part.slots.shape[-1]
            if getattr(part, "exact_rows", False):
                hidden[:, start : start + n] = False
            start += n
        visible[..., rebuilt:stored] &= ~hidden.unsqueeze(1)
    visible = visible.repeat(1, g, 1)  # [H, g·q, N], rows ordered (query head, query) like ``packed``
    probs = masked_softmax(logits, visible)  # padding queries (nothing visible): zero weights, never used
    out = torch.zeros(h, g * q_len, d, device=query.device)
    start = 0
    for part in parts:
        n = part.slots.shape[-1]
        out += part.output(probs[..., start : start + n])
        if masses is not None:
            masses.append(probs[..., start : start + n].sum(1))
        start += n
    m = sum(p.slots.shape[-1] for p in parts[len(parts) - recent_parts :])
    recent = probs[..., start - m :].sum(0).view(g, q_len, m).sum(0).amax(0)
    return out.view(hq, q_len, d).transpose(0, 1), recent
