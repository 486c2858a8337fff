"""benchmarks/quote_fidelity.py: the errors it reads off a cache's rebuilt passages, and its refusals."""

from __future__ import annotations

import pytest
import torch
from test_soak_copy import script
from transformers import DynamicCache

import kvweave
from conftest import far_quote_stream
from kvweave._compat import cache_kwarg

SMALL = dict(
    recent=8, block=8, probe=8, window=8, sinks=2, router=True, bits=16, weighting=0.0, recall_bits=16
)
EXACT_STORE = dict(router=False, residuals=False, probes=False, rank=4096, storage="model")


def _errors(llama, **options):
    """A 400-id prompt with a key said once at slots 300-305, then a question quoting it: ``errors``'s row."""
    fidelity = script("quote_fidelity")
    prompt, question = far_quote_stream()
    full = DynamicCache(config=llama.config)
    with torch.no_grad():
        llama(prompt, **{cache_kwarg(llama): full})
    reference = [(layer.keys[0].float(), layer.values[0].float()) for layer in full.layers]
    cache = kvweave.make_cache("depthweave", llama, recall=0, quote=4, **{**SMALL, **options})
    kw = {cache_kwarg(llama): cache}
    with torch.no_grad():
        llama(prompt, **kw)
        before = fidelity.errors(cache, reference)
        llama(question, **kw)
    return before, fidelity.errors(cache, reference)


def test_errors_read_the_rebuilt_passages_against_full_and_the_store(llama) -> None:
    """Nothing rebuilt: no row. Over an exact store, the store's error is nil and a passage rebuilt over it is
    full's, where 64 tokens of ids from no cache are not; over a lossy store both errors are counted apart."""
    before, exact_over = _errors(llama, quote_over="cache", **EXACT_STORE)
    assert before is None
    assert exact_over["stored_err_k"] < 1e-5 and exact_over["stored_err_v"] < 1e-5
    assert exact_over["rebuilt_err_k"] < 2e-3 and exact_over["rebuilt_err_v"] < 2e-3
    _, exact_ids = _errors(llama, **EXACT_STORE)
    assert exact_ids["rebuilt_err_k"] > 0.05 and exact_ids["stored_err_k"] < 1e-5
    assert exact_ids["spans"] == exact_over["spans"]
    _, lossy = _errors(llama, quote_over="cache", rank=2)
    assert lossy["stored_err_k"] > 0.05 and lossy["rebuilt_err_k"] != lossy["stored_err_k"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--task", "passkey", "--methods", "full"], "DepthWeave specs"),
        (["--task", "passkey", "--methods", "depthweave", "--trials", "6"], "numbered 0 to 5"),
        (["--task", "passkey", "--methods", "depthweave", "--trials", "x"], "numbers separated by commas"),
        (["--task", "nope", "--methods", "depthweave"], "unknown task"),
    ],
)
def test_bad_arguments_are_refused_before_any_model_loads(argv, message, tmp_path, capsys) -> None:
    fidelity = script("quote_fidelity")
    try:
        code = fidelity.main([*argv, "--out", str(tmp_path / "rows.jsonl")])
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "rows.jsonl").exists()
