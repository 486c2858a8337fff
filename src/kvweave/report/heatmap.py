"""The NIAH heatmap: a depth x context grid of score cells, each with its score written in it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

from kvweave.report.layout import BOLD, fitting_chars, svg_document, text, text_lines, wrap


def _mix(a: str, b: str, t: float) -> str:
    ca = [int(a[i : i + 2], 16) for i in (1, 3, 5)]
    cb = [int(b[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(x + (y - x) * t):02x}" for x, y in zip(ca, cb, strict=True))


def score_color(value: float | None) -> str:
    """Red (0) -> yellow (0.5) -> green (1); light grey for a missing cell."""
    if value is None or not math.isfinite(value):
        return "#eeeeee"
    value = min(max(value, 0.0), 1.0)
    if value < 0.5:
        return _mix("#d73027", "#fee08b", value / 0.5)
    return _mix("#fee08b", "#1a9850", (value - 0.5) / 0.5)


TITLE_SIZE = 12
TITLE_LINE = 15


def heatmap(
    row_labels: Sequence[str],
    column_labels: Sequence[str],
    values: Sequence[Sequence[float | None]],
    title: str,
    x_label: str = "context tokens",
    y_label: str = "depth",
    cell: int = 38,
) -> str:
    """A grid of score cells (rows top to bottom, columns left to right) with the score written in each; the
    title (a method spec) is wrapped onto as many lines as it needs, never cut."""
    left = 52
    width = max(left + cell * len(column_labels) + 12, 220)
    titles = wrap(title, fitting_chars(width - 8, BOLD * TITLE_SIZE))
    top = 34 + TITLE_LINE * (len(titles) - 1)
    height = top + cell * len(row_labels) + 40
    out = text_lines(4, 18, titles, TITLE_SIZE, TITLE_LINE, font_weight="600")
    for r, label in enumerate(row_labels):
        y = top + r * cell
        out.append(text(left - 5, y + cell / 2 + 4, label, size=10, anchor="end", fill="#444"))
        for c, value in enumerate(values[r]):
            x = left + c * cell
            fill = score_color(value)
            out.append(
                f'<rect x="{x}" y="{y}" width="{cell - 1}" height="{cell - 1}" fill="{fill}">'
                f"<title>{escape(label)} / {escape(column_labels[c])}: "
                f"{'-' if value is None else f'{100 * value:.0f}%'}</title></rect>"
            )
            if value is not None:
                ink = "#ffffff" if value < 0.2 or value > 0.8 else "#222222"
                score = f"{100 * value:.0f}"
                out.append(text(x + cell / 2, y + cell / 2 + 4, score, size=10, anchor="middle", fill=ink))
    bottom = top + cell * len(row_labels)
    for c, label in enumerate(column_labels):
        out.append(
            text(left + c * cell + cell / 2, bottom + 13, label, size=10, anchor="middle", fill="#444")
        )
    out.append(text(left + cell * len(column_labels) / 2, bottom + 30, x_label, size=10, anchor="middle"))
    out.append(
        f'<text transform="translate(11,{top + cell * len(row_labels) / 2:.1f}) rotate(-90)" font-size="10" '
        f'text-anchor="middle">{escape(y_label)}</text>'
    )
    return svg_document(width, height, title, "heatmap", out)
