"""mxlib.plots: the notebooks' figures hold the data they are given."""

import math

from mxlib import plots


def test_e4m3_code_map():
    fig = plots.e4m3_code_map_figure()
    z = fig.data[0].z
    assert len(z) == 16 and all(len(r) == 16 for r in z)
    assert z[0][0] == 0 and z[0x3][0x8] == 0.0  # code 0x00 is zero; 0x38 is 1.0 (log2 0)
    assert z[0x7][0xE] == math.log2(448) and z[0xF][0xE] == -math.log2(448)


def test_grouped_bar_and_heatmap():
    rows = [dict(distribution="gaussian", a=1.0, b=2.0), dict(distribution="laplace", a=3.0, b=4.0)]
    fig = plots.grouped_bar_figure(rows, "distribution", ["a", "b"], "t", "dB")
    assert [t.name for t in fig.data] == ["gaussian", "laplace"] and list(fig.data[1].y) == [3.0, 4.0]
    experts = [dict(point="a2", layer=1, expert=2, db_lost_max=5.0), dict(point="a1", layer=0, expert=0, db_lost_max=9.0)]
    z = plots.expert_loss_heatmap(experts, 2, 3).data[0].z
    assert z[1][2] == 5.0 and math.isnan(z[0][0])


def test_benchmark_and_spread_figures():
    rows = [dict(scheme="nvfp4", M=m, floor_ms=0.1, **{f"{p}{g}_ms": 1.0 for p in ("bf16", "seed", "fused")
                                                       for g in ("", "_graph")}) for m in (1, 16, 256, 4096)]
    rows.append(dict(rows[0], scheme="w_mxfp4"))  # one point: no figure
    figs = plots.moe_layer_time_figures(rows)
    assert len(figs) == 1 and len(figs[0].data) == 7 and list(figs[0].data[0].x) == [1, 16, 256, 4096]
    model = [dict(layers=4, tokens=1, bf16_ms=1.0, seed_ms=2.0, fused_ms=1.5)]
    assert [list(t.y) for t in plots.model_time_figure(model).data] == [[1.0], [2.0], [1.5]]
    spread = [dict(spread=s, point=p, mean_db_lost=s, max_db_lost=2 * s) for s in (0.0, 1.0) for p in ("a1", "a2")]
    assert len(plots.spread_figure(spread).data) == 4
    hist = plots.scale_code_histogram_figure({"max": [1] * 127, "per_expert": [2] * 127})
    assert [t.name for t in hist.data] == ["max", "per_expert"] and len(hist.data[0].y) == 127
