"""The spread of a measurement over repeats, and the orderings that exceed it.

The workbook's end-to-end comparisons (notebooks 01 and 03) run on several evaluation token sets
(``steps.evaluation_token_sets``): one metric per set. ``spread`` summarizes them (mean, lowest,
highest); ``ordering`` compares two paired series (the same token sets through two schemes) and
calls the ordering resolved only where the mean difference exceeds twice the differences'
standard deviation and every repeat agrees on its sign: otherwise the two are within the noise
of the token sets, and a notebook states no ordering between them.
"""

from __future__ import annotations

import math

__all__ = ["spread", "ordering", "spread_text"]


def _check_values(values, name: str) -> list[float]:
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError(f"{name}: expected at least one value, got none")
    if not all(math.isfinite(v) for v in vals):
        raise ValueError(f"{name}: expected finite values, got {vals}")
    return vals


def spread(values, name: str = "values") -> dict:
    """``{"mean", "low", "high", "std", "n"}`` of a metric over repeats (``std`` with ``n - 1``; 0 for one).

    Raises:
        ValueError: no values, or a non-finite one (the message names ``name``).
    """
    vals = _check_values(values, name)
    n = len(vals)
    mean = sum(vals) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1)) if n > 1 else 0.0
    return dict(mean=mean, low=min(vals), high=max(vals), std=std, n=n)


def spread_text(values, digits: int = 2) -> str:
    """``"mean (low to high, n)"``: how a notebook prints a metric beside the ordering it supports."""
    s = spread(values)
    return f"{s['mean']:.{digits}f} ({s['low']:.{digits}f} to {s['high']:.{digits}f}, {s['n']} repeats)"


def ordering(a, b, names: tuple[str, str] = ("a", "b")) -> dict:
    """Whether ``a`` and ``b`` (the same repeats through two runs, paired) are ordered beyond their spread.

    Returns:
        ``{"difference": spread of a - b, "order": "a > b" | "b > a" | "within noise"}`` with the two
        names of ``names``. Resolved when ``|mean(a - b)| > 2 * std(a - b)`` and every repeat's
        difference has the sign of the mean; a single repeat never resolves (no spread to compare).

    Raises:
        ValueError: series of different lengths, empty or non-finite.
    """
    va, vb = _check_values(a, names[0]), _check_values(b, names[1])
    if len(va) != len(vb):
        raise ValueError(f"{names[0]}, {names[1]}: expected paired series of one length, got {len(va)} and {len(vb)}")
    d = spread([x - y for x, y in zip(va, vb)], f"{names[0]} - {names[1]}")
    order = "within noise"
    if d["n"] > 1 and abs(d["mean"]) > 2 * d["std"] and (d["low"] > 0 or d["high"] < 0):
        order = f"{names[0]} > {names[1]}" if d["mean"] > 0 else f"{names[1]} > {names[0]}"
    return dict(difference=d, order=order)
