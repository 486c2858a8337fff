"""``window`` (StreamingLLM): sinks + recent window; ``positions="shift"`` re-rotates keys into the cache."""

from __future__ import annotations

import torch

import kvweave
from conftest import tiny_model
from kvweave._compat import cache_kwarg

SHIFT = "window:window=8,sinks=2,positions=shift"


def _decode_logits(model, cache, ids, prompt):
    with torch.no_grad():
        model(ids[:, :prompt], **{cache_kwarg(model): cache})
        steps = [
            model(ids[:, i : i + 1], **{cache_kwarg(model): cache}).logits[:, -1]
            for i in range(prompt, ids.shape[1])
        ]
    return torch.cat(steps)


def test_keeps_sinks_and_recent_tokens():
    model = tiny_model("llama")
    cache = kvweave.make_cache("window:window=8,sinks=2", model)
    with torch.no_grad():
        model(torch.randint(3, 150, (1, 30)), **{cache_kwarg(model): cache})
    slots = cache.layers[0].held_slots()[0, 0].tolist()
    assert slots == [0, 1] + list(range(22, 30))


def test_shift_keeps_relative_distances_within_the_cache():
    model = tiny_model("llama")
    cache = kvweave.make_cache(SHIFT, model)
    ids = torch.randint(3, 150, (1, 60))
    _decode_logits(model, cache, ids, 30)
    layer = cache.layers[0]
    positions = layer.cache_positions()
    assert positions.shape[-1] == 10
    assert positions.max().item() <= 2 + 8 - 1  # no key further than sinks + window from the newest query
    assert torch.equal(positions[0, 0], torch.arange(10))
    assert layer.held_slots()[0, 0, -1].item() == 59  # while the tokens themselves are far apart


def test_shift_without_eviction_equals_keep():
    model = tiny_model("qwen2")
    ids = torch.randint(3, 150, (1, 40))
    keep = _decode_logits(model, kvweave.make_cache("window:window=64", model), ids, 20)
    shift = _decode_logits(model, kvweave.make_cache("window:window=64,positions=shift", model), ids, 20)
    assert (keep - shift).abs().max().item() <= 1e-5


def test_shift_changes_logits_once_tokens_are_evicted():
    model = tiny_model("llama")
    ids = torch.randint(3, 150, (1, 40))
    keep = _decode_logits(model, kvweave.make_cache("window:window=8,sinks=2", model), ids, 20)
    shift = _decode_logits(model, kvweave.make_cache(SHIFT, model), ids, 20)
    assert (keep - shift).abs().max().item() > 1e-4


def test_shift_batch_row_equals_single_run_and_prefix_continues():
    model = tiny_model("gemma3")
    torch.manual_seed(1)
    ids = torch.randint(3, 150, (2, 30))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    kwargs = dict(
        max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    batch = model.generate(
        ids, attention_mask=mask, **kwargs, **{cache_kwarg(model): kvweave.make_cache(SHIFT, model)}
    )
    single = model.generate(ids[1:, 5:], **kwargs, **{cache_kwarg(model): kvweave.make_cache(SHIFT, model)})
    assert torch.equal(batch.sequences[1, 30:], single.sequences[0, 25:])
    assert (
        max((a[1] - b[0]).abs().max().item() for a, b in zip(batch.logits, single.logits, strict=True))
        <= 1e-4
    )
