"""Tensor parallelism (issue #21): every registered method on a model sharded over 2 gloo ranks on CPU.

One ``torchrun`` launch (the module fixture) runs :mod:`tp_scenarios` on a tiny random Llama (4 attention heads, 2
KV heads: one per rank) saved to a temporary folder; the same scenarios run here in one process as the reference.
A second launch runs ``kvweave eval --tp 2`` itself. Together about a minute on 2 CPU cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import tp_scenarios as scenarios

import kvweave
from conftest import tiny_config
from kvweave import distributed
from kvweave._compat import cache_kwarg
from kvweave.persist import CacheFileError
from kvweave.registry import parse_method

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch built without distributed"
)

HERE = Path(__file__).resolve().parent
LAUNCH_TIMEOUT = 600
# How much more the two ranks hold together than one process, and why (the 55-token prompt of tp_scenarios):
EXTRA_BYTES = {
    # per-row RoPE positions of every tier (int32 [B, T]), which each rank needs for its heads
    "dkcache": 0.05,
    # each rank factorizes its own heads: its own token-side coordinates, token slots and positions, and a
    # budget met per rank; on this tiny model every rank sits at the smallest rank (1), so nothing shrinks
    "depthweave": 0.15,
    "xkv": 0.15,  # the same cross-layer factorization per rank (DepthWeave's machinery)
}
# the middle tier's scenario (100 new tokens): every rank holds each buffered token's position and score (8 bytes
# per layer) beside 4-bit codes of its one 16-wide head (22 bytes), so 2 ranks hold ~15 % more per token than one
# process on top of the factorization's own 15 %
EXTRA_BYTES_BY_SPEC = {parse_method(written).spec(): 0.25 for written in scenarios.LONGER}
EXTRA_BYTES_PER_ROW = (
    0.02  # per-row bookkeeping every rank holds: budgets, padding counts, quant's block starts
)
LOGIT_TOLERANCE = 1e-5


def _launch(command: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    paths = [str(HERE.parent), str(HERE), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(paths)}  # the caller's kvweave
    result = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert result.returncode == 0, (
        f"{' '.join(command)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-6000:]}"
    )
    return result


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, dict[str, Any]]:
    """``(folder, the model in one process, what the 2 ranks measured)``."""
    root = tmp_path_factory.mktemp("tp")
    folder = scenarios.save_tiny_model(root / "model", tiny_config("llama"))
    model, _ = kvweave.load_model(folder)
    context, _ = scenarios.prompt()
    cache = kvweave.make_cache("full", model)
    with torch.no_grad():
        model(context, **{cache_kwarg(model): cache})
    distributed.save_cache(cache, model, root / "one-process", prompt_ids=context)  # the ranks try to load it
    _launch(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(HERE / "tp_scenarios.py"),
            str(folder),
            str(root),
        ]
    )
    return root, model, json.loads((root / "tp.json").read_text())


@pytest.fixture(scope="module")
def single(work: tuple[Path, Any, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The prefix pattern of every spec in one process."""
    _, model, _ = work
    return {spec: scenarios.prefix_pattern(model, spec) for spec in scenarios.SPECS}


def _logit_gap(one: dict[str, Any], two: dict[str, Any], steps: int | None = None) -> float:
    a, b = torch.tensor(one["logits"][:steps]), torch.tensor(two["logits"][:steps])
    return float((a - b).abs().max())


def test_full_matches_one_process(work: tuple[Path, Any, dict[str, Any]], single: dict[str, Any]) -> None:
    """``full`` on 2 ranks: the same greedy tokens, logits within 1e-5, each rank half of the bytes."""
    _, _, ranks = work
    one, two = single["full"], ranks["prefix"]["full"]
    assert two["tokens"] == one["tokens"]
    assert _logit_gap(one, two) <= LOGIT_TOLERANCE
    assert two["kv_heads"] == 1 and one["kv_heads"] == 2
    assert (two["tp_rank"], two["tp_size"]) == (0, 2) and one["tp_rank"] is None  # stats() names the rank
    assert ranks["per_rank"]["full"]["nbytes"] == [one["nbytes"] // 2] * 2
    assert two["summed_nbytes"] == one["nbytes"]


@pytest.mark.parametrize("spec", scenarios.SPECS)
def test_prefix_pattern_under_tensor_parallelism(
    spec: str, work: tuple[Path, Any, dict[str, Any]], single: dict[str, Any]
) -> None:
    """Every method under TP: the ranks decide alike, the summed bytes are one process's bytes plus what every
    rank must hold for itself, and the tokens and logits are one process's (DepthWeave: see below)."""
    _, _, ranks = work
    one, two = single[spec], ranks["prefix"][spec]
    decisions = ranks["per_rank"][spec]["decisions"]
    assert decisions[0] == decisions[1], "the ranks made different decisions"
    assert two["summed_full_kv_bytes"] == one["summed_full_kv_bytes"]
    extra = EXTRA_BYTES_BY_SPEC.get(spec, EXTRA_BYTES.get(spec.split(":")[0], EXTRA_BYTES_PER_ROW))
    copies = two["context_bytes"] * (two["tp_size"] - 1)  # the ids recall reads: one copy per rank
    assert one["nbytes"] <= two["summed_nbytes"] <= one["nbytes"] * (1 + extra) + copies
    # prefill attention is exact for every method's prompt here, so the first token's logits always agree
    assert _logit_gap(one, two, steps=1) <= LOGIT_TOLERANCE
    if spec.startswith(("depthweave", "xkv")):
        # Each rank's bases span its own heads (G·H/2·D columns), a different factorization from one
        # process's: the decoded logits differ, so later greedy tokens of this random model may too.
        assert two["tokens"][0] == one["tokens"][0]
        return
    assert two["tokens"] == one["tokens"]
    assert _logit_gap(one, two) <= LOGIT_TOLERANCE
    assert decisions[0] == one["decisions"]  # the same entries, tiers and retrievals as one process


def test_depthweave_ranks_agree_on_probe_chosen_ranks(work: tuple[Path, Any, dict[str, Any]]) -> None:
    """The probe errors are all-reduced, so every rank holds its heads at the same ranks."""
    _, _, ranks = work
    for spec in (s for s in scenarios.SPECS if s.startswith("depthweave")):
        owners = [
            [layer.get("rank_k"), layer.get("rank_v")] for layer in ranks["per_rank"][spec]["decisions"][0]
        ]
        assert any(rank != [None, None] for rank in owners)
        assert ranks["per_rank"][spec]["decisions"][0] == ranks["per_rank"][spec]["decisions"][1]


def test_depthweave_ranks_agree_on_the_middle_tier(work: tuple[Path, Any, dict[str, Any]]) -> None:
    """The window is all-reduced, so every rank moves the same tokens to the 4-bit middle tier (and the scenario
    does reach it)."""
    _, _, ranks = work
    for written in scenarios.LONGER:
        decisions = ranks["per_rank"][parse_method(written).spec()]["decisions"]
        assert any(layer["middle_tokens"] > 0 for layer in decisions[0])
        assert decisions[0] == decisions[1]


@pytest.mark.parametrize("spec", scenarios.RECALL_SPECS)
def test_depthweave_recall_under_tensor_parallelism(
    spec: str, work: tuple[Path, Any, dict[str, Any]]
) -> None:
    """Recall's copy detection reads the token ids, the same on every rank: the ranks rebuild the same spans as
    one process, at the same steps, every layer holding the same slots; the rebuild (one forward pass of the
    sharded model) gives each rank its own heads' keys of one process's rebuild; the logits stay finite."""
    _, model, ranks = work
    one = scenarios.recall_copy(model, spec)
    assert one["rebuilds"] >= 1 and any(slots for slots in one["slots"])  # the copy was matched and rebuilt
    for rank in ranks["recall"][spec]:
        assert rank["rebuilds"] == one["rebuilds"]
        assert rank["slots"] == one["slots"]
        assert torch.isfinite(torch.tensor(rank["logits"])).all()
    if one["keys"] is None:  # 4-bit spans: codes, compared through the slots above
        return
    whole = torch.tensor(one["keys"])  # [2 KV heads, span, head dim]
    for r, rank in enumerate(ranks["recall"][spec]):
        torch.testing.assert_close(torch.tensor(rank["keys"]), whole[r : r + 1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", scenarios.NAMES)
def test_per_rank_files_continue_exactly(name: str, work: tuple[Path, Any, dict[str, Any]]) -> None:
    """A cache saved by 2 ranks (one file set each + tp.json) loads back and continues bit for bit."""
    root, _, ranks = work
    assert ranks["save_load"][name] == {"same_tokens": True, "same_logits": True, "manifest_tokens": 48}
    folder = root / "tp-saves" / name
    record = json.loads((folder / distributed.TP_MANIFEST).read_text())
    assert record["world_size"] == 2 and record["ranks"] == ["rank-0-of-2", "rank-1-of-2"]
    assert record["kv_heads"] == {"total": 2, "per_rank": 1}
    prints = [json.loads((folder / rank / "manifest.json").read_text())["model"] for rank in record["ranks"]]
    assert prints[0]["weights_sha256"] != prints[1]["weights_sha256"]  # each rank's file fits its own shard


def test_another_world_size_is_refused(work: tuple[Path, Any, dict[str, Any]]) -> None:
    root, model, ranks = work
    message = ranks["one_process_file"]  # a one-process file, loaded on 2 ranks
    assert message and "saved by 1 tensor-parallel rank" in message and "sharded over 2 ranks" in message
    sharded = root / "tp-saves" / "full"
    with pytest.raises(
        CacheFileError, match=r"saved by 2 tensor-parallel ranks .*world size 1.*with 2 ranks"
    ):
        distributed.load_cache(sharded, model)
    with pytest.raises(CacheFileError, match="tensor-parallel ranks"):
        kvweave.load_cache(sharded, model)


def test_head_counts_that_do_not_divide_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import LlamaConfig

    from kvweave.models import ModelError

    config = LlamaConfig(
        vocab_size=160,
        hidden_size=96,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=6,
        num_key_value_heads=3,
    )
    with pytest.raises(distributed.TensorParallelError, match="6 attention heads and 3 KV heads"):
        distributed.check_head_counts(config, 2)
    distributed.check_head_counts(config, 3)
    config.save_pretrained(tmp_path)
    with pytest.raises(
        distributed.TensorParallelError, match="3 KV heads"
    ):  # `--tp 2`, before any rank starts
        distributed.launch(["generate", "hi", "--tp", "2"], 2, model=str(tmp_path))
    with pytest.raises(ModelError, match="torchrun"):  # tp_plan without ranks to shard over
        kvweave.load_model(tmp_path, tp_plan="auto")
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it: refused before any weight is read
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(distributed.TensorParallelError, match=r"3 KV heads.*divides both \(1, 3\)"):
        kvweave.load_model(tmp_path, tp_plan="auto")


def test_tp_option_relaunches_under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert distributed.needs_launch(2) and not distributed.needs_launch(1)
    command = distributed.torchrun_command(["eval", "--tp", "2"], 2)
    assert "--nproc-per-node=2" in command and command[-5:] == ["-m", "kvweave.cli", "eval", "--tp", "2"]
    monkeypatch.setenv("WORLD_SIZE", "2")  # inside the launched ranks: run
    assert not distributed.needs_launch(2)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(distributed.TensorParallelError, match="--tp 2 runs under a torchrun of 4"):
        distributed.needs_launch(2)


def test_eval_with_tp_writes_one_set_of_rows(work: tuple[Path, Any, dict[str, Any]], tmp_path: Path) -> None:
    """``kvweave eval --tp 2`` starts its ranks; rank 0 alone writes the rows, with the bytes of both ranks."""
    from kvweave.eval import runner

    root, model, _ = work
    folder, out = root / "model", tmp_path / "run"
    args = [
        "--model",
        str(folder),
        "--task",
        "passkey",
        "--context",
        "256",
        "--methods",
        "full,window:window=16",
    ]
    args += ["--trials", "1", "--max-new-tokens", "3"]
    result = _launch([sys.executable, "-m", "kvweave.cli", "eval", "--tp", "2", *args, "--out", str(out)])
    assert result.stdout.count("passkey") == 2  # one table, printed once
    rows = runner.read_rows(out)
    assert [row["method"] for row in rows] == ["full", "window:window=16"]
    assert all(row["tp"] == 2 for row in rows)
    assert (out / "command.txt").read_text().splitlines() == [
        f"kvweave eval --tp 2 {' '.join(args)} --out {out}"
    ]
    config = runner.EvalConfig(
        model=str(folder),
        tasks=["passkey"],
        contexts=[256],
        methods=["full", "window:window=16"],
        trials=1,
        max_new_tokens=3,
    )
    tokenizer = kvweave.load_model(folder)[1]
    reference = runner.run(config, progress=False, model_and_tokenizer=(model, tokenizer))
    for row, alone in zip(rows, reference, strict=True):
        assert (row["prediction"], row["full_kv_bytes"]) == (alone["prediction"], alone["full_kv_bytes"])
        assert alone["kv_bytes"] <= row["kv_bytes"] <= alone["kv_bytes"] * (1 + EXTRA_BYTES_PER_ROW)
    assert rows[0]["kv_bytes"] == reference[0]["kv_bytes"]  # full: exactly one process's bytes
