"""A short soak in CI: benchmarks/soak.py's loop on a tiny random model, ~2,000 decode steps over five methods.

Bounded methods (window, h2o) hold the same bytes at every checkpoint once full; growing ones (quant, dkcache,
depthweave) grow by less than a 16-bit cache per token and stay compressed; the output stays finite; the
process's memory does not grow beyond the cache's own growth; DepthWeave's refreshes stay few."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from conftest import tiny_model

STEPS, EVERY, PROMPT = 400, 100, 64
BOUNDED = ["window:window=32,sinks=4", "h2o:budget=32"]
GROWING = {  # spec: the least compression of its growth against a 16-bit cache on the tiny model
    "quant": 2.0,
    "dkcache:core=16,steady=64,page=8,pages=2": 1.0,
    "depthweave": 2.0,
}


def soak_script():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"
    spec = importlib.util.spec_from_file_location("soak", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def soaked():
    script = soak_script()
    model = tiny_model("llama")
    stream = script.token_stream(None, model.config.vocab_size, PROMPT + STEPS + 1)
    results = {}
    for spec in [*BOUNDED, *GROWING]:
        rows: list[dict] = []
        summary = script.soak(model, stream, spec, STEPS, EVERY, PROMPT, rows.append)
        results[spec] = (rows, summary)
    return results


@pytest.mark.parametrize("spec", BOUNDED)
def test_bounded_methods_hold_the_same_bytes(soaked, spec: str) -> None:
    rows, summary = soaked[spec]
    assert summary["complete"] and summary["finite"]
    assert {r["bytes"] for r in rows} == {rows[0]["bytes"]}, [r["bytes"] for r in rows]
    assert rows[0]["bytes"] < rows[-1]["full_kv_bytes_16bit"] / 4


@pytest.mark.parametrize("spec", list(GROWING))
def test_growing_methods_grow_at_their_compressed_rate(soaked, spec: str) -> None:
    rows, summary = soaked[spec]
    assert summary["complete"] and summary["finite"]
    full_per_token = summary["full_16bit_bytes_per_token"]
    assert summary["bytes_per_token"] <= full_per_token / GROWING[spec] + 1, summary
    if GROWING[spec] > 1:  # the exact recent part counts less as tokens arrive: compressed by the end
        assert rows[-1]["bytes"] < rows[-1]["full_kv_bytes_16bit"], summary
    assert rows[-1]["bytes"] >= rows[0]["bytes"] * 0.5  # it holds the tokens it saw: nothing vanished


def test_memory_does_not_drift_and_refreshes_stay_bounded(soaked) -> None:
    for spec, (_, summary) in soaked.items():
        assert summary["rss_beyond_cache"] < 64 * 2**20, (spec, summary["rss_beyond_cache"])
        assert summary["loss_last"] < 2 * torch.log(torch.tensor(160.0)).item()
    _, depthweave = soaked["depthweave"]
    assert depthweave["folds"] > 0
    assert depthweave["refreshes"] <= depthweave["folds"], depthweave


def test_loss_table_sets_each_checkpoint_beside_full(soaked, tmp_path: Path, capsys) -> None:
    """``--losses``: every method's interval loss beside ``full``'s at the same step, from several rows files;
    a step one of them lacks is a dash, and a missing file is a one-line error."""
    script = soak_script()
    model = tiny_model("llama")
    stream = script.token_stream(None, model.config.vocab_size, PROMPT + STEPS + 1)
    full_rows: list[dict] = []
    script.soak(model, stream, "full", STEPS, EVERY, PROMPT, full_rows.append)
    quant_rows, _ = soaked["quant"]
    files = []
    for name, rows in (("a", full_rows), ("b", quant_rows[:-1])):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(script.json.dumps(r) + "\n" for r in rows))
        files.append(str(path))
    assert script.main(["--losses", *files]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| step | `full` loss | `quant` loss (vs `full`)")
    first, last = full_rows[0], full_rows[-1]
    change = 100 * (quant_rows[0]["loss"] / first["loss"] - 1)
    assert (
        f"| {first['step']:,} | {first['loss']:.3f} | {quant_rows[0]['loss']:.3f} ({change:+.1f} %)"
        in lines[2]
    )
    assert lines[-1] == f"| {last['step']:,} | {last['loss']:.3f} | - |"  # quant's last checkpoint left out
    with pytest.raises(SystemExit):
        script.main(["--losses", str(tmp_path / "none.jsonl")])
    assert "no rows file" in capsys.readouterr().err
