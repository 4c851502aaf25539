"""Charts drawn on the server as plain SVG: nothing is loaded from another host, so the admin
works offline. Every label goes through Django's escaping (format_html)."""
from collections.abc import Sequence

from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

USED, RESERVED, LIMIT, FAILED, HELD = "#417690", "#79aec8", "#999", "#ba2121", "#d49a00"


def burn_down(*, used: int, reserved: int, limit: int, width: int = 160) -> SafeString:
    """One budget as a bar: used (dark), reserved (light), of the limit (the frame)."""
    scale = width / max(limit, used + reserved, 1)
    used_w, reserved_w = round(used * scale), round(reserved * scale)
    return format_html(
        '<svg class="burn-down" width="{}" height="12" role="img" aria-label="{} used, {} reserved of {}">'
        '<rect width="{}" height="12" fill="#eee" stroke="{}"/><rect width="{}" height="12" fill="{}"/>'
        '<rect x="{}" width="{}" height="12" fill="{}"/></svg>',
        width, used, reserved, limit, round(limit * scale), LIMIT, used_w, USED, used_w, reserved_w, RESERVED,
    )


def bars(rows: Sequence[tuple[str, float]], *, unit: str = "", color: str = USED, width: int = 560) -> SafeString:
    """Horizontal bars, one per (label, value), with the value written beside each."""
    if not rows:
        return mark_safe('<p class="chart-empty">nothing to show</p>')
    top = max(value for _, value in rows) or 1
    line, label_w, bar_w = 18, 230, width - 230 - 80
    body = format_html_join("", (
        '<text x="0" y="{}" font-size="11">{}</text><rect x="{}" y="{}" width="{}" height="12" fill="{}"/>'
        '<text x="{}" y="{}" font-size="11">{} {}</text>'), (
        (i * line + 11, label[:40], label_w, i * line + 1, round(bar_w * value / top), color,
         label_w + round(bar_w * value / top) + 4, i * line + 11, _num(value), unit)
        for i, (label, value) in enumerate(rows)))
    return format_html('<svg class="chart" width="{}" height="{}" role="img">{}</svg>', width, len(rows) * line, body)


def columns(series: dict[str, Sequence[float]], labels: Sequence[str], *, colors: dict[str, str],
            limit: Sequence[float] | None = None, unit: str = "", width: int = 480, height: int = 120) -> SafeString:
    """Stacked columns per label (e.g. per hour or day), with an optional limit drawn as a line."""
    totals = [sum(values[i] for values in series.values()) for i in range(len(labels))]
    top = max([*totals, *(limit or []), 1])
    step = width / max(len(labels), 1)
    rects = []
    for i in range(len(labels)):
        y = height
        for name, values in series.items():
            h = height * values[i] / top
            y -= h
            rects.append((round(i * step + 1, 1), round(y, 1), round(max(step - 2, 1), 1), round(h, 1), colors[name],
                          f"{labels[i]} {name}: {_num(values[i])} {unit}"))
    body = format_html_join("", '<rect x="{}" y="{}" width="{}" height="{}" fill="{}"><title>{}</title></rect>', rects)
    if limit:
        points = " ".join(f"{round(i * step + step / 2, 1)},{round(height - height * v / top, 1)}" for i, v in enumerate(limit))
        body += format_html('<polyline points="{}" fill="none" stroke="{}" stroke-dasharray="4 2" vector-effect="non-scaling-stroke"/>', points, FAILED)
    legend = format_html_join(" ", '<span style="color:{}">&#9632; {}</span>', ((c, n) for n, c in colors.items()))
    return format_html(
        '<svg class="chart" viewBox="0 0 {} {}" width="100%" height="{}" preserveAspectRatio="none" role="img" '
        'aria-label="top {} {}">{}</svg><div class="chart-legend">{} {} &middot; {} &ndash; {} &middot; top {} {}</div>',
        width, height, height, _num(top), unit, body, legend,
        format_html('<span style="color:{}">- - limit</span>', FAILED) if limit else "",
        labels[0] if labels else "", labels[-1] if labels else "", _num(top), unit)


def _num(value: float) -> str:
    return f"{value:,.0f}" if value >= 10 or value == int(value) else f"{value:.1f}"
