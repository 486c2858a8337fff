"""``keyformer``: Gumbel-regularised accumulated score, reproducible by seed, bounded during decoding."""

from __future__ import annotations

import torch
from layer_helpers import add_token, hand_built_layer

import kvweave
from conftest import tiny_model
from kvweave._compat import cache_kwarg
from kvweave.methods._eviction import gumbel_noise
from kvweave.methods.keyformer import KeyformerLayer
from kvweave.registry import parse_method


def _held_after_generation(spec, ids):
    model = tiny_model("llama")
    cache = kvweave.make_cache(spec, model)
    model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, **{cache_kwarg(model): cache})
    return torch.cat([layer.held_slots() for layer in cache.layers])


def test_same_seed_same_selection_other_seed_other_selection():
    ids = torch.randint(3, 150, (1, 48))
    first = _held_after_generation("keyformer:budget=16,seed=7", ids)
    assert torch.equal(first, _held_after_generation("keyformer:budget=16,seed=7", ids))
    assert not torch.equal(first, _held_after_generation("keyformer:budget=16,seed=8", ids))


def test_strong_key_tokens_survive_the_noise_and_recent_window_is_kept():
    keys = torch.zeros(1, 1, 30, 4)
    keys[0, 0, [4, 12], 0] = 12.0
    query = torch.zeros(1, 2, 30, 4)
    query[0, :, :, 0] = 1.0
    layer = hand_built_layer(KeyformerLayer, parse_method("keyformer:budget=6,recent=0.5"), keys)
    layer.after_attention(query, None, 0)
    held = layer.held_slots()[0, 0].tolist()
    assert held[-3:] == [27, 28, 29] and {4, 12} <= set(held)
    for _ in range(5):
        layer.after_attention(query[:, :, -1:], None, add_token(layer, torch.zeros(1, 1, 1, 4)))
        assert layer.entries() == 6
    assert {4, 12} <= set(layer.held_slots()[0, 0].tolist())


def test_temperature_rises_from_tau_init_to_tau_end():
    keys = torch.zeros(1, 1, 4, 4)
    layer = hand_built_layer(KeyformerLayer, parse_method("keyformer:tau_init=1.0,tau_end=3.0,steps=4"), keys)
    layer.prompt_tokens = torch.tensor([4])
    logits = torch.zeros(1, 1, 1, 1, 4)
    key = torch.arange(4).view(1, 1, 1, 1, 4)
    # a prompt query (token 3), decode steps 2 and 4 (= steps), and beyond
    for query_token, tau in ((3, 1.0), (5, 2.0), (7, 3.0), (20, 3.0)):
        scaled = layer.gumbel_hook(first=query_token)(logits, 0, 1)
        raw = gumbel_noise(
            0, 0, torch.zeros(1, 1, 1, 1, 1), torch.tensor(query_token).view(1, 1, 1, 1, 1), key
        )
        assert torch.allclose(scaled, raw / tau)
