"""benchmarks/attention_oracle.py: `full`'s attention it reads, the slots it pins exact, and its refusals."""

from __future__ import annotations

import pytest
import torch
from test_soak_copy import script

import kvweave
from conftest import tiny_model
from kvweave._compat import cache_kwarg
from kvweave.methods.depthweave import factorize

SMALL = dict(recent=8, block=8, probe=8, window=8, sinks=2, bits=16, weighting=0.0)


def test_attention_at_is_the_answer_query_row_of_full_attention(llama) -> None:
    """The prompt's share of `full`'s attention from the query that predicts answer token ``at``, read step by
    step over a cache, is the same row of one eager forward pass over the whole sequence."""
    oracle = script("attention_oracle")
    torch.manual_seed(0)
    ids = torch.randint(3, 140, (60,)).tolist()
    prompt, rest, answer = ids[:40], ids[40:48], ids[48:]
    got = oracle.attention_at(llama, prompt, rest, answer, 3)
    eager = tiny_model("llama")
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        out = eager(torch.tensor([prompt + rest + answer[:3]]), output_attentions=True)
    want = torch.stack([a[0, :, -1, :40].float().mean(0) for a in out.attentions]).mean(0)
    assert got.shape == (40,)
    assert torch.allclose(got, want, atol=1e-5)
    assert llama.config._attn_implementation == "sdpa"  # put back


def test_pins_are_exact_rows_only_while_open(llama) -> None:
    """Slots pinned are exact rows of the store whatever the plan chose; outside the block the planner is the
    method's own again."""
    oracle = script("attention_oracle")
    torch.manual_seed(1)
    ids = torch.randint(3, 140, (1, 200))
    pins = torch.arange(100, 116)

    def exact_rows(slots) -> set[int]:
        cache = kvweave.make_cache("depthweave", llama, **SMALL)
        with oracle.pinned(slots), torch.no_grad():
            llama(ids, **{cache_kwarg(llama): cache})
        return set(cache.layers[0].group.rows[0].exact_slots.tolist())

    planner = factorize.make_plan
    plain, forced = exact_rows(None), exact_rows(pins)
    assert not set(pins.tolist()) <= plain
    assert set(pins.tolist()) <= forced
    assert factorize.make_plan is planner


def test_pin_sets_rank_slots_by_attention() -> None:
    oracle = script("attention_oracle")
    score = torch.tensor([0.5, 0.1, 0.3, 0.05, 0.4, 0.2])
    assert oracle.pin_slots("none", score) is None
    assert oracle.pin_slots("top2", score).tolist() == [0, 4]
    assert oracle.pin_slots("top2@1", score).tolist() == [2, 4]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--task", "passkey", "--methods", "full"], "DepthWeave specs"),
        (["--task", "passkey", "--methods", "depthweave", "--pins", "top"], "none, topN or topN@K"),
        (["--task", "passkey", "--methods", "depthweave", "--at", "40"], "--at must be an answer token"),
        (["--task", "passkey", "--methods", "depthweave", "--trials", "6"], "numbered 0 to 5"),
        (["--task", "nope", "--methods", "depthweave"], "unknown task"),
    ],
)
def test_bad_arguments_are_refused_before_any_model_loads(argv, message, tmp_path, capsys) -> None:
    oracle = script("attention_oracle")
    try:
        code = oracle.main([*argv, "--out", str(tmp_path / "rows.jsonl")])
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "rows.jsonl").exists()
