"""``keydiff``: keeps the keys least similar to the mean key; bounded during decoding."""

from __future__ import annotations

import torch
from layer_helpers import add_token, hand_built_layer

from kvweave.methods.keydiff import KeyDiffLayer, key_diversity
from kvweave.registry import parse_method


def _keys():
    torch.manual_seed(0)
    keys = torch.tensor([1.0, 0.0, 0.0, 0.0]).repeat(1, 1, 12, 1) + 0.05 * torch.randn(1, 1, 12, 4)
    keys[0, 0, [3, 8]] = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, -1.0, 0.0]])  # the distinctive ones
    return keys


def test_keeps_distinctive_keys():
    layer = hand_built_layer(KeyDiffLayer, parse_method("keydiff:budget=2"), _keys())
    layer.after_attention(torch.randn(1, 2, 12, 4), None, 0)
    assert layer.held_slots()[0, 0].tolist() == [3, 8]


def test_score_is_minus_cosine_to_mean_unit_key_without_padding():
    keys = _keys()
    pad = torch.zeros(1, 1, 12, dtype=torch.bool)
    pad[0, 0, :2] = True
    unit = torch.nn.functional.normalize(keys[0, 0, 2:], dim=-1)
    anchor = unit.mean(0)
    expected = -torch.nn.functional.cosine_similarity(keys[0, 0], anchor.expand(12, -1), dim=-1)
    assert torch.allclose(key_diversity(keys, pad)[0, 0], expected, atol=1e-6)


def test_decoding_stays_within_budget_and_evicts_the_most_similar():
    layer = hand_built_layer(KeyDiffLayer, parse_method("keydiff:budget=4"), _keys())
    layer.after_attention(torch.randn(1, 2, 12, 4), None, 0)
    first = add_token(layer, torch.tensor([0.0, 0.0, 0.0, 1.0]).view(1, 1, 1, 4))  # distinctive: stays
    layer.after_attention(torch.randn(1, 2, 1, 4), None, first)
    assert layer.entries() == 4 and 12 in layer.held_slots()[0, 0].tolist()
    first = add_token(layer, torch.tensor([1.0, 0.0, 0.0, 0.0]).view(1, 1, 1, 4))  # like the rest: goes
    layer.after_attention(torch.randn(1, 2, 1, 4), None, first)
    assert layer.entries() == 4 and 13 not in layer.held_slots()[0, 0].tolist()
