"""Perplexity through a compressed cache: ``full`` equals the model's own loss; compression costs."""

from __future__ import annotations

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
