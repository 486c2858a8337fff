"""``full`` on a real model: the same tokens and logits as transformers' DynamicCache at ~1K tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvweave
from kvweave._compat import cache_kwarg
from kvweave.eval import tasks
from kvweave.prompt import chat_ids

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def smollm():
    return kvweave.load_model("smollm2-135m")


def test_full_matches_dynamic_cache_at_1k(smollm):
    model, tokenizer = smollm
    sample = tasks.make_sample("passkey", tokenizer, 1000, depth=0.5, seed=1)
    ids = tokenizer(sample.prompt, return_tensors="pt").input_ids
    kwargs = dict(
        max_new_tokens=8,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        attention_mask=torch.ones_like(ids),
    )
    ref = model.generate(ids, **kwargs, **{cache_kwarg(model): DynamicCache(config=model.config)})
    cache = kvweave.make_cache("full", model)
    out = model.generate(ids, **kwargs, **{cache_kwarg(model): cache})
    assert ids.shape[1] > 950
    assert torch.equal(ref.sequences, out.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(ref.logits, out.logits, strict=True)) <= 1e-5
    assert cache.nbytes() == cache.full_kv_bytes(bits=32)


def test_eval_passkey_runs_and_reports_bytes(smollm, tmp_path):
    from kvweave.eval import runner

    config = runner.EvalConfig(
        model="smollm2-135m",
        tasks=["passkey"],
        contexts=[512],
        methods=["full", "window:window=128"],
        trials=1,
    )
    rows = runner.run(config, out_dir=tmp_path, progress=False, model_and_tokenizer=smollm)
    summary = {s["method"]: s for s in runner.summarize(rows)}
    assert summary["full"]["compression"] == pytest.approx(0.5)  # fp32 held vs 16-bit reference
    assert summary["window:window=128"]["kv_bytes"] < summary["full"]["kv_bytes"] / 3
    assert (tmp_path / "rows.jsonl").exists() and (tmp_path / "config.json").exists()
    assert {r["metric"] for r in rows} == {"string_match_all"} and {r["haystack"] for r in rows} == {"repeat"}
    assert {r["max_new_tokens"] for r in rows} == {16}
    for r in rows:  # the process peak of the trial holds the model and the cache at least
        assert r["peak_memory_kind"] in ("process_peak_rss", None)
        assert r["peak_memory_bytes"] is None or r["peak_memory_bytes"] > r["kv_bytes"]


def test_eval_code_task_on_the_real_model(smollm, tmp_path):
    """The code-continuation task end to end: a scored row with the edit-similarity metric."""
    from kvweave.eval import runner

    config = runner.EvalConfig(
        model="smollm2-135m", tasks=["code"], contexts=[512], methods=["full"], trials=1, max_new_tokens=12
    )
    (row,) = runner.run(config, out_dir=tmp_path, progress=False, model_and_tokenizer=smollm)
    assert row["metric"] == "edit_sim" and 0.0 <= row["score"] <= 1.0 and row["max_new_tokens"] == 12
    assert row["answers"] and row["prediction"]


@pytest.mark.parametrize("method", ["depthweave", "dkcache", "quant:bits=4", "snapkv:ratio=0.25"])
def test_every_path_gives_the_same_answer_and_bytes(smollm, method):
    """``kvweave.generate`` and ``make_cache`` + ``model.generate`` (no ``set_prompt``, no tokenizer given: the
    ids come from the forward pass, the tokenizer from ``load_model``) hold the same bytes, write the same
    tokens, on a real tokenizer and a prompt with values in it."""
    model, tokenizer = smollm
    sample = tasks.make_sample("passkey", tokenizer, 900, depth=0.4, seed=3)
    result = kvweave.generate(model, tokenizer, sample.prompt, method, max_new_tokens=8)
    ids = chat_ids(tokenizer, sample.prompt)
    cache = kvweave.make_cache(method, model)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=8,
            do_sample=False,
            **{cache_kwarg(model): cache},
        )
    assert tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True) == result.text
    assert cache.nbytes() == result.cache.nbytes()


def test_long_generation_feeds_the_filler_through_decode_steps(smollm, tmp_path):
    """``--generated N``: N prose tokens between the document and the question, one decode step each. For the
    exact cache that is the same computation as having them in the prompt, so ``full`` answers as it would
    with the filler prefilled; every method's rows say how much was fed."""
    from kvweave.eval import runner

    model, tokenizer = smollm
    config = runner.EvalConfig(
        model="smollm2-135m",
        tasks=["passkey"],
        contexts=[256],
        methods=["full", "quant:residual=32"],
        trials=1,
        generated=48,
        max_new_tokens=6,
    )
    rows = runner.run(config, out_dir=tmp_path, progress=False, model_and_tokenizer=smollm)
    assert {r["generated"] for r in rows} == {48} and all(r["generated_s"] > 0 for r in rows)
    assert {s["task"] for s in runner.summarize(rows)} == {"passkey +48 gen"}
    plain = runner.run(
        runner.EvalConfig(**{**config.__dict__, "generated": 0}),
        out_dir=tmp_path / "plain",
        progress=False,
        model_and_tokenizer=smollm,
    )
    by = {r["method"]: r for r in rows}
    assert by["full"]["prompt_tokens"] == plain[0]["prompt_tokens"] + 48
    # the same prompt, with the filler prefilled instead of fed one token at a time: the same greedy answer
    sample = tasks.make_sample("passkey", tokenizer, 256, depth=rows[0]["depth"], seed=rows[0]["seed"])
    prefix, full_ids = runner.build_prompt(tokenizer, sample, False)
    filler = runner.generated_filler(tokenizer, 48, rows[0]["seed"])
    ids = torch.tensor([prefix + filler + full_ids[len(prefix) :]])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=6,
        do_sample=False,
        **{cache_kwarg(model): kvweave.make_cache("full", model)},
    )
    assert tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True) == by["full"]["prediction"]
    with pytest.raises(ValueError, match="choose one"):
        runner.EvalConfig(**{**config.__dict__, "question_aware": True})
