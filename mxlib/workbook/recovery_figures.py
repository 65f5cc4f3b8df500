"""Notebook 07's figures (``mxlib.studies.recovery``): the rotation trap, each technique against
round-to-nearest with paired intervals, weight error against layer SQNR, the block scales a
technique moved.

Conventions of ``mxlib.workbook.figures``: one colour per series from ``PALETTE``, titled axes.
"""

from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .figures import PALETTE

__all__ = ["rotation_trap_figure", "vs_rtn_figure", "mse_sqnr_figure", "scale_ratio_figure"]


_TRAP_PANELS = (
    ("sqnr_db", "activation SQNR, every value [dB]"),
    ("other_sqnr_db", "SQNR of the other channels [dB]"),
    ("outlier_rel_error", "outlier channels' relative error"),
    ("gemm_rel_error", "GEMM output relative error"),
)


def rotation_trap_figure(rows: list[dict]) -> go.Figure:
    """Bars of what a random-sign block Hadamard rotation changes (``recovery_measures.rotation_trap``'s
    ``rows``: rotated minus plain, means over the draws), per format and rotation size, one panel per measure:
    the activations' SQNR over every value (energy-weighted) and over the other channels, the outlier channels'
    relative error, the GEMM output's relative error. SQNR up is better; an error down is better."""
    fig = make_subplots(rows=2, cols=2, subplot_titles=[t for _, t in _TRAP_PANELS], vertical_spacing=0.15)
    formats = list(dict.fromkeys(r["format"] for r in rows))
    for k, f in enumerate(formats):
        fr = [r for r in rows if r["format"] == f]
        x = [f"{r['points']} points" for r in fr]
        for p, (col, _) in enumerate(_TRAP_PANELS):
            fig.add_trace(
                go.Bar(
                    x=x,
                    y=[r[f"rotated_{col}"] - r[col] for r in fr],
                    name=f,
                    legendgroup=f,
                    showlegend=p == 0,
                    marker=dict(color=PALETTE[k % len(PALETTE)]),
                ),
                row=p // 2 + 1,
                col=p % 2 + 1,
            )
    fig.update_yaxes(title_text="rotated minus plain")
    fig.update_layout(
        title="What a random-sign block Hadamard rotation changes, outliers in fixed channels (mean over the draws)",
        barmode="group",
        height=600,
    )
    return fig


def vs_rtn_figure(rows: list[dict], scheme: str) -> go.Figure:
    """Two panels, one point per technique and task of ``scheme`` with its paired 95 % interval
    against round-to-nearest: exact match (top) and NLL per token (bottom); RTN itself is the 0 line."""
    rows = [r for r in rows if r["scheme"] == scheme and "vs_exact_match" in r]
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.08,
        subplot_titles=("exact match minus rtn", "NLL per token minus rtn [nats]"),
    )
    for k, t in enumerate(dict.fromkeys(r["task"] for r in rows)):
        tr = [r for r in rows if r["task"] == t]
        for row, (y, lo, hi) in enumerate(
            (("vs_exact_match", "vs_low", "vs_high"), ("vs_nll", "vs_nll_low", "vs_nll_high")), 1
        ):
            fig.add_trace(
                go.Scatter(
                    x=[r["technique"] for r in tr],
                    y=[r[y] for r in tr],
                    error_y=dict(type="data", array=[r[hi] - r[y] for r in tr], arrayminus=[r[y] - r[lo] for r in tr]),
                    mode="markers",
                    marker=dict(color=PALETTE[k % len(PALETTE)]),
                    name=t,
                    legendgroup=t,
                    showlegend=row == 1,
                ),
                row=row,
                col=1,
            )
    for row in (1, 2):
        fig.add_hline(y=0, line=dict(color="gray", dash="dot"), row=row, col=1)
    fig.update_layout(title=f"{scheme}: each technique against round-to-nearest, paired 95 % intervals", height=650)
    return fig


def mse_sqnr_figure(rows: list[dict]) -> go.Figure:
    """The dummy model's weight MSE (log axis) against its last decoder layer's SQNR, one point per
    technique, one series per scheme: a lower weight MSE need not give a higher layer SQNR."""
    fig = go.Figure()
    for k, s in enumerate(dict.fromkeys(r["scheme"] for r in rows)):
        sr = [r for r in rows if r["scheme"] == s]
        fig.add_trace(
            go.Scatter(
                x=[r["weight_mse"] for r in sr],
                y=[r["layer_sqnr_db"][-1] for r in sr],
                mode="markers+text",
                text=[r["technique"] for r in sr],
                textposition="top center",
                name=s,
                marker=dict(color=PALETTE[k % len(PALETTE)], size=9),
            )
        )
    fig.update_layout(
        title="Dummy Qwen3-30B-A3B-shaped layers: weight error against the last layer's SQNR",
        xaxis_title="weight MSE (in the basis the technique stores)",
        yaxis_title="last decoder layer SQNR against bf16 [dB]",
        height=520,
    )
    fig.update_xaxes(type="log")
    return fig


def scale_ratio_figure(layer0: dict, scheme: str) -> go.Figure:
    """Histograms of log2 of the applied-block-scale ratio technique / RTN over the blocks a
    technique changed in layer 0 (``block_changes``), one per technique of ``scheme``
    (4/6's blocks scaled to 4 instead of 6 sit at log2(6/4) = 0.58, the dashed line)."""
    fig = go.Figure()
    k = 0
    for (s, name), ch in layer0.items():
        if s != scheme or not sum(ch["ratio_counts"]):
            continue
        edges = ch["ratio_log2_edges"]
        fig.add_trace(
            go.Bar(
                x=[(a + b) / 2 for a, b in zip(edges, edges[1:])],
                y=ch["ratio_counts"],
                name=f"{name} ({100 * ch['scales_changed']:.1f} % of blocks)",
                marker=dict(color=PALETTE[k % len(PALETTE)]),
                opacity=0.6,
            )
        )
        k += 1
    fig.add_vline(x=math.log2(6 / 4), line=dict(color="gray", dash="dash"))
    fig.update_layout(
        title=f"{scheme}, layer 0: how far each technique moved the block scales it changed",
        xaxis_title="log2(block scale / rtn's block scale)",
        yaxis_title="blocks",
        barmode="overlay",
        height=450,
    )
    return fig
