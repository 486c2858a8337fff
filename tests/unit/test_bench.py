"""``kvweave bench``: rows per (context, batch, method), full as the reference, the bound, bad input refused.

Speed itself is measured by the benchmark, never asserted here; these tests check the bookkeeping."""

from __future__ import annotations

import json

import pytest

from conftest import tiny_model
from kvweave.cli import main
from kvweave.eval import bench


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(bench, "load_bench_model", lambda config: (tiny_model("llama"), None))


def test_rows_per_point_with_full_as_reference(tiny, tmp_path):
    config = bench.BenchConfig(
        methods=["full", "window:window=8,sinks=2", "quant:residual=8,group=8"],
        contexts=[40, 64],
        batches=[1, 2],
        model=None,
        shape="qwen2.5-0.5b",
        steps=2,
        rounds=2,
        warmup=1,
    )
    out = tmp_path / "bench.jsonl"
    rows = bench.run_bench(config, bench.write_rows(out))
    assert len(rows) == 2 * 2 * 3
    assert [json.loads(line) for line in out.read_text().splitlines()] == json.loads(json.dumps(rows))
    for row in rows:
        assert len(row["round_ms"]) == 2 and row["ms_per_token"] > 0
        assert row["kv_read_bytes"] <= row["kv_bytes"]
        assert row["bound"] == pytest.approx(
            (
                row["weight_bytes"]
                + next(
                    r["kv_read_bytes"]
                    for r in rows
                    if r["method"] == "full" and r["context"] == row["context"] and r["batch"] == row["batch"]
                )
            )
            / (row["weight_bytes"] + row["kv_read_bytes"]),
            rel=1e-3,
        )
        if row["method"] == "full":
            assert row["speedup"] == 1.0 and row["bound"] == 1.0 and row["overhead_s"] == 0
    window = [r for r in rows if r["method"].startswith("window")]
    assert all(r["bound"] > 1.0 for r in window), "a cache that reads less than full has a bound above 1"


def test_bad_input_is_refused_with_the_option():
    with pytest.raises(ValueError, match="--shape 'gpt-9'"):
        bench.BenchConfig(methods=["full"], contexts=[64], shape="gpt-9")
    with pytest.raises(ValueError, match="--steps"):
        bench.BenchConfig(methods=["full"], contexts=[64], steps=0)
    with pytest.raises(ValueError, match="--context"):
        bench.BenchConfig(methods=["full"], contexts=[])


def test_cli_rejects_a_bad_method_before_loading(capsys):
    assert main(["bench", "--methods", "nosuch", "--context", "64"]) == 2
    assert "unknown method 'nosuch'" in capsys.readouterr().err
