"""``benchmarks/gpu_check.sh`` on a CPU (``GPU_CHECK_DRY=1``): every stage the lent GPU would run, on a tiny random
model, ending in the one JSON the script promises. Run here so the script is known to work before a device is lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_dry_run_writes_every_point_and_the_kernel_counts(tmp_path):
    env = {
        **os.environ,
        "GPU_CHECK_DRY": "1",
        "OUT": str(tmp_path),
        "PYTHON": sys.executable,
        "GPU_CHECK_KERNEL_TESTS": "tests/kernels/test_kernel_imports.py",
        "GPU_CHECK_PACK": "1",
    }
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "gpu-check.json").read_text())
    assert result["dry_run"] is True and result["bench_failed"] is False
    assert result["kernel_tests"]["exit"] == 0 and result["kernel_tests"]["tests"] >= 1
    assert result["kernel_tests"]["failures"] == result["kernel_tests"]["errors"] == 0
    points = {(r["context"], r["batch"]) for r in result["bench"]}
    assert points == {(256, 1), (128, 2)}
    for point in points:
        methods = {r["method"] for r in result["bench"] if (r["context"], r["batch"]) == point}
        assert methods == {"full", "quant:bits=4", "dkcache", "depthweave"}
    assert all(r["model"] == "random:tiny" and r["ms_per_token"] > 0 for r in result["bench"])
    assert any(line.startswith("kernel-tests: exit 0") for line in result["stages"])
    # GPU_CHECK_PACK=1: the per-stage logs folded into one archive, five files in all
    assert {p.name for p in tmp_path.iterdir()} == {
        "gpu-check.json",
        "summary.txt",
        "bench.jsonl",
        "kernel-tests.xml",
        "logs.tar.gz",
    }
    with tarfile.open(tmp_path / "logs.tar.gz") as archive:
        names = {Path(n).name for n in archive.getnames()}
    assert {"env.log", "kernel-tests.log", "bench-256-b1.log", "bench-128-b2.log"} <= names
