"""Charts drawn on the server as plain SVG: nothing is loaded from another host, so the admin
works offline. Every label goes through Django's escaping (format_html).

Each chart has its axes with their unit, and every bar or column carries its value twice: an SVG
`<title>` (the browser's own tooltip, and what a screen reader says) and a `data-tip` attribute
that the console's small script (templates/admin/ops/live.html) shows at once on hover.
"""
import math
from collections.abc import Sequence

from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

USED, RESERVED, LIMIT, FAILED, HELD = "#417690", "#79aec8", "#999", "#ba2121", "#d49a00"
AXIS, GRID, TEXT, LIMIT_LINE = "#888", "#ddd", "currentColor", "#555"
# A limit more than this many times the highest value is left off a chart's scale (and named).
OFF_SCALE = 4


def burn_down(*, used: int, reserved: int, limit: int, width: int = 160, unit: str = "ms") -> SafeString:
    """One budget as a bar: used (dark), reserved (light), of the limit (the frame)."""
    scale = width / max(limit, used + reserved, 1)
    used_w, reserved_w = round(used * scale), round(reserved * scale)
    tip = f"{_num(used)} used, {_num(reserved)} reserved of {_num(limit)} {unit}".strip()
    return format_html(
        '<svg class="burn-down" width="{}" height="12" role="img" aria-label="{}" data-tip="{}"><title>{}</title>'
        '<rect width="{}" height="12" fill="#eee" stroke="{}"/><rect width="{}" height="12" fill="{}"/>'
        '<rect x="{}" width="{}" height="12" fill="{}"/></svg>',
        width, tip, tip, tip, round(limit * scale), LIMIT, used_w, USED, used_w, reserved_w, RESERVED,
    )


def nice_top(value: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten at or above `value` (an axis' end)."""
    if value <= 0:
        return 1
    power = 10 ** math.floor(math.log10(value))
    return next(step * power for step in (1, 2, 5, 10) if step * power >= value)


def bars(rows: Sequence[tuple[str, float]], *, unit: str = "", color: str = USED, width: int = 560) -> SafeString:
    """Horizontal bars, one per (label, value), the value written beside each (its unit is the
    axis'), on an axis from 0 to a round top with its unit."""
    if not rows:
        return mark_safe('<p class="chart-empty">nothing to show</p>')
    top = nice_top(max(value for _, value in rows))
    line, label_w, value_w = 18, 300, 90
    bar_w = width - label_w - value_w
    axis_y = len(rows) * line + 2
    body = format_html_join("", (
        '<text x="0" y="{}" font-size="11" fill="currentColor">{}</text>'
        '<rect x="{}" y="{}" width="{}" height="12" fill="{}" data-tip="{}"><title>{}</title></rect>'
        '<text x="{}" y="{}" font-size="11" fill="currentColor">{}</text>'), (
        (i * line + 11, label[:52], label_w, i * line + 1, max(round(bar_w * value / top), 1), color,
         f"{label}: {_num(value)} {unit}", f"{label}: {_num(value)} {unit}",
         label_w + round(bar_w * value / top) + 4, i * line + 11, _num(value))
        for i, (label, value) in enumerate(rows)))
    ticks = format_html_join("", (
        '<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="{}"/>'
        '<text x="{}" y="{}" font-size="10" text-anchor="middle" fill="currentColor">{}</text>'), (
        (label_w + round(bar_w * f), axis_y, label_w + round(bar_w * f), axis_y + 4, AXIS,
         label_w + round(bar_w * f), axis_y + 15, _num(top * f)) for f in (0, 0.5, 1)))
    # The unit under the axis, after its top tick's value: beside it, "200" and "held" ran together.
    axis = format_html('<g pointer-events="none"><line x1="{}" y1="{}" x2="{}" y2="{}" stroke="{}"/>{}'
                       '<text x="{}" y="{}" font-size="10" text-anchor="end" fill="currentColor">{}</text></g>',
                       label_w, axis_y, label_w + bar_w, axis_y, AXIS, ticks, label_w + bar_w, axis_y + 28, unit)
    return format_html('<svg class="chart" width="{}" height="{}" viewBox="0 0 {} {}" role="img" aria-label="{}">{}{}</svg>',
                       width, axis_y + 32, width, axis_y + 32, unit, body, axis)


def columns(series: dict[str, Sequence[float]], labels: Sequence[str], *, colors: dict[str, str],
            limit: Sequence[float] | None = None, unit: str = "", width: int = 560, height: int = 140,
            x_unit: str = "", mark: str | None = None) -> SafeString:
    """Stacked columns per label (e.g. per hour or day), with an optional limit drawn as a line:
    a y axis from 0 to a round top in `unit`, an x axis with some of the labels (and `x_unit`),
    and every column's values on hover. A limit far above the values is left off the scale (the
    values would be a hairline under it) and named in the legend instead. `mark` names a series
    whose every non-zero value is also marked above its column with its count: one failure among
    hundreds of runs is a sliver no one sees."""
    totals = [sum(values[i] for values in series.values()) for i in range(len(labels))]
    highest = max([*totals, 0])
    off_scale = bool(limit) and highest > 0 and max(limit) > OFF_SCALE * highest or bool(limit) and highest == 0
    top = nice_top(max([*totals, *([] if off_scale else (limit or [])), 0]))
    left, bottom, right, top_margin = 46, 30, 8, 16
    plot_w, plot_h = width - left - right, height - bottom - top_margin
    base = top_margin + plot_h
    step = plot_w / max(len(labels), 1)
    rects = []
    for i in range(len(labels)):
        y = base
        tip = f"{labels[i]}: " + ", ".join(f"{name} {_num(values[i])}" for name, values in series.items()) + f" {unit}"
        if limit:
            tip += f" (limit {_num(limit[i])})"
        for name, values in series.items():
            h = plot_h * values[i] / top
            y -= h
            rects.append((round(left + i * step + 1, 1), round(y, 1), round(max(step - 2, 1), 1), round(h, 1),
                          colors[name], tip, tip))
        # An invisible full-height column: the whole slot answers the hover, also where nothing ran.
        rects.append((round(left + i * step, 1), top_margin, round(step, 1), plot_h, "transparent", tip, tip))
    grid = format_html_join("", '<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="{}"/>', (
        (left, round(base - plot_h * f, 1), left + plot_w, round(base - plot_h * f, 1), GRID) for f in (0.5, 1)))
    body = grid + format_html_join(
        "", '<rect x="{}" y="{}" width="{}" height="{}" fill="{}" data-tip="{}"><title>{}</title></rect>', rects)
    if mark:
        body += format_html_join("", (
            '<g pointer-events="none"><circle cx="{}" cy="{}" r="6" fill="{}"/>'
            '<text x="{}" y="{}" font-size="9" text-anchor="middle" fill="#fff">{}</text></g>'), (
            (round(left + i * step + step / 2, 1), top_margin - 8 + 1, colors[mark], round(left + i * step + step / 2, 1),
             top_margin - 8 + 4, _num(value)) for i, value in enumerate(series[mark]) if value))
    if limit and not off_scale:
        points = " ".join(f"{round(left + i * step + step / 2, 1)},{round(base - plot_h * v / top, 1)}"
                          for i, v in enumerate(limit))
        body += format_html('<polyline points="{}" fill="none" stroke="{}" stroke-dasharray="4 2" pointer-events="none"/>',
                            points, LIMIT_LINE)
    # The grid is drawn first (behind the columns); here only the x axis and the ticks' values.
    y_ticks = format_html_join("", (
        '<text x="{}" y="{}" font-size="10" text-anchor="end" fill="currentColor">{}</text>'), (
        (left - 4, round(base - plot_h * f + 3, 1), _num(top * f)) for f in (0, 0.5, 1)))
    y_ticks += format_html('<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="{}"/>', left, base, left + plot_w, base, AXIS)
    every = max(1, math.ceil(len(labels) / 6))
    x_ticks = format_html_join("", (
        '<text x="{}" y="{}" font-size="10" text-anchor="middle" fill="currentColor">{}</text>'), (
        (round(left + i * step + step / 2, 1), base + 13, labels[i]) for i in range(0, len(labels), every)))
    axes = format_html(
        '<g pointer-events="none">{}<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="{}"/>{}'
        '<text x="2" y="10" font-size="10" fill="currentColor">{}</text>'
        '<text x="{}" y="{}" font-size="10" text-anchor="end" fill="currentColor">{}</text></g>',
        y_ticks, left, top_margin, left, base, AXIS, x_ticks, unit, left + plot_w, base + 26, x_unit)
    legend = format_html_join(" ", '<span style="color:{}">&#9632; {}</span>', ((c, n) for n, c in colors.items()))
    if off_scale:
        limit_legend = format_html('<span class="limit-off-scale">limit {} {}: above this scale</span>',
                                   _num(max(limit)), unit)
    elif limit:
        limit_legend = format_html('<span style="color:{}">- - limit</span>', LIMIT_LINE)
    else:
        limit_legend = ""
    return format_html(
        '<svg class="chart" viewBox="0 0 {} {}" width="100%" style="max-width:{}px" role="img" aria-label="{} per {}">'
        '{}{}</svg><div class="chart-legend">{} {}</div>',
        width, height, width * 1.6, unit, x_unit or "column", body, axes, legend, limit_legend)


def _num(value: float) -> str:
    if value >= 10 or value == int(value):
        return f"{value:,.0f}"
    # Two decimals at most, none padded: an axis' 0.25 tick is "0.25", not "0.2" (it read as a lie).
    return f"{value:.2f}".rstrip("0").rstrip(".")
