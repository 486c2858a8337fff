"""``snapkv``: prompt entries voted by the observation window, the window itself always kept."""

from __future__ import annotations

import torch
from layer_helpers import add_token, hand_built_layer

import kvweave
from conftest import tiny_model
from kvweave._compat import cache_kwarg
from kvweave.methods.snapkv import SnapKVLayer
from kvweave.registry import parse_method


def _hand_built(hot, t=20):
    keys = torch.zeros(1, 1, t, 4)
    keys[0, 0, hot, 0] = 6.0  # what the observation window looks for
    keys[0, 0, [0, 1], 1] = 6.0  # what the earlier prompt queries look for (ignored by SnapKV)
    query = torch.zeros(1, 2, t, 4)
    query[0, :, -4:, 0] = 1.0
    query[0, :, :-4, 1] = 1.0
    return keys, query


def test_window_votes_select_prompt_entries():
    keys, query = _hand_built([3, 7, 11, 13])
    layer = hand_built_layer(SnapKVLayer, parse_method("snapkv:budget=8,window=4,pool=1"), keys)
    layer.after_attention(query, None, 0)
    assert layer.held_slots()[0, 0].tolist() == [3, 7, 11, 13, 16, 17, 18, 19]


def test_pooling_keeps_neighbours_of_a_voted_token():
    keys, query = _hand_built([9])
    layer = hand_built_layer(SnapKVLayer, parse_method("snapkv:budget=7,window=4,pool=3"), keys)
    layer.after_attention(query, None, 0)
    assert layer.held_slots()[0, 0].tolist() == [8, 9, 10, 16, 17, 18, 19]


def test_decoding_appends_uncompressed():
    keys, query = _hand_built([9])
    layer = hand_built_layer(SnapKVLayer, parse_method("snapkv:budget=7,window=4"), keys)
    layer.after_attention(query, None, 0)
    for _ in range(3):
        layer.after_attention(query[:, :, -1:], None, add_token(layer, torch.randn(1, 1, 1, 4)))
    assert layer.entries() == 10 and layer.held_slots()[0, 0, -3:].tolist() == [20, 21, 22]


def test_observation_window_kept_in_every_layer_and_head():
    model = tiny_model("qwen2")
    cache = kvweave.make_cache("snapkv:budget=16,window=6", model)
    with torch.no_grad():
        model(torch.randint(3, 150, (2, 40)), **{cache_kwarg(model): cache})
    for layer in cache.layers:
        slots = layer.held_slots()
        assert slots.shape[-1] == 16
        assert (slots[..., -6:] == torch.arange(34, 40)).all()
