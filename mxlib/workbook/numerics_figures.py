"""Figures of notebook 05's numerics study and whole-model forwards (re-exported by ``figures``)."""

from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .palette import PALETTE

__all__ = ["vllm_vs_hardware_figure", "model_forward_figure"]


def _finite_or_none(v):
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None


def vllm_vs_hardware_figure(studies: list[dict]) -> go.Figure:
    """``mxlib.studies.unification.vllm_vs_hardware_study`` results, one or more schemes.

    Left: per MoE layer, SQNR (dB) of vLLM's and the hardware numerics against the float64 MoE on
    the same quantized operands, of vLLM's against the hardware mode (same layer input), and of
    the layer's output in the two whole-model runs, one dash style per scheme. Right: the logits,
    vLLM vs hardware and each against the bf16 model. An SQNR of +inf (equal outputs: OCP MX) has
    no point or bar; its legend entry or bar label says so.
    """
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.62, 0.38],
        horizontal_spacing=0.1,
        subplot_titles=("each MoE layer", "logits, whole model"),
    )
    lines = (
        ("vllm_vs_ref_sqnr_db", "vLLM vs fp64", 6),
        ("hw_vs_ref_sqnr_db", "hardware vs fp64", 2),
        ("vllm_vs_hw_sqnr_db", "vLLM vs hardware", 2),
        ("e2e_vllm_vs_hw_sqnr_db", "vLLM vs hardware, whole-model runs (earlier layers' drift included)", 2),
    )
    dashes = ("solid", "dot", "dash", "dashdot")
    for si, st in enumerate(studies):
        layers = [r["layer"] for r in st["layers"]]
        for k, (key, label, width) in enumerate(lines):
            ys = [_finite_or_none(r[key]) for r in st["layers"]]
            equal = all(y is None for y in ys)
            fig.add_trace(
                go.Scatter(
                    x=layers,
                    y=ys,
                    mode="lines+markers",
                    name=f"{st['scheme']}: {label}" + (" (equal: +inf)" if equal else ""),
                    line=dict(color=PALETTE[k], dash=dashes[si % len(dashes)], width=width),
                    opacity=0.5 if width > 2 else 1.0,
                    marker=dict(symbol=si),
                ),
                row=1,
                col=1,
            )
    bars = (
        ("vllm_vs_hw_sqnr_db", "vLLM vs hardware"),
        ("vllm_vs_bf16_sqnr_db", "vLLM vs bf16"),
        ("hw_vs_bf16_sqnr_db", "hardware vs bf16"),
    )  # colours after the four lines
    names = [st["scheme"] for st in studies]
    for k, (key, label) in enumerate(bars):
        vals = [st["logits"][key] for st in studies]
        fig.add_trace(
            go.Bar(
                x=names,
                y=[_finite_or_none(v) for v in vals],
                name=f"logits: {label}",
                marker_color=PALETTE[4 + k],
                text=["equal" if _finite_or_none(v) is None else f"{v:.1f}" for v in vals],
                textposition="outside",
            ),
            row=1,
            col=2,
        )
    fig.update_xaxes(title_text="MoE layer", dtick=1, row=1, col=1)
    fig.update_yaxes(title_text="SQNR [dB]", row=1, col=1)
    fig.update_yaxes(title_text="SQNR [dB]", row=1, col=2)
    fig.update_layout(
        title="vLLM vs hardware numerics: MoE layers against float64 on the same operands; logits",
        barmode="group",
        height=520,
        legend=dict(font=dict(size=10), orientation="h", y=-0.2),
    )
    return fig


def model_forward_figure(result: dict | str, eager: bool = False) -> go.Figure:
    """Whole-model forward time by token count, one line per path, log-log, from ``python -m mxlib.bench
    model``'s JSON (a path to the file, or the loaded dict).

    ``eager=False`` plots each row's ``ms`` (the CUDA-graph replay where there was one, else eager);
    ``eager=True`` the eager times. Hover shows the ratio to bf16 and tokens/s.

    Raises:
        ValueError: ``result`` has no ``rows``.
    """
    if isinstance(result, str):
        import json

        with open(result) as f:
            result = json.load(f)
    rows = result.get("rows") or []
    if not rows:
        raise ValueError("result: expected the benchmark JSON with a non-empty 'rows' list")
    key, ratio = ("eager_ms", "eager_ratio_to_bf16") if eager else ("ms", "ratio_to_bf16")
    fig = go.Figure()
    for i, path in enumerate(dict.fromkeys(r["path"] for r in rows)):
        rr = sorted((r for r in rows if r["path"] == path), key=lambda r: r["M"])
        fig.add_trace(
            go.Scatter(
                x=[r["M"] for r in rr],
                y=[r[key] for r in rr],
                name=path,
                mode="lines+markers",
                line=dict(color=PALETTE[i % len(PALETTE)], dash="dash" if path == "bf16" else None),
                customdata=[[r[ratio], r["M"] / (r[key] * 1e-3)] for r in rr],
                hovertemplate="M %{x}: %{y:.3f} ms, %{customdata[0]:.2f}x bf16, %{customdata[1]:.0f} tokens/s",
            )
        )
    cfg, env = result.get("config", {}), result.get("env", {})
    timed = "eager" if eager else ("CUDA graph" if any(r.get("graph_ms") is not None for r in rows) else "eager")
    fig.update_layout(
        title=f"Whole-model forward ({cfg.get('layers', '?')} layers, {timed}), {env.get('device', '')}",
        xaxis_title="tokens M",
        yaxis_title="ms per forward",
        xaxis_type="log",
        yaxis_type="log",
    )
    return fig
