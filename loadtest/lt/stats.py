"""Percentiles and rounding, as every report of loadtest/ computes them."""

import math


def percentile(vals, q):
    """The nearest-rank q-th percentile of vals (any order; None values are
    left out); None when there is none."""
    s = sorted(v for v in vals if v is not None)
    if not s:
        return None
    k = max(0, min(len(s) - 1, math.ceil(q / 100.0 * len(s)) - 1))
    return s[k]


def rnd(x, nd=1):
    """x rounded to nd decimals; None stays None."""
    return None if x is None else round(x, nd)
