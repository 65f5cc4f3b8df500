"""The teaching pictures of notebooks 00 and 02: what a block is, how a code's bits are laid out, where
an element format's values sit, the MoE layer with its quantization points, and the figures of 02's
lessons (block size x scale format, where a block's amax lands on the grid, what outliers do to each part
of the data).

Every figure is drawn from ``mxlib.formats``' tables or from rows the notebook computed; none holds a
literal value of its own. Each holds at least one data trace, so ``tests/test_render.py`` can check in
headless Chromium that it was drawn.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..formats import E8M0_BIAS, ELEMENT_FORMATS, MX_BLOCK_SIZE, NVFP4_BLOCK_SIZE, get_element_format
from ..models.presets import QWEN3_30B_A3B
from .figures import PALETTE

__all__ = [
    "DASHES",
    "mx_block_figure",
    "bit_layout_figure",
    "number_line_figure",
    "moe_layer_figure",
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


# the MoE layer's boxes: (key, label, x, y, kind); kinds pick the colour
_MOE_BOXES = (
    ("x", "hidden_states", 0.0, 1.1, "tensor"),
    ("router", "router<br>(mlp.gate, bf16)", 2.0, 2.4, "bf16"),
    ("topk", "softmax, top-k,<br>renormalize", 4.0, 2.4, "bf16"),
    ("a1", "<b>a1 QDQ</b><br>one global scale", 2.0, 0.0, "qdq"),
    ("w13", "GEMM1<br>a1 @ w13[e]^T", 4.0, 0.0, "gemm"),
    ("act", "SiLU(gate) * up", 6.0, 0.0, "bf16"),
    ("a2", "<b>a2 QDQ</b>", 8.0, 0.0, "qdq"),
    ("w2", "GEMM2<br>a2 @ w2[e]^T", 10.0, 0.0, "gemm"),
    ("sum", "x topk_weights,<br>sum over top_k", 12.0, 0.0, "bf16"),
    ("out", "output", 14.0, 1.1, "tensor"),
    ("w13s", "w13 [E, 2I, H]<br>stored quantized,<br>dequantized to bf16", 4.0, -1.6, "weight"),
    ("w2s", "w2 [E, H, I]<br>stored quantized,<br>dequantized to bf16", 10.0, -1.6, "weight"),
)
_MOE_COLOURS = {
    "tensor": "#7f7f7f",
    "bf16": "#1f77b4",
    "qdq": "#d62728",
    "gemm": "#2ca02c",
    "weight": "#9467bd",
}
_MOE_KINDS = {
    "tensor": "a tensor entering or leaving the layer",
    "bf16": "bf16 / fp32 arithmetic (not quantized)",
    "qdq": "activation QDQ: the activation format's rounding",
    "gemm": "a bf16 GEMM, fp32 accumulate, one expert e at a time",
    "weight": "expert weights in the weight format",
}


def moe_layer_figure(
    hidden_size: int = QWEN3_30B_A3B["hidden_size"],
    moe_intermediate_size: int = QWEN3_30B_A3B["moe_intermediate_size"],
    num_experts: int = QWEN3_30B_A3B["num_experts"],
    top_k: int = QWEN3_30B_A3B["num_experts_per_tok"],
) -> go.Figure:
    """One MoE layer as vLLM's emulation computes it (``TritonExperts.apply`` and its emulation subclasses), with
    the two activation QDQ points and the two weight tensors; shapes for ``T`` tokens (defaults: Qwen3-30B-A3B,
    ``mxlib.models.presets.QWEN3_30B_A3B``).

    The router (softmax over the ``num_experts`` router logits, top-k, renormalized) picks ``top_k`` experts per
    token; the layer input is QDQ'd once per token (a1, one global scale for all experts), then each chosen
    expert ``e`` computes ``SiLU(gate) * up`` of ``a1 @ w13[e]^T`` (gate rows first), QDQ's that (a2), multiplies
    by ``w2[e]``; the ``top_k`` outputs are weighted by ``topk_weights`` and summed. Boxes are coloured by what
    they do (a legend trace per kind); arrows carry the tensor shapes.
    """
    H, I, E, k = hidden_size, moe_intermediate_size, num_experts, top_k
    pos = {key: (x, y) for key, _, x, y, _ in _MOE_BOXES}
    fig = go.Figure()
    half_w, half_h = 0.75, 0.42
    for _, _, x, y, kind in _MOE_BOXES:
        fig.add_shape(
            type="rect",
            x0=x - half_w,
            x1=x + half_w,
            y0=y - half_h,
            y1=y + half_h,
            fillcolor=_MOE_COLOURS[kind],
            opacity=0.9,
            line=dict(color="white", width=1),
            layer="below",
        )
    fig.add_trace(
        go.Scatter(
            x=[x for _, _, x, _, _ in _MOE_BOXES],
            y=[y for _, _, _, y, _ in _MOE_BOXES],
            text=[label for _, label, _, _, _ in _MOE_BOXES],
            mode="text",
            textfont=dict(size=11, color="white"),
            hoverinfo="text",
            showlegend=False,
        )
    )
    arrows = (
        ("x", "router", f"[T, {H}]"),
        ("router", "topk", f"router_logits [T, {E}]"),
        ("x", "a1", f"[T, {H}]"),
        ("a1", "w13", f"[T, {H}]"),
        ("w13", "act", f"[T*{k}, 2*{I}]"),
        ("act", "a2", f"[T*{k}, {I}]"),
        ("a2", "w2", ""),
        ("w2", "sum", f"[T*{k}, {H}]"),
        ("sum", "out", f"[T, {H}]"),
        ("w13s", "w13", ""),
        ("w2s", "w2", ""),
    )
    for src, dst, text in arrows:
        (x0, y0), (x1, y1) = pos[src], pos[dst]
        # from the source box's edge to the destination box's edge, along the line between their centres
        dx, dy = x1 - x0, y1 - y0
        t = min(half_w / abs(dx) if dx else 1.0, half_h / abs(dy) if dy else 1.0)
        fig.add_annotation(
            x=x1 - dx * t,
            y=y1 - dy * t,
            ax=x0 + dx * t,
            ay=y0 + dy * t,
            xref="x",
            yref="y",
            axref="x",
            ayref="y",
            showarrow=True,
            arrowhead=2,
            arrowwidth=1.5,
            arrowcolor="#444444",
        )
        if text:  # the shape above the arrow's middle (a level arrow: above the boxes' top edge)
            fig.add_annotation(
                x=(x0 + x1) / 2,
                y=(y0 + y1) / 2 + (half_h + 0.05 if y0 == y1 else 0.1),
                text=text,
                showarrow=False,
                font=dict(size=9),
                yanchor="bottom",
            )
    tx, ty = pos["topk"]
    fig.add_annotation(
        x=tx + half_w + 0.1,
        y=ty,
        text=f"topk_ids, topk_weights [T, {k}]: which {k} of {E} experts, and their weights",
        showarrow=False,
        xanchor="left",
        font=dict(size=10),
    )
    for dst in ("w13", "sum"):  # the router's choice picks the experts of GEMM1 and weights the sum
        dx, dy = pos[dst]
        fig.add_annotation(
            x=dx,
            y=dy + half_h,
            ax=tx if dst == "w13" else tx + half_w,
            ay=ty - half_h,
            xref="x",
            yref="y",
            axref="x",
            ayref="y",
            showarrow=True,
            arrowhead=2,
            arrowwidth=1,
            arrowcolor="#999999",
        )
    fig.add_annotation(
        x=tx + 0.05,
        y=(ty + pos["w13"][1]) / 2,
        text="topk_ids: expert e",
        showarrow=False,
        xanchor="left",
        font=dict(size=9, color="#666666"),
    )
    for kind, colour in _MOE_COLOURS.items():  # the legend: one marker trace per kind of box
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                name=_MOE_KINDS[kind],
                marker=dict(symbol="square", size=12, color=colour),
            )
        )
    fig.update_layout(
        title=f"One MoE layer in vLLM's emulation: H = {H}, I = {I}, E = {E} experts, top_k = {k}",
        height=520,
        xaxis=dict(visible=False, range=[-0.9, 14.9]),
        yaxis=dict(visible=False, range=[-2.2, 3.2]),
        legend=dict(orientation="h", y=-0.02),
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
