"""Masks over held entries, in one place: which held tokens each query sees, and each row's left padding.

transformers builds its attention mask over *tokens* (``[B, 1, q, N]``); compressed layers hold entries
that each came from one token (``slots``), so the columns of held entries are gathered from that mask:
padding, causality and evictions stay right for any ``generate()`` call.
"""

from __future__ import annotations

import torch

from kvweave._compat import mask_to_bool


def visible_mask(
    attention_mask: torch.Tensor | None, slots: torch.Tensor, first: int, q_len: int
) -> torch.Tensor:
    """``[B, H, q, T]`` bool: which held entries (``slots: [B, H, T]``) each new query may attend to.

    ``attention_mask: [B, 1, q, N]`` is transformers' mask over tokens (``None`` means plain causal without
    padding); the new queries are tokens ``first .. first+q-1``.
    """
    mask = mask_to_bool(attention_mask)
    b, h, t = slots.shape
    if mask is None:
        query_slots = torch.arange(first, first + q_len, device=slots.device).view(1, 1, q_len, 1)
        return slots.unsqueeze(2) <= query_slots
    index = slots.to(torch.int64).unsqueeze(2).expand(b, h, mask.shape[2], t)
    return mask.expand(b, h, -1, -1).gather(3, index)


def prompt_padding(
    attention_mask: torch.Tensor | None, rows: int, tokens: int, device: torch.device
) -> torch.Tensor:
    """``[B]`` left-padding tokens per row among the first ``tokens``, from the prefill mask's last query row."""
    mask = mask_to_bool(attention_mask)
    if mask is None:
        return torch.zeros(rows, dtype=torch.int64, device=device)
    return (~mask[:, 0, -1, :tokens]).sum(-1).to(torch.int64)
