"""Tiny SVG chart helpers: a scatter/line chart, a measured-vs-bound gap chart and a heatmap, as strings to
inline in an HTML page.

No plotting library: the report must render offline, in any browser, from one file. Coordinates are in
CSS pixels; every chart is a standalone ``<svg>`` element with a ``<title>`` for screen readers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from html import escape

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

FONT = "font-family:system-ui,-apple-system,'Segoe UI',sans-serif"


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


def _text(x: float, y: float, text: str, size: int = 11, anchor: str = "start", **attrs: str) -> str:
    extra = "".join(f' {k.replace("_", "-")}="{escape(v)}"' for k, v in attrs.items())
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}"{extra}>'
        f"{escape(text)}</text>"
    )


def _open(width: float, height: float, title: str, css_class: str) -> list[str]:
    return [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="{css_class}" width="{width:.0f}" '
        f'height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" role="img" style="{FONT}">',
        f"<title>{escape(title)}</title>",
        f'<rect x="0" y="0" width="{width:.0f}" height="{height:.0f}" fill="#ffffff"/>',
    ]


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


def _frame(
    out: list[str],
    x_axis: Axis,
    y_axis: Axis,
    height: int,
    title: str,
    x_label: str,
    y_label: str,
    x_format: Callable[[float], str],
    y_format: Callable[[float], str],
) -> None:
    """Title, grid lines with tick labels, the plot frame and the axis labels."""
    left, right, top, bottom = x_axis.start, x_axis.end, y_axis.end, y_axis.start
    out.append(_label(left, 20, title, 72, size=13, font_weight="600"))
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
    out.append(_text((left + right) / 2, height - 10, x_label, anchor="middle"))
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


def _fit_height(height: int, top: int, legend_rows: int) -> int:
    """``height``, or more when the legend needs more rows than the plot is tall."""
    return max(height, top + 6 + LEGEND_ROW * legend_rows + 40)


# ----------------------------------------------------------------------------------------- charts


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
    """Scatter points of each series (joined in x order when ``connect``), with axes, labels and a legend
    (long names shortened, the whole name in a tooltip; the chart grows when the legend needs it). Each point
    has a tooltip with its series, x and y."""
    top = 34
    height = _fit_height(height, top, len(series))
    left, right, bottom = 58, width - LEGEND_WIDTH - 10, height - 46
    xs = [x for s in series for x, _ in s.points]
    ys = [y for s in series for _, y in s.points]
    x_axis = Axis.fit(xs, left, right, log=x_log)
    y_axis = Axis.fit(ys, bottom, top, log=y_log, low=y_low, high=y_high)
    out = _open(width, height, title, "chart")
    _frame(out, x_axis, y_axis, height, title, x_label, y_label, x_format, y_format)
    for index, s in enumerate(series):
        color = s.color or PALETTE[index % len(PALETTE)]
        ordered = sorted(zip(s.points, s.labels or [""] * len(s.points), strict=False))
        pixels = [(x_axis(x), y_axis(y), x, y, label) for (x, y), label in ordered]
        dash = ' stroke-dasharray="5,4"' if s.dashed else ""
        if connect and len(pixels) > 1:
            path = " ".join(f"{px:.1f},{py:.1f}" for px, py, *_ in pixels)
            out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        for px, py, x, y, label in pixels:
            tip = f"{s.name}{f' ({label})' if label else ''}: {x_format(x)}, {y_format(y)}"
            out.append(
                f'<circle cx="{px:.1f}" cy="{py:.1f}" r="4.5" fill="{color}" stroke="#fff">'
                f"<title>{escape(tip)}</title></circle>"
            )
            if label:
                out.append(_label(px + 6, py - 6, label, 22, size=9, fill="#333"))
        out += _legend_line(right, index, top, s.name, color, dash)
    out.append("</svg>")
    return "\n".join(out)


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
    across x. The legend names the series, then the two markers."""
    top = 34
    height = _fit_height(height, top, len(series) + 2)
    left, right, bottom = 58, width - LEGEND_WIDTH - 10, height - 46
    xs = [p.x for s in series for p in s.points]
    ys = [v for s in series for p in s.points for v in (p.y, p.bound)]
    if reference is not None:
        ys.append(reference)
    x_axis = Axis.fit(xs, left, right, log=x_log)
    y_axis = Axis.fit(ys, bottom, top, low=0.0)
    out = _open(width, height, title, "chart gap")
    _frame(out, x_axis, y_axis, height, title, x_label, y_label, x_format, y_format)
    if reference is not None:
        y = y_axis(reference)
        out.append(
            f'<line x1="{left}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="#555" stroke-dasharray="5,4"/>'
        )
    placed: list[tuple[float, float, float, float]] = []  # label boxes drawn so far
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
            label = _place_label(px, py, _shorten(p.label, 12), placed, (left, top, right, bottom))
            if label:
                out.append(label)
        out += _legend_line(right, index, top, s.name, color)
    key_y = top + 6 + LEGEND_ROW * len(series)
    out.append(f'<circle cx="{right + 23}" cy="{key_y:.1f}" r="4.5" fill="#555"/>')
    out.append(_label(right + 38, key_y + 4, measured_name, 20))
    out.append(_diamond(right + 23, key_y + LEGEND_ROW, "#555"))
    out.append(_label(right + 38, key_y + LEGEND_ROW + 4, bound_name, 20))
    out.append("</svg>")
    return "\n".join(out)


def _place_label(
    x: float,
    y: float,
    text: str,
    placed: list[tuple[float, float, float, float]],
    frame: tuple[float, float, float, float],
    size: int = 9,
) -> str:
    """A small label right or left of the point ``(x, y)``, where it overlaps no label placed before it and
    stays inside ``frame``; nothing when neither side is free (the point's tooltip still says it)."""
    if not text:
        return ""
    width, height = 0.58 * size * len(text), size + 1.0
    left, top, right, bottom = frame
    for x0, anchor in ((x + 7, "start"), (x - 7 - width, "end")):
        box = (x0, y + 3 - size, x0 + width, y + 3 - size + height)
        inside = box[0] >= left and box[2] <= right and box[1] >= top and box[3] <= bottom
        if inside and not any(
            box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in placed
        ):
            placed.append(box)
            tx = x + 7 if anchor == "start" else x - 7
            return _text(tx, y + 3, text, size=size, anchor=anchor, fill="#333")
    return ""


def _diamond(x: float, y: float, color: str, size: float = 5.0) -> str:
    return (
        f'<polygon points="{x:.1f},{y - size:.1f} {x + size:.1f},{y:.1f} {x:.1f},{y + size:.1f} '
        f'{x - size:.1f},{y:.1f}" fill="#fff" stroke="{color}" stroke-width="2"/>'
    )


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


def heatmap(
    row_labels: Sequence[str],
    column_labels: Sequence[str],
    values: Sequence[Sequence[float | None]],
    title: str,
    x_label: str = "context tokens",
    y_label: str = "depth",
    cell: int = 38,
) -> str:
    """A grid of score cells (rows top to bottom, columns left to right) with the score written in each."""
    left, top = 52, 34
    width = max(left + cell * len(column_labels) + 12, 190)
    height = top + cell * len(row_labels) + 40
    out = _open(width, height, title, "heatmap")
    out.append(_text(4, 18, _shorten(title, 34), size=12, font_weight="600"))
    for r, label in enumerate(row_labels):
        y = top + r * cell
        out.append(_text(left - 5, y + cell / 2 + 4, label, size=10, anchor="end", fill="#444"))
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
                out.append(
                    _text(
                        x + cell / 2,
                        y + cell / 2 + 4,
                        f"{100 * value:.0f}",
                        size=10,
                        anchor="middle",
                        fill=ink,
                    )
                )
    bottom = top + cell * len(row_labels)
    for c, label in enumerate(column_labels):
        out.append(
            _text(left + c * cell + cell / 2, bottom + 13, label, size=10, anchor="middle", fill="#444")
        )
    out.append(_text(left + cell * len(column_labels) / 2, bottom + 30, x_label, size=10, anchor="middle"))
    out.append(
        f'<text transform="translate(11,{top + cell * len(row_labels) / 2:.1f}) rotate(-90)" font-size="10" '
        f'text-anchor="middle">{escape(y_label)}</text>'
    )
    out.append("</svg>")
    return "\n".join(out)
