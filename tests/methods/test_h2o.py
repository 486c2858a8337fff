"""``h2o``: heavy hitters by accumulated attention + recent window, at prefill and during decoding."""

from __future__ import annotations

import torch
from layer_helpers import add_token, hand_built_layer

from kvweave.methods.h2o import H2OLayer
from kvweave.registry import parse_method


def _column_sums(query, keys):
    """Accumulated causal attention (summed over query heads) each key receives: brute force."""
    logits = torch.einsum("hqd,td->hqt", query, keys)
    causal = torch.ones(keys.shape[0], keys.shape[0], dtype=torch.bool).tril()[-query.shape[1] :]
    return logits.masked_fill(~causal, float("-inf")).softmax(-1).sum(dim=(0, 1))


def _hand_built():
    keys = torch.zeros(1, 1, 10, 4)
    keys[0, 0, [2, 5], 0] = 8.0  # tokens 2 and 5 draw the attention of every later query
    keys[0, 0, :, 1] = torch.linspace(-0.5, 0.5, 10)
    query = torch.zeros(1, 2, 10, 4)  # two query heads share the KV head (GQA)
    query[0, :, :, 0] = 1.0
    query[0, 1, :, 1] = 2.0
    return keys, query


def test_prefill_keeps_largest_accumulated_attention_plus_recent():
    keys, query = _hand_built()
    layer = hand_built_layer(H2OLayer, parse_method("h2o:budget=4,recent=0.5"), keys)
    layer.after_attention(query, None, 0)
    expected = _column_sums(query[0], keys[0, 0])
    heavy = expected[:8].topk(2).indices.sort().values.tolist()
    assert heavy == [2, 5]
    assert layer.held_slots()[0, 0].tolist() == heavy + [8, 9]
    assert torch.allclose(layer.scores[0, 0], expected[[2, 5, 8, 9]], atol=1e-5)


def test_decoding_accumulates_and_evicts_one_per_token():
    keys, query = _hand_built()
    layer = hand_built_layer(H2OLayer, parse_method("h2o:budget=4,recent=0.5"), keys)
    layer.after_attention(query, None, 0)
    before = layer.scores.clone()
    new_query = torch.zeros(1, 2, 1, 4)
    new_query[0, :, 0, 0] = 1.0
    for _ in range(3):
        first = add_token(layer, torch.zeros(1, 1, 1, 4))
        layer.after_attention(new_query, None, first)
        assert layer.entries() == 4
    assert layer.held_slots()[0, 0].tolist() == [2, 5, 11, 12]
    assert (layer.scores[0, 0, :2] > before[0, 0, :2]).all()  # the heavy hitters kept collecting attention


def test_ratio_budget_is_per_row_of_real_tokens():
    keys = torch.randn(2, 2, 20, 8)
    layer = hand_built_layer(H2OLayer, parse_method("h2o:ratio=0.5"), keys, pad_count=torch.tensor([0, 6]))
    layer.after_attention(torch.randn(2, 4, 20, 8), None, 0)
    assert layer.budget.tolist() == [10, 7]
    assert layer.entries() == 10
    pads = layer.held_slots()[1] < 6
    assert (pads.sum(-1) == 3).all()  # row 1 keeps 7 real entries, padding fills the rest
