"""DK-Cache (``dkcache``): tiers, decoupling, far retrieval, RoPE compensation, storage, validation.

Tiny random models; the contract test covers batch alignment, prefix continuation and byte accounting.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvweave
from conftest import tiny_model
from kvweave._compat import cache_kwarg
from kvweave.methods.dkcache import (
    DKCache,
    attention_probs,
    decouple_keys,
    default_bounds,
    far_device,
    group_size,
    measure_key_shift,
    page_upper_bounds,
    remapped_distance,
    steady_mean,
)
from kvweave.ops.attention import fused_part_attention, merge_parts
from kvweave.ops.quantize import dequantize_int8, quantize_int8
from kvweave.registry import parse_method

SMALL = "dkcache:core=4,steady=12,page=8,sinks=2,bits=16,decouple=true,storage=model"  # exact tiers at the model's width, the seed's decoupling


def merge(spec: str, extra: str) -> str:
    """``spec`` with the ``,key=value`` options of ``extra`` set (overriding; a spec names an option once)."""
    name, _, rest = spec.partition(":")
    options = dict(item.split("=", 1) for item in rest.split(",") if item)
    options.update(item.split("=", 1) for item in extra.split(",") if item)
    return name + ":" + ",".join(f"{k}={v}" for k, v in options.items())


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def batch():
    torch.manual_seed(0)
    ids = torch.randint(3, 150, (2, 48))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    return ids, mask


def _generate(model, ids, mask, cache, new_tokens=8):
    return model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        **{cache_kwarg(model): cache},
    )


def _run(model, batch, spec):
    cache = kvweave.make_cache(spec, model)
    return _generate(model, *batch, cache), cache


def _logit_gap(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits, strict=True))


# --------------------------------------------------------------------------------------------- options


def test_default_bounds_scale_with_trained_context():
    assert default_bounds(131072) == (8192, 65536)  # the seed's 128K model: core 8K, steady to 64K
    assert DKCache().bounds(8192) == (512, 4096)
    assert DKCache(core=100).bounds(8192) == (100, 4096)
    assert DKCache(steady=200).bounds(8192) == (200, 200)


def test_alpha_and_profiles():
    assert DKCache().effective_alpha == 0.38
    assert DKCache(profile="chat").effective_alpha == 0.30
    assert DKCache(profile="code").effective_alpha == 0.42
    assert DKCache(profile="code", alpha=0.25).effective_alpha == 0.25
    for alpha in (0.2, 0.51, 1.0):
        with pytest.raises(ValueError, match=r"alpha=.*\[0.25, 0.5\]"):
            DKCache(alpha=alpha)
    with pytest.raises(ValueError, match=r"profile='poetry'.*'chat', 'code'"):
        parse_method("dkcache:profile=poetry")


def test_value_decoupling_and_int4_refused_with_reasons():
    with pytest.raises(ValueError, match="decouple_values=True is refused: values carry the content"):
        parse_method("dkcache:decouple_values=true")
    with pytest.raises(ValueError, match="bits=4 is refused.*seed rule 5"):
        parse_method("dkcache:bits=4")
    assert DKCache(bits=8).bits == 8


def test_post_rope_storage_turns_compensation_off():
    assert DKCache().remaps_positions
    assert not DKCache(key_storage="post_rope").remaps_positions
    assert not DKCache(rope_compensation=False).remaps_positions


def test_attention_paths_are_implementation_settings():
    """The fast paths are chosen inside (no option, no spec carries them); tests and benchmarks set the reference
    on an instance with ``implementation``, which leaves the spec (and so every result row) unchanged."""
    assert DKCache().spec() == "dkcache"
    assert (DKCache().path, DKCache().hold_rotated, DKCache().flash_chunk) == ("fast", True, 1024)
    reference = DKCache(pages=4).implementation(path="reference", hold_rotated=False, flash_chunk=7)
    assert (reference.path, reference.hold_rotated, reference.flash_chunk) == ("reference", False, 7)
    assert reference.spec() == "dkcache:pages=4" and DKCache().path == "fast"
    for spec in ("dkcache:path=reference", "dkcache:hold_rotated=false", "dkcache:flash_chunk=64"):
        with pytest.raises(ValueError, match="unknown option"):
            parse_method(spec)
    with pytest.raises(ValueError, match=r"path='slow'.*'fast', 'reference'"):
        DKCache().implementation(path="slow")
    with pytest.raises(ValueError, match="flash_chunk=0"):
        DKCache().implementation(flash_chunk=0)


# ------------------------------------------------------------------------------------------- decoupling


def test_decoupling_is_per_head_over_real_entries():
    torch.manual_seed(0)
    keys = torch.randn(2, 3, 10, 8)
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[1, :4] = False  # row 1: padding entries do not count
    mean = steady_mean(keys, valid)
    for b in range(2):
        for h in range(3):
            expected = keys[b, h][valid[b]].mean(0)
            torch.testing.assert_close(mean[b, h, 0], expected)
            torch.testing.assert_close(decouple_keys(keys, mean, 0.38)[b, h], keys[b, h] - 0.38 * expected)


def test_uniform_shift_leaves_attention_unchanged_tier_shift_does_not():
    torch.manual_seed(0)
    query, keys, values = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 40, 16) + 2.0, torch.randn(1, 2, 40, 16)
    tier = torch.zeros(40, dtype=torch.bool)
    tier[10:30] = True
    effect = measure_key_shift(query, keys, values, tier, alpha=0.38)
    assert effect["uniform_max_prob_change"] <= 1e-5 and effect["uniform_max_output_change"] <= 1e-5
    assert effect["tier_max_prob_change"] > 1e-3 and effect["tier_max_output_change"] > 1e-3
    assert effect["tier_mass_before"] != pytest.approx(effect["tier_mass_after"])


def test_running_steady_mean_tracks_the_tier(model, batch):
    _, cache = _run(model, batch, merge(SMALL, ",bits=8"))
    layer = cache.layers[0]
    keys, _, positions = layer.steady_tier.read(torch.float32)
    assert layer.rotated  # inside the trained range keys are held post-RoPE; the mean is pre-RoPE
    keys = layer.table.unrotate(keys, positions)
    slots = torch.arange(layer.steady_tier.first_slot, layer.steady_tier.first_slot + keys.shape[2])
    real = slots.view(1, -1) >= layer.pad_count.view(-1, 1)
    torch.testing.assert_close(layer.steady_mean().float(), steady_mean(keys, real), atol=1e-5, rtol=1e-5)


def test_decoupling_changes_decoding_and_its_space_matters(model, batch):
    plain, _ = _run(model, batch, merge(SMALL, ",pages=2,decouple=false"))
    pre, _ = _run(model, batch, merge(SMALL, ",pages=2"))
    post, _ = _run(model, batch, merge(SMALL, ",pages=2,key_storage=post_rope"))
    assert _logit_gap(plain, pre) > 1e-4 and _logit_gap(pre, post) > 1e-6


# ----------------------------------------------------------------------------------------- tiers / far


def test_tokens_move_core_to_steady_to_far(model):
    cache = kvweave.make_cache(merge(SMALL, ",pages=2"), model)
    ids = torch.randint(3, 150, (1, 40))
    with torch.no_grad():
        model(ids, **{cache_kwarg(model): cache})
        tiers = cache.stats()["layers"][0]["tiers"]
        assert tiers == {"core": 4, "steady": 8, "far": 26, "sinks": 2}
        for _ in range(5):
            model(torch.randint(3, 150, (1, 1)), **{cache_kwarg(model): cache})
    stats = cache.stats()["layers"][0]
    assert stats["tiers"] == {"core": 4, "steady": 8, "far": 31, "sinks": 2}
    assert stats["pages_retrieved_last_step"] == 2
    # in attention each step: sinks + 2 pages (the newest may be partly filled) + steady + core (+ the new token)
    assert 2 + 8 + 8 + 4 + 1 < stats["attended_entries"] <= 2 + 2 * 8 + 8 + 4 + 1
    assert stats["entries"] == 45 and set(stats["tier_bytes"]) == {"core", "steady", "far", "other"}


def test_all_pages_retrieved_equals_attention_over_everything(model, batch):
    ref = _generate(model, *batch, DynamicCache(config=model.config))
    out, cache = _run(model, batch, merge(SMALL, ",pages=100,decouple=false"))
    assert torch.equal(out.sequences, ref.sequences)
    assert _logit_gap(out, ref) <= 1e-5
    assert cache.stats()["layers"][0]["pages_retrieved_last_step"] == 5  # ceil((48 - 12 - 2) / 8)


def test_retrieve_never_is_the_seeds_truncation(model, batch):
    out, cache = _run(model, batch, merge(SMALL, ",decouple=false,retrieve=never"))
    window, _ = _run(model, batch, "window:window=12,sinks=2,storage=model")  # sinks + last `steady` tokens
    assert _logit_gap(out, window) <= 1e-5
    stats = cache.stats()["layers"][0]
    assert stats["pages_retrieved_per_step"] == 0 and stats["tiers"]["far"] == 0
    assert stats["attended_entries"] == 2 + 12 + 1
    assert stats["entries"] == 2 + 12  # only the sinks of the far tier are held


def test_entropy_gated_retrieval(model, batch):
    always, _ = _run(model, batch, merge(SMALL, ",pages=2"))
    gated_low, _ = _run(model, batch, merge(SMALL, ",pages=2,retrieve=entropy,entropy_threshold=0"))
    assert _logit_gap(always, gated_low) == 0
    gated_high, cache = _run(model, batch, merge(SMALL, ",pages=2,retrieve=entropy,entropy_threshold=1"))
    never, _ = _run(model, batch, merge(SMALL, ",retrieve=never"))
    assert _logit_gap(gated_high, never) <= 1e-5
    assert cache.stats()["layers"][0]["retrieval_steps"] == 0


def test_page_upper_bound_holds():
    torch.manual_seed(0)
    keys = torch.randn(1, 2, 5, 8, 16)  # [B, H, pages, page, D]
    query = torch.randn(1, 2, 3, 16)
    bound = page_upper_bounds(query, keys.amin(3), keys.amax(3))  # [B, H, q, pages]
    actual = torch.einsum("bhqd,bhptd->bhqpt", query, keys).amax(-1)
    assert (bound >= actual - 1e-5).all()


def test_int8_storage(model, batch):
    x = torch.randn(2, 3, 7, 16) * 5
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and scale.shape == (2, 3, 7, 1)
    assert ((dequantize_int8(q, scale, torch.float32) - x).abs() <= scale / 2 + 1e-6).all()
    exact, exact_cache = _run(model, batch, merge(SMALL, ",pages=2"))
    int8, int8_cache = _run(model, batch, merge(SMALL, ",pages=2,bits=8"))
    assert _logit_gap(exact, int8) < 0.1
    assert int8_cache.nbytes() < exact_cache.nbytes()
    far_only, far_cache = _run(model, batch, merge(SMALL, ",pages=2,far_dtype=int8"))
    assert far_cache.layers[0].far.store["keys"].dtype == torch.int8
    assert far_cache.layers[0].steady_tier.parts["keys"].data.dtype == torch.float32


def test_offload_places_far_tier_on_host():
    assert far_device(torch.device("cuda", 0), True) == torch.device("cpu")
    assert far_device(torch.device("cuda", 0), False) == torch.device("cuda", 0)
    assert far_device(torch.device("cpu"), True) == torch.device("cpu")


def test_offload_on_cpu_changes_nothing(model, batch):
    a, _ = _run(model, batch, merge(SMALL, ",pages=2,offload=true"))
    b, _ = _run(model, batch, merge(SMALL, ",pages=2"))
    assert _logit_gap(a, b) == 0


def test_ratio_sets_bounds_from_the_prompt(model):
    cache = kvweave.make_cache(
        "dkcache:attended=0.5,sinks=2,bits=16,decouple=true,storage=model,page=4", model
    )
    with torch.no_grad():
        model(torch.randint(3, 150, (1, 40)), **{cache_kwarg(model): cache})
    stats = cache.stats()["layers"][0]
    assert stats["steady_bound"] == 18 and stats["core_bound"] == 2  # 0.5 * 40 - 2 sinks; core 1/8 of it


def test_beam_search_reorders_rows(model):
    ids = torch.randint(3, 150, (1, 30))
    cache = kvweave.make_cache(merge(SMALL, ",pages=2"), model)
    out = model.generate(ids, num_beams=2, max_new_tokens=4, do_sample=False, **{cache_kwarg(model): cache})
    assert out.shape == (1, 34)


# ------------------------------------------------------------------------------------- RoPE compensation


def test_remapped_distances_stay_inside_the_trained_range():
    trained, window = 64, 8
    for length in (64, 65, 100, 300, 1000):
        group = group_size(length, window, trained)
        q = torch.arange(length).view(-1, 1)
        k = torch.arange(length).view(1, -1)
        distance = remapped_distance(q, k, window, group, trained)[k.expand(length, -1) <= q]
        assert distance.max() <= trained - 1 and distance.min() >= 0
        inside = remapped_distance(q[:trained], k, window, group, trained)  # queries inside the trained range
        assert torch.equal(inside, q[:trained] - k)
        exact = (q - k)[k.expand(length, -1) <= q]
        assert torch.equal(distance[exact < window], exact[exact < window])  # neighbours are exact
        assert group == 1 or length > trained
    assert group_size(64, window, trained) == 1
    with pytest.raises(ValueError, match="core < trained length"):
        group_size(100, 63, 64)


def _naive_self_extend(rotary, q_pre, k_pre, values, window, group, scaling, trained):
    """Reference: logits from the remapped relative position of each (query, key) pair, causal."""
    n = q_pre.shape[2]
    groups = q_pre.shape[1] // k_pre.shape[1]
    k_pre, values = k_pre.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    positions = torch.arange(n)
    outputs = []
    for i in range(n):
        rel = remapped_distance(torch.tensor(i), positions[: i + 1], window, group, trained)
        rotated = rotary.rotate(q_pre[:, :, i : i + 1].expand(-1, -1, i + 1, -1), rel.view(1, -1))
        logits = (rotated * k_pre[:, :, : i + 1]).sum(-1) * scaling  # q at rel, k at 0
        outputs.append(torch.softmax(logits, -1).unsqueeze(-2) @ values[:, :, : i + 1])
    return torch.cat(outputs, dim=2).transpose(1, 2)


def test_compensated_attention_equals_self_extend_reference(model):
    cache = kvweave.make_cache(
        "dkcache:core=4,steady=12,page=4,pages=100,sinks=2,bits=16,decouple=false,trained_length=16,storage=model",
        model,
    )
    layer, module = cache.layers[0], model.model.layers[0].self_attn
    layer.chunk_elements = 4 * 40 * 12  # several query chunks at prefill
    rotary = cache.rotary_for(0)
    torch.manual_seed(0)
    n = 40
    q_pre, k_pre, values = (
        torch.randn(1, 4, n + 1, 16),
        torch.randn(1, 2, n + 1, 16),
        torch.randn(1, 2, n + 1, 16),
    )
    positions = torch.arange(n + 1).view(1, -1)
    query, key = rotary.rotate(q_pre, positions), rotary.rotate(k_pre, positions)
    layer.lazy_initialization(key, values)
    scaling = 0.25
    out = layer.attend(
        module,
        query[:, :, :n],
        key[:, :, :n],
        values[:, :, :n],
        None,
        position_ids=positions[:, :n],
        scaling=scaling,
    )
    assert layer.groups == [group_size(n, 4, 16)] == [4]
    ref = _naive_self_extend(rotary, q_pre[:, :, :n], k_pre[:, :, :n], values[:, :, :n], 4, 4, scaling, 16)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    # one decode step: sinks + every far page + steady + core, the same remapping (group for n + 1 tokens)
    out = layer.attend(
        module,
        query[:, :, n:],
        key[:, :, n:],
        values[:, :, n:],
        None,
        position_ids=positions[:, n:],
        scaling=scaling,
    )
    ref = _naive_self_extend(rotary, q_pre, k_pre, values, 4, group_size(n + 1, 4, 16), scaling, 16)
    torch.testing.assert_close(out, ref[:, n:], atol=1e-5, rtol=1e-4)
    assert layer.layer_stats()["tiers"]["far"] > 0


def test_compensation_off_pre_rope_storage_equals_post_rope(model, batch):
    pre, _ = _run(model, batch, merge(SMALL, ",pages=2,decouple=false,rope_compensation=false"))
    post, _ = _run(model, batch, merge(SMALL, ",pages=2,decouple=false,key_storage=post_rope"))
    assert torch.equal(pre.sequences, post.sequences) and _logit_gap(pre, post) <= 1e-5


def test_compensation_inside_trained_range_is_identity(model, batch):
    on, _ = _run(model, batch, merge(SMALL, ",pages=2"))
    off, _ = _run(model, batch, merge(SMALL, ",pages=2,rope_compensation=false"))
    assert _logit_gap(on, off) <= 1e-6


def test_beyond_trained_range_batch_rows_equal_single_rows(model, batch):
    spec = merge(SMALL, ",pages=2,trained_length=24")
    out, cache = _run(model, batch, spec)
    assert cache.stats()["layers"][0]["group_size"] > 1
    ids, mask = batch
    single = _generate(model, ids[1:, 5:], mask[1:, 5:], kvweave.make_cache(spec, model))
    assert torch.equal(out.sequences[1, ids.shape[1] :], single.sequences[0, ids.shape[1] - 5 :])
    assert all(torch.isfinite(step).all() for step in out.logits)


def test_shared_prefill_only_inside_the_trained_range(model):
    """The evaluation may replay a shared exact prefill only where compensation leaves positions alone."""
    from kvweave.eval.prefill import record_prefill, replay_prefill

    torch.manual_seed(0)
    ids = torch.randint(3, 150, (1, 40))
    inside = parse_method(
        "dkcache:core=4,steady=12,page=8,sinks=2,bits=16,decouple=true,storage=model,trained_length=64"
    )
    beyond = parse_method(
        "dkcache:core=4,steady=12,page=8,sinks=2,bits=16,decouple=true,storage=model,trained_length=32"
    )
    plain = parse_method(
        "dkcache:core=4,steady=12,page=8,sinks=2,bits=16,decouple=true,storage=model,trained_length=32,rope_compensation=false"
    )
    assert inside.replays_prefill(model.config, 40)
    assert not beyond.replays_prefill(model.config, 40)
    assert plain.replays_prefill(model.config, 40)
    cache = kvweave.KVCache(beyond, model)
    with pytest.raises(ValueError, match="changes prefill attention"):
        replay_prefill(cache, record_prefill(model, ids))


def test_eval_rows_record_entries_attended_per_step(model):
    """The runner's ``attended`` field: DK-Cache attends to sinks + core + steady (+ pages), fewer than held."""
    from kvweave.eval.runner import attended_entries

    torch.manual_seed(0)
    ids = torch.randint(3, 150, (1, 60))
    cache = kvweave.make_cache(merge(SMALL, ",retrieve=never"), model)
    full = kvweave.make_cache("full", model)
    for c in (cache, full):
        with torch.no_grad():
            model.generate(ids, max_new_tokens=3, do_sample=False, **{cache_kwarg(model): c})
    assert attended_entries(full) is None
    attended = attended_entries(cache)
    assert attended is not None and 12 <= attended <= 2 + 12 + 1 < 63  # sinks + steady bound + the new token


def _implemented(spec: str, model, **settings):
    """A cache of ``spec`` with DK-Cache's implementation settings (``path``, ``hold_rotated``,
    ``flash_chunk``) set on the method: the fixture the fast paths are tested against the references with."""
    return kvweave.make_cache(parse_method(spec).implementation(**settings), model)


@pytest.mark.parametrize(("n", "chunk"), [(40, 7), (40, 64), (23, 5)])
def test_fast_compensated_prefill_equals_reference(model, n, chunk):
    """The fused-kernel prefill (bulk / boundary / neighbour parts merged by log-sum-exp) against the chunked
    reference, beyond the trained range, for chunkings that do and do not align with it."""
    torch.manual_seed(3)
    ids = torch.randint(3, 150, (1, n))
    spec = "dkcache:core=4,steady=12,page=4,pages=100,sinks=2,bits=16,decouple=true,storage=model,trained_length=16"
    outs = {}
    for fast in (False, True):
        cache = _implemented(spec, model, path="fast" if fast else "reference", flash_chunk=chunk)
        for layer in cache.layers:
            layer.chunk_elements = 4 * 40 * 12  # several query chunks in the reference
        with torch.no_grad():
            logits = model(ids, **{cache_kwarg(model): cache}).logits
        assert cache.layers[0].groups[0] > 1
        outs[fast] = (logits, cache.layers[0].last_entropy)
    torch.testing.assert_close(outs[True][0], outs[False][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs[True][1], outs[False][1], atol=1e-5, rtol=1e-5)


def test_fast_prefill_part_sees_nothing_gives_no_weight():
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[0, :2] = True
    out, lse = fused_part_attention(q, k, k, mask, 0.3)
    assert (
        torch.isinf(lse.view(1, 2, 2, 3)[..., 1:]).all()
        and torch.isfinite(lse.view(1, 2, 2, 3)[..., 0]).all()
    )
    other = fused_part_attention(q, k, k, None, 0.3)
    merged = merge_parts([(out, lse), other, None])
    torch.testing.assert_close(
        merged.view(1, 2, 2, 3, 8)[..., 1:, :], other[0].view(1, 2, 2, 3, 8)[..., 1:, :]
    )


@pytest.mark.parametrize(
    "options",
    [
        "",
        ",key_storage=post_rope",
        ",bits=8",
        ",retrieve=entropy,entropy_threshold=0.1",
        ",profile=code,far_dtype=int8",
    ],
)
@pytest.mark.parametrize("padded", [False, True])
def test_fast_decode_equals_general_path(model, batch, options, padded):
    """Decode at exact positions (logits per tier, decoupling as a bias) against the general path (tiers
    concatenated), both holding keys post-RoPE; and holding them post-RoPE against holding them pre-RoPE and
    rotating the attended ones every step (equal unless INT8 codes are taken of the other form)."""
    ids, mask = batch if padded else (batch[0][:1], batch[1][:1])
    spec = merge(SMALL, ",pages=2" + options)
    outs = []
    for fast, hold in ((True, True), (False, True), (False, False)):
        cache = _implemented(spec, model, path="fast" if fast else "reference", hold_rotated=hold)
        outs.append(_generate(model, ids, mask, cache, new_tokens=10))
        assert cache.layers[0].rotated == (hold or "post_rope" in options)
        assert cache.layers[0].layer_stats()["tiers"]["far"] > 0
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert _logit_gap(outs[0], outs[1]) <= 1e-4
    if "8" not in options:
        assert torch.equal(outs[1].sequences, outs[2].sequences)
        assert _logit_gap(outs[1], outs[2]) <= 1e-4


def test_held_keys_are_derotated_once_when_the_context_outgrows_the_trained_range(model):
    """A prompt inside the trained range, generation past it: keys held post-RoPE switch to pre-RoPE at the step
    compensation starts, and decoding matches a cache that held them pre-RoPE throughout."""
    torch.manual_seed(1)
    ids = torch.randint(3, 150, (1, 40))
    spec = "dkcache:core=4,steady=12,page=4,pages=3,sinks=2,bits=16,decouple=true,storage=model,trained_length=44"
    outs, caches = [], []
    for hold in (True, False):
        cache = _implemented(spec, model, hold_rotated=hold)
        outs.append(_generate(model, ids, torch.ones_like(ids), cache, new_tokens=12))
        caches.append(cache)
    assert not caches[0].layers[0].rotated and caches[0].layers[0].groups[0] > 1
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert _logit_gap(*outs) <= 1e-4


@pytest.mark.parametrize(
    "options",
    [
        "",
        ",bits=8",
        ",retrieve=entropy,entropy_threshold=0.1",
        ",profile=code,far_dtype=int8",
        ",decouple=false",
        ",hold=inside",
    ],
)
def test_fast_compensated_decode_equals_general_path(model, options):
    """Decode beyond the trained range with steady and far keys held at grouped positions (logits per tier,
    decoupling as a bias) against the general path that rotates every attended key each step; the Self-Extend
    group grows during generation (2 -> 3), so the held keys are re-rotated once on the way. ``hold=inside``
    starts inside the trained range (keys held post-RoPE), so the switch happens while decoding."""
    torch.manual_seed(2)
    inside = "hold=inside" in options
    ids = torch.randint(3, 150, (1, 20 if inside else 40))
    spec = merge(
        "dkcache:core=4,steady=12,page=4,pages=2,sinks=2,bits=16,decouple=true,storage=model,trained_length=24",
        options.replace(",hold=inside", ""),
    )
    outs, caches = [], []
    for fast in (True, False):
        cache = _implemented(spec, model, path="fast" if fast else "reference")
        outs.append(_generate(model, ids, torch.ones_like(ids), cache, new_tokens=30 if inside else 22))
        caches.append(cache)
    layer = caches[0].layers[0]
    assert layer.groups[0] == 3 and layer.held_group == 3 and caches[1].layers[0].held_group is None
    assert layer.layer_stats()["tiers"]["far"] > 0
    if "8" not in options:
        assert torch.equal(outs[0].sequences, outs[1].sequences)
        assert _logit_gap(*outs) <= 1e-4
    else:  # INT8 codes of other key forms: close logits while the prefixes agree (random weights, flat logits)
        new = [o.sequences[0, ids.shape[1] :] for o in outs]
        same = int((new[0] != new[1]).nonzero()[0]) if not torch.equal(*new) else len(new[0]) - 1
        assert same >= 4
        pairs = zip(outs[0].logits[: same + 1], outs[1].logits[: same + 1], strict=True)
        assert max((x - y).abs().max().item() for x, y in pairs) <= 5e-2


def test_compensated_padded_batch_takes_the_general_path(model, batch):
    """Left padding (positions are not slots): the general path, and the same result with the fast path on."""
    ids, mask = batch
    spec = "dkcache:core=4,steady=12,page=4,pages=2,sinks=2,bits=16,decouple=true,storage=model,trained_length=24"
    outs = []
    for fast in (True, False):
        cache = _implemented(spec, model, path="fast" if fast else "reference")
        outs.append(_generate(model, ids, mask, cache, new_tokens=6))
        assert cache.layers[0].held_group is None and cache.layers[0].groups[0] > 1
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert _logit_gap(*outs) <= 1e-5


@pytest.mark.parametrize("padded", [False, True])
def test_page_summaries_are_min_max_of_each_pages_real_keys(model, batch, padded):
    """After prefill and while decoding (pages filling one token at a time), every page's summary is the
    per-channel min / max of the real keys it holds, as attention sees them (post-RoPE here)."""
    ids, mask = batch if padded else (batch[0][:1], batch[1][:1])
    for new_tokens in (1, 4, 7):  # the prefill alone, then pages filled token by token
        cache = kvweave.make_cache(
            "dkcache:core=4,steady=12,page=4,pages=2,sinks=2,bits=16,decouple=true,storage=model", model
        )
        _generate(model, ids, mask, cache, new_tokens=new_tokens)
        layer = cache.layers[0]
        layer._refresh_summaries(torch.float32)
        far = layer.far
        for row, paged in enumerate(far.paged_lengths()):
            for page in range(-(-paged // far.page)):
                real = far.store["keys"][row, :, page * far.page : min(paged, (page + 1) * far.page)]
                torch.testing.assert_close(far.page_min[row, :, page], real.amin(1).float())
                torch.testing.assert_close(far.page_max[row, :, page], real.amax(1).float())


@pytest.mark.parametrize(
    ("spec", "padded"),
    [
        (
            "dkcache:attended=0.5,sinks=2,page=4,pages=2,bits=8",
            True,
        ),  # attended: the tier bounds come from the prompt
        (
            "dkcache:core=4,steady=12,page=4,pages=2,sinks=2,trained_length=24",
            False,
        ),  # held at grouped positions
        (
            "dkcache:core=4,steady=12,page=4,pages=2,sinks=2,trained_length=24,retrieve=entropy,entropy_threshold=0.1",
            True,
        ),  # compensated, padded: the general path
    ],
)
def test_saved_cache_continues_exactly(model, batch, tmp_path, spec, padded):
    """Save a cache mid-generation (tiers moved, far pages summarised, beyond the trained range) and load it into
    a fresh cache: decoding continues bit for bit, with the same bytes held and the same layer statistics."""
    ids, mask = batch if padded else (batch[0][:1], batch[1][:1])
    cache = kvweave.make_cache(spec, model)
    first = _generate(model, ids, mask, cache, new_tokens=5).sequences[:, :-1]  # the last token is not cached
    kvweave.save_cache(cache, model, tmp_path / "kv")
    loaded, _ = kvweave.load_cache(tmp_path / "kv", model)
    assert loaded.nbytes() == cache.nbytes()
    assert [layer.layer_stats() for layer in loaded.layers] == [layer.layer_stats() for layer in cache.layers]
    more = torch.cat([first, torch.randint(3, 150, (first.shape[0], 3))], dim=1)
    longer = torch.cat(
        [mask, torch.ones(first.shape[0], 3 + first.shape[1] - mask.shape[1], dtype=mask.dtype)], 1
    )
    expected = _generate(model, more, longer, cache, new_tokens=6)
    got = _generate(model, more, longer, loaded, new_tokens=6)
    assert torch.equal(got.sequences, expected.sequences)
    assert _logit_gap(got, expected) == 0
    assert [layer.layer_stats() for layer in loaded.layers] == [layer.layer_stats() for layer in cache.layers]


# -- INT8 tiers (the default) and what a step reads


def test_int8_default_is_close_to_16_bit_tiers_and_the_kernel_equals_the_reference(model, batch):
    spec = "dkcache:core=4,steady=12,page=8,sinks=2,pages=100,decouple=false"
    exact, _ = _run(model, batch, spec + ",bits=16")
    int8, cache = _run(model, batch, spec)
    torch_path, _ = _run(model, batch, spec + ",kernel=torch")
    assert cache.layers[0].steady_tier.quantized and cache.layers[0].far.quantized
    assert _logit_gap(int8, exact) < 0.05  # INT8 keys/values: close, not equal
    assert (
        _logit_gap(int8, torch_path) < 1e-4
    )  # the C++ kernel (when built) computes the reference's attention
    assert torch.equal(int8.sequences, torch_path.sequences)
    held16 = kvweave.make_cache(spec + ",bits=16", model)
    _generate(model, *batch, held16)
    assert cache.nbytes() < held16.nbytes()


def test_a_step_reads_less_than_the_cache_holds_when_far_pages_stay_out(model, batch):
    _, cache = _run(model, batch, "dkcache:core=4,steady=12,page=4,pages=1,sinks=2")
    layer = cache.layers[0]
    assert layer.far is not None and layer.far.page_count() > 1
    assert 0 < layer.read_bytes() < layer.nbytes()
    assert cache.read_bytes() < cache.nbytes()


@pytest.mark.parametrize("masked", [False, True])
def test_attention_probs_entropy_matches_xlogy_with_and_without_a_mask(masked: bool) -> None:
    # the decode step's entropy (-sum p log p of the last query, normalised by log of what it sees) and its
    # probabilities against a plain masked softmax and xlogy, with every entry visible (the unmasked shortcut)
    # and with hidden entries, one query of row 1 seeing nothing
    torch.manual_seed(0)
    scores = torch.randn(2, 2, 3, 4, 40) * 4
    visible = torch.ones(2, 2, 4, 40, dtype=torch.bool)
    if masked:
        visible[0, :, :, :7] = False
        visible[1, 1, -1] = False
    probs, entropy = attention_probs(scores, visible, 0.5)
    seen = visible.unsqueeze(2)
    expected = (scores * 0.5).masked_fill(~seen, float("-inf")).softmax(-1).nan_to_num(0.0)
    torch.testing.assert_close(probs, expected)
    last = expected[:, :, :, -1, :]
    count = seen[:, :, :, -1, :].sum(-1).expand_as(last[..., 0]).float()
    raw = -torch.special.xlogy(last, last).sum(-1)
    normalised = torch.where(count > 1, raw / count.clamp(min=2).log(), torch.zeros_like(raw))
    torch.testing.assert_close(entropy, normalised.flatten(1).mean(1))
    assert bool((entropy > 0).all())
