"""The ``full`` method equals transformers' DynamicCache on every supported architecture."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvweave
from conftest import ARCHS, tiny_model
from kvweave._compat import cache_kwarg


def _greedy(model, ids, mask, cache):
    return model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=8,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        **{cache_kwarg(model): cache},
    )


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_equals_dynamic_cache(arch, dtype):
    model = tiny_model(arch, dtype=dtype)
    torch.manual_seed(3)
    ids = torch.randint(3, 150, (2, 24))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    ref = _greedy(model, ids, mask, DynamicCache(config=model.config))
    cache = kvweave.make_cache("full", model)
    out = _greedy(model, ids, mask, cache)
    assert torch.equal(ref.sequences, out.sequences)
    worst = max((a - b).abs().max().item() for a, b in zip(ref.logits, out.logits, strict=True))
    assert worst <= (1e-5 if dtype == torch.float32 else 0.0)
    # bytes: exactly the tensors held, at their real width. transformers' sliding layers keep a view of the
    # last concatenation, whose whole storage stays alive, so they hold a little more than their window.
    width = torch.finfo(dtype).bits // 8
    if arch == "gemma3":
        assert cache.nbytes() >= cache.full_kv_bytes(bits=8 * width)
    else:
        assert cache.nbytes() == cache.full_kv_bytes(bits=8 * width)


def test_prepared_model_without_kvweave_cache_is_unchanged():
    model = tiny_model("llama")
    ids = torch.randint(3, 150, (1, 20))
    with torch.no_grad():
        before = model(ids).logits
        kvweave.prepare(model)
        kvweave.prepare(model)  # idempotent
        during = model(ids, **{cache_kwarg(model): DynamicCache(config=model.config)}).logits
        kvweave.restore(model)
        after = model(ids).logits
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(before, during) and torch.equal(before, after)


def test_compressed_cache_on_unprepared_model_is_an_error():
    model = tiny_model("llama")
    cache = kvweave.make_cache("window:window=4,sinks=1", model)
    kvweave.restore(model)
    with pytest.raises(RuntimeError, match="kvweave.prepare"), torch.no_grad():
        model(torch.randint(3, 150, (1, 12)), **{cache_kwarg(model): cache})


def test_mla_model_refuses_compressed_methods():
    model = tiny_model("deepseek_v3")
    with pytest.raises(ValueError, match="latent"):
        kvweave.make_cache("window", model)


def test_method_spec_parsing():
    method = kvweave.parse_method("window:window=16,sinks=0,positions=shift")
    assert (method.window, method.sinks, method.positions) == (16, 0, "shift")
    assert method.spec() == "window:window=16,sinks=0,positions=shift"
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        kvweave.parse_method("nope")
    with pytest.raises(ValueError, match="window"):
        kvweave.parse_method("window:window=abc")
    with pytest.raises(ValueError, match="key=value"):
        kvweave.parse_method("window:16")
