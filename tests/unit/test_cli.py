"""Command-line plumbing that needs no model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvweave import cli


def test_command_txt_keeps_every_command_that_wrote_to_a_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = ["kvweave", "eval", "--methods", "full", "--out", str(tmp_path)]
    second = ["kvweave", "eval", "--methods", "full,window", "--out", str(tmp_path)]
    for argv in (first, second, first):  # a rerun of the first command is not listed twice
        monkeypatch.setattr(sys, "argv", argv)
        cli._write_command(tmp_path)
    lines = (tmp_path / "command.txt").read_text().splitlines()
    assert lines == [" ".join(first), " ".join(second)]
