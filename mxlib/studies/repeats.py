"""The spread of a measurement over repeats.

The workbook's end-to-end comparisons (notebooks 01 and 03) run on several evaluation token sets
(``steps.evaluation_token_sets``): one metric per set. ``spread`` summarizes them (mean, lowest,
highest, standard deviation) and ``spread_text`` prints that summary. Whether two runs are ordered beyond that
spread is decided by ``mxlib.stats`` (the token set as the unit of replication), never here.
"""

from __future__ import annotations

import math

__all__ = ["spread", "spread_text"]


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
    """``"mean (low to high, n)"``: how a notebook prints a metric over its repeats."""
    s = spread(values)
    return f"{s['mean']:.{digits}f} ({s['low']:.{digits}f} to {s['high']:.{digits}f}, {s['n']} repeats)"
