"""xKV (``xkv``): a plain truncated SVD of the group's pre-RoPE keys and values at the ranks the byte budget buys,
decode tokens exact. Tiny random llama (3 layers, 2 KV heads x 16 dims, fp32)."""

from __future__ import annotations

import pytest
import torch

import kvweave
from conftest import tiny_model
from kvweave._compat import cache_kwarg


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randint(3, 150, (1, n))


def _prefill(model, ids, spec="xkv"):
    cache = kvweave.make_cache(spec, model)
    with torch.no_grad():
        out = model(ids, **{cache_kwarg(model): cache})
    return cache, out.logits[:, -1:].argmax(-1)


def test_the_byte_budget_sets_the_ranks_and_the_value_rank_ratio(model):
    ids = _ids(400)
    held = {}
    for compression in (4.0, 8.0):
        cache, _ = _prefill(model, ids, f"xkv:group=2,compression={compression}")
        ratio = cache.full_kv_bytes(16) / cache.nbytes()
        assert compression * 0.9 <= ratio <= compression * 1.15, (
            compression,
            ratio,
        )  # rank steps are coarse here
        store = cache.context.groups[0].rows[0]
        assert store.rank["v"] == round(store.rank["k"] * 1.5) or store.rank["v"] == store.total_rank("v")
        held[compression] = store.rank["k"]
    assert held[4.0] > held[8.0], "more bytes buy a larger rank"


def test_the_factorization_is_the_optimal_truncated_svd_of_the_pre_rope_keys(model):
    ids = _ids(300)
    cache, _ = _prefill(model, ids, "xkv:group=2,compression=4,storage=model")  # fp32: no 16-bit rounding
    reference = kvweave.make_cache("full", model)
    with torch.no_grad():
        model(ids, **{cache_kwarg(model): reference})
    group = cache.context.groups[0]
    store, members = group.rows[0], group.members
    rotary = cache.rotary_for(members[0])
    positions = torch.arange(ids.shape[1]).view(1, -1)
    exact = [rotary.unrotate(reference.layers[i].keys.float(), positions)[0] for i in members]  # [H, n, D]
    x = torch.cat([k.transpose(0, 1).flatten(1) for k in exact], dim=1)  # [n, G·H·D]
    rank = store.rank["k"]
    s = torch.linalg.svdvals(x)
    optimal = s[rank:].square().sum().sqrt() / s.square().sum().sqrt()
    held = [rotary.unrotate(cache.layers[i].held_kv()[0].unsqueeze(0), positions)[0] for i in members]
    stored = torch.cat([k.transpose(0, 1).flatten(1) for k in held], dim=1)
    error = (stored - x).norm() / x.norm()
    assert rank < x.shape[1] and optimal > 1e-3, "the budget must truncate for this test to mean anything"
    assert error == pytest.approx(float(optimal), rel=1e-3), "a plain, unweighted truncated SVD"


def test_decode_tokens_stay_exact_and_are_paid_at_the_full_rate(model):
    ids = _ids(200)
    cache, token = _prefill(model, ids, "xkv:group=2,compression=6")
    before = cache.nbytes()
    per_token = sum(2 * layer.recent.keys.shape[1] * layer.recent.keys.shape[3] for layer in cache.layers)
    per_token *= cache.layers[0].recent.keys.element_size()
    steps = 40  # past a 32-token block: no DepthWeave middle tier turns them into integers either
    with torch.no_grad():
        for _ in range(steps):
            token = model(token, **{cache_kwarg(model): cache}).logits[:, -1:].argmax(-1)
    assert cache.layers[0].recent.count() == steps, "nothing generated is folded into the factorization"
    assert all(layer.recent.middle is None for layer in cache.layers)
    assert cache.nbytes() - before == steps * (per_token + 8 * len(cache.layers))  # + position and score


def test_xkv_offers_the_options_its_paper_has_and_refuses_a_missing_budget():
    from kvweave.registry import METHODS

    info = METHODS["xkv"].describe()
    assert [o["name"] for o in info["options"]] == ["group", "compression", "storage", "value_rank"]
    assert not info["capabilities"]["reads_token_ids"]
    with pytest.raises(ValueError, match="compression=None"):
        METHODS["xkv"](compression=None)
