"""Notebook 06's figures (``mxlib.studies.accuracy``): paired intervals, learned routing, per-expert amax.

Conventions of ``mxlib.workbook.figures``: one colour per series from ``PALETTE``, titled axes, e4m3's
thresholds drawn by ``add_scale_ratio_thresholds``.
"""

from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..formats import NVFP4_FLUSH_RATIO
from .figures import PALETTE, add_scale_ratio_thresholds

__all__ = ["interval_figure", "usage_figure", "amax_figure"]


def interval_figure(rows: list[dict], key: str, title: str) -> go.Figure:
    """Two panels, one point per ``row[key]`` and task with its paired 95 % interval as error bars:
    the exact-match difference against bf16 (top) and the NLL-per-token difference (bottom)."""
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.08,
        subplot_titles=("exact match minus bf16", "NLL per token minus bf16 [nats]"),
    )
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    for k, t in enumerate(tasks):
        tr = [r for r in rows if r["task"] == t]
        x = [r[key] for r in tr]
        color = PALETTE[k % len(PALETTE)]
        for row, (y, lo, hi) in enumerate(
            (("delta_exact_match", "delta_low", "delta_high"), ("delta_nll", "delta_nll_low", "delta_nll_high")), 1
        ):
            fig.add_trace(
                go.Scatter(
                    x=x,
                    y=[r[y] for r in tr],
                    error_y=dict(
                        type="data",
                        array=[r[hi] - r[y] for r in tr],
                        arrayminus=[r[y] - r[lo] for r in tr],
                    ),
                    mode="markers",
                    marker=dict(color=color),
                    name=t,
                    legendgroup=t,
                    showlegend=row == 1,
                ),
                row=row,
                col=1,
            )
    fig.add_hline(y=0, line=dict(color="gray", dash="dot"), row=1, col=1)
    fig.add_hline(y=0, line=dict(color="gray", dash="dot"), row=2, col=1)
    fig.update_layout(title=title, height=650, legend_title_text="task")
    return fig


def usage_figure(usage: dict[str, list[list[float]]]) -> go.Figure:
    """A heatmap of the routed share of each expert (columns) per task and layer (rows), over the
    uniform share (1 = uniform)."""
    y, z = [], []
    for t, layers in usage.items():
        for i, shares in enumerate(layers):
            y.append(f"{t} L{i}")
            z.append([s * len(shares) for s in shares])
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=[f"e{e}" for e in range(len(z[0]))],
            y=y,
            colorscale="Viridis",
            colorbar=dict(title="share / uniform"),
        )
    )
    fig.update_layout(
        title="Learned routing: each expert's share of a task's (token, expert) pairs", height=120 + 24 * len(y)
    )
    fig.update_yaxes(autorange="reversed")
    return fig


def amax_figure(rows: list[dict]) -> go.Figure:
    """dB lost by ``max`` against ``per_expert`` on each expert's own activations, against its scale
    ratio ``r`` (log axis), a1 and a2, with e4m3's subnormal and flush thresholds drawn."""
    fig = go.Figure()
    for k, point in enumerate(("a1", "a2")):
        pr = [r for r in rows if r["point"] == point]
        fig.add_trace(
            go.Scatter(
                x=[r["scale_ratio"] for r in pr],
                y=[r["db_lost_max"] for r in pr],
                mode="markers",
                name=point,
                marker=dict(color=PALETTE[k]),
                text=[f"layer {r['layer']} expert {r['expert']}: amax {r['amax']:.3g}" for r in pr],
            )
        )
    fig.update_layout(
        title="The trained model's experts: dB lost under one global scale (max)",
        xaxis_title="expert scale ratio r to the layer's max",
        yaxis_title="dB lost against per_expert",
    )
    fig.update_xaxes(type="log", range=[math.log10(NVFP4_FLUSH_RATIO) - 0.5, 0.1])
    return add_scale_ratio_thresholds(fig)
