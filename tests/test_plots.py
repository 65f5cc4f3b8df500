"""mxlib.workbook.figures: the notebooks' figures hold the data they are given."""

import math

import pytest

pytest.importorskip("plotly", reason="the workbook extra (plotly) is not installed")

from mxlib.workbook import figures  # noqa: E402


def test_grouped_bar_and_heatmap():
    rows = [dict(distribution="gaussian", a=1.0, b=2.0), dict(distribution="laplace", a=3.0, b=4.0)]
    fig = figures.grouped_bar_figure(rows, "distribution", ["a", "b"], "t", "dB")
    assert [t.name for t in fig.data] == ["gaussian", "laplace"] and list(fig.data[1].y) == [3.0, 4.0]
    experts = [
        dict(point="a2", layer=1, expert=2, db_lost_max=5.0),
        dict(point="a1", layer=0, expert=0, db_lost_max=9.0),
    ]
    z = figures.expert_loss_heatmap(experts, 2, 3).data[0].z
    assert z[1][2] == 5.0 and math.isnan(z[0][0])


def test_benchmark_and_spread_figures():
    rows = [
        dict(
            scheme="nvfp4",
            M=m,
            bound_ms=0.1,
            **{f"{p}{g}_ms": 1.0 for p in ("bf16", "dequant", "fused") for g in ("", "_graph")},
        )
        for m in (1, 16, 256, 4096)
    ]
    rows.append(dict(rows[0], scheme="w_mxfp4"))  # one point: no figure
    figs = figures.moe_layer_time_figures(rows)
    assert len(figs) == 1 and len(figs[0].data) == 7 and list(figs[0].data[0].x) == [1, 16, 256, 4096]
    model = [dict(layers=4, tokens=1, bf16_ms=1.0, dequant_ms=2.0, fused_ms=1.5)]
    assert [list(t.y) for t in figures.model_time_figure(model).data] == [[1.0], [2.0], [1.5]]
    spread = [dict(spread=s, point=p, mean_db_lost=s, max_db_lost=2 * s) for s in (0.0, 1.0) for p in ("a1", "a2")]
    assert len(figures.spread_figure(spread).data) == 4
    hist = figures.scale_code_histogram_figure({"max": [1] * 127, "per_expert": [2] * 127})
    assert [t.name for t in hist.data] == ["max", "per_expert"] and len(hist.data[0].y) == 127


def test_format_pow2():
    assert figures.format_pow2(2.0**-6) == "2^-6" and figures.format_pow2(-(2.0**-9)) == "-2^-9"
    assert (
        figures.format_pow2(2.0**15) == "2^15" and figures.format_pow2(1.0) == "1" and figures.format_pow2(8.0) == "8"
    )
    assert figures.format_pow2(448.0) == "448" and figures.format_pow2(57344.0) == "57344"
    assert figures.format_pow2(3) == "3" and figures.format_pow2(0.0) == "0" and figures.format_pow2(-0.0) == "-0"


def test_e4m3_code_map_shows_magnitudes():
    fig = figures.e4m3_code_map_figure()
    special, mag = fig.data
    z, text = mag.z, mag.text
    # 0x01 (2^-9) and 0x7E (448) sit at the two ends of the colour scale, no longer the same colour
    assert z[0x0][0x1] == -9.0 and z[0x7][0xE] == math.log2(448) and mag.zmin == -9.0
    assert z[0x3][0x8] == 0.0 and text[0x3][0x8] == "1" and text[0xB][0x8] == "-1"  # +-1 told apart by text
    assert z[0][0] is None and z[0x7][0xF] is None  # zero and NaN have no magnitude colour ...
    assert special.z[0][0] == 0.0 and special.z[0x7][0xF] == 1.0 and special.z[0xF][0xF] == 1.0  # ... their own
    assert text[0][0] == "0" and text[0x8][0] == "-0" and text[0x7][0xF] == "NaN"
    assert text[0x0][0x1] == "2^-9" and text[0x7][0xE] == "448"


def test_table_is_tall_enough_for_wrapped_rows():
    rows = [dict(case=f"c{i}", why="a long explanation " * 8) for i in range(20)]
    fig = figures.table(rows, title="t")
    short = figures.table([dict(case=f"c{i}", why="x") for i in range(20)], title="t")
    assert fig.layout.height > short.layout.height >= 20 * 20  # no cap: every row fits
    assert len(fig.data[0].cells.values[0]) == 20
    assert figures.table([dict(v=2.0**-6)], pow2=True).data[0].cells.values[0] == ["2^-6"]


def test_storage_accuracy_figure_labels_and_separates_points():
    rows = [dict(scheme=f"s{i}", bits_per_weight=4.25, sqnr_db=20.0 + i) for i in range(5)]
    rows += [
        dict(scheme="nvfp4", bits_per_weight=4.5, sqnr_db=21.0),
        dict(scheme="w6", bits_per_weight=6.25, sqnr_db=30.0),
    ]
    fig = figures.storage_accuracy_figure(rows)
    assert [t.name for t in fig.data] == [
        f"{i + 1}. {n}" for i, n in enumerate([f"s{i}" for i in range(5)] + ["nvfp4", "w6"])
    ]
    assert [t.text[0] for t in fig.data] == [str(i + 1) for i in range(7)]  # each marker numbered
    xs = [t.x[0] for t in fig.data]
    assert len(set(xs)) == 7  # the five 4.25-bit schemes no longer overlap
    assert len({t.marker.color for t in fig.data}) == 7  # and no colour repeats
    assert all(abs(x - 4.25) <= 0.1 + 1e-9 for x in xs[:5]) and list(fig.layout.xaxis.tickvals) == [4.25, 4.5, 6.25]


def test_sweep_figure():
    rows = [dict(outlier_scale=s, a=1.0 * s, b=2.0) for s in (1, 10, 100)]
    fig = figures.sweep_figure(rows, "outlier_scale", ["a", "b"], "t", "x", "y", log_x=True)
    assert [t.name for t in fig.data] == ["a", "b"] and list(fig.data[0].y) == [1.0, 10.0, 100.0]
    assert fig.data[0].line.color != fig.data[1].line.color and fig.layout.xaxis.type == "log"


def test_bar_figure_is_horizontal_with_error_bars():
    rows = [dict(scheme=f"w_mxfp6_e3m2_a_mxfp6_e3m2_{i}", sqnr_db=10.0 + i, lo=9.0 + i, hi=12.0 + i) for i in range(3)]
    fig = figures.bar_figure(rows, "scheme", ["sqnr_db"], errors={"sqnr_db": ("lo", "hi")})
    bar = fig.data[0]
    assert bar.orientation == "h" and list(bar.y) == [r["scheme"] for r in rows] and list(bar.x) == [10.0, 11.0, 12.0]
    assert list(bar.error_x.array) == [2.0, 2.0, 2.0] and list(bar.error_x.arrayminus) == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="errors"):
        figures.bar_figure(rows, "scheme", ["sqnr_db"], errors={"kl": ("lo", "hi")})
    with pytest.raises(ValueError, match="rows"):
        figures.bar_figure([], "scheme", ["sqnr_db"])
