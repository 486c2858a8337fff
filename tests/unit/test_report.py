"""``kvweave report``: run folders -> one self-contained HTML page + a markdown summary.

Synthetic rows (no model). The browser test renders the page in headless Chromium and checks the
screenshot shows the charts; it skips when Chromium is not installed.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvweave.cli import main
from kvweave.report import data, load_run, render_html, svg, write_report
from kvweave.report.specs import SPEC_VERSION

METHODS = {"full": 1.0, "window:ratio=0.25": 0.25, "window:ratio=0.5": 0.5}
MB = 2**20


def fake_rows(model: str = "tiny", methods: dict[str, float] = METHODS) -> list[dict]:
    """Rows shaped like the runner's: two tasks, two lengths, three depths, a few methods."""
    rng = random.Random(0)
    rows = []
    for task in ("passkey", "niah_multikey"):
        for context in (1024, 2048):
            for trial, depth in enumerate((0.1, 0.5, 0.9)):
                for method, kept in methods.items():
                    full = context * 12 * MB // 1024
                    held = int(full * kept)
                    score = 1.0 if kept == 1.0 or rng.random() < kept + 0.3 else 0.0
                    rows.append(
                        {
                            "model": model,
                            "method": method,
                            "options": {},
                            "task": task,
                            "context": context,
                            "trial": trial,
                            "depth": depth,
                            "seed": trial,
                            "score": score,
                            "kv_bytes": held,
                            "full_kv_bytes": full,
                            "compression": full / held,
                            "prefill_s": 0.5 * context / 1024,
                            "decode_tok_s": 20.0 / (kept + 0.5) * (1 - context / 8192),
                            "key": f"{method}|{task}|{context}|{trial}",
                            "spec_version": SPEC_VERSION,
                        }
                    )
    return rows


def write_run(folder: Path, rows: list[dict], config: dict | None = None, command: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"trunc')
    if config is not None:
        (folder / "config.json").write_text(json.dumps({"config": config, "environment": {"torch": "2.x"}}))
    if command is not None:
        (folder / "command.txt").write_text(command + "\n")
    return folder


CONFIG = {
    "model": "tiny",
    "tasks": ["passkey", "niah_multikey"],
    "contexts": [1024, 2048],
    "methods": ["full", "window:ratio=0.25", "window:ratio=0.5"],
    "trials": 3,
    "question_aware": False,
    "dtype": "float32",
    "haystack": None,
    "data_dir": None,
    "seed": 0,
    "beyond_trained": False,
    "max_new_tokens": 32,
}


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return write_run(tmp_path / "demo-tiny", fake_rows(), CONFIG)


# ----------------------------------------------------------------------------------------- data


def test_command_reconstructed_from_config(run_dir: Path) -> None:
    run = load_run(run_dir)
    assert run.command.startswith(
        "kvweave eval --model tiny --task passkey,niah_multikey --context 1024,2048"
    )
    assert "--methods full,window:ratio=0.25,window:ratio=0.5" in run.command
    assert "--max-new-tokens 32" in run.command and run.command.endswith(f"--out {run_dir}")
    assert len(run.rows) == 36  # the truncated last line is ignored


def test_command_txt_wins(tmp_path: Path) -> None:
    run = load_run(write_run(tmp_path / "r", fake_rows(), CONFIG, command="kvweave demo --trials 3"))
    assert run.command == "kvweave demo --trials 3"


def test_not_a_run_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="rows.jsonl"):
        load_run(tmp_path)


def test_names() -> None:
    assert (
        data.family("window:ratio=0.25") == "window"
        and data.options_label("window:ratio=0.25") == "ratio=0.25"
    )
    assert data.family("full") == "full" and data.options_label("full") == "default"
    assert data.family("kvpress:SnapKV:0.75") == "kvpress:SnapKV"
    assert data.options_label("kvpress:SnapKV:0.75") == "0.75"


def test_speed_ratio_against_full_and_kvpress_baseline() -> None:
    summary = [
        {"model": "m", "method": "full", "task": "t", "context": 1, "decode_tok_s": 10.0},
        {"model": "m", "method": "window", "task": "t", "context": 1, "decode_tok_s": 15.0},
        {"model": "m", "method": "kvpress:full", "task": "t", "context": 2, "decode_tok_s": 8.0},
        {"model": "m", "method": "kvpress:SnapKV:0.5", "task": "t", "context": 2, "decode_tok_s": 4.0},
        {"model": "m", "method": "window", "task": "t", "context": 3, "decode_tok_s": 4.0},
    ]
    ratios = [s["speed_vs_full"] for s in data.speed_ratios(summary)]
    assert ratios == [1.0, 1.5, 1.0, 0.5, None]


def test_heatmap_grid_and_frontier() -> None:
    rows = [r for r in fake_rows() if r["task"] == "passkey"]
    depths, contexts, grid = data.heatmap_grid([r for r in rows if r["method"] == "full"])
    assert depths == [0.1, 0.5, 0.9] and contexts == [1024, 2048]
    assert grid == [[1.0, 1.0]] * 3
    series = data.frontier(rows)
    assert set(series) == {"full", "window"}
    assert sorted(round(p.compression, 2) for p in series["window"]) == [2.0, 4.0]
    assert series["full"][0].accuracy == 1.0 and series["full"][0].n == 6


def test_axis_ticks() -> None:
    axis = svg.Axis.fit([1.0, 4.0], 0, 100, log=True)
    assert axis.ticks() == [1.0, 2.0, 4.0] and 0 < axis(1.0) < axis(2.0) < axis(4.0) < 100
    assert axis(2.0) == pytest.approx(50)
    linear = svg.Axis.fit([0.0, 0.93], 100, 0)
    assert linear.ticks()[0] == 0.0 and linear.ticks()[-1] >= 0.93
    single = svg.Axis.fit([2048.0], 0, 10, log=True)
    assert single.low < 2048 < single.high
    assert svg.format_number(2048) == "2k" and svg.format_number(0.25) == "0.25"


# ----------------------------------------------------------------------------------------- page


def test_html_is_self_contained(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    md = tmp_path / "summary.md"
    write_report([run_dir], out, markdown=md)
    html = out.read_text()
    assert html.count("<svg") == 2 * 3 + 2 + 2  # heatmaps (2 tasks x 3 methods), 2 frontiers, memory + speed
    for forbidden in ("<script", "http://cdn", "https://", "<link", "@import"):
        assert forbidden not in html
    assert "kvweave eval --model tiny" in html
    text = md.read_text()
    # one overview table per context length, tasks as columns
    assert "### 1K tokens" in text and "### 2K tokens" in text
    assert text.count("| method | niah_multikey | passkey | compression | KV MiB | decode vs full |") == 2
    assert "| `full` | 100% (" in text  # accuracy with its number of trials
    assert "```sh\nkvweave eval --model tiny" in text
    assert "`window:ratio=0.25`" in text


def test_several_runs_and_models(run_dir: Path, tmp_path: Path) -> None:
    other = write_run(
        tmp_path / "kvpress", fake_rows("tiny", {"kvpress:full": 1.0, "kvpress:SnapKV:0.75": 0.25})
    )
    third = write_run(tmp_path / "small", fake_rows("small", {"full": 1.0}))
    html = render_html([load_run(run_dir), load_run(other), load_run(third)])
    assert "tiny \u00b7 kvpress:SnapKV" in html and "small \u00b7 full" in html


def test_rows_copied_to_resume_beside_them_count_once_across_runs(run_dir: Path, tmp_path: Path) -> None:
    from kvweave.report.markdown import render as render_markdown

    rows = fake_rows()
    full = [r for r in rows if r["method"] == "full"]
    # a second run resumed beside a copy of the first's full rows, plus one new full trial of its own
    new_trial = dict(full[0], trial=7, seed=7, key="full|passkey|1024|7", decode_tok_s=99.0)
    extra = dict(full[0], method="window:ratio=0.125", key="w", kv_bytes=full[0]["kv_bytes"] // 8)
    copied = write_run(tmp_path / "resumed", [*full, new_trial, extra])
    runs = [load_run(run_dir), load_run(copied)]
    assert len(data.unique_rows(runs)) == len(rows) + 2
    pooled = data.pooled_summary(runs)
    counts: dict[tuple[str, str, int], int] = {}
    for entry in pooled:
        key = (entry["method"], entry["task"], entry["context"])
        counts[key] = counts.get(key, 0) + entry["n"]
    assert counts[("full", "passkey", 1024)] == 4  # three trials once, the new one
    assert counts[("full", "passkey", 2048)] == 3  # not six
    # the resumed run's entries keep its own speed ratio, against the full rows in its folder (copied or not)
    window = next(e for e in pooled if e["method"] == "window:ratio=0.125")
    assert window["run"] == "resumed" and window["speed_vs_full"] is not None
    markdown = render_markdown(runs)
    assert f"{len(rows) + 2} result rows and {len(full)} copies" in markdown
    tables = markdown.split("## Results by context length")[1].split("## Runs")[0]
    assert "| `full` | 100% (3) | 100% (4) |" in tables  # 1K: multi-key three trials, passkey four
    assert "| `full` | 100% (3) | 100% (3) |" in tables  # 2K: the copies not counted again
    assert "(6)" not in tables.split("window:ratio=0.25")[0]


def test_cli_report(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.html"
    assert main(["report", str(run_dir), "-o", str(out), "--md", str(tmp_path / "s.md")]) == 0
    assert out.is_file() and (tmp_path / "s.md").is_file()
    assert str(out) in capsys.readouterr().out
    assert main(["report", str(tmp_path / "missing"), "-o", str(out)]) == 2


def test_csv_has_one_line_per_cell_with_speed_ratios(run_dir: Path, tmp_path: Path) -> None:
    import csv

    out = tmp_path / "cells.csv"
    assert main(["report", str(run_dir), "-o", str(tmp_path / "r.html"), "--csv", str(out)]) == 0
    lines = list(csv.DictReader(out.open(newline="")))
    assert tuple(lines[0]) == data.CSV_COLUMNS
    assert len(lines) == 3 * 2 * 2  # methods x tasks x contexts
    rows = fake_rows()
    for line in lines:
        cell = [
            r
            for r in rows
            if (r["method"], r["task"], r["context"]) == (line["method"], line["task"], int(line["context"]))
        ]
        assert line["run"] == "demo-tiny" and int(line["n"]) == len(cell) == 3
        assert float(line["accuracy"]) == pytest.approx(sum(r["score"] for r in cell) / 3)
        full = next(
            r
            for r in lines
            if (r["method"], r["task"], r["context"]) == ("full", line["task"], line["context"])
        )
        assert float(line["speed_vs_full"]) == pytest.approx(
            float(line["decode_tok_s"]) / float(full["decode_tok_s"])
        )
    assert {float(line["speed_vs_full"]) for line in lines if line["method"] == "full"} == {1.0}


def write_ppl_run(folder: Path) -> Path:
    """A ``kvweave ppl --out`` folder: two methods, two windows, and a torn last line."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [
        {"model": "tiny", "method": method, "corpus": "wiki", "window": 1024, "target": 128, "index": i,
         "key": f"{method}|wiki|1024|128|{i}", "nll": nll, "kv_bytes": held, "full_kv_bytes": 100, "seconds": 1.0,
         "spec_version": SPEC_VERSION}
        for i in range(2)
        for method, nll, held in [("full", 2.0 + i, 200), ("keydiff:ratio=0.125", 2.5 + i, 25)]
    ]  # fmt: skip
    (folder / "ppl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"torn')
    (folder / "command.txt").write_text("kvweave ppl --model tiny --windows 2 --out runs/ppl\n")
    return folder


def test_perplexity_runs_are_reported(run_dir: Path, tmp_path: Path) -> None:
    ppl_dir = write_ppl_run(tmp_path / "ppl-tiny")
    md_path, csv_path = tmp_path / "s.md", tmp_path / "c.csv"
    write_report([run_dir, ppl_dir], tmp_path / "r.html", markdown=md_path, csv=csv_path)
    md = md_path.read_text()
    # exp(mean NLL): full exp(2.5) = 12.18, keydiff exp(3.0) = 20.09, +64.9 %
    assert "| tiny | wiki | 1024 (128) | `keydiff:ratio=0.125` | 2 | 4.00x | 20.09 | +64.9% |" in md
    assert "| tiny | wiki | 1024 (128) | `full` | 2 | 0.50x | 12.18 | +0.0% |" in md
    assert "kvweave ppl --model tiny --windows 2" in md
    html = (tmp_path / "r.html").read_text()
    assert 'id="perplexity"' in html and "perplexity vs compression" in html and "+64.9%" in html
    only = tmp_path / "only.html"
    write_report([ppl_dir], only)  # a perplexity run alone makes a report too
    assert 'id="perplexity"' in only.read_text()


# ----------------------------------------------------------------------------------------- browser


def read_png(path: Path) -> np.ndarray:
    """Pixels ``[H, W, C]`` (uint8) of an 8-bit, non-interlaced grey/RGB/RGBA PNG."""
    blob = path.read_bytes()
    assert blob[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    offset, chunks, header = 8, [], b""
    while offset < len(blob):
        (length,) = struct.unpack(">I", blob[offset : offset + 4])
        kind = blob[offset + 4 : offset + 8]
        body = blob[offset + 8 : offset + 8 + length]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            chunks.append(body)
        offset += 12 + length
    width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert depth == 8 and interlace == 0, "only 8-bit non-interlaced PNGs"
    channels = {0: 1, 2: 3, 4: 2, 6: 4}[color]
    stride = width * channels
    raw = np.frombuffer(zlib.decompress(b"".join(chunks)), dtype=np.uint8).reshape(height, stride + 1)
    image = np.zeros((height, stride), dtype=np.uint8)
    previous = np.zeros(stride, dtype=np.uint8)
    for y in range(height):
        kind, line = raw[y, 0], raw[y, 1:]
        if kind == 0:
            row = line.copy()
        elif kind == 1:  # Sub: cumulative sum along each channel (uint8 wraps like the filter)
            row = np.cumsum(line.reshape(width, channels), axis=0, dtype=np.uint8).reshape(stride)
        elif kind == 2:  # Up
            row = line + previous
        else:  # Average / Paeth depend on the decoded left neighbour: byte by byte
            row = _unfilter_sequential(int(kind), line.tolist(), previous.tolist(), channels)
        image[y] = row
        previous = image[y]
    return image.reshape(height, width, channels)


def _unfilter_sequential(kind: int, line: list[int], up: list[int], bpp: int) -> np.ndarray:
    out = [0] * len(line)
    for i, value in enumerate(line):
        left = out[i - bpp] if i >= bpp else 0
        if kind == 3:
            out[i] = (value + ((left + up[i]) >> 1)) & 0xFF
            continue
        upper_left = up[i - bpp] if i >= bpp else 0
        p = left + up[i] - upper_left
        pa, pb, pc = abs(p - left), abs(p - up[i]), abs(p - upper_left)
        predictor = left if pa <= pb and pa <= pc else (up[i] if pb <= pc else upper_left)
        out[i] = (value + predictor) & 0xFF
    return np.array(out, dtype=np.uint8)


def test_png_reader_round_trip(tmp_path: Path) -> None:
    """The reader against a PNG written here with every filter type."""
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, size=(5, 4, 3), dtype=np.uint8)
    rows = []
    for y, kind in enumerate((0, 1, 2, 3, 4)):
        line = image[y].reshape(-1).astype(int)
        up = image[y - 1].reshape(-1).astype(int) if y else np.zeros_like(line)
        left = np.concatenate([[0] * 3, line[:-3]])
        upper_left = np.concatenate([[0] * 3, up[:-3]])
        if kind == 0:
            pred = np.zeros_like(line)
        elif kind == 1:
            pred = left
        elif kind == 2:
            pred = up
        elif kind == 3:
            pred = (left + up) // 2
        else:
            p = left + up - upper_left
            pa, pb, pc = abs(p - left), abs(p - up), abs(p - upper_left)
            pred = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, up, upper_left))
        rows.append(bytes([kind]) + bytes(((line - pred) % 256).astype(np.uint8)))

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 4, 5, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(b"".join(rows))) + chunk(b"IEND", b"")
    (tmp_path / "t.png").write_bytes(png)
    assert np.array_equal(read_png(tmp_path / "t.png"), image)


def chromium() -> str | None:
    """The headless browser, if installed (Debian's ``chromium``)."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def screenshot(html: Path, png: Path, profile: Path) -> None:
    command = [
        chromium() or "chromium",
        "--headless",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        f"--screenshot={png}",
        "--window-size=1400,3000",
        html.resolve().as_uri(),
    ]
    if os.geteuid() == 0:
        command.insert(2, "--no-sandbox")
    subprocess.run(command, capture_output=True, timeout=120, check=False)


def colored_bands(image: np.ndarray, min_pixels: int = 40) -> list[tuple[int, int]]:
    """Vertical extents ``(top, bottom)`` of the runs of rows holding saturated (non-grey) pixels."""
    rgb = image[..., :3].astype(int)
    saturated = (rgb.max(axis=2) - rgb.min(axis=2)) > 60
    busy = saturated.sum(axis=1) >= 3
    bands, start = [], None
    for y, flag in enumerate(list(busy) + [False]):
        if flag and start is None:
            start = y
        elif not flag and start is not None:
            if saturated[start:y].sum() >= min_pixels:
                bands.append((start, y))
            start = None
    return bands


def has_color(image: np.ndarray, hex_color: str, tolerance: int = 12, count: int = 30) -> bool:
    target = np.array([int(hex_color[i : i + 2], 16) for i in (1, 3, 5)])
    close = np.abs(image[..., :3].astype(int) - target).max(axis=2) <= tolerance
    return int(close.sum()) >= count


@pytest.mark.browser
@pytest.mark.skipif(
    chromium() is None, reason="headless Chromium is not installed (apt-get install chromium)"
)
def test_report_renders_in_chromium(run_dir: Path, tmp_path: Path) -> None:
    html = tmp_path / "report.html"
    write_report([run_dir], html)
    png = tmp_path / "shot.png"
    screenshot(html, png, tmp_path / "profile")
    assert png.is_file(), "chromium wrote no screenshot"
    assert png.stat().st_size > 20_000, "the screenshot is suspiciously small (a blank page?)"
    image = read_png(png)
    assert image.shape[:2] == (3000, 1400)
    # the heatmaps' green (all found) and the frontier's first series colour are on screen
    assert has_color(image, "#1a9850", count=500), "no heatmap cells drawn"
    assert has_color(image, svg.PALETTE[0], count=100), "no series drawn"
    assert has_color(image, svg.PALETTE[1], count=50), "second series missing"
    # heatmaps (two task rows), frontiers, memory/speed: several separate colored regions down the page
    bands = colored_bands(image)
    assert len(bands) >= 3, f"expected several chart regions, found {bands}"
    assert bands[-1][0] - bands[0][0] > 600, f"charts do not span the page: {bands}"


# ----------------------------------------------------------------------------------------- demo


def test_demo_method_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    from kvweave import demo
    from kvweave.registry import METHODS, Method, option

    @dataclasses.dataclass
    class Factor(Method):
        """A method whose ratio option is a compression factor."""

        budget_options = {"target": "compression"}
        target: float = option(2.0, "compression factor to reach")

        def __post_init__(self) -> None:
            self.check_range("target", 1.0)

    Factor.name = "factor"
    monkeypatch.setitem(METHODS, "factor", Factor)
    assert demo.method_spec("factor", 4) == ("factor:target=4", "")
    assert demo.method_spec("factor", 8) == ("factor:target=8", "")
    assert demo.method_spec("window", 4) == ("window:ratio=0.25", "")
    assert demo.method_spec("window", 8) == ("window:ratio=0.125", "")
    assert demo.method_spec("quant", 8) == ("quant:bits=2", "")
    assert demo.method_spec("dkcache", 4) == ("dkcache:attended=0.25", "")  # attended, not bits=4
    assert demo.method_spec("full", None) == ("full", "")
    spec, note = demo.method_spec("no-such-method", 4)
    assert spec is None and "not registered, skipped" in note
    specs, notes = demo.default_methods()
    assert specs[:3] == ["full", "window:ratio=0.25", "window:ratio=0.125"]
    assert "factor:target=4" not in specs  # only the candidates the demo names
    assert not notes


def test_demo_verdict_names_what_kept_accuracy() -> None:
    from kvweave import demo

    def entry(method, task, accuracy, compression, speed):
        return {
            "method": method,
            "task": task,
            "accuracy": accuracy,
            "n": 3,
            "compression": compression,
            "kv_bytes": int(2**20 / compression),
            "decode_tok_s": speed,
        }

    summary = [
        entry("full", "passkey", 1.0, 0.5, 10.0),
        entry("snapkv:ratio=0.125", "passkey", 1.0, 7.9, 12.0),
        entry("window:ratio=0.125", "passkey", 1 / 3, 7.9, 13.0),
        entry("snapkv:ratio=0.25", "passkey", 1.0, 3.9, 11.0),
        entry("dkcache:attended=0.25", "passkey", 1.0, 1.9, 9.0),
    ]
    text = demo.verdict(summary, 1024, 3)
    assert "full scored 100%" in text
    assert "At about 8x of a 16-bit cache (measured 6x or more), snapkv:ratio=0.125 (7.9x, 100%" in text
    assert "window:ratio=0.125 (7.9x, 33%, decode 1.30x of full) did not" in text
    assert "At about 4x of a 16-bit cache (measured 3x or more), snapkv:ratio=0.25" in text
    assert "Below 3x held: dkcache:attended=0.25" in text and "INT8" in text
    assert "Fastest decode: window:ratio=0.125 at 1.30x of full" in text
    line = demo.table_line(
        "snapkv:ratio=0.125", demo.method_lines(summary)["snapkv:ratio=0.125"], ["passkey"]
    )
    assert "100%" in line and "7.90x" in line and "1.20x" in line


def test_demo_end_to_end_without_a_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys) -> None:
    from kvweave.eval import runner
    from kvweave.eval import tasks as task_lib

    def sample(task, tokenizer, context, depth, seed, **kw):
        return task_lib.Sample(task, "doc", "q?", ["42"], depth, seed, context)

    def trial_row(model, tokenizer, config, trial, sample, *extra):
        kept = 1.0 if trial.method == "full" else 0.25
        return {
            "model": config.model,
            "method": trial.method,
            "task": trial.task,
            "context": trial.context,
            "trial": trial.trial,
            "depth": trial.depth,
            "score": float(kept == 1.0),
            "kv_bytes": int(4000 * kept),
            "full_kv_bytes": 4000,
            "prefill_s": 0.1,
            "decode_tok_s": 10 / kept,
            "key": trial.key(),
        }

    monkeypatch.setattr(task_lib, "make_sample", sample)
    monkeypatch.setattr(runner, "run_trial", trial_row)
    monkeypatch.setattr("kvweave.models.load_model", lambda *a, **k: (object(), object()))
    monkeypatch.setattr("kvweave.cli._check_model", lambda name: None)  # "stub" is not a real model
    out = tmp_path / "demo"
    argv = ["demo", "--model", "stub", "--methods", "full,window:ratio=0.25", "--context", "128"]
    assert main([*argv, "--trials", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "window:ratio=0.25" in printed.out and "4.00x" in printed.out  # its line in the table
    assert "Verdict (2 trials per task at 128 tokens" in printed.out
    assert "8 trials (8 to run" in printed.err
    for name in ("rows.jsonl", "config.json", "command.txt", "report.html", "summary.md", "summary.csv"):
        assert (out / name).is_file(), name
    command = (out / "command.txt").read_text()
    assert command.startswith(
        "kvweave demo --model stub --context 128 --trials 2 --methods full,window:ratio=0.25"
    )
    assert "```sh\nkvweave demo --model stub" in (out / "summary.md").read_text()
    assert main([*argv, "--trials", "2", "--out", str(out)]) == 0  # resumes: nothing left to run
    assert "(0 to run" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------- kvpress script


def kvpress_script():
    """The benchmark script as a module (it imports only the standard library at load time)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "kvpress_side_by_side.py"
    spec = importlib.util.spec_from_file_location("kvpress_side_by_side", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kvpress_script_dry_run(capsys: pytest.CaptureFixture[str]) -> None:
    script = kvpress_script()
    assert script.main(["--dry-run", "--presses", "SnapKV,Knorm", "--ratios", "0.5,0.75"]) == 0
    out = capsys.readouterr().out
    assert "kvpress:full, kvpress:SnapKV:0.5, kvpress:SnapKV:0.75, kvpress:Knorm:0.5" in out
    assert "predictions: 30" in out and "--child" in out


def test_kvpress_append_starts_a_new_line_after_a_crash(tmp_path: Path) -> None:
    script = kvpress_script()
    path = tmp_path / "predictions.jsonl"
    path.write_text('{"key": "a"}\n{"key": "b", "tru')
    script._append_jsonl(path, {"key": "c"})
    assert [r["key"] for r in script._read_jsonl(path)] == ["a", "c"]


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")  # kvpress's transformers
def test_kvpress_protocol_matches_generate_on_an_uncompressed_cache(llama) -> None:
    """With no press, the script's prefill + question + greedy loop gives ``generate``'s tokens."""
    import torch

    script = kvpress_script()
    prompt = {"prefill_ids": list(range(5, 45)), "full_ids": list(range(5, 53)), "max_new_tokens": 6}
    llama.generation_config.eos_token_id = None
    result = script.predict_one(llama, None, prompt)
    full = torch.tensor([prompt["full_ids"]])
    with torch.no_grad():
        expected = llama.generate(
            full, attention_mask=torch.ones_like(full), max_new_tokens=6, do_sample=False
        )
    assert result["new_ids"] == expected[0, full.shape[1] :].tolist()
    assert result["context_tokens"] == 40 and result["prompt_tokens"] == 48
    # 16-bit reference for 48 + 5 tokens fed, 3 layers, 2 kv heads x 16 dims for K and V; held in fp32
    assert result["full_kv_bytes"] == 3 * (2 * 2 * 16) * 53 * 2
    assert result["kv_bytes"] == 2 * result["full_kv_bytes"]


def test_metric_note_names_scores_that_are_not_accuracy() -> None:
    from kvweave.report import data

    note = data.metric_note(["passkey", "code", "qa_loogle", "qa_quality"])
    assert note is not None and "code: mean edit similarity" in note and "qa_loogle: mean token F1" in note
    assert "passkey" not in note
    assert data.metric_note(["passkey", "niah_single"]) is None


# ----------------------------------------------------------------------------------------- markdown guide


def cell_rows(
    method: str,
    scores: dict[str, list[float]],
    kept: float,
    speed: float,
    context: int = 4096,
    model: str = "tiny",
) -> list[dict]:
    """Rows of one method: ``scores[task]`` one score per trial, ``kept`` of the 16-bit bytes held."""
    full = 1000 * context
    return [
        {
            "model": model,
            "method": method,
            "task": task,
            "context": context,
            "trial": trial,
            "depth": 0.5,
            "score": score,
            "kv_bytes": int(full * kept),
            "full_kv_bytes": full,
            "prefill_s": 1.0,
            "decode_tok_s": speed,
            "key": f"{method}|{task}|{context}|{trial}",
        }
        for task, task_scores in scores.items()
        for trial, score in enumerate(task_scores)
    ]


def guide_of(rows: list[dict]) -> str:
    from kvweave.report import markdown
    from kvweave.report.data import Run

    text = markdown.render([Run(Path("synthetic"), rows)])
    return text.split("## Which method for which need", 1)[1].split("\n## ", 1)[0]


def headings(text: str) -> list[str]:
    """Each heading's GitHub anchor, computed here independently (outside code fences)."""
    anchors, seen, fenced = [], {}, False
    for line in text.splitlines():
        fenced = fenced != line.startswith("```")
        if not fenced and line.startswith("#"):
            slug = "".join(c for c in line.lstrip("#").strip().lower() if c.isalnum() or c in "-_ ")
            slug = slug.replace(" ", "-")
            anchors.append(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_markdown_opens_with_a_contents_list(run_dir: Path, tmp_path: Path) -> None:
    import re

    ppl_dir = write_ppl_run(tmp_path / "ppl-tiny")
    md = tmp_path / "s.md"
    write_report([run_dir, ppl_dir], tmp_path / "r.html", markdown=md)
    text = md.read_text()
    assert text.startswith("# kvweave results\n")
    contents = text.split("**Contents**", 1)[1].split("\n## ", 1)[0]
    assert text.index("**Contents**") < text.index("## Which method for which need")
    assert "- [Which method for which need](#which-method-for-which-need)\n" in contents
    assert (
        "- [Results by context length](#results-by-context-length): [1K tokens](#1k-tokens) \u00b7 "
        in contents
    )
    assert "- [Perplexity](#perplexity)\n" in contents
    assert "- [Runs](#runs): [demo-tiny](#demo-tiny) \u00b7 [ppl-tiny](#ppl-tiny)" in contents
    # every link points at a heading, and every section heading is listed
    links = re.findall(r"\]\(#([^)]+)\)", contents)
    anchors = headings(text)
    assert set(links) <= set(anchors)
    assert set(anchors) - set(links) == {"kvweave-results"}
    # the tables by length are there as before
    assert "### 1K tokens" in text and "### 2K tokens" in text


def test_markdown_anchor_follows_github() -> None:
    from kvweave.report import markdown

    seen: dict[str, int] = {}
    assert markdown.anchor("16K tokens", seen) == "16k-tokens"
    assert markdown.anchor("Perplexity at 8x (`ppl-4k`)", seen) == "perplexity-at-8x-ppl-4k"
    assert markdown.anchor("h2o-keyformer_pi 4k", seen) == "h2o-keyformer_pi-4k"
    assert markdown.anchor("16K tokens", seen) == "16k-tokens-1"
    assert markdown.anchor("16K tokens", seen) == "16k-tokens-2"


def test_guide_picks_the_most_compression_within_five_points() -> None:
    rows = cell_rows("full", {"passkey": [1, 1, 1, 1], "niah_single": [1, 1, 1, 1]}, 2.0, 10.0)
    # 4x, mean 95 vs 100: exactly 5 points below, qualifies
    rows += cell_rows(
        "window:ratio=0.25", {"passkey": [1, 1, 1, 1], "niah_single": [1, 1, 1, 0.6]}, 0.25, 12.0
    )
    # 8x, mean 87.5: out; 2x, no loss: qualifies with less compression
    rows += cell_rows(
        "keydiff:ratio=0.125", {"passkey": [1, 1, 1, 1], "niah_single": [1, 1, 0, 1]}, 0.125, 15.0
    )
    rows += cell_rows("quant", {"passkey": [1, 1, 1, 1], "niah_single": [1, 1, 1, 1]}, 0.5, 9.0)
    # shares only passkey with full, scores 100 there, but holds more bytes than full: never "compression"
    rows += cell_rows("dkcache", {"passkey": [1, 1]}, 3.0, 11.0)
    guide = guide_of(rows)
    assert "is at most 5 points below `full`'s mean over the same tasks" in guide  # the rule is stated
    assert (
        "- **Most compression at no loss:** `window:ratio=0.25` at 4.00x, mean score 95.0% over the 2 tasks it "
        "shares with `full` (8 trials) vs `full`'s 100.0% (8 trials); its largest single-task drop: "
        "niah_single 100% (4) \u2192 90% (4)." in guide
    )
    assert (
        "- **Fastest decode:** `keydiff:ratio=0.125`, decoding at 1.50x the speed of `full` (median of 2 cells, "
        "one per run and task; 8 trials), mean score 87.5% over the 2 tasks it shares with `full` (8 trials) "
        "vs `full`'s 100.0% (8 trials)." in guide
    )
    # tiny is not in the registry: nothing says how far it was trained, so the line says it is skipped
    assert "- **Beyond the trained context:** skipped: nothing in the rows or kvweave's registry" in guide
    assert "No rows lie beyond their model's trained context." in guide


def test_guide_says_when_no_method_qualifies() -> None:
    rows = cell_rows("full", {"passkey": [1, 1, 1], "niah_single": [1, 1, 1]}, 2.0, 10.0)
    rows += cell_rows("window:ratio=0.25", {"passkey": [1, 0, 0], "niah_single": [0, 0, 0]}, 0.25, 12.0)
    rows += cell_rows("snapkv:ratio=0.25", {"passkey": [1, 1, 1], "niah_single": [1, 0, 0]}, 0.25, 11.0)
    guide = guide_of(rows)
    assert (
        "- **Most compression at no loss:** no method qualifies: none that holds fewer bytes than `full` "
        "(0.50x) keeps its mean score within 5 points of `full`'s; the closest is `snapkv:ratio=0.25` at 4.00x, "
        "mean score 66.7% over the 2 tasks it shares with `full` (6 trials) vs `full`'s 100.0% (6 trials)."
        in guide
    )
    only_full = guide_of(
        cell_rows("full", {"passkey": [1]}, 2.0, 10.0) + cell_rows("dkcache", {"passkey": [1]}, 2.5, 9.0)
    )
    assert "no method qualifies: no method here holds fewer bytes than `full` (0.50x)." in only_full
    no_full = guide_of(cell_rows("window:ratio=0.25", {"passkey": [1]}, 0.25, 12.0))
    assert "- **Most compression at no loss:** no `full` rows at this length to compare against." in no_full
    assert "- **Fastest decode:** no decode speed measured against `full` at this length." in no_full


def test_guide_beyond_the_trained_context_per_model_and_length() -> None:
    # smollm2-135m is trained to 8K (registry): 16K rows lie beyond it, 4K rows do not
    rows = cell_rows("full", {"passkey": [0, 0, 0, 0]}, 2.0, 5.0, context=16384, model="smollm2-135m")
    rows += cell_rows("dkcache", {"passkey": [1, 1, 0, 0]}, 2.2, 4.0, context=16384, model="smollm2-135m")
    rows += cell_rows(
        "window:ratio=0.25", {"passkey": [1, 0, 0, 0]}, 0.25, 6.0, context=16384, model="smollm2-135m"
    )
    rows += cell_rows("full", {"passkey": [1, 1]}, 2.0, 5.0, context=4096, model="smollm2-135m")
    guide = guide_of(rows)
    assert "**[4K tokens](#4k-tokens)** (smollm2-135m)" in guide
    assert "**[16K tokens](#16k-tokens)** (smollm2-135m)" in guide
    assert (
        "- **Beyond the trained context:** no such rows at this length (smollm2-135m is trained to 8K)."
        in guide
    )
    assert (
        "- **Beyond the trained context:** smollm2-135m is trained to 8K, these rows run 2x past it: `dkcache` "
        "(best of 2 methods tried), mean score 50.0% on passkey (4 trials) vs `full`'s 0.0% (4 trials); "
        "compression 0.45x, decode 0.80x `full`." in guide
    )
    assert "No rows lie beyond" not in guide


# ----------------------------------------------------------------------------------------- bench

BENCH_ENV = {
    "python": "3.11.7",
    "torch": "2.13.0+cpu",
    "transformers": "5.24.0",
    "kvweave": "0.1.0",
    "git": "abc1234",
    "machine": "x86_64",
    "processor": "",
    "cpus": 16,
    "threads": 16,
    "cuda": True,
    "gpu": "NVIDIA H200",
    "device": "cuda",
    "dtype": "bfloat16",
}
LONG_SPEC = "dkcache:attended=0.125,bits=8,page=32,sinks=8,core=256"


def bench_row(method: str, context: int, batch: int = 1, **values: float) -> dict:
    """A ``kvweave bench`` row (the fields of ``kvweave.eval.bench._rows``)."""
    ms, speedup, bound, compression = (values[k] for k in ("ms", "speedup", "bound", "compression"))
    full_16 = context * 24 * 1024
    return {
        "kind": "bench", "model": "random:llama-3.1-8b", "method": method, "context": context, "batch": batch,
        "device": "cuda", "dtype": "bfloat16", "steps": 8, "rounds": 3, "ms_per_token": ms,
        "tok_s": round(1000 * batch / ms, 3), "round_ms": [ms] * 3, "speedup": speedup, "bound": bound,
        "of_bound": round(speedup / bound, 4), "prefill_s": 0.25, "overhead_s": 0.0 if method == "full" else 0.125,
        "kv_bytes": int(full_16 / compression), "kv_read_bytes": int(full_16 / compression / 2),
        "full_kv_bytes_16bit": full_16, "compression": compression, "weight_bytes": 16 * 2**30,
        "bandwidth_gb_s": 3900.5, "step_bound_ms": 4.5, "peak_bytes": 20 * 2**30,
        "peak_kind": "cuda allocator peak", "environment": BENCH_ENV, "spec_version": SPEC_VERSION,
    }  # fmt: skip


def fake_bench_rows() -> list[dict]:
    """Two methods (one with a long spec), two context lengths, one batch size."""
    return [
        bench_row("full", 4096, ms=10.0, speedup=1.0, bound=1.0, compression=1.0),
        bench_row(LONG_SPEC, 4096, ms=8.0, speedup=1.25, bound=1.6, compression=7.5),
        bench_row("full", 16384, ms=20.0, speedup=1.0, bound=1.0, compression=1.0),
        bench_row(LONG_SPEC, 16384, ms=12.5, speedup=1.6, bound=2.9, compression=7.9),
    ]


def write_bench(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"torn')
    return path


def test_bench_file_is_reported(tmp_path: Path) -> None:
    bench = write_bench(tmp_path / "gpu" / "bench.jsonl", fake_bench_rows())
    html_path, md_path = tmp_path / "r.html", tmp_path / "s.md"
    runs = write_report([bench], html_path, markdown=md_path)
    assert len(runs[0].bench) == 4 and not runs[0].rows and runs[0].name == "bench.jsonl"
    html = html_path.read_text()
    assert 'id="bench"' in html and "Decode speed (kvweave bench)" in html
    assert html.count("<svg") == 2  # one batch size: tok/s vs context + speedup vs compression
    assert "batch 1: decode tok/s vs context" in html and "batch 1: speedup vs compression" in html
    assert "<polyline" in html  # two lengths: the tok/s lines are drawn
    # each point's speedup (dot) and its bound (diamond; one more in the legend), with a tooltip
    assert html.count("<polygon") == 4 + 1 and "bandwidth bound" in html
    assert (
        f"{LONG_SPEC}, 16384 tokens, batch 1: compression 7.90x, speedup 1.60x, bound 2.90x (55% of it)"
        in html
    )
    assert 'id="overview"' not in html and 'id="frontier"' not in html  # no eval rows, no eval sections
    for forbidden in ("<script", "https://", "<link", "@import"):
        assert forbidden not in html
    # the long spec is shortened in the legend (both ends kept), whole in its tooltip
    assert f"<title>{LONG_SPEC}</title>" in html and ">dkcache:a\u20268,core=256</text>" in html
    # the table: speedup beside its bound, achieved/bound, bytes held and read, the machine
    assert "<td>1.25x</td><td>1.60x</td><td>78%</td>" in html
    assert "<td>1.60x</td><td>2.90x</td><td>55%</td>" in html
    assert "<td>12.5</td><td>80.0</td>" in html  # ms/token, tok/s
    assert "gpu NVIDIA H200" in html and "threads 16" in html and "torch 2.13.0+cpu" in html
    assert "git abc1234" in html and "measured copy bandwidth 3900.5 GB/s" in html
    assert "Peak MiB: cuda allocator peak." in html
    md = md_path.read_text()
    assert "## Decode speed" in md and "### random:llama-3.1-8b, cuda bfloat16" in md
    assert "| method | context | batch | ms/token | tok/s | speedup | bound | achieved/bound |" in md
    assert (
        f"| `{LONG_SPEC}` | 16384 | 1 | 12.5 | 80.0 | 1.60x | 2.90x | 55% | 48.61 | 24.30 | 0.25 | +0.12 |"
        in md
    )
    assert (
        "| `full` | 4096 | 1 | 10.0 | 100 | 1.00x | 1.00x | 100% | 96.00 | 48.00 | 0.25 | +0.00 | 20480 |"
        in md
    )
    assert "the command is not recorded" in md
    assert "- [Decode speed](#decode-speed): [random:llama-3.1-8b, cuda bfloat16](#" in md


def test_bench_single_context_draws_points_not_lines(tmp_path: Path) -> None:
    rows = [r for r in fake_bench_rows() if r["context"] == 4096]
    bench = write_bench(tmp_path / "one.jsonl", rows)
    (tmp_path / "command.txt").write_text(
        "kvweave eval --model tiny --out x\nkvweave bench --shape llama-3.1-8b --context 4k --out one.jsonl\n"
    )
    html_path, md_path = tmp_path / "r.html", tmp_path / "s.md"
    write_report([bench], html_path, markdown=md_path)
    html = html_path.read_text()
    assert html.count("<svg") == 2 and "<polyline" not in html
    assert "one length measured (4096)" in html
    assert "<td>1.25x</td><td>1.60x</td><td>78%</td>" in html
    md = md_path.read_text()
    # the bench command from the command.txt beside the file, without the eval line
    assert "```sh\nkvweave bench --shape llama-3.1-8b --context 4k --out one.jsonl\n```" in md
    assert "kvweave eval --model tiny" not in md


def test_bench_folder_beside_eval_rows(run_dir: Path, tmp_path: Path) -> None:
    rows = fake_bench_rows()
    rows.append(bench_row("full", 4096, batch=4, ms=12.0, speedup=1.0, bound=1.0, compression=1.0))
    rows.append(bench_row("full", 4096, ms=11.0, speedup=1.0, bound=1.0, compression=1.0))  # a rerun
    write_bench(run_dir / "bench.jsonl", rows)
    run = load_run(run_dir)
    assert len(run.rows) == 36 and len(run.bench) == 6
    csv_path = tmp_path / "cells.csv"
    write_report([run_dir], tmp_path / "r.html", markdown=tmp_path / "s.md", csv=csv_path)
    html = (tmp_path / "r.html").read_text()
    assert html.count("<svg") == 2 * 3 + 2 + 2 + 2 * 2  # the eval charts, then two per batch size
    assert "batch 4: speedup vs compression" in html
    section = html.split('id="bench"', 1)[1].split('id="runs"', 1)[0]
    assert "<td>11.0</td>" in section and "<td>10.0</td>" not in section  # a point's latest measurement
    assert "1 point was measured more than once" in html
    import csv

    assert tuple(next(csv.DictReader(csv_path.open(newline="")))) == data.CSV_COLUMNS  # cells CSV as before
    bench_lines = list(csv.DictReader((tmp_path / "cells-bench.csv").open(newline="")))
    assert tuple(bench_lines[0]) == data.BENCH_CSV_COLUMNS and len(bench_lines) == 6
    assert bench_lines[0]["gpu"] == "NVIDIA H200" and bench_lines[0]["run"] == "demo-tiny"


def test_bench_bad_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.html"
    other = tmp_path / "notes.jsonl"
    other.write_text('{"kind": "something else"}\n')
    assert main(["report", str(other), "-o", str(out)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and str(other) in error and 'no rows with kind "bench"' in error
    rows_file = write_run(tmp_path / "eval", fake_rows()) / "rows.jsonl"
    with pytest.raises(FileNotFoundError, match="give their folder"):
        load_run(rows_file)
    with pytest.raises(FileNotFoundError, match="bench.jsonl"):
        load_run(tmp_path / "missing")
    assert main(["report", str(tmp_path / "missing"), "-o", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err and not out.exists()


def test_cli_report_bench_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = write_bench(tmp_path / "bench.jsonl", fake_bench_rows())
    out, cells = tmp_path / "r.html", tmp_path / "cells.csv"
    assert main(["report", str(bench), "-o", str(out), "--csv", str(cells)]) == 0
    printed = capsys.readouterr().out
    assert "4 bench rows" in printed and str(tmp_path / "cells-bench.csv") in printed
    assert (tmp_path / "cells-bench.csv").is_file()


def _serving_row(method: str, concurrency: int, tpot: float, kernel: str | None = None) -> dict[str, Any]:
    return {
        "kind": "vllm_load",
        "method": method,
        "kernel": kernel,
        "concurrency": concurrency,
        "model": "/models/qwen2.5-coder-0.5b",
        "context": 2048,
        "dtype": "float32",
        "kv_space_gib": 1,
        "kv_tokens": 43648 if method == "none" else 310656,
        "requests": 8,
        "completed": 8 if concurrency < 32 else 7,
        "failed": 0 if concurrency < 32 else 1,
        "output_tokens_per_s": 2.0 * concurrency / (1 + tpot),
        "requests_per_s": 0.1 * concurrency,
        "tpot_median_s": tpot,
        "tpot_p99_s": 2 * tpot,
        "ttft_median_s": 3.0 * concurrency,
        "ttft_p99_s": 9.0 * concurrency,
        "preemptions": 2.0 if concurrency == 32 and method == "none" else 0.0,
        "accuracy": 1.0,
    }


def test_serving_rows_are_reported(tmp_path: Path) -> None:
    """`benchmarks/vllm_load.py` rows: throughput, TPOT and TTFT against concurrency per method (a kernel
    named in the rows is its own series), the table with failures and preemptions, the command beside them."""
    folder = tmp_path / "vllm-load"
    folder.mkdir()
    rows = [
        _serving_row(method, c, tpot, kernel)
        for method, kernel, tpot in (
            ("none", None, 0.25),
            ("quant:bits=4", "auto", 0.34),
            ("quant:bits=4", "torch", 0.5),
        )
        for c in (1, 4, 32)
    ]
    rows.append({"kind": "vllm_load", "method": "none", "concurrency": 16})  # incomplete: not reported
    refusal = "NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX."
    rows.append({**_serving_row("fp8", 1, 0.0), "refused": refusal})  # in the table, not drawn
    for field in ("requests", "completed", "failed", "output_tokens_per_s", "tpot_median_s", "ttft_median_s"):
        del rows[-1][field]
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "command.txt").write_text("benchmarks/vllm_load.py --methods none,quant:bits=4 --out x\n")
    html_path, md_path = tmp_path / "r.html", tmp_path / "s.md"
    runs = write_report([folder], html_path, markdown=md_path)
    assert len(runs[0].serving) == 10 and not runs[0].rows
    html = html_path.read_text()
    assert 'id="serving"' in html and 'id="overview"' not in html
    assert html.count("<svg") == 3 and html.count("<polyline") >= 9  # 3 charts x 3 series, each a line
    assert "output tokens / s vs concurrency" in html and "quant:bits=4 (kernel torch)" in html
    charts = "".join(re.findall(r"<svg.*?</svg>", html, flags=re.S))
    assert "fp8" not in charts and f"refused at start-up: {refusal}" in html  # no series for a refused point
    md = md_path.read_text()
    assert f"| `fp8` | - | 1 | refused at start-up: {refusal} | - |" in md
    assert (
        "10 serving rows" in md
        and "```sh\nbenchmarks/vllm_load.py --methods none,quant:bits=4 --out x\n```" in md
    )
    assert "| `none` | - | 32 | 7 / 8 (1 failed) |" in md
    assert "| `quant:bits=4` | torch | 1 | 8 / 8 | 1.333 |" in md
    # vLLM's own cache first, then the methods, each by concurrency
    order = [line.split("|")[1].strip() for line in md.splitlines() if line.startswith("| `")]
    assert order[:3] == ["`none`"] * 3 and order[3] == "`fp8`" and order[4:] == ["`quant:bits=4`"] * 6
