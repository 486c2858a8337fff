"""``benchmarks/vllm_load.py`` without a server: its statistics, its reading of vLLM's metrics, its resume."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import vllm_load  # noqa: E402


def test_percentiles_interpolate_and_handle_empty():
    assert vllm_load.percentile([], 0.5) is None
    assert vllm_load.percentile([3.0], 0.99) == 3.0
    assert vllm_load.percentile([1.0, 2.0, 3.0, 4.0], 0.5) == pytest.approx(2.5)
    assert vllm_load.percentile(list(map(float, range(101))), 0.99) == pytest.approx(99.0)


def test_metrics_are_summed_over_label_sets_and_others_ignored():
    text = "\n".join(
        [
            "# HELP vllm:num_preemptions_total preemptions",
            'vllm:num_preemptions_total{engine="0",model_name="kvweave"} 3.0',
            'vllm:num_preemptions_total{engine="1",model_name="kvweave"} 2.0',
            'vllm:num_requests_waiting{model_name="kvweave"} 7',
            'vllm:kv_cache_usage_perc{model_name="kvweave"} 0.25',
            'vllm:e2e_request_latency_seconds_bucket{le="1.0"} 4',
            "malformed_line_without_value",
        ]
    )
    assert vllm_load.parse_metrics(text) == {
        "vllm:num_preemptions_total": 5.0,
        "vllm:num_requests_waiting": 7.0,
        "vllm:kv_cache_usage_perc": 0.25,
    }


def test_a_point_counts_failed_requests_and_times_only_the_served_ones():
    results = [
        {"error": None, "output_tokens": 10, "ttft_s": 1.0, "tpot_s": 0.1, "score": 1.0},
        {"error": None, "output_tokens": 6, "ttft_s": 3.0, "tpot_s": 0.3, "score": 0.0},
        {"error": "APITimeoutError: timed out", "output_tokens": 0},
    ]
    point = vllm_load.summarize_point(results, wall=8.0)
    assert (point["requests"], point["completed"], point["failed"]) == (3, 2, 1)
    assert point["requests_per_s"] == 0.25 and point["output_tokens_per_s"] == 2.0
    assert point["ttft_median_s"] == 2.0 and point["tpot_median_s"] == pytest.approx(0.2)
    assert point["accuracy"] == 0.5 and point["errors"] == ["APITimeoutError: timed out"]


def test_points_already_written_are_skipped_and_a_cut_line_is_not(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"method": "none", "concurrency": 4}) + "\n" + '{"method": "quant:bi')
    assert vllm_load.done_rows(rows) == {("none", 4)}
    assert vllm_load.done_rows(tmp_path / "missing.jsonl") == set()


def test_the_server_log_capacity_line_is_read(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("INFO start\nINFO [kv_cache_utils.py:1] GPU KV cache size: 174,720 tokens\nINFO ready\n")
    assert vllm_load.kv_tokens(log) == 174720


def test_bad_arguments_fail_before_any_server_starts(tmp_path, capsys):
    with pytest.raises(SystemExit):
        vllm_load.main(["--model", "m", "--out", str(tmp_path), "--concurrency", "0"])
    assert "--concurrency" in capsys.readouterr().err
    with pytest.raises(ValueError, match="pages"):
        vllm_load.main(["--model", "m", "--out", str(tmp_path), "--methods", "dkcache"])


def test_fp8_names_serve_vllms_own_cache_at_that_dtype():
    args = argparse.Namespace(
        model="m", port=8766, max_model_len=2316, dtype="float32", concurrency=[1, 4], prefix_caching=False
    )
    fp8 = vllm_load.server_command(args, "fp8_e5m2")
    assert fp8[fp8.index("--method") + 1] == "none" and fp8[-2:] == ["--kv-cache-dtype", "fp8_e5m2"]
    own = vllm_load.server_command(args, "none")
    assert "--kv-cache-dtype" not in own and own[own.index("--method") + 1] == "none"
    quant = vllm_load.server_command(args, "quant:bits=4")
    assert quant[quant.index("--method") + 1] == "quant:bits=4" and "--kv-cache-dtype" not in quant


def test_a_server_that_exits_at_start_up_is_a_refused_row_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    """One row per concurrency naming the log's error; the next method still runs; a rerun skips them."""
    started = []
    error = "NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX."

    def exits_at_start(args, method, log_path):
        started.append(method)
        log_path.write_text(  # as vLLM logs it: a warning naming an error, the root cause, its wrappers
            "WARNING 12-05 [system_utils.py:255] raise the ulimit, or `OSError: [Errno 24] Too many open files`\n"
            "(Worker pid=19973) ERROR 12-05 11:02:56 [multiproc_executor.py:1063] Traceback (most recent call):\n"
            f"(Worker pid=19973) ERROR 12-05 11:02:56 [multiproc_executor.py:1063] {error}\n"
            "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n"
        )
        return subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])

    monkeypatch.setattr(vllm_load, "start_server", exits_at_start)
    argv = ["--model", "m", "--out", str(tmp_path), "--methods", "fp8,fp8_e5m2", "--concurrency", "1,4"]
    assert vllm_load.main(argv + ["--port", "8799"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [(r["method"], r["concurrency"]) for r in rows] == [
        ("fp8", 1), ("fp8", 4), ("fp8_e5m2", 1), ("fp8_e5m2", 4)
    ]  # fmt: skip
    assert all(r["refused"] == error and "requests" not in r for r in rows)
    printed = capsys.readouterr().out
    assert f"| `fp8` | 4 | refused at start-up: {error} |" in printed
    assert vllm_load.main(argv + ["--port", "8799"]) == 0 and started == ["fp8", "fp8_e5m2"]
