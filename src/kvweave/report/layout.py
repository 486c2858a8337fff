"""Layout for the SVG charts: text extents, wrapping, label placement without overlaps, markers and legends.

No text measuring is possible without a browser, so a text's box is estimated from its length and font size
(:data:`CHAR_WIDTH` of the size per character, a little wider than system-ui's mean glyph). Labels are placed
greedily: each takes the first candidate position whose box meets no box taken before it (other labels,
point markers) and stays inside the plot; a label with no room goes to a numbered list under the chart.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from html import escape

CHAR_WIDTH = 0.62
"""Estimated text width per character, as a fraction of the font size."""
ASCENT, DESCENT = 0.85, 0.25
"""Estimated extent of a text above and below its baseline, as fractions of the font size."""

Box = tuple[float, float, float, float]
"""``(x0, y0, x1, y1)`` in pixels, y down."""


def text_width(text: str, size: float) -> float:
    """Estimated width in pixels of ``text`` at font ``size``."""
    return CHAR_WIDTH * size * len(text)


BOLD = 1.08
"""How much wider a bold text runs (titles): a factor on the font size for :func:`fitting_chars`."""


def fitting_chars(width: float, size: float) -> int:
    """How many characters fit in ``width`` pixels at font ``size``."""
    return max(1, int(width / (CHAR_WIDTH * size)))


def text_box(x: float, y: float, text: str, size: float, anchor: str = "start", pad: float = 1.0) -> Box:
    """The estimated box of ``text`` drawn at ``(x, y)`` (its baseline) with ``anchor``, grown by ``pad``."""
    width = text_width(text, size)
    x0 = x if anchor == "start" else x - width / 2 if anchor == "middle" else x - width
    return (x0 - pad, y - ASCENT * size - pad, x0 + width + pad, y + DESCENT * size + pad)


def overlaps(a: Box, b: Box) -> bool:
    """Whether two boxes share any area."""
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def inside(box: Box, frame: Box) -> bool:
    """Whether ``box`` lies within ``frame``."""
    return box[0] >= frame[0] and box[1] >= frame[1] and box[2] <= frame[2] and box[3] <= frame[3]


BREAKS = ",: \u00b7/"
"""Characters a long name may be wrapped after (method specs have no spaces: ``a=1,b=2``)."""


def wrap(text: str, limit: int) -> list[str]:
    """``text`` in lines of at most ``limit`` characters, broken after :data:`BREAKS` characters where it can
    be (hard-broken where a piece is longer than ``limit``); nothing is dropped."""
    limit = max(limit, 4)
    pieces, current = [], ""
    for char in text:
        current += char
        if char in BREAKS:
            pieces.append(current)
            current = ""
    if current:
        pieces.append(current)
    lines: list[str] = []
    line = ""
    for piece in pieces:
        while len(piece) > limit:  # a piece that fits no line: cut it
            room = limit - len(line)
            lines.append(line + piece[:room])
            piece, line = piece[room:], ""
        if len(line) + len(piece.rstrip()) > limit and line:
            lines.append(line)
            line = ""
        line += piece
    if line or not lines:
        lines.append(line)
    return [entry.rstrip() for entry in lines]


def text(x: float, y: float, content: str, size: float = 11, anchor: str = "start", **attrs: str) -> str:
    """A ``<text>`` element (attribute names with ``_`` for ``-``)."""
    extra = "".join(f' {k.replace("_", "-")}="{escape(v)}"' for k, v in attrs.items())
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size:g}" text-anchor="{anchor}"{extra}>'
        f"{escape(content)}</text>"
    )


def text_lines(x: float, y: float, lines: Sequence[str], size: float, step: float, **attrs: str) -> list[str]:
    """One ``<text>`` per line, baselines ``step`` apart from ``y``."""
    return [text(x, y + i * step, line, size=size, **attrs) for i, line in enumerate(lines)]


FONT = "font-family:system-ui,-apple-system,'Segoe UI',sans-serif"


def svg_document(width: float, height: float, title: str, css_class: str, body: Sequence[str]) -> str:
    """A standalone ``<svg>`` of ``width`` x ``height`` on white, with ``title`` for screen readers."""
    head = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="{css_class}" width="{width:.0f}" '
        f'height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" role="img" style="{FONT}">',
        f"<title>{escape(title)}</title>",
        f'<rect x="0" y="0" width="{width:.0f}" height="{height:.0f}" fill="#ffffff"/>',
    ]
    return "\n".join([*head, *body, "</svg>"])


# ----------------------------------------------------------------------------------------- placement


class Placer:
    """The boxes taken in one chart so far; places each new text where it meets none of them."""

    def __init__(self, frame: Box | None = None) -> None:
        self.frame = frame
        self.boxes: list[Box] = []

    def take(self, box: Box) -> None:
        """Mark ``box`` as taken (a marker, a label drawn elsewhere)."""
        self.boxes.append(box)

    def free(self, box: Box) -> bool:
        """Whether ``box`` is inside the frame and meets no taken box."""
        if self.frame is not None and not inside(box, self.frame):
            return False
        return not any(overlaps(box, taken) for taken in self.boxes)

    def place(
        self, candidates: Iterable[tuple[float, float, str]], content: str, size: float
    ) -> tuple[float, float, str] | None:
        """The first free ``(x, y, anchor)`` of ``candidates`` for ``content`` (taken from then on), or None."""
        for x, y, anchor in candidates:
            box = text_box(x, y, content, size, anchor)
            if self.free(box):
                self.take(box)
                return x, y, anchor
        return None


MARKER_SIZE = 4.5
"""Point markers' radius (the largest shape reaches 1.25 x it)."""


def around_point(
    x: float, y: float, size: float, lines: int = 3, half_width: float = 0.0
) -> list[tuple[float, float, str]]:
    """Candidate label positions just clear of a point marker (or of a row of markers ``2 * half_width``
    wide): right, left, above, below, then right and left nudged up and down by one to ``lines`` lines (then
    further above and below when ``lines`` > 1)."""
    clear = marker_box(0, 0)[2] + 1.5  # the marker's reach, the label's padding and half a pixel
    line = size + 2
    middle = y + 0.3 * size  # baseline that centres the text on the point
    side = clear + half_width
    above, below = y - clear - DESCENT * size, y + clear + ASCENT * size
    spots = [
        (x + side, middle, "start"),
        (x - side, middle, "end"),
        (x, above, "middle"),
        (x, below, "middle"),
    ]
    for step in (k * sign for k in range(1, lines + 1) for sign in (1, -1)):
        spots += [(x + side, middle + step * line, "start"), (x - side, middle + step * line, "end")]
    if lines > 1:
        spots += [(x, above - line, "middle"), (x, below + line, "middle")]
    return spots


def farther(x: float, y: float, size: float, reach: float = 48.0) -> list[tuple[float, float, str]]:
    """More candidate positions for a short text (a point's number), on rings up to ``reach`` pixels from
    the point, nearest first: where it is drawn away from its point, a leader line joins them."""
    spots = []
    radius = 12.0
    while radius <= reach:
        count = max(8, int(2 * math.pi * radius / 8))
        for k in range(count):
            angle = 2 * math.pi * k / count
            spots.append((x + radius * math.cos(angle), y + radius * math.sin(angle) + 0.3 * size, "middle"))
        radius += 6.0
    return spots


def clusters(points: Sequence[tuple[float, float]], radius: float = 6.0) -> list[int]:
    """For each point, the index of the first point of its cluster: points closer than ``radius`` to one
    another (directly or through a chain of such points) coincide on screen."""
    parent = list(range(len(points)))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    for i, (xi, yi) in enumerate(points):
        for j in range(i):
            if math.hypot(xi - points[j][0], yi - points[j][1]) < radius:
                parent[root(i)] = root(j)
    return [root(i) for i in range(len(points))]


def spread(
    xs: Sequence[float], groups: Sequence[int], step: float = 8.0, widest: float = 48.0
) -> list[float]:
    """New x positions that set the points of each cluster (``groups``, from :func:`clusters`) side by side
    in their x order, centred on the cluster's mean: ``step`` apart, closer when that would spread a big
    cluster wider than ``widest`` (on a context axis, a wide spread would read as another length)."""
    members: dict[int, list[int]] = {}
    for i, group in enumerate(groups):
        members.setdefault(group, []).append(i)
    moved = list(xs)
    for indices in members.values():
        if len(indices) < 2:
            continue
        gap = min(step, widest / (len(indices) - 1))
        centre = sum(xs[i] for i in indices) / len(indices)
        for rank, i in enumerate(sorted(indices, key=lambda i: (xs[i], i))):
            moved[i] = centre + (rank - (len(indices) - 1) / 2) * gap
    return moved


# ----------------------------------------------------------------------------------------- markers

MARKERS = ("circle", "square", "triangle", "diamond", "down", "cross")
"""Marker shapes, cycled over the series of a chart (with the 10 colours: 30 distinct series)."""


def marker(shape: str, x: float, y: float, color: str, size: float = MARKER_SIZE, title: str = "") -> str:
    """A point marker of ``shape`` centred on ``(x, y)``; ``title`` is its tooltip."""
    tip = f"<title>{escape(title)}</title>" if title else ""
    s = size
    if shape == "square":
        s *= 0.9
        head = f'<rect x="{x - s:.1f}" y="{y - s:.1f}" width="{2 * s:.1f}" height="{2 * s:.1f}"'
    elif shape == "circle":
        head = f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{s:g}"'
    else:
        if shape == "triangle":
            corners = [(x, y - 1.2 * s), (x + 1.1 * s, y + 0.8 * s), (x - 1.1 * s, y + 0.8 * s)]
        elif shape == "down":
            corners = [(x, y + 1.2 * s), (x + 1.1 * s, y - 0.8 * s), (x - 1.1 * s, y - 0.8 * s)]
        elif shape == "diamond":
            corners = [(x, y - 1.25 * s), (x + 1.1 * s, y), (x, y + 1.25 * s), (x - 1.1 * s, y)]
        else:  # cross: a plus sign with thick arms
            a, b = 1.15 * s, 0.4 * s
            corners = [
                (x - b, y - a), (x + b, y - a), (x + b, y - b), (x + a, y - b), (x + a, y + b), (x + b, y + b),
                (x + b, y + a), (x - b, y + a), (x - b, y + b), (x - a, y + b), (x - a, y - b), (x - b, y - b),
            ]  # fmt: skip
        path = "M" + " L".join(f"{cx:.1f},{cy:.1f}" for cx, cy in corners) + " Z"
        head = f'<path d="{path}"'
    return f'{head} fill="{color}" stroke="#fff" stroke-width="1">{tip}</{head[1:].split()[0]}>'


def marker_box(x: float, y: float, size: float = MARKER_SIZE) -> Box:
    """The box a marker covers (the largest shape's)."""
    r = 1.25 * size + 0.5
    return (x - r, y - r, x + r, y + r)


# ----------------------------------------------------------------------------------------- legends


@dataclass
class LegendEntry:
    """One legend line: a marker (and a line sample when ``line``) in ``color``, then the whole ``name``."""

    name: str
    color: str
    shape: str = "circle"
    line: bool = True
    dashed: bool = False


LEGEND_SIZE = 11
LEGEND_LINE = 14
SAMPLE = 26
"""Width of a legend entry's sample (line and marker) before its text."""


def legend_columns(widths: Sequence[float], width: float) -> int:
    """How many legend columns: the most (up to 4, none narrower than 180 px) in which at most a quarter of
    the entries need wrapping."""
    best = 1
    for columns in range(2, min(4, len(widths)) + 1):
        column_width = width / columns
        if column_width >= 180 and sum(w > column_width for w in widths) <= len(widths) / 4:
            best = columns
    return best


def legend_block(
    entries: Sequence[LegendEntry], x0: float, y0: float, width: float
) -> tuple[list[str], float]:
    """The legend under a chart: entries in as many equal columns as fit ``width``, each name whole (wrapped
    onto more lines when it is wider than a column). Returns the SVG parts and the height used."""
    if not entries:
        return [], 0.0
    columns = legend_columns([SAMPLE + text_width(e.name, LEGEND_SIZE) + 16 for e in entries], width)
    column_width = width / columns
    chars = fitting_chars(column_width - SAMPLE - 12, LEGEND_SIZE)
    parts: list[str] = []
    y = y0
    for first in range(0, len(entries), columns):
        row = entries[first : first + columns]
        wrapped = [wrap(e.name, chars) for e in row]
        for column, (entry, lines) in enumerate(zip(row, wrapped, strict=True)):
            x = x0 + column * column_width
            mid = y + LEGEND_LINE / 2
            if entry.line or entry.dashed:
                dash = ' stroke-dasharray="5,4"' if entry.dashed else ""
                parts.append(
                    f'<line x1="{x:.1f}" y1="{mid:.1f}" x2="{x + SAMPLE - 6:.1f}" y2="{mid:.1f}" '
                    f'stroke="{entry.color}" stroke-width="2.5"{dash}/>'
                )
            parts.append(marker(entry.shape, x + (SAMPLE - 6) / 2, mid, entry.color, size=4.0))
            baseline = mid + 0.35 * LEGEND_SIZE
            parts += text_lines(x + SAMPLE, baseline, lines, LEGEND_SIZE, LEGEND_LINE)
        y += LEGEND_LINE * max(len(lines) for lines in wrapped) + 4
    return parts, y - y0


NOTE_SIZE = 10
NOTE_LINE = 13


def notes_block(
    notes: Sequence[tuple[str, str]], x0: float, y0: float, width: float
) -> tuple[list[str], float]:
    """Numbered point labels under a chart, ``(number, text)`` each, wrapped to ``width``. Returns the SVG
    parts and the height used."""
    if not notes:
        return [], 0.0
    indent = text_width("00  ", NOTE_SIZE)
    chars = fitting_chars(width - indent, NOTE_SIZE)
    parts = [text(x0, y0 + NOTE_SIZE, "Points numbered on the chart:", size=NOTE_SIZE, fill="#444")]
    y = y0 + NOTE_SIZE + NOTE_LINE
    for number, note in notes:
        lines = wrap(note, chars)
        parts.append(text(x0, y, number, size=NOTE_SIZE, font_weight="600"))
        parts += text_lines(x0 + indent, y, lines, NOTE_SIZE, NOTE_LINE, fill="#333")
        y += NOTE_LINE * len(lines)
    return parts, y - y0
