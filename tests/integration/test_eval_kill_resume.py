"""Killing a real ``kvweave eval`` process mid-run and rerunning it loses nothing and redoes nothing finished.

The unit tests cover the same with stubs (``tests/unit/test_runner.py``); this one runs the command line on the
real smollm2-135m, kills it with SIGKILL (no cleanup handler runs) once some rows are written, and reruns it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

COMMAND = [
    "eval", "--model", "smollm2-135m", "--task", "passkey", "--context", "768", "--trials", "4",
    "--methods", "full,window:window=128", "--max-new-tokens", "8",
]  # fmt: skip


def _kvweave(args: list[str], **kw) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    return subprocess.Popen(
        [sys.executable, "-m", "kvweave.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kw,
    )


def _rows(folder: Path) -> list[dict]:
    path = folder / "rows.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_sigkill_mid_run_then_rerun(tmp_path: Path) -> None:
    from kvweave.models import resolve

    resolve("smollm2-135m")  # installed (and converted) before the clock starts
    out = tmp_path / "run"
    first = _kvweave([*COMMAND, "--out", str(out)])
    deadline = time.monotonic() + 600
    while len(_rows(out)) < 2:
        assert first.poll() is None, first.stderr.read().decode()[-2000:] if first.stderr else ""
        assert time.monotonic() < deadline, "no rows after 10 minutes"
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=60)
    assert first.returncode == -signal.SIGKILL
    before = _rows(out)
    assert 2 <= len(before) < 8, "the run finished before it was killed; the test would prove nothing"

    second = _kvweave([*COMMAND, "--out", str(out)])
    _, err = second.communicate(timeout=900)
    assert second.returncode == 0, err.decode()[-2000:]
    after = _rows(out)
    keys = [row["key"] for row in after]
    assert len(keys) == len(set(keys)) == 8  # every (method, trial) once: nothing lost, nothing duplicated
    assert after[: len(before)] == before  # finished rows kept as they were, not redone
    assert (out / "command.txt").read_text().count("kvweave eval") == 1  # the same command, listed once
