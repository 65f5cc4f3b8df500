"""The teaching pictures of notebooks 00 and 02: what a block is, how a code's bits are laid out, where
an element format's values sit, and the figures of 02's lessons (block size x scale format, where a
block's amax lands on the grid, what outliers do to each part of the data).

Every figure is drawn from ``mxlib.formats``' tables or from rows the notebook computed; none holds a
literal value of its own. Each holds at least one data trace, so ``tests/test_render.py`` can check in
headless Chromium that it was drawn.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..formats import E8M0_BIAS, ELEMENT_FORMATS, MX_BLOCK_SIZE, NVFP4_BLOCK_SIZE, get_element_format
from .figures import PALETTE

__all__ = [
    "DASHES",
    "mx_block_figure",
    "bit_layout_figure",
    "number_line_figure",
    "scale_format_grid_figure",
    "amax_on_grid_figure",
    "outlier_parts_figure",
]

DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")  # one per series, beside its hue
_FIELD_COLOURS = {"sign": "#d62728", "exponent": "#1f77b4", "mantissa": "#2ca02c"}


def _boxes(fig, y: float, x0: float, widths, colours, labels, height: float = 0.8):
    """Rectangles side by side from ``x0`` at height ``y``, each with its label at its centre (a text trace)."""
    xs, ys, texts = [], [], []
    x = x0
    for w, c, t in zip(widths, colours, labels):
        fig.add_shape(
            type="rect",
            x0=x,
            x1=x + w,
            y0=y - height / 2,
            y1=y + height / 2,
            fillcolor=c,
            line=dict(color="white", width=1),
            layer="below",
        )
        xs.append(x + w / 2)
        ys.append(y)
        texts.append(t)
        x += w
    fig.add_trace(
        go.Scatter(
            x=xs,
            y=ys,
            text=texts,
            mode="text",
            textfont=dict(size=10, color="white"),
            showlegend=False,
            hoverinfo="text",
        )
    )
    return x


def mx_block_figure() -> go.Figure:
    """An OCP MX block (32 e2m1 elements, one shared E8M0 scale byte) above an NVFP4 block (16 e2m1 elements,
    one ue4m3 scale byte, and the tensor's one fp32 global scale), drawn to scale in bits."""
    e2m1 = get_element_format("e2m1")
    fig = go.Figure()
    rows = (
        (1.0, "OCP MX (MXFP4)", MX_BLOCK_SIZE, "E8M0 scale<br>2^(b-127)", None),
        (0.0, "NVFP4", NVFP4_BLOCK_SIZE, "ue4m3<br>scale", "fp32 global scale<br>(one per tensor)"),
    )
    for y, name, k, scale_label, global_label in rows:
        x = _boxes(fig, y, 0, [8], ["#9467bd"], [scale_label])
        x = _boxes(
            fig,
            y,
            x + 1,
            [e2m1.nbits] * k,
            ["#1f77b4" if i % 2 else "#4a90d9" for i in range(k)],
            [f"P{i}" for i in range(k)],
        )
        fig.add_annotation(
            x=x + 1,
            y=y,
            text=f"{name}: {k} elements x {e2m1.nbits} bits + 8 scale bits = {e2m1.nbits + 8 / k:g} bits a value",
            showarrow=False,
            xanchor="left",
        )
        if global_label:
            _boxes(fig, y - 0.75, 0, [32], ["#7f7f7f"], [global_label], height=0.5)
    fig.update_layout(
        title="A block: k elements (P0 .. Pk-1, e2m1 codes of 4 bits) share one scale; value_i = scale * P_i",
        height=330,
        xaxis=dict(visible=False, range=[-1, 230]),
        yaxis=dict(visible=False, range=[-1.3, 1.6]),
        margin=dict(l=10, r=10, t=50, b=10),
    )
    return fig


def _layout(name: str) -> tuple[list[str], str]:
    """The bit fields of an element format or ``e8m0``, most significant first, and its value formula."""
    if name == "e8m0":
        return ["exponent"] * 8, f"value = 2^(E - {E8M0_BIAS}); no sign, no mantissa; 0xFF is NaN"
    f = get_element_format(name)
    fields = ["sign"] + ["exponent"] * f.ebits + ["mantissa"] * f.mbits
    return fields, (
        f"normal: (-1)^S * 2^(E - {f.bias}) * (1 + M / {2**f.mbits}); "
        f"subnormal (E = 0): (-1)^S * 2^{1 - f.bias} * (M / {2**f.mbits})"
    )


def bit_layout_figure(formats=("e2m1", "e4m3", "e8m0")) -> go.Figure:
    """One row of bit boxes per format (sign red, exponent blue, mantissa green, most significant bit left)
    with its value formula; ``formats`` are element format names or ``e8m0``."""
    fig = go.Figure()
    for i, name in enumerate(formats):
        fields, formula = _layout(name)
        y = -i
        _boxes(fig, y, 0, [1] * len(fields), [_FIELD_COLOURS[f] for f in fields], [f[0].upper() for f in fields])
        fig.add_annotation(x=-0.3, y=y, text=f"<b>{name}</b> ({len(fields)} bits)", showarrow=False, xanchor="right")
        fig.add_annotation(x=8.5, y=y, text=formula, showarrow=False, xanchor="left")
    for field, colour in _FIELD_COLOURS.items():  # the legend: one marker trace per field
        fig.add_trace(
            go.Scatter(
                x=[None], y=[None], mode="markers", name=field, marker=dict(symbol="square", size=12, color=colour)
            )
        )
    fig.update_layout(
        title="Bit fields: S sign, E exponent, M mantissa (most significant bit on the left)",
        height=110 + 70 * len(formats),
        xaxis=dict(visible=False, range=[-3.5, 30]),
        yaxis=dict(visible=False, range=[-len(formats) + 0.4, 0.6]),
        margin=dict(l=10, r=10, t=50, b=10),
    )
    return fig


def number_line_figure(element: str = "e2m1") -> go.Figure:
    """Every finite value of ``element`` on a number line, labelled with its code; subnormals (exponent
    field 0) in their own colour; the midpoints between neighbours (where rounding switches) as ticks."""
    f = ELEMENT_FORMATS[element]
    values = [(c, f.code_value(c)) for c in range(2**f.nbits)]
    finite = sorted({(v, c) for c, v in values if v == v and abs(v) != float("inf") and not (v == 0 and c)})
    sub = [(v, c) for v, c in finite if (c >> f.mbits) & ((1 << f.ebits) - 1) == 0 and v != 0]
    normal = [(v, c) for v, c in finite if (v, c) not in sub]
    fig = go.Figure()
    for name, pts, colour in (("normal", normal, "#1f77b4"), ("subnormal (E = 0)", sub, "#ff7f0e")):
        fig.add_trace(
            go.Scatter(
                x=[v for v, _ in pts],
                y=[0] * len(pts),
                mode="markers+text",
                name=name,
                text=[f"0x{c:X}<br>{v:g}" for v, c in pts],
                textposition="top center",
                marker=dict(size=11, color=colour),
            )
        )
    xs = [v for v, _ in finite]
    mids = [(a + b) / 2 for a, b in zip(xs, xs[1:])]
    fig.add_trace(
        go.Scatter(
            x=mids,
            y=[0] * len(mids),
            mode="markers",
            name="midpoints (ties go to the even code)",
            marker=dict(symbol="line-ns-open", size=16, color="#7f7f7f"),
        )
    )
    fig.update_layout(
        title=f"{element}: every value and its code (beyond ±{f.max:g} a value saturates to ±{f.max:g})",
        height=260,
        yaxis=dict(visible=False, range=[-0.5, 1.2]),
        xaxis_title="value",
        margin=dict(l=10, r=10, t=50, b=40),
    )
    return fig


def scale_format_grid_figure(rows: list[dict]) -> go.Figure:
    """Bars of SQNR for each (block_size, scale format): ``rows`` with ``block_size``, ``scale``, ``sqnr_db``
    (and optionally ``data``), one bar group per block size, one colour per scale format."""
    fig = go.Figure()
    for k, scale in enumerate(dict.fromkeys(r["scale"] for r in rows)):
        sel = [r for r in rows if r["scale"] == scale]
        fig.add_trace(
            go.Bar(
                x=[f"block {r['block_size']}" + (f", {r['data']}" if "data" in r else "") for r in sel],
                y=[r["sqnr_db"] for r in sel],
                name=f"{scale} scale",
                marker_color=PALETTE[k],
                text=[f"{r['sqnr_db']:.2f}" for r in sel],
                textposition="outside",
            )
        )
    lo = min(r["sqnr_db"] for r in rows)
    fig.update_layout(
        barmode="group",
        title="e2m1 elements: block size x scale format (SQNR, dB)",
        yaxis=dict(title="SQNR [dB]", range=[lo - 2, max(r["sqnr_db"] for r in rows) + 1]),
    )
    return fig


def amax_on_grid_figure(landed: dict, element: str = "e2m1") -> go.Figure:
    """Histograms of where each block's amax lands after scaling (``{label: values}``, e.g. from
    ``format_lessons.amax_on_grid``), over the element's grid points (grey lines) and its max (red)."""
    f = ELEMENT_FORMATS[element]
    fig = go.Figure()
    for k, (label, vals) in enumerate(landed.items()):
        fig.add_trace(
            go.Histogram(
                x=[float(v) for v in vals],
                name=label,
                opacity=0.6,
                marker_color=PALETTE[k],
                xbins=dict(size=0.05),
                histnorm="percent",
            )
        )
    top = max(float(max(v)) for v in landed.values())
    for v in f.values():
        if v == v and 0 < v <= max(top, f.max):
            fig.add_vline(x=v, line=dict(color="#d62728" if v == f.max else "#bbbbbb", width=2 if v == f.max else 1))
    fig.update_layout(
        barmode="overlay",
        title=f"Where a block's amax lands on the {element} grid after scaling",
        xaxis_title="amax / block scale",
        yaxis_title="% of blocks",
    )
    return fig


def outlier_parts_figure(rows: list[dict], schemes) -> go.Figure:
    """Three panels against the outlier magnitude (``format_lessons.outlier_parts_sweep`` rows): the global
    SQNR, the SQNR on the values that are not outliers, and the share of those flushed to zero; one hue
    and one dash style per scheme, the same in every panel."""
    fig = make_subplots(
        rows=1,
        cols=3,
        subplot_titles=("global SQNR [dB]", "SQNR without the outliers [dB]", "non-outliers flushed to 0 [%]"),
    )
    xs = [r["outlier_scale"] for r in rows]
    for k, s in enumerate(schemes):
        style = dict(color=PALETTE[k % len(PALETTE)], dash=DASHES[k % len(DASHES)], width=2)
        for col, key, scale in ((1, "global_db", 1), (2, "rest_db", 1), (3, "flushed", 100)):
            fig.add_trace(
                go.Scatter(
                    x=xs,
                    y=[r[f"{s}_{key}"] * scale for r in rows],
                    mode="lines+markers",
                    name=s,
                    line=style,
                    legendgroup=s,
                    showlegend=col == 1,
                ),
                row=1,
                col=col,
            )
    fig.update_xaxes(type="log", title_text="outlier_scale")
    fig.update_layout(title="Outliers: what the global SQNR hides", height=430)
    return fig
