"""The HTML report's layout: the "which method for which need" panel names the right methods, no two texts of
a chart overlap (even where several methods land on the same point), a single context length gets bar
charts, and no legend entry is cut without its whole name at hand.

Text extents are estimated here independently of the report's own layout code: about 0.6 x the font size
per character, from 0.8 x the size above the baseline to 0.2 x below it.
"""

from __future__ import annotations

import html as html_lib
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from kvweave.report import layout, load_run, render_html
from kvweave.report.data import Run
from kvweave.report.specs import SPEC_VERSION

MB = 2**20
LONG = "dkcache:attended=0.125,decouple=True,pages=32,retrieve=never,bits=16,storage=model,sinks=8"


def rows_of(
    method: str,
    kept: float,
    scores: dict[str, list[float]],
    contexts: tuple[int, ...] = (4096,),
    speed: float = 10.0,
    prefill: float = 1.0,
    model: str = "tiny",
    depths: tuple[float, ...] = (0.1, 0.5, 0.9),
) -> list[dict]:
    """Result rows of one method: ``scores[task]`` one score per trial (cycling over ``depths``) at every
    context length, holding ``kept`` of a 16-bit cache's bytes, decoding at ``speed`` tok/s."""
    rows = []
    for context in contexts:
        full = context * 12 * MB // 1024
        for task, task_scores in scores.items():
            for trial, score in enumerate(task_scores):
                rows.append(
                    {
                        "model": model,
                        "method": method,
                        "task": task,
                        "context": context,
                        "trial": trial,
                        "depth": depths[trial % len(depths)],
                        "score": score,
                        "kv_bytes": int(full * kept),
                        "full_kv_bytes": full,
                        "prefill_s": prefill,
                        "decode_tok_s": speed,
                        "key": f"{method}|{task}|{context}|{trial}",
                    }
                )
    return rows


def page_of(rows: list[dict], name: str = "synthetic") -> str:
    return render_html([Run(Path(name), rows)])


# ----------------------------------------------------------------------------------------- reading the page


def svgs(page: str) -> list[str]:
    """Every ``<svg>`` element of the page."""
    return re.findall(r"<svg\b.*?</svg>", page, flags=re.S)


def section(page: str, name: str) -> str:
    found = re.search(rf'<section id="{name}">.*?</section>', page, flags=re.S)
    assert found, f"no {name} section"
    return found.group(0)


TEXT = re.compile(r"<text\b([^>]*)>(.*?)</text>", flags=re.S)


def attribute(attrs: str, name: str) -> str | None:
    found = re.search(rf'\b{name}="([^"]*)"', attrs)
    return found.group(1) if found else None


def text_boxes(svg: str) -> list[tuple[str, tuple[float, float, float, float]]]:
    """``(text, (x0, y0, x1, y1))`` of every ``<text>`` of one chart, estimated from its position, font size,
    length and anchor (rotated axis labels included)."""
    boxes = []
    for attrs, raw in TEXT.findall(svg):
        content = html_lib.unescape(raw)
        size = float(attribute(attrs, "font-size") or 11)
        anchor = attribute(attrs, "text-anchor") or "start"
        width = 0.6 * size * len(content)
        transform = attribute(attrs, "transform")
        if transform:  # translate(x,y) rotate(-90): the text runs upwards from (x, y)
            tx, ty = (float(v) for v in re.search(r"translate\(([-\d.]+),([-\d.]+)\)", transform).groups())
            assert "rotate(-90)" in transform
            y0 = ty - width / 2 if anchor == "middle" else ty - width if anchor == "start" else ty
            boxes.append((content, (tx - 0.8 * size, y0, tx + 0.2 * size, y0 + width)))
            continue
        x, y = float(attribute(attrs, "x")), float(attribute(attrs, "y"))
        x0 = x if anchor == "start" else x - width / 2 if anchor == "middle" else x - width
        boxes.append((content, (x0, y - 0.8 * size, x0 + width, y + 0.2 * size)))
    return boxes


def overlapping(svg: str) -> list[tuple[str, str]]:
    """The pairs of texts of one chart whose boxes intersect."""
    boxes = text_boxes(svg)
    pairs = []
    for i, (a, box_a) in enumerate(boxes):
        for b, box_b in boxes[:i]:
            if (
                box_a[0] < box_b[2] - 0.01
                and box_b[0] < box_a[2] - 0.01
                and box_a[1] < box_b[3] - 0.01
                and box_b[1] < box_a[3] - 0.01
            ):
                pairs.append((b, a))
    return pairs


def texts(svg: str) -> list[str]:
    return [html_lib.unescape(raw) for _, raw in TEXT.findall(svg)]


class Tables(HTMLParser):
    """Every ``<table>`` of a page as rows of cell texts."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[list[list[str]]] = []
        self.cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag == "table":
            self.tables.append([])
        elif tag == "tr" and self.tables:
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self.cell = []
        elif tag == "br" and self.cell is not None:
            self.cell.append(" | ")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self.cell is not None:
            self.tables[-1][-1].append(" ".join("".join(self.cell).split()))
            self.cell = None

    def handle_data(self, content: str) -> None:
        if self.cell is not None:
            self.cell.append(content)


def tables(fragment: str) -> list[list[list[str]]]:
    parser = Tables()
    parser.feed(fragment)
    return parser.tables


def table_after(fragment: str, heading: str) -> list[dict[str, str]]:
    """The table under ``<h3>heading</h3>`` as dicts keyed by its header cells."""
    rest = fragment.split(f"<h3>{heading}</h3>", 1)[1]
    header, *body = tables(rest.split("</table>", 1)[0] + "</table>")[0]
    return [dict(zip(header, cells, strict=True)) for cells in body]


# ----------------------------------------------------------------------------------------- fabricated runs


def known_answer_rows() -> list[dict]:
    """One length, two retrieval tasks and one QA task, where each recommendation is known by construction."""
    tasks = ("passkey", "niah_single", "qa_quality")
    ones = {task: [1.0, 1.0, 1.0] for task in tasks}
    rows = rows_of("full", 2.0, ones, speed=10.0, prefill=2.0)  # float32 model: 0.5x a 16-bit cache
    # ~4x: snapkv keeps everything, window loses half; quant (2x) is exact but does not fit 1/4
    rows += rows_of("snapkv:ratio=0.25", 0.25, ones, speed=12.0, prefill=4.0)
    rows += rows_of("window:ratio=0.25", 0.25, {t: [1.0, 0.0, 1.0] for t in tasks}, speed=13.0, prefill=1.8)
    rows += rows_of("quant", 0.25, ones, speed=9.0, prefill=2.2)  # 4x too, exact like snapkv
    rows += rows_of("quant:bits=8", 0.5, ones, speed=9.0, prefill=2.1)  # 2x: no budget
    # ~8x (7.0x fits: 85% of 8x is 6.8x): keydiff scores best but runs only passkey; h2o runs all three.
    # keydiff decodes fastest, 33 points below full
    rows += rows_of("keydiff:ratio=0.125", 1 / 7.0, {"passkey": [1.0, 1.0, 0.0]}, speed=20.0, prefill=2.0)
    rows += rows_of("h2o:ratio=0.125", 0.125, {t: [1.0, 0.0, 0.0] for t in tasks}, speed=15.0, prefill=3.0)
    # 6x does not fit 1/8
    rows += rows_of("keyformer:ratio=0.16", 1 / 6.0, ones, speed=11.0, prefill=6.0)
    return rows


def test_panel_names_the_right_methods() -> None:
    page = page_of(known_answer_rows())
    panel = section(page, "guide")
    assert page.index('id="guide"') < page.index('id="overview"')  # at the top of the page
    assert "Which method for which need" in panel and "<svg" not in panel
    budget = {
        row["task group (tasks)"]: row for row in table_after(panel, "Best accuracy within a byte budget")
    }
    assert set(budget) == {"retrieval (niah_single, passkey)", "question answering (qa_quality)"}
    retrieval = budget["retrieval (niah_single, passkey)"]
    # at ~4x three methods fit; snapkv and quant are exact, keyformer (6x) too: the most compression wins
    four, eight = (
        retrieval["\u2264 1/4 of a 16-bit cache (~4x)"],
        retrieval["\u2264 1/8 of a 16-bit cache (~8x)"],
    )
    assert four.startswith("keyformer:ratio=0.16 | 100% vs full 100% on 2/2 tasks (6 trials), 6.00x"), four
    # at ~8x: h2o runs both retrieval tasks (33%), keydiff only passkey (67%): named as higher on fewer tasks
    assert eight.startswith("h2o:ratio=0.125 | 33% vs full 100% on 2/2 tasks (6 trials), 8.00x"), eight
    assert "higher on fewer tasks: keydiff:ratio=0.125 67% on 1/2 (3 trials), 7.00x" in eight
    assert retrieval["full (16-bit reference)"] == "100% on 2 tasks (6 trials), 0.50x"
    qa = budget["question answering (qa_quality)"]
    assert qa["\u2264 1/8 of a 16-bit cache (~8x)"].startswith(
        "h2o:ratio=0.125 | 33% vs full 100% on 1/1 task"
    )
    (length,) = table_after(panel, "Compression and decode speed at each context length")
    assert length["context"] == "4K"
    assert length["most compression at no loss"].startswith("keyformer:ratio=0.16 | 6.00x, mean 100% vs full")
    # keydiff decodes fastest (2x full) at 33 points below full; the fastest at no loss is snapkv (1.2x)
    assert length["fastest decode"] == (
        "keydiff:ratio=0.125 | decodes at 2.00x full (1 cell, 3 trials), mean 67% vs full 100% on 1 shared task "
        "(3 trials)"
    )
    assert length["fastest decode within 5 points of full"].startswith(
        "snapkv:ratio=0.25 | decodes at 1.20x full (median of 3 cells, 9 trials), mean 100% vs full 100%"
    )
    (prefill,) = table_after(panel, "Prefill cost")
    assert prefill["full's prefill (median s)"] == "2.00 s"
    assert prefill["cheapest prefill"].startswith(
        "window:ratio=0.25 | 0.90x full's prefill time (median of 3"
    )
    assert prefill["costliest prefill"].startswith("keyformer:ratio=0.16 | 3.00x full's prefill time")
    assert prefill["prefill of the no-loss pick"].startswith("keyformer:ratio=0.16 | 3.00x")


def test_panel_without_full_or_fitting_methods() -> None:
    panel = section(page_of(rows_of("quant:bits=8", 0.5, {"passkey": [1.0]})), "guide")
    (row,) = table_after(panel, "Best accuracy within a byte budget")
    assert row["full (16-bit reference)"] == "not run"
    assert row["\u2264 1/4 of a 16-bit cache (~4x)"] == "no method holds \u2264 1/4 of the bytes here"
    (length,) = table_after(panel, "Compression and decode speed at each context length")
    assert length["most compression at no loss"] == "no full rows to compare against"


def colliding_rows() -> list[dict]:
    """Five evictors at exactly the same compression and scores at two budgets, a long-spec method, two
    lengths and two tasks: every label lands on the same spot as four others."""
    tasks = {"passkey": [1.0, 1.0, 0.0], "niah_multikey": [1.0, 0.0, 0.0]}
    contexts = (2048, 4096)
    rows = rows_of("full", 2.0, {t: [1.0] * 3 for t in tasks}, contexts, speed=10.0)
    for name in ("window", "snapkv", "h2o", "keydiff", "keyformer"):
        rows += rows_of(f"{name}:ratio=0.25", 0.25, tasks, contexts, speed=12.0)
        rows += rows_of(f"{name}:ratio=0.125", 0.125, tasks, contexts, speed=12.0)
    rows += rows_of(LONG, 0.25, tasks, contexts, speed=12.0)
    rows += rows_of("quant", 2.0, {t: [1.0] * 3 for t in tasks}, contexts, speed=10.0)  # on top of full
    return rows


def test_no_two_labels_overlap_where_methods_collide() -> None:
    page = page_of(colliding_rows())
    charts = svgs(page)
    assert len(charts) > 10
    for chart in charts:
        assert not overlapping(chart), (
            re.search(r"<title>(.*?)</title>", chart).group(1),
            overlapping(chart),
        )
    frontier = [c for c in svgs(section(page, "frontier")) if "passkey: accuracy vs compression" in c][0]
    labels = texts(frontier)
    # five families at ratio=0.25 on one spot: one label, not five; the coincident markers are set apart
    assert labels.count("ratio=0.25") == 1 and labels.count("ratio=0.125") == 1
    markers = re.findall(
        r'<(?:circle cx="([\d.]+)" cy="([\d.]+)"|rect x="([\d.]+)" y="([\d.]+)"|path d="M([\d.]+),([\d.]+))',
        frontier,
    )
    assert len(markers) == len(set(markers)) >= 13
    # the long spec's label has no room on the chart: it is numbered, and said whole under the chart
    assert f"{LONG.split(':', 1)[1]}" in "".join(labels)
    assert "Points numbered on the chart:" in labels


def test_every_point_label_is_drawn_or_listed() -> None:
    frontier = svgs(section(page_of(colliding_rows()), "frontier"))[0]
    joined = "".join(texts(frontier))
    for label in ("ratio=0.25", "ratio=0.125", "default"):
        assert label in joined


def test_single_context_gets_bar_charts() -> None:
    tasks = {"passkey": [1.0, 0.0, 1.0]}
    rows = rows_of("full", 0.5, tasks, speed=10.0)
    rows += rows_of("window:ratio=0.25", 0.25, tasks, speed=14.0)
    rows += rows_of(LONG, 0.3, tasks, speed=12.0)
    part = section(page_of(rows), "memory-speed")
    charts = svgs(part)
    assert len(charts) == 2 and all('class="chart bars"' in c for c in charts)
    assert "<polyline" not in part and "<circle" not in part
    memory, speed = charts
    assert "KV cache held at 4k tokens" in memory and "decode speed at 4k tokens" in speed
    # one bar per method, and the 16-bit full cache as a dashed one
    assert memory.count("<rect x=") - 1 == 4 and speed.count("<rect x=") - 1 == 3
    assert 'stroke-dasharray="5,3"' in memory
    assert "one context length (4096 tokens): one bar per method" in memory
    for chart in charts:
        assert not overlapping(chart)
        assert LONG in "".join(texts(chart))  # the long name whole, wrapped over lines


def test_two_contexts_keep_lines() -> None:
    rows = rows_of("full", 0.5, {"passkey": [1.0]}, (2048, 4096))
    rows += rows_of("window:ratio=0.25", 0.25, {"passkey": [1.0]}, (2048, 4096))
    part = section(page_of(rows), "memory-speed")
    assert "bars" not in part and part.count("<polyline") >= 4


def test_legend_entries_are_whole() -> None:
    rows = colliding_rows() + rows_of(LONG, 0.25, {"passkey": [1.0]}, (2048, 4096), model="other-model")
    page = page_of(rows)
    for chart in svgs(page):
        names = texts(chart)
        assert not [n for n in names if "\u2026" in n], "a text cut in a chart without its whole name"
    # every chart that draws the long method names it whole (legend, heatmap title or numbered note)
    for chart in svgs(section(page, "memory-speed")) + svgs(section(page, "heatmaps")):
        title = re.search(r"<title>(.*?)</title>", chart).group(1)
        if "dkcache" in title or "memory" in title.lower() or "KV cache" in title:
            assert LONG in "".join(texts(chart)), title
    legend = "".join(texts(svgs(section(page, "memory-speed"))[0]))
    assert f"other-model \u00b7 {LONG}" in legend and f"tiny \u00b7 {LONG}" in legend


BENCH_SPEC = "dkcache:attended=0.125,bits=8,page=32,sinks=8,core=256"


def bench_row(method: str, context: int, ms: float, speedup: float, bound: float, compression: float) -> dict:
    full_16 = context * 24 * 1024
    return {
        "kind": "bench", "model": "random:llama-3.1-8b", "method": method, "context": context, "batch": 1,
        "device": "cuda", "dtype": "bfloat16", "ms_per_token": ms, "tok_s": 1000 / ms, "speedup": speedup,
        "bound": bound, "of_bound": speedup / bound, "prefill_s": 0.25, "overhead_s": 0.0,
        "kv_bytes": int(full_16 / compression), "full_kv_bytes_16bit": full_16, "compression": compression,
        "spec_version": SPEC_VERSION,
    }  # fmt: skip


def test_bench_legend_shortened_only_with_the_whole_name_at_hand(tmp_path: Path) -> None:
    rows = [
        bench_row("full", 4096, 10.0, 1.0, 1.0, 1.0),
        bench_row(BENCH_SPEC, 4096, 8.0, 1.25, 1.6, 7.5),
        bench_row("window:ratio=0.125", 4096, 7.0, 1.43, 1.8, 7.9),
    ]
    path = tmp_path / "bench.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = render_html([load_run(path)])
    bars, gap = svgs(page)
    assert 'class="chart bars"' in bars and "one length measured (4096)" in bars
    assert BENCH_SPEC in "".join(texts(bars))
    # the gap chart's legend shortens long specs in the middle: the tooltip and the table have them whole
    for group, short in re.findall(r"<g><title>([^<]*)</title>(<text[^>]*>[^<]*\u2026[^<]*</text>)", gap):
        assert group == BENCH_SPEC and f'<td class="name">{BENCH_SPEC}</td>' in page, short
    cut = [t for t in texts(gap) if "\u2026" in t]
    assert len(cut) == 1 and len(re.findall(r"<title>[^<]*</title><text[^>]*>[^<]*\u2026", gap)) == 1
    for chart in (bars, gap):
        assert not overlapping(chart)
    # the panel names the fastest bench method
    (fastest,) = table_after(section(page, "guide"), "Fastest decode in kvweave bench")
    assert fastest["fastest decode (kvweave bench)"].startswith("window:ratio=0.125 | 1.43x full's decode")


# ----------------------------------------------------------------------------------------- layout pieces


@pytest.mark.parametrize("limit", [6, 10, 22, 40])
def test_wrap_keeps_every_character(limit: int) -> None:
    lines = layout.wrap(LONG, limit)
    assert "".join(lines) == LONG and all(len(line) <= limit for line in lines)
    assert layout.wrap("short", 40) == ["short"]
    spaced = layout.wrap("qwen2.5-coder-0.5b \u00b7 window:ratio=0.25", 20)
    assert " ".join(spaced).replace("  ", " ") == "qwen2.5-coder-0.5b \u00b7 window:ratio=0.25"


def test_placer_never_overlaps() -> None:
    placer = layout.Placer((0, 0, 200, 100))
    placed = []
    for _ in range(40):  # forty labels around one point: each lands apart from the others, or nowhere
        spot = placer.place(layout.around_point(100, 50, 9), "ratio=0.25", 9)
        if spot:
            placed.append(layout.text_box(*spot[:2], "ratio=0.25", 9, spot[2]))
    assert 1 < len(placed) < 40
    assert not any(layout.overlaps(a, b) for i, a in enumerate(placed) for b in placed[:i])


def test_coincident_points_are_set_apart() -> None:
    groups = layout.clusters([(10, 10), (11, 10), (10, 11), (50, 50)])
    assert groups[:3] == [0, 0, 0] and groups[3] == 3
    moved = layout.spread([10, 11, 10, 50], groups)
    assert moved[3] == 50 and sorted(moved[:3]) == pytest.approx([2.33, 10.33, 18.33], abs=0.01)
    assert moved[1] > moved[2]  # in their x order (ties by index)
    crowd = layout.spread([0.0] * 25, [0] * 25)  # a big cluster is squeezed, not spread across the chart
    assert max(crowd) - min(crowd) == pytest.approx(48)
