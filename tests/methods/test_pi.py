"""``pi`` (position interpolation): positions divided by ``factor``, nothing else changes."""

from __future__ import annotations

import torch
from transformers import DynamicCache

import kvweave
from conftest import tiny_model
from kvweave._compat import cache_kwarg


def _decode_logits(model, cache, ids, prompt=20):
    with torch.no_grad():
        model(ids[:, :prompt], **{cache_kwarg(model): cache})
        steps = [
            model(ids[:, i : i + 1], **{cache_kwarg(model): cache}).logits[:, -1]
            for i in range(prompt, ids.shape[1])
        ]
    return torch.cat(steps)


def test_factor_one_equals_full_logits():
    model = tiny_model("llama")
    ids = torch.randint(3, 150, (1, 30))
    reference = _decode_logits(model, DynamicCache(config=model.config), ids)
    assert (
        _decode_logits(model, kvweave.make_cache("pi:factor=1.0,storage=model", model), ids) - reference
    ).abs().max() <= 1e-5
    at_16_bits = _decode_logits(model, kvweave.make_cache("pi:factor=1.0", model), ids)  # storage=auto
    assert (at_16_bits - reference).abs().max() <= 1e-3


def test_keys_are_stored_at_interpolated_positions():
    model = tiny_model("qwen2")
    ids = torch.randint(3, 150, (1, 24))
    reference, cache = (
        DynamicCache(config=model.config),
        kvweave.make_cache("pi:factor=4.0,storage=model", model),
    )
    with torch.no_grad():
        model(ids, **{cache_kwarg(model): reference})
        model(ids, **{cache_kwarg(model): cache})
    rotary = cache.rotary_for(0)
    positions = torch.arange(24).view(1, -1)
    expected = rotary.rotate(rotary.unrotate(reference.layers[0].keys, positions), positions / 4.0)
    assert torch.allclose(cache.layers[0].keys, expected, atol=1e-5)
    assert torch.equal(cache.layers[0].values, reference.layers[0].values)
    assert cache.nbytes() <= cache.full_kv_bytes(bits=32) * 1.01  # memory of the exact cache


def test_interpolation_changes_logits_and_keeps_sliding_layers():
    model = tiny_model("gemma3")  # layers 0 and 2 are sliding-window layers: transformers' own
    ids = torch.randint(3, 150, (1, 30))
    reference = _decode_logits(model, DynamicCache(config=model.config), ids)
    cache = kvweave.make_cache("pi:factor=2.0", model)
    out = _decode_logits(model, cache, ids)
    assert (out - reference).abs().max() > 1e-4
    assert type(cache.layers[0]).__name__ != "InterpolatedLayer"
    assert type(cache.layers[1]).__name__ == "InterpolatedLayer"
