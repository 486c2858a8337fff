"""De-rotating post-RoPE keys and rotating them back is an exact inverse."""

from __future__ import annotations

import torch

from conftest import tiny_model
from kvweave.ops.rope import Rotary, apply_rotary, find_rotary, remove_rotary


def test_remove_is_inverse_of_apply():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 17, 16, dtype=torch.float64)
    angles = torch.rand(2, 17, 8, dtype=torch.float64) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    assert torch.allclose(remove_rotary(apply_rotary(x, cos, sin), cos, sin), x, atol=1e-12)


def test_model_rotary_round_trip_and_matches_model_keys():
    model = tiny_model("qwen2")
    rotary = Rotary(find_rotary(model))
    positions = torch.arange(40).view(1, -1)
    pre = torch.randn(1, 2, 40, 16)
    post = rotary.rotate(pre, positions)
    assert torch.allclose(rotary.unrotate(post, positions), pre, atol=1e-5)
    # the same rotation the model applies
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    cos, sin = find_rotary(model)(pre, positions)
    _, expected = apply_rotary_pos_emb(pre, pre, cos, sin)
    assert torch.allclose(post, expected, atol=1e-6)


def test_fractional_positions_interpolate_angles():
    model = tiny_model("llama")
    rotary = Rotary(find_rotary(model))
    cos_half, _ = rotary.cos_sin(torch.tensor([[5.0]]), torch.device("cpu"))
    cos_int, _ = rotary.cos_sin(torch.tensor([[10.0]]) / 2, torch.device("cpu"))
    assert torch.allclose(cos_half, cos_int)


def test_gemma3_rotary_takes_layer_type():
    model = tiny_model("gemma3")
    local = Rotary(find_rotary(model), "sliding_attention").cos_sin(torch.arange(30.0).view(1, -1), "cpu")[0]
    glob = Rotary(find_rotary(model), "full_attention").cos_sin(torch.arange(30.0).view(1, -1), "cpu")[0]
    assert local.shape == glob.shape
