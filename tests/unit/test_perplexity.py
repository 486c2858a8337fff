"""Perplexity through a compressed cache: ``full`` equals the model's own loss; compression costs."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import tiny_model
from kvweave.eval.perplexity import summarize_perplexity, window_nll


def test_full_window_nll_equals_plain_loss():
    model = tiny_model("llama")
    torch.manual_seed(0)
    ids = torch.randint(3, 150, (60,)).tolist()
    got = window_nll(model, ids, "full", target=12)
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]])).logits[0, -12:]
    expected = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[-12:])).item()
    assert abs(got["nll"] - expected) < 1e-5
    assert got["kv_bytes"] == 2 * got["full_kv_bytes"]  # fp32 held vs the 16-bit reference


def test_eviction_changes_nll_and_summary_compares_to_full():
    model = tiny_model("llama")
    ids = torch.randint(3, 150, (80,)).tolist()
    rows = [
        {"method": "full", **window_nll(model, ids, "full", 10)},
        {"method": "window:window=8", **window_nll(model, ids, "window:window=8,sinks=2", 10)},
    ]
    assert rows[0]["nll"] != rows[1]["nll"]
    summary = {s["method"]: s for s in summarize_perplexity(rows)}
    assert summary["full"]["ppl_vs_full"] == 0
    assert summary["window:window=8"]["compression"] > summary["full"]["compression"]


def _stub_corpus(monkeypatch, n_tokens: int = 400) -> None:
    """A corpus of ``n_tokens`` ids; windows are cut by the real :func:`perplexity_windows`."""
    from kvweave.eval import tasks as task_lib

    class Ids:
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [3 + (i * i + 3 * i) % 140 for i in range(n_tokens)]

    monkeypatch.setattr(task_lib, "load_corpus", lambda name, data_dir=None: "text")
    return Ids()


def test_ppl_folder_resumes_after_a_torn_line_and_refuses_other_windows(monkeypatch, tmp_path):
    import pytest

    from kvweave.eval.perplexity import run_perplexity

    model = tiny_model("llama")
    tokenizer = _stub_corpus(monkeypatch)
    kw = dict(window=40, target=8, out_dir=tmp_path, progress=False)
    rows = run_perplexity(model, tokenizer, "tiny", ["full", "window:window=8,sinks=2"], windows=2, **kw)
    assert len(rows) == 4 and all(len(r["window_sha1"]) == 16 for r in rows)
    path = tmp_path / "ppl.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:3]) + "\n" + lines[3][:30])  # a crash in the middle of the last row
    again = run_perplexity(model, tokenizer, "tiny", ["full", "window:window=8,sinks=2"], windows=2, **kw)
    assert len(again) == 4 and len(path.read_text().splitlines()) == 5  # the torn line stays, ignored
    assert {r["key"] for r in again} == {r["key"] for r in rows}
    assert [r["nll"] for r in again] == [r["nll"] for r in rows]  # the redone row scores the same
    with pytest.raises(ValueError, match="another --windows count"):
        run_perplexity(model, tokenizer, "tiny", ["full"], windows=3, **kw)
    with pytest.raises(ValueError, match="new --out folder"):
        run_perplexity(model, tokenizer, "other", ["full"], windows=2, **kw)
    extended = run_perplexity(model, tokenizer, "tiny", ["full", "quant:bits=4"], windows=2, **kw)
    assert len(extended) == 6  # another method is added, nothing redone


def test_summary_keeps_settings_apart():
    from kvweave.eval.perplexity import summarize_perplexity

    rows = [
        {
            "model": "m",
            "corpus": "c",
            "window": w,
            "target": 8,
            "method": m,
            "nll": nll,
            "kv_bytes": 4,
            "full_kv_bytes": 2,
        }
        for w, m, nll in [(40, "full", 1.0), (40, "x", 1.5), (80, "full", 2.0), (80, "x", 2.0)]
    ]
    summary = {(s["window"], s["method"]): s for s in summarize_perplexity(rows)}
    assert summary[(40, "x")]["ppl_vs_full"] > 0.6 and summary[(80, "x")]["ppl_vs_full"] == 0


def test_stepwise_scoring_equals_one_pass_for_full_and_is_kept_apart():
    from kvweave.eval.perplexity import summarize_perplexity

    model = tiny_model("llama")
    torch.manual_seed(1)
    ids = torch.randint(3, 150, (90,)).tolist()
    one = window_nll(model, ids, "full", 16)
    step = window_nll(model, ids, "full", 16, stepwise=True)
    assert abs(one["nll"] - step["nll"]) < 1e-5
    # an evictor decodes differently token by token (the window slides), so the two scorings differ
    evict_one = window_nll(model, ids, "window:window=8,sinks=2", 16)
    evict_step = window_nll(model, ids, "window:window=8,sinks=2", 16, stepwise=True)
    assert abs(evict_one["nll"] - evict_step["nll"]) > 1e-4
    base = {"model": "m", "corpus": "c", "window": 90, "target": 16}
    rows = [
        {**base, "method": "full", "stepwise": False, **one},
        {**base, "method": "full", "stepwise": True, **step},
        {**base, "method": "w", "stepwise": True, **evict_step},
    ]
    summary = summarize_perplexity(rows)
    assert len(summary) == 3 and {s["stepwise"] for s in summary} == {False, True}
    (w,) = [s for s in summary if s["method"] == "w"]
    assert w["ppl_vs_full"] == pytest.approx(math.exp(evict_step["nll"] - step["nll"]) - 1)
