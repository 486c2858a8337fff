"""Properties of the pure parts, over inputs hypothesis draws (shapes, dtypes, lengths, option values).

Quantize -> dequantize stays within the bound its bits and scales imply; a factorization at full rank
reconstructs and its error never grows with rank; eviction keeps the sinks, the recent window and no more than
its budget; DK-Cache's tiers hold every token exactly once; a page summary's bound is >= the true max of q·k;
the method-spec parser round-trips ``Method.spec()``; ``visible_mask`` agrees with a brute-force mask."""

from __future__ import annotations

import dataclasses
import math

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import kvweave
from conftest import tiny_model
from kvweave._compat import cache_kwarg
from kvweave.methods._eviction import select_keep
from kvweave.ops.lowrank import top_basis
from kvweave.ops.masking import visible_mask
from kvweave.ops.pages import PageBounds, page_extremes, page_upper_bounds
from kvweave.ops.quantize import dequantize, pack, quantize, quantize_int8
from kvweave.registry import METHODS, parse_method

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MODEL = tiny_model("llama")


def tensors(draw: st.DrawFn, shape: tuple[int, ...]) -> torch.Tensor:
    """A seeded random tensor of ``shape`` at a drawn scale and offset (heavy tails sometimes)."""
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0]))
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * scale
    if draw(st.booleans()):
        x = x + draw(st.floats(-50, 50))
    if draw(st.booleans()):  # an outlier channel, as real keys have
        x[..., 0] *= 20
    return x


# ----------------------------------------------------------------------------------------------- quantize


@FAST
@given(st.data(), st.sampled_from([2, 4, 8]), st.sampled_from([-1, -2]))
def test_asymmetric_quantization_error_is_within_its_bound(data, bits: int, dim: int) -> None:
    shape = tuple(data.draw(st.lists(st.integers(1, 9), min_size=2, max_size=4)))
    x = tensors(data.draw, shape)
    codes, scale, minimum = quantize(x, dim, bits)
    levels = (1 << bits) - 1
    assert codes.dtype == torch.uint8 and int(codes.max()) <= levels
    error = (dequantize(codes, scale, minimum) - x).abs()
    low, high = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    s, m = scale.float(), minimum.float()
    # half a step, plus what the float16 rounding of the stored scale and minimum moves the ends by
    bound = 0.5 * s + (high - (m + levels * s)).abs() + (low - m).abs()
    assert bool((error <= bound * (1 + 1e-5) + 1e-6).all())


@FAST
@given(st.data())
def test_int8_per_token_error_is_half_a_step(data) -> None:
    shape = tuple(data.draw(st.lists(st.integers(1, 9), min_size=2, max_size=4)))
    x = tensors(data.draw, shape)
    q, scale = quantize_int8(x)
    error = (q.float() * scale - x).abs()
    assert bool((error <= 0.5 * scale * (1 + 1e-5) + 1e-6).all())


@FAST
@given(st.data(), st.sampled_from([4, 8]), st.sampled_from([0, 1, 4]))
def test_packed_groups_error_is_within_half_a_step(data, bits: int, group: int) -> None:
    n, w = data.draw(st.integers(1, 12)), data.draw(st.integers(1, 9))
    x = tensors(data.draw, (n, w))
    packed = pack(x, bits, group, torch.float32)
    levels = 127 if bits == 8 else 7
    scale = packed.scale.float()  # type: ignore[union-attr]
    expanded = scale.repeat_interleave(group, dim=-2)[:n] if group > 0 else scale
    error = (packed.dequantize() - x).abs()
    bound = 0.5 * expanded + (x.abs() - levels * expanded).clamp(min=0)  # clipped where float16 rounded down
    assert bool((error <= bound * (1 + 1e-3) + 1e-6).all())


# ----------------------------------------------------------------------------------------------- low rank


@FAST
@given(st.data())
def test_factorization_is_exact_at_full_rank_and_error_never_grows_with_rank(data) -> None:
    n, w = data.draw(st.integers(1, 24)), data.draw(st.integers(1, 16))
    true_rank = data.draw(st.integers(1, min(n, w)))
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(n, true_rank, generator=generator) @ torch.randn(true_rank, w, generator=generator)
    norm = float(x.norm()) or 1.0
    errors = []
    for rank in range(1, min(n, w) + 1):
        basis, _ = top_basis(x, rank)
        assert basis.shape == (w, rank)
        errors.append(float((x - x @ basis @ basis.T).norm()) / norm)
    assert errors[-1] < 1e-3
    assert errors[true_rank - 1] < 1e-3  # the true rank is enough
    assert all(later <= earlier + 1e-4 for earlier, later in zip(errors, errors[1:], strict=False))


# ----------------------------------------------------------------------------------------------- eviction


def _run(spec: str, prompt: int, steps: int, seed: int):
    cache = kvweave.make_cache(spec, MODEL)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 150, (1, prompt + steps), generator=generator)
    with torch.no_grad():
        MODEL(ids[:, :prompt], **{cache_kwarg(MODEL): cache})
        for step in range(steps):
            MODEL(ids[:, prompt + step : prompt + step + 1], **{cache_kwarg(MODEL): cache})
            yield cache


@SLOW
@given(st.integers(1, 12), st.integers(0, 4), st.integers(2, 40), st.integers(0, 12), st.integers(0, 99))
def test_window_keeps_its_sinks_and_recent_tokens_and_no_more(window, sinks, prompt, steps, seed) -> None:
    for cache in _run(f"window:window={window},sinks={sinks}", prompt, steps + 1, seed):
        seen = cache.get_seq_length()
        expected = list(range(min(sinks, seen))) + list(range(max(sinks, seen - window), seen))
        for layer in cache.layers:
            held = layer.held_slots()[0]  # [H, T]
            for head in held:
                assert head.tolist() == expected


@SLOW
@given(
    st.integers(4, 16),
    st.sampled_from([0.25, 0.5]),
    st.integers(2, 40),
    st.integers(1, 10),
    st.integers(0, 99),
)
def test_h2o_keeps_the_newest_tokens_and_no_more_than_its_budget(budget, recent, prompt, steps, seed) -> None:
    for cache in _run(f"h2o:budget={budget},recent={recent}", prompt, steps, seed):
        seen = cache.get_seq_length()
        for layer in cache.layers:
            assert layer.entries() <= max(budget, 0) or seen <= budget
            assert layer.entries() == min(seen, budget)
            newest = int(budget * recent)
            held = layer.held_slots()[0]
            for head in held:
                assert len(set(head.tolist())) == head.numel()
                assert set(range(seen - min(newest, seen), seen)) <= set(head.tolist())


@SLOW
@given(st.integers(4, 16), st.integers(1, 8), st.integers(2, 40), st.integers(1, 6), st.integers(0, 99))
def test_snapkv_keeps_its_window_and_its_prompt_budget(budget, window, prompt, steps, seed) -> None:
    assume(window <= budget)
    for step, cache in enumerate(_run(f"snapkv:budget={budget},window={window}", prompt, steps, seed)):
        for layer in cache.layers:
            held = layer.held_slots()[0]
            kept_prompt = [s for s in held[0].tolist() if s < prompt]
            assert len(kept_prompt) == min(prompt, budget)
            assert set(range(max(0, prompt - window), prompt)) <= set(kept_prompt)  # the observation window
            assert set(range(prompt, prompt + step + 1)) <= set(held[0].tolist())  # decoded tokens stay


@FAST
@given(st.data())
def test_select_keep_keeps_protected_and_top_entries_and_never_duplicates(data) -> None:
    b, h, t = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3)), data.draw(st.integers(1, 20))
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    priority = torch.rand(b, h, t, generator=generator)
    pads = torch.tensor([data.draw(st.integers(0, t - 1)) for _ in range(b)])
    pad = (torch.arange(t).view(1, 1, -1) < pads.view(-1, 1, 1)).expand(b, h, t)
    budget = torch.tensor([data.draw(st.integers(1, t)) for _ in range(b)])
    count = int(budget.max())
    recent = data.draw(st.integers(0, t))
    protected = (torch.arange(t) >= t - recent).view(1, 1, -1)
    keep = select_keep(priority, pad, budget, count, protected)
    assert keep.shape == (b, h, count)
    for row in range(b):
        for head in range(h):
            kept = keep[row, head].tolist()
            assert len(set(kept)) == len(kept)
            real = [i for i in range(t) if not pad[row, head, i]]
            quota = min(int(budget[row]), len(real))
            chosen = set(kept[:quota])
            assert all(not pad[row, head, i] for i in chosen)  # the budget goes to real entries first
            safe = [i for i in real if protected[0, 0, i]]
            if len(safe) <= quota:
                assert set(safe) <= chosen  # protected (recent) entries are kept
                others = [i for i in real if i not in safe]
                left = quota - len(safe)
                best = sorted(others, key=lambda i: (-float(priority[row, head, i]), i))[:left]
                assert set(best) <= chosen  # then the highest priorities


# ----------------------------------------------------------------------------------------------- DK-Cache


@SLOW
@given(
    st.integers(1, 8),
    st.integers(0, 16),
    st.sampled_from([2, 4, 8]),
    st.integers(0, 3),
    st.sampled_from([8, 16]),
    st.lists(st.integers(1, 9), min_size=1, max_size=6),
    st.integers(2, 30),
)
def test_dkcache_tiers_hold_every_token_exactly_once(core, extra, page, sinks, bits, chunks, prompt) -> None:
    spec = f"dkcache:core={core},steady={core + extra},page={page},pages=2,sinks={sinks},bits={bits}"
    cache = kvweave.make_cache(spec, MODEL)
    generator = torch.Generator().manual_seed(prompt)
    with torch.no_grad():
        for size in [prompt, *chunks]:
            MODEL(torch.randint(3, 150, (1, size), generator=generator), **{cache_kwarg(MODEL): cache})
            seen = cache.get_seq_length()
            for layer in cache.layers:
                core_positions = layer.core_tier.positions.view()[0].tolist() if len(layer.core_tier) else []
                steady = layer.steady_tier.positions.view()[0].tolist() if len(layer.steady_tier) else []
                far: list[int] = []
                if layer.far is not None:
                    held = layer.far.lengths[0]
                    far = (
                        layer.far.sink["positions"][0, : min(sinks, held)].tolist() if layer.far.sink else []
                    )
                    paged = layer.far.paged_lengths()[0]
                    far += layer.far.store["positions"][0, :paged].tolist() if paged else []
                assert far + steady + core_positions == list(range(seen)), (far, steady, core_positions)
                assert len(core_positions) <= core and len(steady) <= extra


# ----------------------------------------------------------------------------------------------- pages


@FAST
@given(st.data(), st.integers(1, 8), st.integers(1, 20), st.integers(1, 8))
def test_page_bounds_are_at_least_the_true_max_of_q_dot_k(data, page, tokens, dim) -> None:
    keys = tensors(data.draw, (1, 2, tokens, dim))
    query = tensors(data.draw, (1, 2, 3, dim))
    low, high = page_extremes(keys, page)
    bounds = page_upper_bounds(query, low, high)  # [1, 2, 3, P]
    logits = query @ keys.transpose(-1, -2)  # [1, 2, 3, T]
    pages = -(-tokens // page)
    padded = torch.nn.functional.pad(logits, (0, pages * page - tokens), value=float("-inf"))
    true_max = padded.unflatten(-1, (pages, page)).amax(-1)
    slack = 1e-4 * (1 + true_max.abs())
    assert bool((bounds >= true_max - slack).all())
    quantized = PageBounds.of(low[0], high[0]).upper_bounds(query[0])  # INT8 summaries, rounded outwards
    assert bool((quantized >= bounds[0] - slack[0]).all())


# ----------------------------------------------------------------------------------------------- specs


def _option_values(field: dataclasses.Field) -> st.SearchStrategy:
    default = field.default
    if isinstance(default, bool):
        return st.booleans()
    if isinstance(default, int):
        return st.integers(-2, 4 * max(1, abs(default)))
    if isinstance(default, float):
        return st.floats(-1, 4 * max(1.0, abs(default)), allow_nan=False) | st.sampled_from([0.25, 0.125])
    if isinstance(default, str):
        words = ["keep", "shift", "auto", "model", "float16", "bfloat16", "fast", "reference", "always"]
        return st.sampled_from([default, *words, "never", "entropy", "int8", "post_rope", "torch", "max"])
    return st.none() | st.sampled_from([0.25, 0.5, 1.0, 8, 64, 256])  # options whose default is None


@st.composite
def methods(draw: st.DrawFn):
    name = draw(st.sampled_from(sorted(METHODS)))
    cls = METHODS[name]
    options = {
        f.name: draw(_option_values(f))
        for f in dataclasses.fields(cls)
        if f.name not in ("decouple_values",) and draw(st.booleans())
    }
    try:
        return parse_method(name, **options)
    except (ValueError, TypeError):
        assume(False)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]
)
@given(methods())
def test_spec_round_trips(method) -> None:
    again = parse_method(method.spec())
    assert again == method
    assert again.spec() == method.spec()
    assert all(not (isinstance(v, float) and not math.isfinite(v)) for v in again.options().values())


# ----------------------------------------------------------------------------------------------- masks


@FAST
@given(st.data(), st.booleans())
def test_visible_mask_matches_brute_force(data, additive: bool) -> None:
    b, h = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    tokens = data.draw(st.integers(1, 24))
    q_len = data.draw(st.integers(1, tokens))
    first = tokens - q_len
    pads = [data.draw(st.integers(0, first)) for _ in range(b)]
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    held = data.draw(st.integers(1, tokens))
    slots = torch.stack(
        [
            torch.stack([torch.randperm(tokens, generator=generator)[:held].sort().values for _ in range(h)])
            for _ in range(b)
        ]
    ).to(torch.int32)  # [B, H, T]: evicted per head
    query = torch.arange(first, first + q_len).view(1, 1, -1, 1)
    key = torch.arange(tokens).view(1, 1, 1, -1)
    allowed = (key <= query) & (key >= torch.tensor(pads).view(-1, 1, 1, 1))  # [B, 1, q, N]
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min) if additive else allowed
    got = visible_mask(mask, slots, first, q_len)
    for row in range(b):
        for head in range(h):
            for i in range(q_len):
                for t in range(held):
                    assert bool(got[row, head, i, t]) == bool(allowed[row, 0, i, slots[row, head, t]])
    causal = visible_mask(None, slots, first, q_len)
    assert torch.equal(causal, slots.unsqueeze(2) <= (first + torch.arange(q_len)).view(1, 1, -1, 1))
