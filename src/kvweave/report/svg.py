"""Tiny SVG chart helpers: a scatter/line chart, a bar chart, a measured-vs-bound gap chart and (from
:mod:`kvweave.report.heatmap`) a heatmap, as strings to inline in an HTML page.

No plotting library: the report must render offline, in any browser, from one file. Coordinates are in
CSS pixels; every chart is a standalone ``<svg>`` element with a ``<title>`` for screen readers. Texts are
laid out with :mod:`kvweave.report.layout` so that no two overlap and no name is cut without its whole text
at hand.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from html import escape

from kvweave.report.heatmap import heatmap, score_color  # noqa: F401  (re-exported: svg.heatmap)
from kvweave.report.layout import (
    BOLD,
    MARKERS,
    LegendEntry,
    Placer,
    around_point,
    clusters,
    farther,
    fitting_chars,
    legend_block,
    marker,
    marker_box,
    notes_block,
    spread,
    svg_document,
    text,
    text_lines,
    text_width,
    wrap,
)

PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#bcbd22",
    "#7f7f7f",
)
"""Categorical series colours (the Tableau 10 set)."""


@dataclass
class Series:
    """One named series of ``(x, y)`` points, optionally labelled point by point."""

    name: str
    points: list[tuple[float, float]]
    labels: list[str] = field(default_factory=list)
    color: str = ""
    dashed: bool = False


# ----------------------------------------------------------------------------------------- axes


def nice_step(span: float, count: int) -> float:
    """A round tick step (1, 2, 2.5 or 5 x 10^k) giving about ``count`` ticks over ``span``."""
    raw = span / max(count, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 2.5, 5, 10):
        if raw <= factor * magnitude:
            return factor * magnitude
    return 10 * magnitude


@dataclass
class Axis:
    """A linear or base-2 logarithmic axis over ``[low, high]``, mapped to pixels ``[start, end]``."""

    low: float
    high: float
    start: float
    end: float
    log: bool = False

    @classmethod
    def fit(
        cls,
        values: Sequence[float],
        start: float,
        end: float,
        log: bool = False,
        low: float | None = None,
        high: float | None = None,
    ) -> Axis:
        """An axis covering ``values`` (padded when they are all equal), with optional fixed bounds."""
        finite = [v for v in values if v is not None and math.isfinite(v) and (v > 0 or not log)]
        lo = low if low is not None else (min(finite) if finite else 0.0)
        hi = high if high is not None else (max(finite) if finite else 1.0)
        if log:
            # pad by a fraction of an octave so points on a power of two are not drawn on the frame
            low_exp, high_exp = math.log2(max(lo, 1e-9)), math.log2(max(hi, 1e-9))
            pad = 0.5 if high_exp - low_exp < 1e-9 else 0.12 * max(1.0, high_exp - low_exp)
            lo = lo if low is not None else 2 ** (low_exp - pad)
            hi = hi if high is not None else 2 ** (high_exp + pad)
        else:
            if hi <= lo:
                pad = abs(lo) * 0.1 or 1.0
                lo, hi = lo - pad, hi + pad
            step = nice_step(hi - lo, 5)
            lo = lo if low is not None else math.floor(lo / step) * step
            hi = hi if high is not None else math.ceil(hi / step) * step
        return cls(lo, hi, start, end, log)

    def ticks(self) -> list[float]:
        """Tick values: powers of two on a log axis, round steps on a linear one."""
        if self.log:
            first = math.ceil(math.log2(self.low) - 1e-9)
            last = math.floor(math.log2(self.high) + 1e-9)
            stride = max(1, math.ceil((last - first + 1) / 8))
            return [2.0**k for k in range(first, last + 1, stride)]
        step = nice_step(self.high - self.low, 5)
        first = math.ceil(self.low / step - 1e-9)
        ticks = []
        k = first
        while k * step <= self.high + 1e-9 * step:
            ticks.append(round(k * step, 10))
            k += 1
        return ticks

    def __call__(self, value: float) -> float:
        """Pixel coordinate of ``value``."""
        if self.log:
            value = max(value, 1e-12)
            t = (math.log2(value) - math.log2(self.low)) / (math.log2(self.high) - math.log2(self.low))
        else:
            t = (value - self.low) / (self.high - self.low)
        return self.start + t * (self.end - self.start)


def format_number(value: float) -> str:
    """Short tick text: 2048 -> 2k, 4000 -> 4k, 0.25 -> 0.25, 12.0 -> 12."""
    if value == 0:
        return "0"
    if abs(value) >= 1000:
        for unit in (1024, 1000):
            if value % unit == 0:
                return f"{value / unit:g}k"
        return f"{value:.0f}"
    return f"{value:.3g}"


# ----------------------------------------------------------------------------------------- pieces

_text = text


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def _shorten_middle(text: str, limit: int) -> str:
    """``text`` cut in the middle to ``limit`` characters, so that both ends stay: method specs of one family
    differ in their options, at the end."""
    if len(text) <= limit:
        return text
    head = (limit - 1) // 2
    return text[:head] + "\u2026" + text[len(text) - (limit - 1 - head) :]


def _label(
    x: float, y: float, text: str, limit: int, size: int = 11, middle: bool = False, **attrs: str
) -> str:
    """A text shortened to ``limit`` characters (at its end, or in its ``middle``); when shortened, the whole
    text is its tooltip."""
    short = _shorten_middle(text, limit) if middle else _shorten(text, limit)
    if short == text:
        return _text(x, y, text, size=size, **attrs)
    return f"<g><title>{escape(text)}</title>{_text(x, y, short, size=size, **attrs)}</g>"


LEGEND_WIDTH = 170
LEGEND_ROW = 18
TITLE_SIZE = 13
TITLE_LINE = 16
TOP = 34
"""The plot's top edge under a one-line title."""


def _title(out: list[str], title: str, width: float) -> float:
    """The chart title, wrapped to ``width`` (never cut); returns the plot's top edge under it."""
    lines = wrap(title, fitting_chars(width - 20, BOLD * TITLE_SIZE))
    out += text_lines(10, 20, lines, TITLE_SIZE, TITLE_LINE, font_weight="600")
    return TOP + TITLE_LINE * (len(lines) - 1)


def _frame(
    out: list[str],
    x_axis: Axis,
    y_axis: Axis,
    x_label: str,
    y_label: str,
    x_format: Callable[[float], str],
    y_format: Callable[[float], str],
) -> None:
    """Grid lines with tick labels, the plot frame and the axis labels (the x label under the ticks)."""
    left, right, top, bottom = x_axis.start, x_axis.end, y_axis.end, y_axis.start
    for tick in x_axis.ticks():
        x = x_axis(tick)
        out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}" stroke="#e5e5e5"/>')
        out.append(_text(x, bottom + 15, x_format(tick), anchor="middle", fill="#444"))
    for tick in y_axis.ticks():
        y = y_axis(tick)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="#e5e5e5"/>')
        out.append(_text(left - 6, y + 4, y_format(tick), anchor="end", fill="#444"))
    out.append(
        f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" fill="none" stroke="#999"/>'
    )
    out.append(_text((left + right) / 2, bottom + 33, x_label, anchor="middle"))
    out.append(
        f'<text transform="translate(14,{(top + bottom) / 2:.1f}) rotate(-90)" font-size="11" '
        f'text-anchor="middle">{escape(y_label)}</text>'
    )


def _legend_line(right: float, index: int, top: float, name: str, color: str, dash: str = "") -> list[str]:
    legend_y = top + 6 + LEGEND_ROW * index
    return [
        f'<line x1="{right + 14}" y1="{legend_y}" x2="{right + 32}" y2="{legend_y}" stroke="{color}" '
        f'stroke-width="3"{dash}/>',
        _label(right + 38, legend_y + 4, name, 20, middle=True),
    ]


def _fit_height(height: int, top: float, legend_rows: int) -> int:
    """``height``, or more when the legend needs more rows than the plot is tall."""
    return int(max(height, top + 6 + LEGEND_ROW * legend_rows + 40))


def _svg(width: float, height: float, title: str, css_class: str, body: list[str]) -> str:
    return svg_document(width, height, title, css_class, body)


# ----------------------------------------------------------------------------------------- line chart

POINT_LABEL_SIZE = 9
POINT_LABEL_CHARS = 26
"""Point labels longer than this go to the numbered list under the chart, whole."""


@dataclass
class _Point:
    series: int
    px: float
    py: float
    x: float
    y: float
    label: str


def _point_labels(
    points: list[_Point],
    groups: list[int],
    names: list[str],
    placer: Placer,
    x_format: Callable[[float], str],
    y_format: Callable[[float], str],
) -> tuple[list[str], list[tuple[str, str]]]:
    """Each distinct label of a cluster of coincident points drawn once, where it overlaps nothing; a label
    that is too long or finds no room becomes a number beside the point, explained under the chart."""
    requests: dict[tuple[int, str], list[_Point]] = {}
    for point, group in zip(points, groups, strict=True):
        if point.label:
            requests.setdefault((group, point.label), []).append(point)
    out: list[str] = []
    notes: list[tuple[str, str]] = []
    size = POINT_LABEL_SIZE
    for (_, label), members in sorted(requests.items(), key=lambda kv: (kv[1][0].px, kv[1][0].py)):
        x = sum(p.px for p in members) / len(members)
        y = members[0].py
        spread_half = (max(p.px for p in members) - min(p.px for p in members)) / 2
        spots = around_point(x, y, size, lines=1, half_width=spread_half)  # farther would be ambiguous
        spot = placer.place(spots, label, size) if len(label) <= POINT_LABEL_CHARS else None
        if spot is not None:
            out.append(_text(spot[0], spot[1], label, size=size, anchor=spot[2], fill="#333"))
            continue
        number = str(len(notes) + 1)
        who = ", ".join(data_names(names[p.series] for p in members))
        note = f"{who} ({label}): {x_format(members[0].x)}, {y_format(members[0].y)}"
        spot = placer.place(spots, number, size) or placer.place(farther(x, y, size), number, size)
        if spot is None:
            note += " (no room to number it on the chart)"
        else:
            if math.hypot(spot[0] - x, spot[1] - 0.3 * size - y) > 10:  # away from its point: a leader line
                out.append(_leader(x, y, spot[0], spot[1] - 0.3 * size, size))
            out.append(
                _text(spot[0], spot[1], number, size=size, anchor=spot[2], fill="#000", font_weight="700")
            )
        notes.append((number, note))
    return out, notes


def _leader(x: float, y: float, tx: float, ty: float, size: float) -> str:
    """A thin line from a point's marker edge towards its number at ``(tx, ty)`` (stopping short of it)."""
    distance = math.hypot(tx - x, ty - y)
    ux, uy = (tx - x) / distance, (ty - y) / distance
    start, stop = 6.0, distance - 0.6 * size
    return (
        f'<line x1="{x + ux * start:.1f}" y1="{y + uy * start:.1f}" x2="{x + ux * stop:.1f}" '
        f'y2="{y + uy * stop:.1f}" stroke="#777" stroke-width="0.8"/>'
    )


def data_names(names: Iterable[str]) -> list[str]:
    """Distinct names in first-seen order."""
    return list(dict.fromkeys(names))


def line_chart(
    series: Sequence[Series],
    title: str,
    x_label: str,
    y_label: str,
    x_log: bool = False,
    y_log: bool = False,
    y_low: float | None = None,
    y_high: float | None = None,
    x_format: Callable[[float], str] = format_number,
    y_format: Callable[[float], str] = format_number,
    width: int = 560,
    height: int = 330,
    connect: bool = True,
) -> str:
    """Points of each series (joined in x order when ``connect``) with axes and a legend under the plot that
    names every series whole. Series are told apart by colour and marker shape; coincident points are set
    side by side; point labels never overlap (each distinct label of coincident points is drawn once, and one
    with no room becomes a number explained under the chart). Each point has a tooltip with its values."""
    out: list[str] = []
    top = _title(out, title, width)
    left, right = 58, width - 16
    bottom = top + height - 80
    xs = [x for s in series for x, _ in s.points]
    ys = [y for s in series for _, y in s.points]
    x_axis = Axis.fit(xs, left, right, log=x_log)
    y_axis = Axis.fit(ys, bottom, top, log=y_log, low=y_low, high=y_high)
    _frame(out, x_axis, y_axis, x_label, y_label, x_format, y_format)
    points = [
        _Point(index, x_axis(x), y_axis(y), x, y, label)
        for index, s in enumerate(series)
        for (x, y), label in sorted(zip(s.points, s.labels or [""] * len(s.points), strict=False))
    ]
    groups = clusters([(p.px, p.py) for p in points])
    for point, moved in zip(points, spread([p.px for p in points], groups), strict=True):
        point.px = moved
    colors = [s.color or PALETTE[i % len(PALETTE)] for i, s in enumerate(series)]
    shapes = [MARKERS[i % len(MARKERS)] for i in range(len(series))]
    placer = Placer((left + 2, top + 2, right - 2, bottom - 2))
    for index, s in enumerate(series):
        own = [p for p in points if p.series == index]
        dash = ' stroke-dasharray="5,4"' if s.dashed else ""
        if connect and len(own) > 1:
            path = " ".join(f"{p.px:.1f},{p.py:.1f}" for p in own)
            out.append(
                f'<polyline points="{path}" fill="none" stroke="{colors[index]}" stroke-width="2"{dash}/>'
            )
    for p in points:
        s = series[p.series]
        tip = f"{s.name}{f' ({p.label})' if p.label else ''}: {x_format(p.x)}, {y_format(p.y)}"
        out.append(marker(shapes[p.series], p.px, p.py, colors[p.series], title=tip))
        placer.take(marker_box(p.px, p.py))
    labels, notes = _point_labels(points, groups, [s.name for s in series], placer, x_format, y_format)
    out += labels
    entries = [
        LegendEntry(s.name, colors[i], shapes[i], line=connect and len(s.points) > 1, dashed=s.dashed)
        for i, s in enumerate(series)
    ]
    legend, used = legend_block(entries, 10, bottom + 44, width - 20)
    out += legend
    numbered, more = notes_block(notes, 10, bottom + 44 + used + 6, width - 20)
    out += numbered
    total = bottom + 44 + used + (6 + more if notes else 0) + 10
    return _svg(width, total, title, "chart", out)


# ----------------------------------------------------------------------------------------- bar chart


@dataclass
class Bar:
    """One bar: a whole ``name`` above it, its ``value`` after it."""

    name: str
    value: float
    color: str = ""
    tip: str = ""
    dashed: bool = False


BAR_NAME_SIZE = 11
BAR_HEIGHT = 12


def bar_chart(
    bars: Sequence[Bar],
    title: str,
    value_label: str,
    note: str = "",
    value_format: Callable[[float], str] = format_number,
    width: int = 560,
) -> str:
    """Horizontal bars, one per entry, each under its whole name (wrapped when long) with its value at its
    end, on a shared axis from 0: what a chart against context length becomes when there is one length."""
    out: list[str] = []
    top = _title(out, title, width)
    if note:
        lines = wrap(note, fitting_chars(width - 20, 10))
        out += text_lines(10, top + 2, lines, 10, 13, fill="#555")
        top += 13 * len(lines) + 2
    left, right = 12, width - 12
    value_room = max((text_width(value_format(b.value), 10) for b in bars), default=0.0) + 10
    axis = Axis.fit([0.0, *(b.value for b in bars)], left, right - value_room, low=0.0)
    chars = fitting_chars(right - left, BAR_NAME_SIZE)
    rows: list[str] = []
    y = top + 6
    for index, bar in enumerate(bars):
        color = bar.color or PALETTE[index % len(PALETTE)]
        names = wrap(bar.name, chars)
        rows += text_lines(left, y + BAR_NAME_SIZE, names, BAR_NAME_SIZE, 13)
        bar_y = y + 13 * len(names) + 3
        end = axis(max(bar.value, 0.0))
        style = (
            f'fill="#ffffff" stroke="{color}" stroke-width="2" stroke-dasharray="5,3"'
            if bar.dashed
            else f'fill="{color}"'
        )
        tip = bar.tip or f"{bar.name}: {value_format(bar.value)}"
        rows.append(
            f'<rect x="{left}" y="{bar_y:.1f}" width="{max(end - left, 1.0):.1f}" height="{BAR_HEIGHT}" '
            f"{style}><title>{escape(tip)}</title></rect>"
        )
        rows.append(_text(end + 5, bar_y + BAR_HEIGHT - 2, value_format(bar.value), size=10, fill="#333"))
        y = bar_y + BAR_HEIGHT + 8
    bottom = y
    for tick in axis.ticks():
        x = axis(tick)
        out.append(f'<line x1="{x:.1f}" y1="{top + 4}" x2="{x:.1f}" y2="{bottom:.1f}" stroke="#e5e5e5"/>')
        out.append(_text(x, bottom + 14, value_format(tick), size=10, anchor="middle", fill="#444"))
    out += rows
    out.append(f'<line x1="{left}" y1="{top + 4}" x2="{left}" y2="{bottom:.1f}" stroke="#999"/>')
    out.append(_text((left + right) / 2, bottom + 32, value_label, anchor="middle"))
    return _svg(width, bottom + 44, title, "chart bars", out)


# ----------------------------------------------------------------------------------------- gap chart


@dataclass
class GapPoint:
    """A measured value beside the most it could be: ``y`` (measured) and ``bound`` at the same ``x``."""

    x: float
    y: float
    bound: float
    label: str = ""
    tip: str = ""


@dataclass
class GapSeries:
    """One named series of :class:`GapPoint`."""

    name: str
    points: list[GapPoint]
    color: str = ""


def gap_chart(
    series: Sequence[GapSeries],
    title: str,
    x_label: str,
    y_label: str,
    x_log: bool = True,
    reference: float | None = 1.0,
    x_format: Callable[[float], str] = format_number,
    y_format: Callable[[float], str] = format_number,
    measured_name: str = "measured",
    bound_name: str = "bound",
    width: int = 560,
    height: int = 330,
) -> str:
    """Each point drawn twice: a filled dot at its measured ``y`` and a hollow diamond at its ``bound``, joined
    by a thin vertical segment (the gap); a dashed horizontal line at ``reference``. Points are not joined
    across x. The legend names the series (long names shortened in the middle, whole in their tooltip: the
    table beside the chart gives them), then the two markers. Point labels never overlap."""
    out: list[str] = []
    top = _title(out, title, width)
    height = _fit_height(height, top, len(series) + 2)
    left, right, bottom = 58, width - LEGEND_WIDTH - 10, height - 46
    xs = [p.x for s in series for p in s.points]
    ys = [v for s in series for p in s.points for v in (p.y, p.bound)]
    if reference is not None:
        ys.append(reference)
    x_axis = Axis.fit(xs, left, right, log=x_log)
    y_axis = Axis.fit(ys, bottom, top, low=0.0)
    _frame(out, x_axis, y_axis, x_label, y_label, x_format, y_format)
    if reference is not None:
        y = y_axis(reference)
        out.append(
            f'<line x1="{left}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="#555" stroke-dasharray="5,4"/>'
        )
    placer = Placer((left + 2, top + 2, right - 2, bottom - 2))
    for s in series:
        for p in s.points:
            placer.take(marker_box(x_axis(p.x), y_axis(p.y)))
            placer.take(marker_box(x_axis(p.x), y_axis(p.bound)))
    for index, s in enumerate(series):
        color = s.color or PALETTE[index % len(PALETTE)]
        for p in sorted(s.points, key=lambda p: (p.x, p.y)):
            px, py, pb = x_axis(p.x), y_axis(p.y), y_axis(p.bound)
            tip = p.tip or (
                f"{s.name}{f' ({p.label})' if p.label else ''}: x {x_format(p.x)}, {measured_name} "
                f"{y_format(p.y)}, {bound_name} {y_format(p.bound)}"
            )
            out.append(f"<g><title>{escape(tip)}</title>")
            out.append(
                f'<line x1="{px:.1f}" y1="{py:.1f}" x2="{px:.1f}" y2="{pb:.1f}" stroke="{color}" '
                'stroke-width="1.5" stroke-opacity="0.7"/>'
            )
            out.append(_diamond(px, pb, color))
            out.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="4.5" fill="{color}" stroke="#fff"/>')
            out.append("</g>")
            label = _shorten(p.label, 12)
            spot = (
                placer.place(around_point(px, py, POINT_LABEL_SIZE), label, POINT_LABEL_SIZE)
                if label
                else None
            )
            if spot is not None:
                out.append(_text(spot[0], spot[1], label, size=POINT_LABEL_SIZE, anchor=spot[2], fill="#333"))
        out += _legend_line(right, index, top, s.name, color)
    key_y = top + 6 + LEGEND_ROW * len(series)
    out.append(f'<circle cx="{right + 23}" cy="{key_y:.1f}" r="4.5" fill="#555"/>')
    out.append(_label(right + 38, key_y + 4, measured_name, 20))
    out.append(_diamond(right + 23, key_y + LEGEND_ROW, "#555"))
    out.append(_label(right + 38, key_y + LEGEND_ROW + 4, bound_name, 20))
    return _svg(width, height, title, "chart gap", out)


def _diamond(x: float, y: float, color: str, size: float = 5.0) -> str:
    return (
        f'<polygon points="{x:.1f},{y - size:.1f} {x + size:.1f},{y:.1f} {x:.1f},{y + size:.1f} '
        f'{x - size:.1f},{y:.1f}" fill="#fff" stroke="{color}" stroke-width="2"/>'
    )
