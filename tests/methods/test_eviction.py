"""Shared eviction plumbing: per-row budgets, padding never kept over real tokens, protected entries."""

from __future__ import annotations

import pytest
import torch
from layer_helpers import hand_built_layer

from kvweave.methods._eviction import budget_per_row, gumbel_noise, select_keep
from kvweave.methods.h2o import H2OLayer
from kvweave.methods.keyformer import KeyformerLayer
from kvweave.registry import parse_method


def test_select_keep_takes_top_entries_per_head():
    priority = torch.tensor([[[5.0, 1.0, 4.0, 2.0], [1.0, 9.0, 0.0, 8.0]]])
    index = select_keep(priority, torch.zeros(1, 2, 4, dtype=torch.bool), torch.tensor([2]), 2)
    assert [sorted(r) for r in index[0].tolist()] == [[0, 2], [1, 3]]


def test_padding_fills_a_smaller_row_budget_and_never_beats_real_tokens():
    priority = torch.tensor([[[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]], [[9.0, 9.0, 1.0, 2.0, 3.0, 4.0]]])
    pad = torch.tensor([[[False] * 6], [[True, True, False, False, False, False]]])
    index = select_keep(priority, pad, torch.tensor([4, 2]), 4)
    assert sorted(index[0, 0].tolist()) == [2, 3, 4, 5]
    assert sorted(index[1, 0].tolist()) == [0, 1, 4, 5]  # two best real entries + the row's padding as filler
    # a budget larger than the real tokens keeps every real token before any padding
    index = select_keep(priority, pad, torch.tensor([5, 5]), 5)
    assert set(range(2, 6)) <= set(index[1, 0].tolist())


def test_protected_entries_first_latest_first():
    priority = torch.tensor([[[9.0, 8.0, 0.0, 0.0, 0.0]]])
    protected = torch.tensor([[[False, False, True, True, True]]])
    pad = torch.zeros(1, 1, 5, dtype=torch.bool)
    assert sorted(select_keep(priority, pad, torch.tensor([4]), 4, protected)[0, 0].tolist()) == [0, 2, 3, 4]
    assert sorted(select_keep(priority, pad, torch.tensor([2]), 2, protected)[0, 0].tolist()) == [3, 4]


def test_ratio_budget_counts_real_tokens():
    assert budget_per_row(0.5, 99, torch.tensor([40, 33])).tolist() == [20, 16]
    assert budget_per_row(None, 12, torch.tensor([40, 33])).tolist() == [12, 12]
    assert budget_per_row(0.01, 99, torch.tensor([10])).tolist() == [1]


def test_gumbel_noise_is_deterministic_and_gumbel_distributed():
    keys = torch.arange(20000)
    a = gumbel_noise(0, 3, torch.tensor(1), torch.tensor(7), keys)
    assert torch.equal(a, gumbel_noise(0, 3, torch.tensor(1), torch.tensor(7), keys))
    assert not torch.equal(a, gumbel_noise(1, 3, torch.tensor(1), torch.tensor(7), keys))
    assert abs(a.mean().item() - 0.5772) < 0.05  # Euler-Mascheroni constant
    assert abs(a.var().item() - torch.pi**2 / 6) < 0.1


@pytest.mark.parametrize("padded", [False, True])
def test_attention_received_in_chunks_skips_only_keys_no_query_sees(padded):
    """Prefill scores are computed in row chunks that read only the causal prefix of the keys; the sums equal
    one brute-force pass over the whole prompt, with and without left padding, and with Keyformer's hook."""
    torch.manual_seed(0)
    b, h, g, t, d = 2, 2, 3, 37, 8
    keys, query = torch.randn(b, h, t, d), torch.randn(b, h * g, t, d)
    pad = torch.tensor([0, 5]) if padded else torch.zeros(b, dtype=torch.int64)
    real = torch.arange(t).view(1, -1) >= pad.view(-1, 1)  # [B, T]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    visible = causal.view(1, t, t) & real.view(b, 1, t)
    mask = torch.where(visible, 0.0, float("-inf")).unsqueeze(1) if padded else None
    logits = torch.einsum("bhgqd,bhtd->bhgqt", query.view(b, h, g, t, d), keys)
    weights = logits.masked_fill(~visible.view(b, 1, 1, t, t), float("-inf")).softmax(-1)
    weights = torch.where(real.view(b, 1, 1, t, 1), weights, 0.0)
    expected = weights.sum(dim=(2, 3))
    layer = hand_built_layer(H2OLayer, parse_method("h2o:budget=8"), keys, pad_count=pad)
    for elements in (1 << 25, b * h * g * t * 4):  # one chunk; chunks of four query rows
        assert torch.allclose(
            layer.attention_received(query, mask, 0, elements=elements), expected, atol=1e-5
        )
    layer = hand_built_layer(KeyformerLayer, parse_method("keyformer:budget=8"), keys, pad_count=pad)
    layer.prompt_tokens = real.sum(-1)
    whole = layer.attention_received(query, mask, 0, layer.gumbel_hook(0), elements=1 << 25)
    chunked = layer.attention_received(query, mask, 0, layer.gumbel_hook(0), elements=b * h * g * t * 4)
    assert torch.allclose(whole, chunked, atol=1e-5)
    assert not torch.allclose(whole, expected, atol=1e-3)  # the hook did change the logits
