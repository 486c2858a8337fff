"""The README's and findings' headline figures are what their committed rows give, and say so when the rows
predate the method's current defaults."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvweave.report import headlines
from kvweave.report.headlines import SPAN, Headline, render

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", ROOT / "docs" / "findings.md", ROOT / "docs" / "vllm.md"]


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.name)
def test_headline_figures_are_rendered_from_their_rows(path):
    text = path.read_text()
    assert SPAN.search(text), f"{path.name} has no headline spans"
    assert render(text) == text, (
        f"stale figures in {path.name}: run python -m kvweave.report.headlines {path.name}"
    )


def test_every_headline_has_rows_and_a_span():
    used = {m.group("name") for path in DOCUMENTS for m in SPAN.finditer(path.read_text())}
    assert used == set(headlines.HEADLINES), "a headline without a span, or a span without a headline"
    for headline in headlines.HEADLINES.values():
        assert headline.select(ROOT)


def _rows(tmp_path, rows):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_figure_from_older_defaults_names_the_configuration_it_measured(tmp_path):
    _rows(
        tmp_path,
        [
            {"method": "depthweave", "spec_version": 9, "speedup": 1.2},
            {"method": "depthweave", "spec_version": 9, "speedup": 1.0},
            {"method": "depthweave", "spec_version": 9, "speedup": 1.1},
        ],
    )
    current = Headline("rows.jsonl", "depthweave", "speedup", "{:.2f}x")
    assert current.value(tmp_path) == "1.10x"  # the median, current defaults: no note
    _rows(tmp_path, [{"method": "depthweave", "spec_version": 8, "speedup": 1.13}])
    assert (
        current.value(tmp_path)
        == "1.13x (rows of `depthweave:quote=0,quote_after=48`, an older configuration)"
    )
    _rows(tmp_path, [{"method": "depthweave", "spec_version": 7, "speedup": 1.13}])
    old = "1.13x (rows of `depthweave:recall=0,quote=0,quote_after=48`, an older configuration)"
    assert current.value(tmp_path) == old
    # a figure whose text names the older configuration it shows carries no note; another one still does
    named = dataclasses.replace(current, named="depthweave:recall=0,quote=0,quote_after=48")
    assert named.value(tmp_path) == "1.13x"
    assert dataclasses.replace(current, named="depthweave:quote=0").value(tmp_path) == old


def test_a_span_is_rewritten_and_unknown_or_empty_ones_refused(tmp_path):
    _rows(tmp_path, [{"method": "quant", "spec_version": 4, "compression": 2.5, "task": "a"}])
    table = {"q": Headline("rows.jsonl", "quant", "compression", "{:.1f}x", (("task", "a"),))}
    assert (
        render("x <!-- fig:q -->9.9x<!-- /fig --> y", tmp_path, table)
        == "x <!-- fig:q -->2.5x<!-- /fig --> y"
    )
    with pytest.raises(KeyError, match="fig:nope"):
        render("<!-- fig:nope -->1<!-- /fig -->", tmp_path, table)
    empty = {"q": Headline("rows.jsonl", "quant", "compression", "{:.1f}x", (("task", "b"),))}
    with pytest.raises(ValueError, match="no rows"):
        render("<!-- fig:q -->1<!-- /fig -->", tmp_path, empty)


def test_a_figure_over_several_runs_reads_every_file_and_refuses_a_missing_one(tmp_path):
    # the runs of one point, each in its own rows file: the range covers all of them
    for name, speedup in (("a.jsonl", 1.27), ("b.jsonl", 1.07)):
        (tmp_path / name).write_text(
            json.dumps({"method": "depthweave", "spec_version": 9, "speedup": speedup})
        )
    runs = Headline(("a.jsonl", "b.jsonl"), "depthweave", "speedup", "{:.2f}x", summary="range")
    assert runs.value(tmp_path) == "1.07–1.27x"
    with pytest.raises(FileNotFoundError, match="c.jsonl"):
        Headline(("a.jsonl", "c.jsonl"), "depthweave", "speedup", "{:.2f}x").value(tmp_path)


def test_a_figure_over_two_strings_of_one_configuration_counts_only_the_rows_that_are_it_today(tmp_path):
    # spec version 8 wrote today's default at ~16x with quote spelled out; version 9 writes it bare. Version 8's
    # bare string meant quote off: another configuration, left out, as is another string of version 9
    _rows(
        tmp_path,
        [
            {"method": "depthweave:compression=16.0,quote=3,quote_after=16", "spec_version": 8, "score": 0.2},
            {"method": "depthweave:compression=16.0", "spec_version": 9, "score": 0.4},
            {"method": "depthweave:compression=16.0", "spec_version": 8, "score": 0.7},
            {"method": "depthweave:compression=16.0,quote=0", "spec_version": 9, "score": 0.9},
        ],
    )
    both = ("depthweave:compression=16.0", "depthweave:compression=16.0,quote=3,quote_after=16")
    cell = Headline("rows.jsonl", both, "score", "{:.0f} %", summary="mean", scale=100)
    assert [r["score"] for r in cell.select(tmp_path)] == [0.2, 0.4]
    assert cell.value(tmp_path) == "30 %"  # no note: every row counted is today's configuration
    # one string alone keeps its older rows and names them, as before
    bare = dataclasses.replace(cell, method="depthweave:compression=16.0")
    assert bare.value(tmp_path) == (
        "55 % (rows of `depthweave:compression=16.0,quote=0,quote_after=48`, an older configuration)"
    )
    # none of the rows is today's configuration: no figure
    _rows(tmp_path, [{"method": "depthweave:compression=16.0", "spec_version": 8, "score": 0.7}])
    with pytest.raises(ValueError, match="no rows"):
        cell.value(tmp_path)
