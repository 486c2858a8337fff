"""benchmarks/soak_copy.py: the copy marks, the refusal of options that change what is stored, and that a resumed
cache with its saved options continues exactly as the uninterrupted soak did (so its rows diagnose the soak)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_model

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def script(name: str):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


def test_copyable_marks_tokens_an_earlier_occurrence_predicts() -> None:
    copy = script("soak_copy")
    ids = [1, 2, 3, 4, 9, 9, 9, 1, 2, 3, 4, 5]
    # position 10 (4) follows 1,2,3 as it did at 3; position 11 (5) does not (4 was followed by 9)
    assert copy.copyable(ids, 8, 12, 3) == [False, False, True, False]
    # the earlier occurrence must end before the token: a run of one token is copyable once it has repeated
    assert copy.copyable([7, 7, 7], 2, 3, 2) == [False]
    assert copy.copyable([7, 7, 7, 7], 3, 4, 2) == [True]


def test_options_that_change_the_store_are_refused() -> None:
    copy = script("soak_copy")

    class Cache:
        method = object()

    with pytest.raises(SystemExit, match="compression"):
        copy.apply_variant(Cache(), "compression=4")


@pytest.mark.parametrize("spec", ["depthweave", "quant"])
def test_a_resumed_cache_continues_the_soak_exactly(tmp_path: Path, spec: str) -> None:
    soak, copy = script("soak"), script("soak_copy")
    model = tiny_model("llama")
    prompt, first, more = 48, 60, 40
    stream = soak.token_stream(None, model.config.vocab_size, prompt + first + more + 1)
    whole: list[dict] = []
    soak.soak(model, stream, spec, first + more, first + more, prompt, whole.append)
    state = tmp_path / "state"
    soak.soak(model, stream, spec, first, first, prompt, lambda row: None, state_dir=state, save_every=1)
    marks = copy.copyable(stream[0].tolist(), prompt + first + 1, prompt + first + more + 1, 4)
    rows = copy.run_variant(model, stream, state, "default", more, marks, more)
    reference = copy.reference_rows(model, stream, prompt + first, more, marks, more)
    # the soak's single interval covers both stretches: its mean over all steps from the two parts
    whole_full: list[dict] = []
    soak.soak(model, stream, "full", first + more, first + more, prompt, whole_full.append)
    head: list[dict] = []
    soak.soak(model, stream, spec, first, first, prompt, head.append)
    combined = (head[0]["loss"] * first + rows[0]["loss"] * more) / (first + more)
    assert combined == pytest.approx(whole[0]["loss"], rel=1e-5)
    head_full: list[dict] = []
    soak.soak(model, stream, "full", first, first, prompt, head_full.append)
    combined_full = (head_full[0]["loss"] * first + reference[0]["loss"] * more) / (first + more)
    assert combined_full == pytest.approx(whole_full[0]["loss"], rel=1e-4)
    assert rows[0]["copy_tokens"] == reference[0]["copy_tokens"] == sum(marks)
    assert torch.isfinite(torch.tensor(rows[0]["loss"]))
