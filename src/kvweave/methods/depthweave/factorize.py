"""Factorization of a row store: bases and coefficients from a chunk, projection of later chunks, refresh.

Functions over a :class:`~kvweave.methods.depthweave.store.RowStore`: :func:`add_chunk` folds a chunk in (the
first creates the bases by a weighted truncated SVD, ``kvweave.ops.lowrank``, with probe-chosen ranks; later ones
are projected onto them and may refresh them); :func:`stored_chunk` is a chunk as it would be stored (quantized
through ``kvweave.ops.quantize``), which the probes compare with the exact chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kvweave.methods.depthweave.chunk import EVICTED, EXACT, HI, LO, MID, Chunk, Plan
from kvweave.methods.depthweave.ranks import (
    Budget,
    interpolate,
    next_rank,
    ranks_for_error,
    ranks_within,
    side_bytes,
)
from kvweave.methods.depthweave.router import make_plan, novelty_score, router_score
from kvweave.methods.depthweave.select import bounds_bytes, summarize
from kvweave.methods.depthweave.store import COORD_GROUP, RowStore
from kvweave.ops.lowrank import orthonormal_columns, top_basis
from kvweave.ops.quantize import fake_quantize, pack, packed_bytes
from kvweave.ops.rope import apply_rotary

if TYPE_CHECKING:
    from kvweave.methods.depthweave.probes import Probe
    from kvweave.ops.rope import Rotary


def add_chunk(
    store: RowStore, chunk: Chunk, probe: Probe | None, rotary: Rotary | None, budget: Budget
) -> None:
    """Fold ``chunk`` into ``store``: a first chunk creates the bases, later ones are projected onto them."""
    cos_sin = rotary.cos_sin(chunk.positions.view(1, -1), chunk.x_k.device) if rotary is not None else None
    before = {key: segment.slots.numel() for key, segment in store.segments.items()}
    refreshes = store.log["refreshes"]
    if not store.basis["k"]:
        initialize(store, chunk, probe, cos_sin, budget)
    else:
        project(store, chunk, probe if store.method.probes else None, cos_sin, budget)
    store.log["folds"] += 1
    if store.method.decode_tokens > 0:  # page summaries of what changed (all of it after a refresh)
        summarize(store, rotary, {} if store.log["refreshes"] != refreshes else before)


def initialize(store: RowStore, chunk: Chunk, probe: Probe | None, cos_sin: Any, budget: Budget) -> None:
    """Prefill fold: plan the tokens, find the bases (weighted truncated SVD), choose the ranks, store."""
    method = store.method
    novelty = None
    if method.router:
        provisional = {s: top_basis(x, method.rank)[0] for s, x in (("k", chunk.x_k), ("v", chunk.x_v))}
        novelty = novelty_score(chunk, provisional["k"].T, provisional["v"].T)
    plan = make_plan(chunk, novelty, method)
    factor = plan.index(HI, MID, LO)
    limit = chunk.x_k.shape[1] if chunk.x_k.shape[1] <= 2048 else 1024  # randomized SVD beyond 2048 columns
    weight = torch.ones(factor.numel(), device=chunk.x_k.device)
    if method.weighting > 0:  # rows the prompt's end attends to count more in the basis
        attention = chunk.attention[factor]
        weight = weight + method.weighting * attention / attention.mean().clamp_min(1e-12)
    rows = weight.sqrt().unsqueeze(1)
    bases = {s: top_basis(x[factor] * rows, limit)[0] for s, x in (("k", chunk.x_k), ("v", chunk.x_v))}
    caps = {s: v.shape[1] for s, v in bases.items()}
    if method.probes and probe is not None:
        ranks = choose_ranks(store, chunk, plan, bases, probe, cos_sin, budget)
    else:
        ranks = method.fixed_ranks(store, plan, caps, budget)
    for side in ("k", "v"):
        store.rank[side] = ranks[side]
        store.set_basis(side, bases[side][:, : method.bucket_widths(ranks[side], caps[side])[0]].T)
    store.store(chunk, plan)
    store.log.update(
        rank_k=ranks["k"], rank_v=ranks["v"], basis_k=store.total_rank("k"), basis_v=store.total_rank("v")
    )
    if probe is not None:
        keys, values = stored_chunk(store, chunk, plan, cos_sin)
        store.probe_reference = probe.error(keys, values, plan.kind != EVICTED)
        store.log["probe_error"] = store.probe_reference


def project(
    store: RowStore, chunk: Chunk, probe: Probe | None, cos_sin: Any, budget: Budget | None = None
) -> None:
    """Decode-time fold: project onto the bases; refresh them or move the rank when the probe says so; what
    the ``compression`` budget has left after the coordinates goes to exact rows (:func:`spend_budget`)."""
    method = store.method
    novelty = None
    spending = budget is not None and method.compression is not None and method.residuals
    if method.router or spending:
        novelty = novelty_score(chunk, store.basis_matrix("k"), store.basis_matrix("v"))
    plan = make_plan(chunk, novelty, method)
    if spending:
        plan = spend_budget(store, chunk, plan, novelty, budget)  # type: ignore[arg-type]
    if probe is not None:
        keys, values = stored_chunk(store, chunk, plan, cos_sin)
        error = probe.error(keys, values, plan.kind != EVICTED)
        store.log["last_fold_error"] = error
        reference = method.target_error or store.probe_reference or error
        if error > method.drift * reference:
            if method.target_error is not None:  # error-driven: later chunks get the next rank up
                store.rank = {s: next_rank(r, +1) for s, r in store.rank.items()}
            refresh(store, chunk, plan)
            store.log["refreshes"] += 1
            if method.target_error is None:
                # what the refreshed basis achieves is the new reference: a probe that reads high for
                # reasons a basis cannot fix (one query, a short chunk) must not refresh every fold, and
                # every refresh re-quantizes the old coordinates
                keys, values = stored_chunk(store, chunk, plan, cos_sin)
                store.probe_reference = max(reference, probe.error(keys, values, plan.kind != EVICTED))
        elif method.target_error is not None and error * method.drift < reference:
            store.rank = {s: next_rank(r, -1) for s, r in store.rank.items()}
        store.log.update(rank_k=store.rank["k"], rank_v=store.rank["v"])
    store.store(chunk, plan)


def spend_budget(store: RowStore, chunk: Chunk, plan: Plan, novelty: torch.Tensor, budget: Budget) -> Plan:
    """Keep as exact rows the chunk tokens the stored bases represent worst, as many as the byte budget of
    ``compression`` has left once every token's coordinates are paid for.

    A decode-time chunk projected onto the prefill's bases costs a few bytes per token (its coordinates), so
    without this a long generation drifts far past ``compression`` (25x at 2,250 steps on smollm2-135m) and the
    tokens it writes are the ones the bases fit worst. The budget is the row's whole one (its tokens' 16-bit
    bytes / ``compression``, less the recent buffer), so the held bytes track the target however long decoding
    runs. Tokens are ranked as the router ranks them: the better of the attention they received while recent
    and their energy outside the bases (:func:`~kvweave.methods.depthweave.router.router_score`).
    """
    method = store.method
    factor = plan.index(HI, MID, LO)
    if factor.numel() == 0:
        return plan
    element = store.dtype.itemsize
    index_bytes = 8 if method.keys == "pre_rope" else 4  # slot (+ position) per token
    widths = [method.bucket_widths(store.rank[s], store.total_rank(s))[1] for s in ("k", "v")]
    per_coordinate = sum(packed_bytes(COORD_GROUP, w, method.bits, COORD_GROUP, element) for w in widths)
    coordinate_cost = per_coordinate / COORD_GROUP + index_bytes
    exact_cost = store.exact_bytes_estimate(1, element) + 4
    held = sum(held for held, _ in store.part_bytes(store.members).values())
    available = budget.full_16bit / method.compression - budget.recent_bytes  # type: ignore[operator]
    spare = available - held - factor.numel() * coordinate_cost
    count = min(int(spare // max(exact_cost - coordinate_cost, 1)), factor.numel())
    if count <= 0:
        return plan
    score = router_score(chunk, novelty)[factor]
    kind = plan.kind.clone()
    kind[factor[score.topk(count).indices]] = EXACT
    return Plan(kind)


def stored_chunk(
    store: RowStore, chunk: Chunk, plan: Plan, cos_sin: Any
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer ``[H, n, D]`` post-RoPE keys and values of ``chunk`` as they would be stored now."""
    method = store.method
    recon = {}
    for side, x in (("k", chunk.x_k), ("v", chunk.x_v)):
        basis = store.basis_matrix(side)
        coords = x @ torch.linalg.pinv(basis)
        width = torch.zeros(chunk.size, dtype=torch.int64, device=x.device)
        for kind, w in zip(
            (HI, MID, LO), method.bucket_widths(store.rank[side], basis.shape[0]), strict=True
        ):
            width[plan.kind == kind] = w
        coords = coords * (torch.arange(coords.shape[1], device=x.device) < width.unsqueeze(1))
        recon[side] = fake_quantize(coords, method.bits, COORD_GROUP) @ basis
    return assemble(store, chunk, plan, recon["k"], recon["v"], cos_sin)


def assemble(
    store: RowStore,
    chunk: Chunk,
    plan: Plan,
    recon_k: torch.Tensor | None,
    recon_v: torch.Tensor | None,
    cos_sin: Any,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Exact rows as stored, factorized rows from ``recon_*`` (``None``: exact), per layer. ``recon_*`` is
    ``[n, G·H·D]`` (every chunk token) or ``[n_f, G·H·D]`` (the factorized tokens only, in plan order: what
    the rank probes build, saving a scatter into a chunk-sized tensor)."""
    factor = plan.index(HI, MID, LO)
    exact = plan.index(EXACT)
    bits = store.method.residual_bits
    if recon_k is not None and recon_k.shape[0] != factor.numel():
        recon_k = recon_k[factor]
    if recon_v is not None and recon_v.shape[0] != factor.numel():
        recon_v = recon_v[factor]
    if cos_sin is not None and recon_k is not None:  # gathered once, not once per layer
        cos_sin = (cos_sin[0][:, factor], cos_sin[1][:, factor])
    keys, values = [], []
    for i, (k, v) in enumerate(zip(chunk.keys, chunk.values, strict=True)):
        # a side that is neither rebuilt nor rounded stays the exact tensor (no copy)
        rounded = exact.numel() and bits != 16
        k = k.float().clone() if recon_k is not None or rounded else k.float()
        v = v.float().clone() if recon_v is not None or rounded else v.float()
        if exact.numel() and bits != 16:
            k[:, exact] = fake_quantize(k[:, exact], bits, 0)
            v[:, exact] = fake_quantize(v[:, exact], bits, 0)
        columns = slice(i * store.width, (i + 1) * store.width)
        if recon_k is not None and factor.numel():
            rows = recon_k[:, columns].reshape(-1, store.heads, store.dim).transpose(0, 1)  # [H, n_f, D]
            if cos_sin is not None:
                rows = apply_rotary(rows.unsqueeze(0), *cos_sin)[0]
            k[:, factor] = rows
        if recon_v is not None and factor.numel():
            v[:, factor] = recon_v[:, columns].reshape(-1, store.heads, store.dim).transpose(0, 1)
        keys.append(k)
        values.append(v)
    return keys, values


def available_bytes(store: RowStore, plan: Plan, budget: Budget) -> float:
    """What ``compression`` leaves a row for coordinates and coefficients once the recent buffer, the exact
    rows, the token indices and the page summaries are paid for."""
    method, counts = store.method, plan.counts()
    factorized = int(plan.index(HI, MID, LO).numel())
    fixed = budget.recent_bytes + store.exact_bytes_estimate(counts["exact"], store.dtype.itemsize)
    fixed += factorized * (8 if method.keys == "pre_rope" else 4) + counts["exact"] * 4
    fixed += bounds_bytes(method, factorized, len(store.members), store.heads, store.dim)
    return budget.full_16bit / (method.compression or 8.0) - fixed


def side_cost(store: RowStore, plan: Plan, caps: dict[str, int]) -> Callable[[str, int], int]:
    """``(side, rank) -> bytes`` of that side's coordinates and coefficients for ``plan``'s buckets."""
    counts = plan.counts()
    sizes = (counts["hi"], counts["mid"], counts["lo"])
    element = store.dtype.itemsize
    return lambda side, rank: side_bytes(
        store.method, sizes, caps[side], rank, len(store.members), store.width, element
    )


def choose_ranks(
    store: RowStore,
    chunk: Chunk,
    plan: Plan,
    bases: dict[str, torch.Tensor],
    probe: Probe,
    cos_sin: Any,
    budget: Budget,
) -> dict[str, int]:
    """``r_K, r_V`` from probe errors: cheapest meeting ``target_error``, or best within the budget."""
    method = store.method
    factor = plan.index(HI, MID, LO)
    exact_keys = [k.float() for k in chunk.keys]
    exact_values = [v.float() for v in chunk.values]
    keep = plan.kind != EVICTED
    caps = {s: bases[s].shape[1] for s in ("k", "v")}

    cost = side_cost(store, plan, caps)
    # every probed rank's coordinates are the leading columns of one projection
    projected = {s: x[factor] @ bases[s] for s, x in (("k", chunk.x_k), ("v", chunk.x_v))}

    def side_error(side: str, rank: int) -> float:
        basis = bases[side]
        cap = basis.shape[1]
        widths = method.bucket_widths(rank, cap)
        top = widths[0]
        x = chunk.x_k if side == "k" else chunk.x_v
        coords = projected[side][:, :top]
        width = torch.tensor(widths, device=x.device)[plan.kind[factor].clamp(max=LO)]
        coords = coords * (torch.arange(top, device=x.device) < width.unsqueeze(1))
        r = fake_quantize(basis[:, :top].T.contiguous(), method.coefficient_bits, top)
        recon = fake_quantize(coords, method.bits, COORD_GROUP) @ r  # [n_f, W]: the factorized rows only
        if side == "k":
            keys, _ = assemble(store, chunk, plan, recon, None, cos_sin)
            return probe.error(keys, exact_values, keep)
        _, values = assemble(store, chunk, plan, None, recon, cos_sin)
        return probe.error(exact_keys, values, keep, exact_keys=True)

    if method.target_error is not None:
        ranks, errors = ranks_for_error(caps, cost, side_error, method.target_error)
    else:  # byte budget: what the row may spend on coordinates and coefficients
        ranks, errors = ranks_within(caps, cost, side_error, available_bytes(store, plan, budget))
    store.log["probe_error_k"] = interpolate(errors["k"], ranks["k"])
    store.log["probe_error_v"] = interpolate(errors["v"], ranks["v"])
    return ranks


def refresh(store: RowStore, chunk: Chunk, plan: Plan) -> None:
    """New bases: top directions of (stored reconstruction + this chunk), old coordinates re-expressed.

    Works in the span of the old basis and the chunk (``Q: [G·H·D, k]``): it needs no exact old KV and
    costs ``O(n·r²)``. Segment widths stay; the total rank may grow to fit a raised rank.
    """
    method = store.method
    factor = plan.index(HI, MID, LO)
    for side in ("k", "v"):
        old = store.basis_matrix(side)  # [r, W]
        x = (chunk.x_k if side == "k" else chunk.x_v)[factor]
        total = max(old.shape[0], method.bucket_widths(store.rank[side], old.shape[1])[0])
        q = orthonormal_columns(torch.cat([old.T, x.T], dim=1))  # [W, k]
        projected = x @ q
        gram = projected.T @ projected
        segments = list(store.segments.values())
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
            repacked = pack(new, method.bits, COORD_GROUP, store.dtype)
            if side == "k":
                segment.coords_k = repacked
            else:
                segment.coords_v = repacked
        store.set_basis(side, (q @ top).T)
    store.log.update(basis_k=store.total_rank("k"), basis_v=store.total_rank("v"))
