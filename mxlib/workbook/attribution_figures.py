"""Figures of ``mxlib.studies.attribution``: where a scheme's loss comes from, read at a glance.

``attribution_figure`` draws one row per scheme and four panels, each a delta from bf16 of one
metric: the waterfall (the sources enabled one after another, in the plan's order, up to the
total), each source alone with the interaction, weights against activations with their
interaction, and each layer alone with the layers' interaction. A waterfall step is red where it
loses (NLL, noise or KL up, exact match down) and green where it gains. The bars of every panel but the
first sum to the total (the black bar); a source keeps its colour in every panel.
``attribution_rows`` flattens one result into table rows, ``attribution_table`` shows them
(``figures.table``).
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..studies.attribution import SOURCES
from .figures import PALETTE, table

__all__ = ["attribution_rows", "attribution_figure", "attribution_table", "metric_label"]

# a colour per source (blue, orange, purple, brown), none of them the waterfall's red (a loss) or green (a gain)
_SOURCE_COLOUR = dict(zip(SOURCES, (PALETTE[0], PALETTE[1], PALETTE[4], PALETTE[5])))
_WEIGHTS, _ACTIVATIONS = PALETTE[8], PALETTE[9]
_INTERACTION, _TOTAL, _LAYER = "#999999", "#000000", "#3f6e8c"
_PANELS = ("waterfall (fixed order)", "one source at a time", "weights vs activations", "one layer at a time")


def attribution_rows(result: dict, metric: str, task: str | None = None) -> list[dict]:
    """One attribution's ``metric`` (on ``task`` for ``attribute_trained``, e.g. ``all``) as table rows:
    ``part`` (``total``, the waterfall's steps, ``only <s>``, ``interaction (sources)``, ``weights``,
    ``activations``, ``interaction (w x a)``, ``layer <l>``, ``interaction (layers)``) and ``delta``
    (from bf16; exact match in prompts and as a fraction ``delta_fraction`` when a task is given),
    with the paired 95 % interval where there is one (``interval``, in the metric's per-prompt or
    per-token units; a waterfall step's against the step before it, the others' against bf16) and
    ``beyond_noise_floor`` where a noise floor was given; ``sqnr_db`` (``attribute_layers``): the configuration's
    SQNR (a waterfall step's: with the sources up to it on).

    Raises:
        KeyError: an unknown metric or task, naming the known ones.
    """
    decs = result["decompositions"] if task is None else result["decompositions"].get(task)
    if decs is None:
        raise KeyError(f"task: expected one of {list(result['decompositions'])}, got {task!r}")
    if metric not in decs:
        raise KeyError(f"metric: expected one of {list(decs)}, got {metric!r}")
    d = decs[metric]
    diffs, steps = result.get("differences", {}), result.get("increment_differences", {})
    parts = [("total", d["total"], "all", diffs)]
    parts += [(f"waterfall +{s}", v, name, steps) for (s, v), name in zip(d["waterfall"], result["plan"]["steps"])]
    parts += [(f"only {s}", v, f"only {s}", diffs) for s, v in d["singles"].items()]
    parts.append(("interaction (sources)", d["interaction"], None, diffs))
    parts += [("weights", d["weights"], "weights", diffs), ("activations", d["activations"], "activations", diffs)]
    parts.append(("interaction (w x a)", d["interaction_wa"], None, diffs))
    parts += [(f"layer {li}", v, f"layer {li}", diffs) for li, v in d["layers"].items()]
    parts.append(("interaction (layers)", d["interaction_layers"], None, diffs))
    rows = []
    for part, v, config, source in parts:
        row = dict(scheme=result["scheme"], part=part, delta=v)
        if task is not None and metric == "exact_match":
            row["delta_fraction"] = v / result["n"][task]
        diff = source.get(config, {}).get(task, {}).get(metric) if config else None
        if diff is not None:
            row["interval"] = f"[{diff['low']:+.4g}, {diff['high']:+.4g}]"
            if diff["beyond"] is not None:
                row["beyond_noise_floor"] = diff["beyond"]
        if "sqnr_db" in result and config is not None and metric.endswith(" nsr"):
            row["sqnr_db"] = result["sqnr_db"][config][metric[: -len(" nsr")]]
        rows.append(row)
    return rows


def metric_label(metric: str, task: str | None = None) -> str:
    """Axis text of a metric: ``exact_match`` in prompts, NLL in nats per token, NSR and KL as named."""
    text = {
        "exact_match": "exact match [prompts]",
        "nll_per_token": "NLL [nats / token]",
        "logits kl": "logits KL [nats]",
    }.get(metric, f"{metric} [noise / signal]" if metric.endswith(" nsr") else metric)
    return f"{text} on {task}" if task else text


def _bars(fig, row, col, labels, values, colours, fmt):
    fig.add_trace(
        go.Bar(
            x=labels,
            y=values,
            marker_color=colours,
            text=[fmt(v) for v in values],
            textposition="outside",
            cliponaxis=False,
            showlegend=False,
        ),
        row=row,
        col=col,
    )


def attribution_figure(results: list[dict] | dict, metric: str, task: str | None = None, title: str = "") -> go.Figure:
    """The attribution of ``metric`` (on ``task`` for ``attribute_trained`` results) for each result.

    Args:
        results: ``attribute_trained`` or ``attribute_layers`` results (one or a list: a row each).
        metric: a key of their decompositions (``exact_match``, ``nll_per_token``; ``logits nsr``,
            ``layer <l> nsr``, ``logits kl``); task: a task or ``all`` (trained results only).

    Raises:
        KeyError: an unknown metric or task (``attribution_rows``).
    """
    results = [results] if isinstance(results, dict) else list(results)
    up_is_worse = metric != "exact_match"  # NLL, noise power and KL grow with the loss; exact match falls
    worse, better = PALETTE[3], PALETTE[2]
    fmt = (lambda v: f"{v:+d}") if metric == "exact_match" else (lambda v: f"{v:+.3g}")
    fig = make_subplots(
        rows=len(results),
        cols=4,
        shared_yaxes=True,
        horizontal_spacing=0.03,
        vertical_spacing=0.12 if len(results) > 1 else 0.0,
        column_widths=[0.3, 0.26, 0.2, 0.24],
        subplot_titles=list(_PANELS),
    )
    for i, res in enumerate(results, 1):
        attribution_rows(res, metric, task)  # checks metric and task, naming the known ones
        decs = res["decompositions"] if task is None else res["decompositions"][task]
        d = decs[metric]
        order = [s for s, _ in d["waterfall"]]
        fig.add_trace(
            go.Waterfall(
                x=[f"+{s}" for s in order] + ["total"],
                y=[v for _, v in d["waterfall"]] + [d["total"]],
                measure=["relative"] * len(order) + ["total"],
                text=[fmt(v) for _, v in d["waterfall"]] + [fmt(d["total"])],
                textposition="outside",
                cliponaxis=False,
                connector=dict(line=dict(color="#bbbbbb")),
                increasing=dict(marker=dict(color=worse if up_is_worse else better)),
                decreasing=dict(marker=dict(color=better if up_is_worse else worse)),
                totals=dict(marker=dict(color=_TOTAL)),
                showlegend=False,
            ),
            row=i,
            col=1,
        )
        singles = list(d["singles"].items())
        _bars(
            fig,
            i,
            2,
            [s for s, _ in singles] + ["interaction", "total"],
            [v for _, v in singles] + [d["interaction"], d["total"]],
            [_SOURCE_COLOUR[s] for s, _ in singles] + [_INTERACTION, _TOTAL],
            fmt,
        )
        _bars(
            fig,
            i,
            3,
            ["weights", "activations", "interaction", "total"],
            [d["weights"], d["activations"], d["interaction_wa"], d["total"]],
            [_WEIGHTS, _ACTIVATIONS, _INTERACTION, _TOTAL],
            fmt,
        )
        layers = list(d["layers"].items())
        _bars(
            fig,
            i,
            4,
            [f"layer {li}" for li, _ in layers] + ["interaction", "total"],
            [v for _, v in layers] + [d["interaction_layers"], d["total"]],
            [_LAYER] * len(layers) + [_INTERACTION, _TOTAL],
            fmt,
        )
        fig.update_yaxes(title_text=f"<b>{res['scheme']}</b><br>Δ {metric_label(metric, task)}", row=i, col=1)
    fig.update_layout(
        title=title or f"Where the loss comes from (change from bf16): {metric_label(metric, task)}",
        height=380 * len(results) + 80,
        margin=dict(t=90),
        uniformtext=dict(minsize=9, mode="show"),
    )
    return fig


def attribution_table(results: list[dict] | dict, metric: str, task: str | None = None, title: str = "") -> go.Figure:
    """``attribution_rows`` of each result, one table (``figures.table``)."""
    results = [results] if isinstance(results, dict) else list(results)
    rows = [row for res in results for row in attribution_rows(res, metric, task)]
    columns = list(dict.fromkeys(k for row in rows for k in row))
    return table(rows, title or f"Change from bf16 per part: {metric_label(metric, task)}", columns)
