"""benchmarks/answer_divergence.py: following a reference answer through a cache, and its refusals."""

from __future__ import annotations

import pytest
import torch
from test_soak_copy import script

import kvweave


def test_follow_greedy_matches_generate_and_forcing_reads_the_reference(llama) -> None:
    """Greedy, ``follow`` gives ``generate``'s tokens; fed its own answer it agrees at every step; fed another,
    the log-probabilities are those of the tokens fed."""
    div = script("answer_divergence")
    torch.manual_seed(1)
    ids = torch.randint(3, llama.config.vocab_size, (1, 24))
    prefill, rest = ids[0, :20].tolist(), ids[0, 20:].tolist()
    greedy = div.follow(llama, kvweave.make_cache("full", llama), prefill, rest, None, 6)
    out = llama.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert greedy["argmax"] == out[0, 24:].tolist()
    same = div.follow(llama, kvweave.make_cache("full", llama), prefill, rest, greedy["argmax"], 6)
    assert same["argmax"] == greedy["argmax"] and same["logp"] == pytest.approx(greedy["logp"], abs=1e-5)
    other = [(t + 1) % llama.config.vocab_size for t in greedy["argmax"]]
    forced = div.follow(llama, kvweave.make_cache("full", llama), prefill, rest, other, 6)
    assert forced["argmax"][0] == greedy["argmax"][0]  # the first step sees no forced token yet
    assert forced["logp"][0] < greedy["logp"][0]  # the same logits, a token that is not their argmax
    # the margin is the gap between the top two log-probabilities: never negative, and the argmax's log-probability
    # minus the margin is the runner-up's, which a forced non-argmax token cannot exceed
    assert all(m >= 0 for m in greedy["margin"])
    assert forced["margin"][0] == pytest.approx(greedy["margin"][0], abs=1e-5)
    assert forced["logp"][0] <= greedy["logp"][0] - greedy["margin"][0] + 1e-5


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--task", "nope", "--methods", "depthweave"], "unknown task"),
        (["--task", "passkey", "--methods", "depthweave", "--trials", "6"], "numbered 0 to 5"),
        (["--task", "passkey", "--methods", "depthweave", "--trials", "a"], "numbers separated by commas"),
        (["--task", "passkey", "--methods", "depthweave", "--tokens", "0"], "--tokens must be at least 1"),
    ],
)
def test_bad_arguments_are_refused_before_any_model_loads(argv, message, tmp_path, capsys) -> None:
    div = script("answer_divergence")
    try:
        code = div.main([*argv, "--out", str(tmp_path / "rows.jsonl")])
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "rows.jsonl").exists()
