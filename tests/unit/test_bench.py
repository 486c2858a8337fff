"""``kvweave bench``: rows per (context, batch, method), full as the reference, the bound, bad input refused.

Speed itself is measured by the benchmark, never asserted here; these tests check the bookkeeping."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_model
from kvweave.cli import main
from kvweave.eval import bench


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(bench, "load_bench_model", lambda config: (tiny_model("llama"), None))
    # a steady bus: a loaded machine would rerun a point's rounds (tested on its own below)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda device: 10.0)


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


def test_one_recorded_prefill_per_point_replays_into_every_exact_method(tiny, monkeypatch):
    """Methods whose prefill is exact are filled from one recording (``prefill: replayed``) and hold the same
    bytes and decode the same tokens as with their own forward pass; the others prefill themselves."""
    methods = [
        "full",
        "depthweave:recent=8,block=8,group=2,compression=3,probe=4,window=8,sinks=2,page=4",
        "quant:residual=8,group=8",
        "pi:factor=2",
    ]
    base = dict(
        methods=methods,
        contexts=[48],
        batches=[1],
        model=None,
        shape="qwen2.5-0.5b",
        steps=3,
        rounds=1,
        warmup=0,
    )
    tokens: dict[tuple[bool, str], list[int]] = {}
    decode = bench._decode

    def spy(model, trial, steps, device):
        out = decode(model, trial, steps, device)
        tokens.setdefault((base["share"], trial.spec), []).append(int(trial.token[0, 0]))
        return out

    monkeypatch.setattr(bench, "_decode", spy)
    rows = {}
    for share in (True, False):
        base["share"] = share
        config = bench.BenchConfig(**{k: v for k, v in base.items() if k != "share"}, share_prefill=share)
        rows[share] = {r["method"]: r for r in bench.run_bench(config, lambda row: None)}
    assert {m: r["prefill"] for m, r in rows[True].items()} == {
        "full": "replayed",
        methods[1]: "replayed",
        methods[2]: "replayed",
        "pi:factor=2": "own",
    }
    assert {r["prefill"] for r in rows[False].values()} == {"own"}
    for method in methods:
        assert rows[True][method]["kv_bytes"] == rows[False][method]["kv_bytes"], method
        assert tokens[(True, method)] == tokens[(False, method)], method


def test_a_chunked_prefill_point_gives_the_rows_of_a_whole_one(tiny, monkeypatch):
    """``--prefill-chunk``: the shared recording and the own prefills go through the model in chunks; the rows
    say so and hold what the whole-prompt point holds (the same bytes, replays and own prefills alike)."""
    methods = ["full", "quant:residual=8,group=8", "pi:factor=2"]
    rows = {}
    messages: list[str] = []
    for chunk in (0, 16):
        config = bench.BenchConfig(
            methods=methods,
            contexts=[48],
            batches=[2],
            model=None,
            shape="qwen2.5-0.5b",
            steps=1,
            rounds=1,
            warmup=0,
            prefill_chunk=chunk,
        )
        rows[chunk] = {r["method"]: r for r in bench.run_bench(config, lambda row: None, messages.append)}
    for method in methods:
        assert rows[16][method]["prefill_chunk"] == 16 and rows[0][method]["prefill_chunk"] == 0
        assert rows[16][method]["prefill"] == rows[0][method]["prefill"]
        assert rows[16][method]["kv_bytes"] == rows[0][method]["kv_bytes"], method
    assert any("recording the prefill: 32/48 tokens" in m for m in messages)
    with pytest.raises(ValueError, match="--prefill-chunk"):
        bench.BenchConfig(methods=["full"], contexts=[64], prefill_chunk=-2)


def test_a_rerun_resumes_after_the_points_already_written(tiny, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    argv = [
        "bench",
        "--methods",
        "full,window:window=8,sinks=2",
        "--shape",
        "qwen2.5-0.5b",
        "--context",
        "40,48",
        "--steps",
        "1",
        "--rounds",
        "1",
        "--warmup",
        "0",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    lines = (out / "bench.jsonl").read_text().splitlines()
    assert len(lines) == 4
    # a crash cut the last point short: only its first row landed
    (out / "bench.jsonl").write_text("\n".join(lines[:3]) + "\n")
    seen: list[int] = []
    real = bench.prompt
    monkeypatch.setattr(
        bench, "prompt", lambda tok, vocab, n, b, dev: seen.append(n) or real(tok, vocab, n, b, dev)
    )
    assert main(argv) == 0
    assert seen == [48], "the finished point is skipped, the cut one measured again"
    rows = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()]
    assert sorted((r["context"], r["method"]) for r in rows[3:]) == [
        (48, "full"),
        (48, "window:window=8,sinks=2"),
    ]
    seen.clear()
    assert main(argv) == 0 and seen == []
    assert "already has its rows" in capsys.readouterr().out
    assert main([*argv, "--restart"]) == 0 and seen == [40, 48]


def test_a_point_whose_bandwidth_moved_is_run_again_and_marked(tiny, monkeypatch):
    readings = iter([10.0, 5.0, 10.0, 4.0])  # loaded, rerun, still loaded
    monkeypatch.setattr(bench, "copy_bandwidth", lambda device: next(readings))
    config = bench.BenchConfig(
        methods=["full"], contexts=[40], model=None, shape="qwen2.5-0.5b", steps=1, rounds=2, warmup=0
    )
    (row,) = bench.run_bench(config, lambda row: None)
    assert row["loaded"] is True and row["reruns"] == 1 and len(row["round_ms"]) == 2
    assert (row["bandwidth_start_gb_s"], row["bandwidth_end_gb_s"], row["bandwidth_gb_s"]) == (10.0, 4.0, 4.0)
    assert row["round_min_ms"] <= row["ms_per_token"] <= row["round_max_ms"]
    steady = iter([10.0, 9.0])
    monkeypatch.setattr(bench, "copy_bandwidth", lambda device: next(steady))
    (row,) = bench.run_bench(config, lambda row: None)
    assert row["loaded"] is False and row["reruns"] == 0


def test_prefill_rounds_are_interleaved_and_reported_as_medians(tiny, monkeypatch):
    """--prefill-rounds N: every method prefills N times, full first in each round; prefill_s is the median
    of its rounds and prefill_vs_full the median of its per-round ratios to full's."""
    order: list[str] = []
    seconds = iter([10.0, 13.0, 12.0, 12.0, 11.0, 30.0])  # full, window; full, window; full, window
    real = bench._prefill

    def timed(model, spec, ids, device, shared=None, chunk=0):
        trial = real(model, spec, ids, device, shared, chunk)
        if ids.shape[1] > 256:  # the untimed 256-token warm-up is not a round
            order.append(spec.split(":")[0])
            trial.prefill_s = next(seconds)
        return trial

    monkeypatch.setattr(bench, "_prefill", timed)
    config = bench.BenchConfig(
        methods=["full", "window:window=8,sinks=2"],
        contexts=[300],
        model=None,
        shape="qwen2.5-0.5b",
        steps=1,
        rounds=1,
        warmup=0,
        prefill_rounds=3,
        share_prefill=False,
    )
    rows = {r["method"].split(":")[0]: r for r in bench.run_bench(config, lambda row: None)}
    assert order == ["full", "window"] * 3
    assert rows["full"]["prefill_round_s"] == [10.0, 12.0, 11.0] and rows["full"]["prefill_s"] == 11.0
    assert rows["window"]["prefill_round_s"] == [13.0, 12.0, 30.0] and rows["window"]["prefill_s"] == 13.0
    assert rows["window"]["prefill_vs_full"] == pytest.approx(1.3)  # median of 1.3, 1.0, 2.727
    assert rows["full"]["prefill_vs_full"] == 1.0
    with pytest.raises(ValueError, match="--prefill-rounds must be at least 1"):
        bench.BenchConfig(methods=["full"], contexts=[64], prefill_rounds=0)


def test_prefill_eta_counts_every_prefill_as_whole_without_a_shared_recording():
    """--own-prefill: the methods left each take what a whole prefill took, full's included (it was 0 s)."""
    done = [bench._Trial("full", None, torch.zeros(1), 80.0, (0, ""), how="own")]
    assert bench._prefill_eta(done, ["depthweave", "full"], None, 8192, 0.0, sharing=False) == 160.0
