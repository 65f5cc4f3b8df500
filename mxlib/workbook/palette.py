"""The workbook figures' colours: distinct hues in a fixed order (plotly's D3, black, gold, Dark24)."""

from __future__ import annotations

import plotly.colors

__all__ = ["PALETTE"]

# distinct colours for many series (plotly's default cycle repeats after 10): category10, then two
# more that differ from all of them, then Dark24's
PALETTE: tuple[str, ...] = tuple(
    dict.fromkeys([*plotly.colors.qualitative.D3, "#000000", "#FFD700", *plotly.colors.qualitative.Dark24])
)
