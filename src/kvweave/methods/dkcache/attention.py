"""DK-Cache's attention computations: Self-Extend remapped attention (the general masked path and the fused
CPU prefill), attention over per-tier logits, and the steady tier's decoupling as a logit bias."""

from __future__ import annotations

from typing import Any

import torch

from kvweave._compat import mask_to_bool
from kvweave.kernels import cpu_int8
from kvweave.kernels.cpu_int8 import HeldRows
from kvweave.methods.dkcache.far import Part
from kvweave.methods.dkcache.positions import is_near
from kvweave.ops.attention import fused_part_attention, masked_softmax, merge_parts
from kvweave.ops.masking import visible_mask
from kvweave.ops.rope import RopeTable, rotate_half

CHUNK_ELEMENTS = 1 << 25
"""Elements of one block of attention logits (float32) during a compensated prefill: ~128 MiB (the default of
:class:`~kvweave.methods.dkcache.layer.DKCacheLayer`'s ``chunk_elements``, which also sizes its key passes)."""

ScoredPart = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]
"""``(logits [B, H, groups·n, T], values [B, H, T, D], slots [B, 1 or H, T], validity [B, H, T] or None)``."""


def remapped_attention(
    q_exact: torch.Tensor,
    q_grouped: torch.Tensor | None,
    k_exact: torch.Tensor,
    k_grouped: torch.Tensor | None,
    values: torch.Tensor,
    visible: torch.Tensor,
    near: torch.Tensor | None,
    scaling: float,
    exact_from: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention whose near pairs use exact RoPE positions and the others grouped ones.

    ``q_*: [B, Hq, n, D]``, ``k_*, values: [B, H, T, D]``, ``visible, near: [B, H or 1, n, T]`` bool (``near``
    True: use ``q_exact·k_exact``, else ``q_grouped·k_grouped``; ``None``: exact only). ``exact_from``: no
    key before it is near any query (its exact logits are not computed). Returns the output
    ``[B, n, Hq, D]`` and ``[B]``: the last query's attention entropy / log(entries it sees), mean over heads.
    """
    b, hq, n, d = q_exact.shape
    h, t = k_exact.shape[1], k_exact.shape[2]
    groups = hq // h

    def logits(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:  # [B, H, groups, n, T']
        return (q.reshape(b, h, groups * n, d) @ k.to(q.dtype).transpose(-1, -2)).view(b, h, groups, n, -1)

    if q_grouped is not None and k_grouped is not None and near is not None:
        scores = logits(q_grouped, k_grouped)
        band = near[..., exact_from:].unsqueeze(2)
        scores[..., exact_from:] = torch.where(
            band, logits(q_exact, k_exact[:, :, exact_from:]), scores[..., exact_from:]
        )
    else:
        scores = logits(q_exact, k_exact)
    probs, entropy = attention_probs(scores, visible, scaling)
    out = (probs.to(values.dtype).view(b, h, groups * n, t) @ values).view(b, hq, n, -1)
    return out.transpose(1, 2).contiguous(), entropy


def attention_probs(
    scores: torch.Tensor, visible: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax of ``scores: [B, H, groups, n, T]`` (unscaled logits) over the ``visible: [B, H or 1, n, T]``
    entries, and ``[B]``: the last query's attention entropy / log(entries it sees), mean over heads."""
    seen = visible.unsqueeze(2)
    # a decode step without padding sees every entry: no mask to apply (checked on the CPU only, where it is free)
    everything = seen.device.type == "cpu" and bool(seen.all())
    # a query that sees nothing (padding): zeros
    probs = masked_softmax(scores.float().mul(scaling), None if everything else seen)
    last = probs[:, :, :, -1, :]
    # -sum p log p, with p = 0 giving 0 · log(tiny) = 0 as in xlogy (which is 4x slower on the CPU)
    entropy = -(last * last.clamp(min=torch.finfo(last.dtype).tiny).log()).sum(-1)
    count = seen[:, :, :, -1, :].sum(-1).expand_as(entropy).float()
    normalised = torch.where(count > 1, entropy / count.clamp(min=2).log(), torch.zeros_like(entropy))
    return probs, normalised.flatten(1).mean(1)


def flash_remapped_prefill(
    q_exact: torch.Tensor,
    q_grouped: torch.Tensor,
    k_exact: torch.Tensor,
    k_grouped: torch.Tensor,
    values: torch.Tensor,
    window: int,
    trained: int,
    scaling: float,
    chunk: int,
) -> torch.Tensor | None:
    """:func:`remapped_attention` over a whole unpadded prompt (positions ``0..n-1``), in fused CPU kernels.

    Per chunk of queries ``[low, high)`` that lies beyond the trained range, three parts merged by their
    log-sum-exp: grouped positions over the keys far from every query of the chunk (no mask), grouped over
    the boundary keys (``j <= i - window``) and exact over the neighbours (``i - window < j <= i``); inside
    the trained range exact causal attention (bulk + diagonal). Nothing ``n x n`` is materialised, which makes
    a 16K compensated prefill minutes instead of half an hour on a CPU. Returns ``[B, n, Hq, D]``, or ``None``
    if the kernel is not available (accelerators: the caller then uses :func:`remapped_attention`).
    """
    if q_exact.device.type != "cpu" or not hasattr(
        torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"
    ):
        return None
    b, hq, n, d = q_exact.shape
    h = k_exact.shape[1]
    groups = hq // h
    outputs = []
    device = q_exact.device
    starts = sorted(set(range(0, n, chunk)) | ({trained} if 0 < trained < n else set()))  # no chunk straddles
    for low, high in zip(starts, starts[1:] + [n], strict=True):
        rows = torch.arange(low, high, device=device).view(-1, 1)
        if high <= trained:  # every query inside the trained range: exact and causal
            diag = torch.arange(low, high, device=device).view(1, -1) <= rows
            parts = [
                fused_part_attention(
                    q_exact[:, :, low:high], k_exact[:, :, :low], values[:, :, :low], None, scaling
                ),
                fused_part_attention(
                    q_exact[:, :, low:high], k_exact[:, :, low:high], values[:, :, low:high], diag, scaling
                ),
            ]
        else:
            cut, edge = max(0, low - window + 1), max(0, high - window + 1)
            far_cols = torch.arange(cut, edge, device=device).view(1, -1)
            near_cols = torch.arange(cut, high, device=device).view(1, -1)
            parts = [
                fused_part_attention(
                    q_grouped[:, :, low:high], k_grouped[:, :, :cut], values[:, :, :cut], None, scaling
                ),
                fused_part_attention(
                    q_grouped[:, :, low:high],
                    k_grouped[:, :, cut:edge],
                    values[:, :, cut:edge],
                    far_cols <= rows - window,
                    scaling,
                ),
                fused_part_attention(
                    q_exact[:, :, low:high],
                    k_exact[:, :, cut:high],
                    values[:, :, cut:high],
                    (near_cols <= rows) & (near_cols > rows - window),
                    scaling,
                ),
            ]
        c = high - low
        out = merge_parts(parts).view(b, h, groups, c, d).reshape(b, hq, c, d)
        outputs.append(out.to(q_exact.dtype))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


def chunked_remapped_prefill(
    query: torch.Tensor,
    query_grouped: torch.Tensor,
    key: torch.Tensor,
    key_grouped: torch.Tensor | None,
    value: torch.Tensor,
    positions: torch.Tensor,
    attention_mask: torch.Tensor | None,
    window: int,
    trained: int,
    scaling: float,
    contiguous: bool,
    chunk_elements: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`remapped_attention` over a prompt (``positions: [B, n]``, any padding) in chunks of queries whose
    logits hold about ``chunk_elements`` elements: the reference prefill beyond the trained range. Returns
    ``[B, n, Hq, D]`` and the last chunk's entropy (that of the prompt's last query). ``contiguous``: every
    real token's position is its slot minus the row's padding (keys far from a whole chunk are skipped)."""
    b, hq, n, _ = query.shape
    chunk = max(1, chunk_elements // max(1, 2 * b * hq * n))
    outputs, entropy = [], None
    for low in range(0, n, chunk):
        high = min(n, low + chunk)
        visible = prefill_visible(attention_mask, positions.shape[0], n, low, high, query.device)[..., :high]
        near = is_near(
            positions[:, low:high].unsqueeze(-1), positions[:, :high].unsqueeze(1), window, trained
        ).unsqueeze(1)
        # keys before low - window + 1 are far from every query of the chunk (positions grow with slots)
        banded = contiguous and bool((positions[:, low:high] >= trained).all())
        out, entropy = remapped_attention(
            query[:, :, low:high],
            query_grouped[:, :, low:high],
            key[:, :, :high],
            key_grouped[:, :, :high] if key_grouped is not None else None,
            value[:, :, :high],
            visible,
            near,
            scaling,
            exact_from=max(0, low - window + 1) if banded else 0,
        )
        outputs.append(out)
    assert entropy is not None
    return torch.cat(outputs, dim=1), entropy


def concatenated_attention(
    query: torch.Tensor,
    query_grouped: torch.Tensor | None,
    parts: list[Part],
    rotated: list[tuple[torch.Tensor, torch.Tensor]],
    valid: list[torch.Tensor],
    query_positions: torch.Tensor,
    attention_mask: torch.Tensor | None,
    window: int,
    trained: int,
    scaling: float,
    first: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`remapped_attention` over attention parts (:data:`~kvweave.methods.dkcache.far.Part`) concatenated:
    the general decode path. ``rotated``: each part's keys at (exact, grouped) positions, ``valid``: each part's
    validity ``[B, 1 or H, T]``, ``query_positions: [B, q]``; ``query_grouped`` ``None``: exact positions only.
    Returns ``[B, q, Hq, D]``, the last query's normalised entropy and its attended entries ``[B]``."""
    rows, q_len = query_positions.shape
    h = parts[-1][0].shape[1]  # KV heads
    keys_exact = torch.cat([k.expand(-1, h, -1, -1) for k, _ in rotated], dim=2)
    keys_grouped = (
        None if query_grouped is None else torch.cat([g.expand(-1, h, -1, -1) for _, g in rotated], dim=2)
    )
    values = torch.cat([p[1].expand(-1, h, -1, -1) for p in parts], dim=2)
    positions = torch.cat([p[2].expand(rows, h, -1) for p in parts], dim=2)
    slots = torch.cat([p[3].expand(rows, h, -1) for p in parts], dim=2)
    ok = torch.cat([v.expand(rows, h, -1) for v in valid], dim=2)
    slots = slots.clamp(0, first + q_len - 1)
    visible = visible_mask(attention_mask, slots.to(torch.int32), first, q_len) & ok.unsqueeze(2)
    near = None
    if query_grouped is not None:
        near = is_near(query_positions.view(rows, 1, q_len, 1), positions.unsqueeze(2), window, trained)
    out, entropy = remapped_attention(
        query, query_grouped, keys_exact, keys_grouped, values, visible, near, scaling
    )
    return out, entropy, visible[:, :, -1, :].sum(-1).float().mean(1)


def prefill_visible(
    attention_mask: torch.Tensor | None, rows: int, n: int, low: int, high: int, device: torch.device
) -> torch.Tensor:
    """``[B, 1, high-low, n]`` bool: which prompt tokens queries ``low..high-1`` may see."""
    mask = mask_to_bool(attention_mask)
    if mask is not None:
        return mask[:, :, low:high, :n].expand(rows, -1, -1, -1)
    queries = torch.arange(low, high, device=device).view(-1, 1)
    return (torch.arange(n, device=device).view(1, -1) <= queries).view(1, 1, high - low, n)


def attend_parts(
    parts: list[ScoredPart],
    shape: torch.Size,
    attention_mask: torch.Tensor | None,
    scaling: float,
    first: int,
    q_len: int,
    dtype: torch.dtype,
    kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One softmax over the concatenated logits of attention parts (:data:`ScoredPart`), the output summed per
    part at ``dtype`` (the model's): ``[B, q, Hq, D]``, the last query's normalised entropy ``[B]`` and the
    entries it attended (mean over KV heads) ``[B]``. ``kernel``: the softmax and entropy in one C++ pass over
    the parts (:func:`~kvweave.kernels.cpu_int8.parts_softmax`, CPU; no concatenation), else in torch."""
    b, hq, n, _ = shape
    h = parts[-1][1].shape[1]
    g = hq // h
    # each part's logits hidden where its entries are not visible; a part that hides nothing (the tiers of a
    # decode step without padding: most of the entries) is not masked at all (checked on the CPU, where it is free)
    cpu = parts[-1][0].device.type == "cpu"
    scored, last_seen, hidden = [], [], False
    for logits, _, slots, ok in parts:
        visible = visible_mask(
            attention_mask, slots.clamp(0, first + q_len - 1).to(torch.int32), first, q_len
        )
        visible = (visible if ok is None else visible & ok.unsqueeze(2)).expand(b, h, n, -1)
        last_seen.append(visible[:, :, -1, :].sum(-1))  # [B, H]
        logits = logits.view(b, h, g, n, -1)
        if not (cpu and bool(visible.all())):
            logits, hidden = logits.masked_fill(~visible.unsqueeze(2), float("-inf")), True
        scored.append(logits)
    count = torch.stack(last_seen).sum(0)  # [B, H] entries the last query sees
    if kernel and cpu:
        weights, rows = cpu_int8.parts_softmax([x.reshape(b, h, g * n, -1) for x in scored], scaling)
        raw = rows.view(b, h, g, n)[..., -1]  # [B, H, g]: the last query's entropy
    else:
        probs = torch.cat(scored, dim=-1).float().mul(scaling).softmax(-1)
        if hidden:  # a query that sees nothing (padding): zeros, the rule of masked_softmax
            probs = probs.nan_to_num(0.0)
        weights = list(probs.reshape(b, h, g * n, -1).split([x.shape[-1] for x in scored], dim=-1))
        last = probs[:, :, :, -1, :]
        # -sum p log p, with p = 0 giving 0 · log(tiny) = 0 as in xlogy (which is 4x slower on the CPU)
        raw = -(last * last.clamp(min=torch.finfo(last.dtype).tiny).log()).sum(-1)  # [B, H, g]
    seen_count = count.unsqueeze(-1).expand_as(raw).float()
    normalised = torch.where(seen_count > 1, raw / seen_count.clamp(min=2).log(), torch.zeros_like(raw))
    entropy = normalised.flatten(1).mean(1)
    out = None
    for (_, values, *_), weight in zip(parts, weights, strict=True):
        if isinstance(values, HeldRows):  # INT8 or 16-bit rows: weighted straight from what is held
            term = values.weighted(weight).to(dtype)
        else:
            term = weight.to(values.dtype) @ values
        out = term if out is None else out + term
    assert out is not None
    attended = count.float().mean(1)
    return out.view(b, hq, n, -1).transpose(1, 2).contiguous(), entropy, attended


def decoupling_bias(
    query: torch.Tensor,
    mean: torch.Tensor,
    alpha: float,
    table: RopeTable | None,
    positions: torch.Tensor,
    first_slot: int,
    aligned: bool,
) -> torch.Tensor:
    """``[B, H, groups·n, T]`` (or ``T = 1`` broadcast): the steady logits' decoupling shift ``−α·q·k_shift`` for
    keys held post-RoPE (``mean: [B, H, 1, D]``). Pre-RoPE decoupling (``table``) shifts key ``j`` by
    ``R(p_j)·m``, so the bias is ``−α·(cos(p_j)·(q∘m) + sin(p_j)·(q∘rot(m)))``; post-RoPE decoupling (``None``)
    shifts every key by ``m``. ``aligned``: the positions are the slots ``first_slot ..`` (a table slice)."""
    b, hq, n, d = query.shape
    h = mean.shape[1]
    q = query.reshape(b, h, hq // h * n, d)
    m = mean.to(q.dtype)
    if table is None:
        return -alpha * (q @ m.transpose(-1, -2))
    cos, sin = table.tables[query.device]
    if aligned:  # positions are the slots: a slice of the table, [T, D]
        cos, sin = (t[first_slot : first_slot + positions.shape[-1]] for t in (cos, sin))
    else:  # [B, 1, T, D]
        cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    return -alpha * ((q * m) @ cos.transpose(-1, -2) + (q * rotate_half(m)) @ sin.transpose(-1, -2))


def grouped_decoupling_bias(
    query_grouped: torch.Tensor,
    mean: torch.Tensor,
    alpha: float,
    table: RopeTable,
    first_slot: int,
    length: int,
    group: int,
) -> torch.Tensor:
    """``[B, H, groups·n, T]``: the steady logits' decoupling shift ``−α·q·R(p_j // G)·m`` for the steady
    tier's slots ``first_slot ..`` (positions are slots), computed once per distinct grouped position."""
    b, hq, n, d = query_grouped.shape
    h = mean.shape[1]
    q = query_grouped.reshape(b, h, hq // h * n, d)
    m = mean.to(q.dtype)
    low, high = first_slot // group, (first_slot + length - 1) // group + 1
    cos, sin = (t[low:high].to(q.dtype) for t in table.tables[query_grouped.device])
    distinct = -alpha * ((q * m) @ cos.transpose(-1, -2) + (q * rotate_half(m)) @ sin.transpose(-1, -2))
    index = torch.arange(first_slot, first_slot + length, device=query_grouped.device) // group - low
    return distinct.index_select(-1, index)


def compensated_parts(
    query: torch.Tensor,
    query_grouped: torch.Tensor,
    far_parts: list[tuple[Part, torch.Tensor]],
    tiers: list[tuple[Any, torch.Tensor | None]],
    alpha: float,
    table: RopeTable,
    group: int,
    core_size: int,
    first: int,
    q_len: int,
    rows: int,
) -> list[ScoredPart]:
    """The scored parts of a decode step beyond the trained range, every position its slot (the fast path of
    compensation: the same attention as :func:`concatenated_attention`, computed per tier).

    Steady and far keys are held rotated at their grouped positions ``p // G`` (:class:`~.holding.KeyHolding`),
    so they only meet the grouped query; every steady and far key is at least ``core`` tokens from the query,
    hence never a neighbour. ``tiers``: ``(steady, its decoupling mean or None)`` then ``(core, None)``; the
    (small) core tier is rotated at exact and grouped positions each step and its neighbours take the exact
    logits; the steady decoupling enters as a logit bias at grouped positions. ``far_parts``: sinks and retrieved
    pages (keys already grouped)."""
    dtype = query.dtype
    b, hq, n, d = query.shape
    core = tiers[-1][0]
    h = core.parts["keys"].view().shape[1]
    q, qg = query.reshape(b, h, hq // h * n, d), query_grouped.reshape(b, h, hq // h * n, d)
    parts: list[ScoredPart] = []
    for (keys, values, _, slots), ok in far_parts:
        parts.append((qg @ keys.to(qg.dtype).transpose(-1, -2), values, slots, ok))
    for tier, mean in tiers:
        if not len(tier):
            continue
        keys, values, positions = tier.read(dtype)
        slots = torch.arange(tier.first_slot, tier.first_slot + len(tier), device=query.device)
        if tier is not core:
            logits = qg @ keys.to(qg.dtype).transpose(-1, -2)
            if mean is not None:
                logits = logits + grouped_decoupling_bias(
                    query_grouped, mean, alpha, table, tier.first_slot, len(tier), group
                )
        else:
            queries = torch.arange(first, first + q_len, device=query.device).view(-1, 1)
            near = is_near(queries, slots.view(1, -1), core_size)  # [n, T] (positions are slots)
            exact = q @ table.rotate(keys, positions).to(q.dtype).transpose(-1, -2)
            far_logits = qg @ table.rotate(keys, positions // group).to(qg.dtype).transpose(-1, -2)
            logits = torch.where(near.repeat(hq // h, 1), exact, far_logits)
        parts.append((logits, values, slots.view(1, 1, -1).expand(rows, 1, -1), None))
    return parts
