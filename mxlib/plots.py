"""Plotly figures for the workbook notebooks.

Figures render with plotly.js embedded in the notebook output (renderer
``notebook``), so the executed notebooks and their HTML export work offline.
"""

from __future__ import annotations

import math

import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

__all__ = ["use_offline_renderer", "table", "layer_sqnr_figure", "bar_figure", "heatmap_figure", "scatter_figure"]


def use_offline_renderer() -> None:
    """Embed plotly.js in notebook outputs (self-contained HTML export, no network)."""
    pio.renderers.default = "notebook"


def _fmt(v):
    if isinstance(v, float):
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return f"{v:.4g}"
    return str(v)


def table(rows: list[dict], title: str = "", columns: list[str] | None = None) -> go.Figure:
    """A plotly table of dict rows (floats shown with 4 significant digits)."""
    columns = columns or list(rows[0])
    cells = [[_fmt(r.get(c, "")) for r in rows] for c in columns]
    fig = go.Figure(go.Table(header=dict(values=columns, align="left"), cells=dict(values=cells, align="left")))
    fig.update_layout(title=title, height=min(120 + 28 * len(rows), 900), margin=dict(l=10, r=10, t=40, b=10))
    return fig


def layer_sqnr_figure(per_layer: dict[str, list[dict]], title: str = "SQNR of each decoder layer's output") -> go.Figure:
    """One line per run: SQNR (dB) of each decoder layer's output against the bf16 model."""
    fig = go.Figure()
    for name, layers in per_layer.items():
        fig.add_trace(go.Scatter(x=[r["layer"] for r in layers], y=[r["sqnr_db"] for r in layers],
                                 mode="lines+markers", name=name))
    fig.update_layout(title=title, xaxis_title="decoder layer", yaxis_title="SQNR vs bf16 [dB]")
    fig.update_xaxes(dtick=1)
    return fig


def bar_figure(rows: list[dict], x: str, ys: list[str], title: str = "", ytitles: list[str] | None = None) -> go.Figure:
    """Side-by-side bar charts, one panel per metric in ``ys``."""
    fig = make_subplots(rows=1, cols=len(ys), subplot_titles=ytitles or ys)
    for i, y in enumerate(ys, 1):
        fig.add_trace(go.Bar(x=[r[x] for r in rows], y=[r[y] for r in rows], name=y, showlegend=False), row=1, col=i)
    fig.update_layout(title=title, height=450)
    return fig


def heatmap_figure(z, x, y, title: str, colorbar: str) -> go.Figure:
    fig = go.Figure(go.Heatmap(z=z, x=x, y=y, colorbar=dict(title=colorbar), colorscale="Viridis"))
    fig.update_layout(title=title)
    return fig


def scatter_figure(traces: dict[str, tuple], title: str, xtitle: str, ytitle: str, log_x: bool = False) -> go.Figure:
    """``traces``: name -> (x values, y values[, hover texts])."""
    fig = go.Figure()
    for name, tr in traces.items():
        fig.add_trace(go.Scatter(x=tr[0], y=tr[1], mode="markers", name=name,
                                 text=tr[2] if len(tr) > 2 else None))
    fig.update_layout(title=title, xaxis_title=xtitle, yaxis_title=ytitle)
    if log_x:
        fig.update_xaxes(type="log")
    return fig
