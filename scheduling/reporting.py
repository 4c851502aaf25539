"""Figures for people: the one percentile and the one plain-text table of `bench/` and `rehearse`."""
import math
from collections.abc import Iterable, Sequence


def percentile(values: Iterable[float | None], p: float):
    """Linear interpolation between the closest ranks (numpy's default); None for no values.

    Where the rank is exact the value itself comes back, so the median of an odd count of
    integers stays an integer (byte counts and peak RSS keep their form in JSON).
    """
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    if lo == hi:
        return xs[lo]
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def median(values: Iterable[float | None]):
    return percentile(values, 50)


def fmt(value, spec: str, missing: str = "-") -> str:
    """`format(value, spec)`, or `missing` for None."""
    return missing if value is None else format(value, spec)


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str] | None], right: Iterable[int] = ()) -> str:
    """Columns as wide as their widest cell, two spaces apart, a rule under the headers.

    `right`: indexes of the right-aligned columns; a None row is an empty line (a group break).
    """
    right = set(right)
    widths = [max([len(h), *(len(r[i]) for r in rows if r)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), line(["-" * w for w in widths]),
                      *("" if r is None else line(r) for r in rows)])
