"""Diagnostics the DK-Cache seed argues from: JSON-able measurements on tiny random models."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import tiny_model
from kvweave import diagnostics


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


class _CharTokenizer:
    """Stands in for a tokenizer: one token per character."""

    def __call__(self, text, return_tensors=None):
        return type("Encoded", (), {"input_ids": torch.tensor([[ord(c) % 150 + 3 for c in text]])})()


def test_key_similarity_by_distance(model):
    ids = torch.randint(3, 150, (1, 70))
    result = diagnostics.key_similarity_by_distance(model, ids)
    assert result["distances"] == [1, 2, 4, 8, 16, 32, 64]
    assert result["layers"] == [0, 1, 2]
    for name in ("cosine_post_rope", "cosine_pre_rope", "cosine_pre_rope_demeaned", "covariance_pre_rope"):
        assert len(result[name]["mean"]) == 7 and len(result[name]["per_layer"]) == 3
    assert all(-1 <= c <= 1 for c in result["cosine_pre_rope"]["mean"])


def test_pre_rope_keys_undo_the_rotation(model):
    keys = diagnostics.layer_keys(model, torch.randint(3, 150, (1, 12)))
    post, pre = keys[0]
    torch.testing.assert_close(post[:, 0], pre[:, 0])  # position 0: no rotation
    torch.testing.assert_close(post.norm(dim=-1), pre.norm(dim=-1))  # rotations keep norms


def test_entropy_by_length(model):
    ids = torch.randint(3, 150, (1, 64))
    result = diagnostics.entropy_by_length(model, ids, [16, 64, 999], window=8)
    assert result["lengths"] == [16, 64] and len(result["entropy"]) == 2
    assert all(0 < h <= math.log(160) + 1e-4 for h in result["entropy"])
    with torch.no_grad():
        logits = model(ids[:, :16]).logits[0, 8:16]
    from kvweave.sampling import entropy

    assert result["entropy"][0] == pytest.approx(entropy(logits).mean().item(), rel=1e-4)
    with pytest.raises(ValueError, match="no length"):
        diagnostics.entropy_by_length(model, ids, [100])


def test_rope_phase_range(model):
    result = diagnostics.rope_phase_range(model, [512, 1024, 4096])
    rows = result["rope"]["default"]["by_length"]
    assert [r["unseen_frequencies"] for r in rows[:2]] == [0, 0]  # inside the trained 1024 tokens
    assert rows[2]["unseen_frequencies"] > 0 and rows[2]["compensated_group"] > 1
    assert rows[2]["compensated_max_distance"] < 1024 and rows[2]["compensated_unseen_frequencies"] == 0


def test_run_diagnostics_is_json(model):
    out = diagnostics.run_diagnostics(
        model,
        _CharTokenizer(),
        "a short text, repeated",
        [16, 48],
        methods=["dkcache:core=4,steady=8,trained_length=32"],
    )
    assert json.loads(json.dumps(out))["lengths"] == [16, 48]
    assert [e["method"] for e in out["entropy"]] == [
        "plain model",
        "dkcache:core=4,steady=8,trained_length=32",
    ]
