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
