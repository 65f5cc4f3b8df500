"""Plotly figures for the workbook notebooks.

Figures render with plotly.js embedded in the notebook output (renderer
``notebook``), so the executed notebooks and their HTML export work offline.
"""

from __future__ import annotations

import math

import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from .formats import ELEMENT_FORMATS

__all__ = [
    "use_offline_renderer",
    "table",
    "layer_sqnr_figure",
    "bar_figure",
    "heatmap_figure",
    "scatter_figure",
    "e4m3_code_map_figure",
    "grouped_bar_figure",
    "expert_loss_heatmap",
    "scale_code_histogram_figure",
    "spread_figure",
    "moe_layer_time_figures",
    "model_time_figure",
]


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


def e4m3_code_map_figure() -> go.Figure:
    """Every e4m3 code 0x00-0xFF as a 16 x 16 heatmap of its signed log2 magnitude (NaN codes 0)."""
    e4m3 = ELEMENT_FORMATS["e4m3"]
    grid = [[e4m3.code_value(16 * r + c) for c in range(16)] for r in range(16)]
    z = [[math.copysign(math.log2(abs(v)), v) if v and math.isfinite(v) else 0 for v in row] for row in grid]
    return heatmap_figure(z, [f"x{c:X}" for c in range(16)], [f"{r:X}x" for r in range(16)],
                          "e4m3 codes 0x00-0xFF: signed log2 of the value (0x7F and 0xFF are NaN)", "±log2|v|")


def grouped_bar_figure(rows: list[dict], group: str, xs: list[str], title: str, ytitle: str) -> go.Figure:
    """One bar group per key in ``xs``, one bar (trace) per row, named by ``row[group]``."""
    fig = go.Figure()
    for r in rows:
        fig.add_trace(go.Bar(name=str(r[group]), x=list(xs), y=[r[x] for x in xs]))
    fig.update_layout(barmode="group", title=title, yaxis_title=ytitle)
    return fig


def expert_loss_heatmap(experts: list[dict], num_layers: int, num_experts: int, point: str = "a2",
                        strategy: str = "max") -> go.Figure:
    """dB lost by ``strategy`` against ``per_expert`` for every (layer, expert) at ``point``, from
    ``mxlib.studies.unification_study``'s ``experts`` rows; experts without a row stay blank."""
    z = [[float("nan")] * num_experts for _ in range(num_layers)]
    for r in experts:
        if r["point"] == point:
            z[r["layer"]][r["expert"]] = r[f"db_lost_{strategy}"]
    return heatmap_figure(z, list(range(num_experts)), [f"layer {i}" for i in range(num_layers)],
                          f"dB lost by `{strategy}` against `per_expert` ({point})", "dB")


def scale_code_histogram_figure(histograms: dict[str, list[int]], strategies=("max", "per_expert"),
                                point: str = "a2") -> go.Figure:
    """Overlaid histograms of e4m3 block-scale codes (0-126) per strategy, log counts; codes 0-7
    (e4m3's subnormals, 0 a flushed block) shaded."""
    fig = go.Figure()
    for s in strategies:
        if s in histograms:
            fig.add_trace(go.Bar(x=list(range(len(histograms[s]))), y=histograms[s], name=s))
    fig.add_vrect(x0=-0.5, x1=7.5, fillcolor="red", opacity=0.1, annotation_text="subnormal scales")
    fig.update_layout(barmode="overlay", title=f"e4m3 block-scale codes of {point} blocks", xaxis_title="e4m3 code",
                      yaxis_title="blocks", yaxis_type="log")
    return fig


def spread_figure(spread_rows: list[dict]) -> go.Figure:
    """Mean and worst-expert dB lost (a1, a2) against ``expert_spread``, from spread-study rows."""
    fig = go.Figure()
    for point in ("a1", "a2"):
        rr = [r for r in spread_rows if r["point"] == point]
        fig.add_trace(go.Scatter(x=[r["spread"] for r in rr], y=[r["mean_db_lost"] for r in rr], name=f"{point} mean",
                                 mode="lines+markers"))
        fig.add_trace(go.Scatter(x=[r["spread"] for r in rr], y=[r["max_db_lost"] for r in rr],
                                 name=f"{point} worst expert", mode="lines+markers"))
    fig.update_layout(title="Loss of the single global scale vs per-expert weight spread",
                      xaxis_title="expert_spread (sigma)", yaxis_title="dB lost")
    return fig


def moe_layer_time_figures(rows: list[dict], min_points: int = 4) -> list[go.Figure]:
    """One log-log figure per scheme with at least ``min_points`` token counts: bf16, seed and fused
    times (graph replay solid, eager dotted) and the memory floor, from MoE-benchmark rows."""
    figs = []
    for scheme in dict.fromkeys(r["scheme"] for r in rows):
        rr = [r for r in rows if r["scheme"] == scheme]
        if len(rr) < min_points:
            continue
        m = [r["M"] for r in rr]
        fig = go.Figure()
        for path in ("bf16", "seed", "fused"):
            fig.add_trace(go.Scatter(x=m, y=[r[f"{path}_graph_ms"] for r in rr], name=f"{path} (graph)", mode="lines+markers"))
            fig.add_trace(go.Scatter(x=m, y=[r[f"{path}_ms"] for r in rr], name=f"{path} (eager)", mode="lines+markers",
                                     line=dict(dash="dot")))
        fig.add_trace(go.Scatter(x=m, y=[r["floor_ms"] for r in rr], name="memory floor", line=dict(dash="dash")))
        fig.update_layout(title=f"{scheme}: MoE layer time", xaxis_title="tokens M", yaxis_title="ms", xaxis_type="log",
                          yaxis_type="log")
        figs.append(fig)
    return figs


def model_time_figure(model_rows: list[dict]) -> go.Figure:
    """Whole-model forward time per path (bf16, seed, fused), one bar group per (layers, tokens)."""
    fig = go.Figure()
    for path in ("bf16", "seed", "fused"):
        fig.add_trace(go.Bar(x=[f"{r['layers']} layers, {r['tokens']} tokens" for r in model_rows],
                             y=[r[f"{path}_ms"] for r in model_rows], name=path))
    fig.update_layout(barmode="group", title="Whole-model forward time", yaxis_title="ms")
    return fig
