"""Command-line plumbing that needs no model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvweave import cli


def test_command_txt_keeps_every_command_that_wrote_to_a_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = ["kvweave", "eval", "--methods", "full", "--out", str(tmp_path)]
    second = ["kvweave", "eval", "--methods", "full,window", "--out", str(tmp_path)]
    for argv in (first, second, first):  # a rerun of the first command is not listed twice
        monkeypatch.setattr(sys, "argv", argv)
        cli._write_command(tmp_path)
    lines = (tmp_path / "command.txt").read_text().splitlines()
    assert lines == [" ".join(first), " ".join(second)]


def test_method_sweeps_expand_to_every_combination() -> None:
    from kvweave.cli import _methods

    assert _methods("full,window:ratio=0.25|0.125,quant:bits=4") == [
        "full",
        "window:ratio=0.25",
        "window:ratio=0.125",
        "quant:bits=4",
    ]
    assert _methods("dkcache:ratio=0.125,pages=8|16,decouple=true|false") == [
        "dkcache:ratio=0.125,pages=8,decouple=true",
        "dkcache:ratio=0.125,pages=8,decouple=false",
        "dkcache:ratio=0.125,pages=16,decouple=true",
        "dkcache:ratio=0.125,pages=16,decouple=false",
    ]


def test_context_lengths_accept_k_as_1024() -> None:
    import argparse

    from kvweave.cli import _ints

    assert _ints("2048,4k,8K,0.5k") == [2048, 4096, 8192, 512]
    with pytest.raises(argparse.ArgumentTypeError, match="4k,8k"):
        _ints("4k,lots")


# ------------------------------------------------------------------ issue 18, point 8: the CLI with one voice


class _WouldLoad(BaseException):  # noqa: N818  (the input was accepted: a model would load now)
    pass


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Stop every command where it would load a model (recording the name)."""
    import kvweave.models

    loads: list[str] = []

    def load(name, *args, **kwargs):
        loads.append(str(name))
        raise _WouldLoad(name)

    monkeypatch.setattr(kvweave.models, "load_model", load)
    return loads


def _error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return code, lines[0]


def test_demo_takes_4k_like_every_length(tmp_path: Path, no_model: list[str]) -> None:
    with pytest.raises(_WouldLoad):
        cli.main(["demo", "--context", "4k", "--methods", "full", "--out", str(tmp_path / "demo")])
    assert no_model  # it got as far as loading the model


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--methods", "window:ratio=0"], "out of range; allowed (0, 1]"),
        (["eval", "--methods", "window:"], "nothing after ':'"),
        (["eval", "--methods", "window:ratio=0.25,ratio=0.5"], "'ratio' is given twice"),
        (["demo", "--context", "0"], "between 1 and"),
    ],
)
def test_degenerate_or_duplicated_options_are_refused(
    argv: list[str], message: str, no_model: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, line = _error_line(capsys, argv)
    assert code == 2 and message in line and not no_model


def test_paths_of_the_wrong_kind_get_one_line(
    tmp_path: Path, no_model: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("x")
    code, line = _error_line(capsys, ["generate", "hi", "--load-cache", str(tmp_path / "file")])
    assert code == 2 and "is a file, not a saved-cache folder" in line
    code, line = _error_line(capsys, ["generate", "--prompt-file", str(tmp_path)])
    assert code == 2 and "is a folder; give a text file" in line
    assert not no_model


def test_a_corrupt_cache_is_reported_before_the_model_loads(
    tmp_path: Path, no_model: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    import kvweave
    from conftest import tiny_model
    from kvweave._compat import cache_kwarg

    model = tiny_model("llama")
    cache = kvweave.make_cache("window:window=8,sinks=2", model)
    ids = torch.randint(3, 150, (1, 20))
    with torch.no_grad():
        model(ids, **{cache_kwarg(model): cache})
    folder = kvweave.save_cache(cache, model, tmp_path / "kv", prompt_ids=ids)
    data = bytearray((folder / "kv.safetensors").read_bytes())
    data[-3] ^= 1
    (folder / "kv.safetensors").write_bytes(bytes(data))
    code, line = _error_line(capsys, ["generate", "hi", "--load-cache", str(folder)])
    assert code == 2 and "checksum mismatch" in line and not no_model


def test_the_too_long_prompt_error_names_generates_own_options() -> None:
    from types import SimpleNamespace

    from kvweave.cli_args import _check_generate_length

    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=100))
    with pytest.raises(ValueError) as error:
        _check_generate_length(model, 90, 20, beyond_trained=False)
    assert "--max-new-tokens" in str(error.value) and "--beyond-trained" in str(error.value)
    assert "--context" not in str(error.value)
    _check_generate_length(model, 90, 20, beyond_trained=True)
