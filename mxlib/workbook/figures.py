"""Plotly figures for the workbook notebooks.

Notebooks call ``mxlib.workbook.setup.use_notebook_renderer()``: figures carry the plotly mime
bundle (drawn by JupyterLab, also untrusted) and HTML with plotly.js embedded (offline export).
Tables size themselves to show every row (``tests/test_render.py`` checks it in Chromium); traces
of many series take distinct colours from a 24-colour palette.
"""

from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..formats import ELEMENT_FORMATS, NVFP4_FLUSH_RATIO, NVFP4_SUBNORMAL_RATIO
from .palette import PALETTE

__all__ = [
    "PALETTE",
    "format_pow2",
    "table",
    "table_height",
    "layer_sqnr_figure",
    "bar_figure",
    "heatmap_figure",
    "scatter_figure",
    "storage_accuracy_figure",
    "sweep_figure",
    "e4m3_code_map_figure",
    "add_scale_ratio_thresholds",
    "grouped_bar_figure",
    "expert_loss_heatmap",
    "scale_code_histogram_figure",
    "spread_figure",
    "moe_layer_time_figures",
    "model_time_figure",
    "vllm_vs_hardware_figure",
    "model_forward_figure",
]


def format_pow2(v, min_abs_exp: int = 4) -> str:
    """``v`` as text; a power of two ``2^k`` with ``|k| >= min_abs_exp`` prints as ``"2^k"`` (or ``"-2^k"``).

    ``format_pow2(0.015625) == "2^-6"``, ``format_pow2(448.0) == "448"``, ``format_pow2(1.0) == "1"``.
    Other floats print with 4 significant digits; non-floats with ``str``.
    """
    if isinstance(v, float) and math.isfinite(v) and v != 0.0:
        m, e = math.frexp(abs(v))
        if m == 0.5 and abs(e - 1) >= min_abs_exp:
            return f"{'-' if v < 0 else ''}2^{e - 1}"
    return _fmt(v)


def _fmt(v):
    if isinstance(v, float):
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        if v.is_integer() and abs(v) < 1e7 and not (v == 0 and math.copysign(1.0, v) < 0):
            return str(int(v))  # 57344, not 5.734e+04; -0.0 keeps its sign below
        return f"{v:.4g}"
    return str(v)


_TABLE_WIDTH_CHARS = 150  # characters across a table at the workbook's ~1100 px (7 px a character)
_ROW_PX = 20  # one line of a cell (plotly's default font, 12 px, with padding)


def _widths(cells: list[list[str]], columns: list[str]) -> list[int]:
    """Relative column widths: the longest entry of each column (header included), clipped to [4, 60]."""
    return [min(max(len(str(h)), *(len(t) for t in col), 4), 60) for h, col in zip(columns, cells)]


def _lines(text: str, width_chars: float) -> int:
    return max(1, math.ceil(len(text) / max(width_chars, 1.0)))


def table_height(cells: list[list[str]], columns: list[str], title: bool = True) -> int:
    """Pixels a plotly table needs to show every row without scrolling: each row as tall as its most
    wrapped cell (estimated from the column widths ``table`` gives), plus header and title."""
    widths = _widths(cells, columns)
    chars = [_TABLE_WIDTH_CHARS * w / sum(widths) for w in widths]
    header = max(_lines(str(h), c) for h, c in zip(columns, chars))
    rows = sum(max(_lines(col[i], c) for col, c in zip(cells, chars)) for i in range(len(cells[0]))) if cells else 0
    return 60 * title + 30 + (_ROW_PX + 8) * header + _ROW_PX * rows + 4 * len(cells[0] if cells else [])


def table(rows: list[dict], title: str = "", columns: list[str] | None = None, pow2: bool = False) -> go.Figure:
    """A plotly table of dict rows (floats with 4 significant digits), tall enough to show every row.

    ``pow2=True`` prints powers of two as ``2^k`` (``format_pow2``). For very wide tables (many
    columns, long names) prefer ``mxlib.workbook.explorers.rows_table`` (HTML), which never wraps a name.
    """
    columns = columns or list(rows[0])
    fmt = format_pow2 if pow2 else _fmt
    cells = [[fmt(r.get(c, "")) for r in rows] for c in columns]
    fig = go.Figure(
        go.Table(
            columnwidth=_widths(cells, columns),
            header=dict(values=columns, align="left"),
            cells=dict(values=cells, align="left"),
        )
    )
    fig.update_layout(title=title, height=table_height(cells, columns), margin=dict(l=10, r=10, t=50, b=10))
    return fig


def layer_sqnr_figure(
    per_layer: dict[str, list[dict]], title: str = "SQNR of each decoder layer's output"
) -> go.Figure:
    """One line per run: SQNR (dB) of each decoder layer's output against the bf16 model."""
    fig = go.Figure()
    for k, (name, layers) in enumerate(per_layer.items()):
        fig.add_trace(
            go.Scatter(
                x=[r["layer"] for r in layers],
                y=[r["sqnr_db"] for r in layers],
                mode="lines+markers",
                name=name,
                line=dict(color=PALETTE[k % len(PALETTE)]),
            )
        )
    fig.update_layout(title=title, xaxis_title="decoder layer", yaxis_title="SQNR vs bf16 [dB]")
    fig.update_xaxes(dtick=1)
    return fig


def bar_figure(
    rows: list[dict],
    x: str,
    ys: list[str],
    title: str = "",
    ytitles: list[str] | None = None,
    errors: dict[str, tuple[str, str]] | None = None,
) -> go.Figure:
    """Side-by-side horizontal bar charts, one panel per metric in ``ys``, the rows' ``x`` labels down
    the shared vertical axis (first row at the top), one label a line so that long names never overlap.

    ``errors`` maps a metric to the keys of its interval's low and high ends in each row (a spread
    over repeats, drawn as an error bar from low to high around the bar's value).

    Raises:
        ValueError: no rows, or an ``errors`` key that is not in ``ys``.
    """
    if not rows:
        raise ValueError("rows: expected at least one row")
    errors = errors or {}
    if set(errors) - set(ys):
        raise ValueError(f"errors: expected keys among ys {ys}, got {sorted(errors)}")
    fig = make_subplots(rows=1, cols=len(ys), subplot_titles=ytitles or ys, shared_yaxes=True, horizontal_spacing=0.04)
    labels = [str(r[x]) for r in rows]
    for i, y in enumerate(ys, 1):
        vals = [r[y] for r in rows]
        err = None
        if y in errors:
            lo, hi = errors[y]
            err = dict(
                type="data",
                symmetric=False,
                array=[r[hi] - v for r, v in zip(rows, vals)],
                arrayminus=[v - r[lo] for r, v in zip(rows, vals)],
                color="#444",
                thickness=1.5,
            )
        fig.add_trace(go.Bar(y=labels, x=vals, orientation="h", name=y, showlegend=False, error_x=err), row=1, col=i)
    fig.update_yaxes(autorange="reversed", type="category", automargin=True)
    fig.update_layout(title=title, height=140 + 26 * len(rows), bargap=0.25)
    return fig


def heatmap_figure(z, x, y, title: str, colorbar: str) -> go.Figure:
    fig = go.Figure(go.Heatmap(z=z, x=x, y=y, colorbar=dict(title=colorbar), colorscale="Viridis"))
    fig.update_layout(title=title)
    return fig


def scatter_figure(traces: dict[str, tuple], title: str, xtitle: str, ytitle: str, log_x: bool = False) -> go.Figure:
    """``traces``: name -> (x values, y values[, hover texts])."""
    fig = go.Figure()
    for name, tr in traces.items():
        fig.add_trace(go.Scatter(x=tr[0], y=tr[1], mode="markers", name=name, text=tr[2] if len(tr) > 2 else None))
    fig.update_layout(title=title, xaxis_title=xtitle, yaxis_title=ytitle)
    if log_x:
        fig.update_xaxes(type="log")
    return fig


def storage_accuracy_figure(
    rows: list[dict],
    x: str = "bits_per_weight",
    y: str = "sqnr_db",
    label: str = "scheme",
    title: str = "Accuracy against storage",
    xtitle: str = "expert weight bits per element (scales included)",
    ytitle: str = "logits SQNR vs bf16 [dB]",
    spread: float = 0.2,
) -> go.Figure:
    """One numbered marker per row, each in its own colour; the legend names the numbers.

    Rows sharing an ``x`` value (five schemes store 4.25 bits) are spread side by side over
    ``spread`` (in x units) in the order of their ``y``, so no two points hide each other; each
    marker carries a short number (``1.``, ``2.``, ... in the legend, with the row's label), which
    stays legible where full names would collide. The axis ticks stay at the true ``x`` values,
    and the hover text gives the label and the exact ``x`` and ``y``.
    """
    groups: dict[float, list[dict]] = {}
    for r in rows:
        groups.setdefault(r[x], []).append(r)
    fig = go.Figure()
    k = 0
    for xv, rr in sorted(groups.items()):
        rr = sorted(rr, key=lambda r: r[y])
        n = len(rr)
        for j, r in enumerate(rr):
            dx = 0.0 if n == 1 else spread * (j / (n - 1) - 0.5)
            fig.add_trace(
                go.Scatter(
                    x=[xv + dx],
                    y=[r[y]],
                    mode="markers+text",
                    name=f"{k + 1}. {r[label]}",
                    text=[str(k + 1)],
                    textposition="top center",
                    textfont=dict(size=11),
                    marker=dict(size=11, color=PALETTE[k % len(PALETTE)]),
                    hovertemplate=f"{r[label]}<br>{x} {xv}<br>{y} %{{y:.3f}}<extra></extra>",
                )
            )
            k += 1
    fig.update_layout(title=title, xaxis_title=xtitle, yaxis_title=ytitle, height=600)
    fig.update_xaxes(tickvals=sorted(groups), range=[min(groups) - 0.5, max(groups) + 0.5])
    return fig


def sweep_figure(
    rows: list[dict], x: str, ys: list[str], title: str, xtitle: str, ytitle: str, log_x: bool = False
) -> go.Figure:
    """One line per key in ``ys`` against ``row[x]`` (e.g. ``explorers.outlier_scale_sweep`` rows), distinct colours."""
    fig = go.Figure()
    for k, y in enumerate(ys):
        fig.add_trace(
            go.Scatter(
                x=[r[x] for r in rows],
                y=[r[y] for r in rows],
                name=y,
                mode="lines+markers",
                line=dict(color=PALETTE[k % len(PALETTE)]),
            )
        )
    fig.update_layout(title=title, xaxis_title=xtitle, yaxis_title=ytitle)
    if log_x:
        fig.update_xaxes(type="log")
    return fig


def e4m3_code_map_figure() -> go.Figure:
    """Every e4m3 code 0x00-0xFF as a 16 x 16 map; colour is log2 of the magnitude, text the value.

    Row ``R``, column ``C`` is code ``0xRC``. The colour scale runs from 2^-9 (0x01, the smallest
    subnormal) to 448 (0x7E), so small and large codes differ; the negative half (rows 8-F) repeats
    the positive colours and its text carries the sign. Zero (0x00, 0x80) and NaN (0x7F, 0xFF) have
    no magnitude: they are drawn in their own grey and black cells and labelled ``0`` / ``NaN``.
    Powers of two print as ``2^k``.
    """
    e4m3 = ELEMENT_FORMATS["e4m3"]
    grid = [[e4m3.code_value(16 * r + c) for c in range(16)] for r in range(16)]
    z = [[math.log2(abs(v)) if v and math.isfinite(v) else None for v in row] for row in grid]
    text = [
        [
            "NaN"
            if math.isnan(v)
            else ("-0" if v == 0 and math.copysign(1, v) < 0 else ("0" if v == 0 else _value_text(v)))
            for v in row
        ]
        for row in grid
    ]
    xs, ys = [f"x{c:X}" for c in range(16)], [f"{r:X}x" for r in range(16)]
    fig = go.Figure()
    # zero and NaN cells first, in their own colours, under the magnitude layer (which leaves them blank)
    special = [[0.0 if v == 0 else (1.0 if math.isnan(v) else None) for v in row] for row in grid]
    fig.add_trace(
        go.Heatmap(
            z=special,
            x=xs,
            y=ys,
            colorscale=[[0, "#bbbbbb"], [1, "#000000"]],
            zmin=0,
            zmax=1,
            text=text,
            texttemplate="%{text}",
            textfont=dict(size=9),
            showscale=False,
            hovertemplate="code %{y}%{x}: %{text}<extra></extra>",
            name="zero / NaN",
        )
    )
    fig.add_trace(
        go.Heatmap(
            z=z,
            x=xs,
            y=ys,
            text=text,
            texttemplate="%{text}",
            textfont=dict(size=9),
            colorscale="Viridis",
            zmin=-9,
            zmax=math.log2(e4m3.max),
            colorbar=dict(
                title="log2|v|", tickvals=list(range(-9, 9, 3)), ticktext=[f"2^{k}" for k in range(-9, 9, 3)]
            ),
            hovertemplate="code %{y}%{x}: %{text}<extra></extra>",
            name="log2|v|",
        )
    )
    for row in (0, 8):  # the subnormal codes 0x01-0x07 and 0x81-0x87: exponent field 0, outlined
        fig.add_shape(
            type="rect", x0=0.5, x1=7.5, y0=row - 0.5, y1=row + 0.5, line=dict(color="#d62728", width=3), layer="above"
        )
    fig.update_layout(
        title="e4m3 codes 0x00-0xFF (row R, column C = code 0xRC): colour log2|value|, grey zero, black NaN,"
        "<br>subnormals (exponent field 0) outlined in red",
        height=660,
        yaxis=dict(autorange="reversed"),
    )
    return fig


def _value_text(v: float) -> str:
    """An exact label for a code-map cell: ``2^k`` for powers of two from 16 and below 1/2, the exact decimal
    from 1/2 up (``0.5625``, ``-1.125``, ``448``), and below 1/2 ``m·2^k`` with the significand exact
    (``1.125·2^-4``; a subnormal as a multiple of the smallest one, ``3·2^-9``)."""
    a = abs(v)
    t = format_pow2(v, min_abs_exp=1 if a < 0.5 else 4)
    if t.startswith(("2^", "-2^")):
        return t
    sign = "-" if v < 0 else ""
    if a >= 0.5:
        return f"{v:g}"
    if a < 2.0**-6:  # subnormal: an integer multiple of 2^-9
        return f"{sign}{int(a / 2.0**-9)}·2^-9"
    k = math.floor(math.log2(a))
    return f"{sign}{a / 2.0**k:g}·2^{k}"


def add_scale_ratio_thresholds(fig, y_range=None):
    """Draw ``mxlib.formats.NVFP4_SUBNORMAL_RATIO`` and ``NVFP4_FLUSH_RATIO`` on a figure whose x axis is an expert
    scale ratio (log or linear), as two dashed line traces from the lowest to the highest y of the
    figure's traces (or ``y_range = (y0, y1)``). Returns ``fig``.

    Traces rather than ``add_vline`` shapes: plotly places shapes and their annotations
    inconsistently on log axes (plotly/plotly.py#4012). A log x axis without a set range gets one spanning every
    trace's x with 0.15 decades either side, so that a threshold at the edge of the data shows.
    """
    if y_range is None:
        ys = [
            float(y)
            for tr in fig.data
            if getattr(tr, "y", None) is not None
            for y in tr.y
            if y is not None and math.isfinite(float(y))
        ]
        y_range = (min(ys, default=0.0), max(ys, default=1.0))
    for ratio, name in (
        (NVFP4_SUBNORMAL_RATIO, "r = 2^-6/448: largest block scale subnormal"),
        (NVFP4_FLUSH_RATIO, "r = 2^-10/448: every block flushed"),
    ):
        fig.add_trace(
            go.Scatter(
                x=[ratio, ratio],
                y=list(y_range),
                mode="lines",
                name=name,
                line=dict(dash="dash", color="gray" if ratio == NVFP4_SUBNORMAL_RATIO else "black"),
            )
        )
    # lines get no autorange padding: on a log axis left to autorange, a threshold at the edge would hide on the frame
    if fig.layout.xaxis.type == "log" and fig.layout.xaxis.range is None:
        xs = [
            float(x)
            for tr in fig.data
            if getattr(tr, "x", None) is not None
            for x in tr.x
            if x is not None and math.isfinite(float(x)) and float(x) > 0
        ]
        fig.update_xaxes(range=[math.log10(min(xs)) - 0.15, math.log10(max(xs)) + 0.15])
    return fig


def grouped_bar_figure(rows: list[dict], group: str, xs: list[str], title: str, ytitle: str) -> go.Figure:
    """One bar group per key in ``xs``, one bar (trace) per row, named by ``row[group]``."""
    fig = go.Figure()
    for r in rows:
        fig.add_trace(go.Bar(name=str(r[group]), x=list(xs), y=[r[x] for x in xs]))
    fig.update_layout(barmode="group", title=title, yaxis_title=ytitle)
    return fig


def expert_loss_heatmap(
    experts: list[dict],
    num_layers: int,
    num_experts: int,
    point: str = "a2",
    strategy: str = "max",
    noise_db: float = 0.75,
    min_top_db: float = 6.0,
) -> go.Figure:
    """dB lost by ``strategy`` against ``per_expert`` for every (layer, expert) at ``point``, from
    ``mxlib.studies.unification.unification_study``'s ``experts`` rows; experts without a row stay blank.

    The colour range is anchored to the noise, not to the data: losses within ``±noise_db`` (the rounding
    noise notebook 04 asserts) are one pale grey, and the colour runs from there to at least
    ``min_top_db``, so a run whose experts all sit in the noise shows no hot cell."""
    z = [[float("nan")] * num_experts for _ in range(num_layers)]
    for r in experts:
        if r["point"] == point:
            z[r["layer"]][r["expert"]] = r[f"db_lost_{strategy}"]
    seen = [v for row in z for v in row if v == v]
    zmin, zmax = -noise_db, max([min_top_db, *seen])
    edge = 2 * noise_db / (zmax - zmin)  # where +noise_db sits on the 0-1 colour axis
    colours = [[0.0, "#eeeeee"], [edge, "#eeeeee"], [min(edge + 1e-6, 1.0), "#fdd49e"], [1.0, "#b30000"]]
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=list(range(num_experts)),
            y=[f"layer {i}" for i in range(num_layers)],
            zmin=zmin,
            zmax=zmax,
            colorscale=colours,
            colorbar=dict(title="dB lost"),
        )
    )
    fig.update_layout(
        title=f"dB lost by `{strategy}` against `per_expert` ({point}); grey: within ±{noise_db:g} dB (rounding noise)"
    )
    return fig


def scale_code_histogram_figure(
    histograms: dict[str, list[int]], strategies=("max", "per_expert"), point: str = "a2"
) -> go.Figure:
    """Overlaid histograms of e4m3 block-scale codes (0-126) per strategy, log counts; codes 0-7
    (e4m3's subnormals, 0 a flushed block) shaded."""
    fig = go.Figure()
    for s in strategies:
        if s in histograms:
            fig.add_trace(go.Bar(x=list(range(len(histograms[s]))), y=histograms[s], name=s))
    fig.add_vrect(x0=-0.5, x1=7.5, fillcolor="red", opacity=0.1, annotation_text="subnormal scales")
    fig.update_layout(
        barmode="overlay",
        title=f"e4m3 block-scale codes of {point} blocks",
        xaxis_title="e4m3 code",
        yaxis_title="blocks",
        yaxis_type="log",
    )
    return fig


def spread_figure(spread_rows: list[dict]) -> go.Figure:
    """Mean and worst-expert dB lost (a1, a2) against ``expert_spread``, from spread-study rows."""
    fig = go.Figure()
    for point in ("a1", "a2"):
        rr = [r for r in spread_rows if r["point"] == point]
        fig.add_trace(
            go.Scatter(
                x=[r["spread"] for r in rr],
                y=[r["mean_db_lost"] for r in rr],
                name=f"{point} mean",
                mode="lines+markers",
            )
        )
        fig.add_trace(
            go.Scatter(
                x=[r["spread"] for r in rr],
                y=[r["max_db_lost"] for r in rr],
                name=f"{point} worst expert",
                mode="lines+markers",
            )
        )
    fig.update_layout(
        title="Loss of the single global scale vs per-expert weight spread",
        xaxis_title="expert_spread (sigma)",
        yaxis_title="dB lost",
    )
    return fig


def moe_layer_time_figures(rows: list[dict], min_points: int = 4) -> list[go.Figure]:
    """One log-log figure per scheme with at least ``min_points`` token counts: bf16, dequantize-then-GEMM and fused
    times (graph replay solid, eager dotted) and the bandwidth bound (computed: the bytes moved once at the measured
    copy bandwidth), from MoE-benchmark rows."""
    figs = []
    for scheme in dict.fromkeys(r["scheme"] for r in rows):
        rr = [r for r in rows if r["scheme"] == scheme]
        if len(rr) < min_points:
            continue
        m = [r["M"] for r in rr]
        fig = go.Figure()
        for path in ("bf16", "dequant", "fused"):
            fig.add_trace(
                go.Scatter(x=m, y=[r[f"{path}_graph_ms"] for r in rr], name=f"{path} (graph)", mode="lines+markers")
            )
            fig.add_trace(
                go.Scatter(
                    x=m,
                    y=[r[f"{path}_ms"] for r in rr],
                    name=f"{path} (eager)",
                    mode="lines+markers",
                    line=dict(dash="dot"),
                )
            )
        fig.add_trace(
            go.Scatter(x=m, y=[r["bound_ms"] for r in rr], name="bandwidth bound (computed)", line=dict(dash="dash"))
        )
        fig.update_layout(
            title=f"{scheme}: MoE layer time",
            xaxis_title="tokens M",
            yaxis_title="ms",
            xaxis_type="log",
            yaxis_type="log",
        )
        figs.append(fig)
    return figs


def model_time_figure(model_rows: list[dict]) -> go.Figure:
    """Whole-model forward time per path (bf16, seed, fused), one bar group per (layers, tokens)."""
    fig = go.Figure()
    for path in ("bf16", "dequant", "fused"):
        fig.add_trace(
            go.Bar(
                x=[f"{r['layers']} layers, {r['tokens']} tokens" for r in model_rows],
                y=[r[f"{path}_ms"] for r in model_rows],
                name=path,
            )
        )
    fig.update_layout(barmode="group", title="Whole-model forward time", yaxis_title="ms")
    return fig


# the numerics and whole-model figures live in their own module; re-exported here
from .numerics_figures import model_forward_figure, vllm_vs_hardware_figure  # noqa: E402
