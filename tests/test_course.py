"""The teaching functions and figures of notebooks 00, 02 and 04 (``mxlib.workbook.format_lessons``,
``mxlib.workbook.course_figures``, the e4m3 code map's labels, the expert-loss heatmap's colour range, the
workbook runner's preset), against oracles that do not share their code: a float64 MXFP4 by hand with
the OCP floor rule, ml_dtypes' float8_e4m3fn, literal e2m1 grids."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from mxlib import analysis as A
from mxlib.workbook import course_figures as C
from mxlib.workbook import explorers as X
from mxlib.workbook import figures
from mxlib.workbook import format_lessons as L

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _mx_floor_by_hand(x: np.ndarray, block: int) -> np.ndarray:
    """MXFP4 QDQ with the OCP floor rule in float64: scale 2^(floor(log2 amax) - 2), nearest e2m1 magnitude
    (ties to the even index), saturating at 6."""
    grid = np.array(E2M1)
    out = np.empty_like(x)
    for i, b in enumerate(x.reshape(-1, block)):
        amax = np.abs(b).max()
        e = math.frexp(amax)[1] - 1 - 2 if amax > 0 else 0
        a = np.minimum(np.abs(b) / 2.0**e, 6.0)
        d = np.abs(a[:, None] - grid[None, :])
        best = d.min(axis=1, keepdims=True)
        near = d == best
        idx = np.where(near & (np.arange(8) % 2 == 0), np.arange(8), 99).min(axis=1)
        idx = np.where(near.sum(axis=1) > 1, idx, d.argmin(axis=1))
        out.reshape(-1, block)[i] = np.sign(b) * grid[idx] * 2.0**e
    return out


@pytest.mark.parametrize("block", [16, 32])
def test_block_format_sqnr_matches_a_float64_mxfp4_by_hand(block):
    x = A.sample("gaussian", (8, 256), 3)
    dq = _mx_floor_by_hand(x.double().numpy(), block)
    want = 10 * math.log10((x.double().numpy() ** 2).sum() / ((x.double().numpy() - dq) ** 2).sum())
    assert L.block_format_sqnr(x, "e2m1", block, "e8m0", "floor") == pytest.approx(want, abs=1e-9)


def test_block_format_corners_are_mxfp4_and_nvfp4_and_bad_input_is_named():
    x = A.sample("gaussian", (4, 512), 1)
    s = A.scheme_sqnr(x, schemes=("mxfp4", "nvfp4"))
    assert L.block_format_sqnr(x, "e2m1", 32, "e8m0") == s["mxfp4"]
    assert L.block_format_sqnr(x, "e2m1", 16, "e4m3") == s["nvfp4"]
    with pytest.raises(ValueError, match="scale_format"):
        L.block_format_sqnr(x, "e2m1", 32, "ue8m0")
    with pytest.raises(ValueError, match="element"):
        L.block_format_sqnr(x, "e4m3", 16, "e4m3")
    with pytest.raises(ValueError, match="block_size=24"):
        L.block_format_sqnr(x, "e2m1", 24, "e8m0")


def test_amax_lands_in_a_factor_of_two_under_e8m0_and_at_6_under_e4m3():
    x = A.sample("gaussian", (16, 1024), 0)
    e8 = L.amax_on_grid(x, "e2m1", 32, "e8m0", "even")
    amax = x.reshape(-1, 32).abs().amax(dim=1)
    # by hand: even = floor + 1 when the significand rounds (half up, one mantissa bit) to 2, i.e. s >= 1.75
    exps = [math.frexp(a)[1] - 1 - 2 + (2 * math.frexp(a)[0] >= 1.75) for a in amax.tolist()]
    assert e8.tolist() == [a / 2.0**e for a, e in zip(amax.tolist(), exps)]
    assert 3.5 <= e8.min() and e8.max() < 7.0
    e4 = L.amax_on_grid(x, "e2m1", 16, "e4m3")
    assert (6 / (1 + 2**-4) <= e4).all() and (e4 <= 6 / (1 - 2**-4)).all()


def test_rule_sqnr_rows_and_best():
    x = A.sample("gaussian", (8, 1024), 0)
    rows = L.rule_sqnr(x, ("mxfp4", "mxfp8_e4m3"))
    for r in rows:
        assert r["best"] == max(("floor", "even", "rceil"), key=lambda m: r[m])
    assert rows[0]["floor"] == L.block_format_sqnr(x, "e2m1", 32, "e8m0", "floor")
    with pytest.raises(ValueError, match="schemes"):
        L.rule_sqnr(x, ("nvfp4",))


def test_outlier_parts_split_the_data():
    x, mask = X.outlier_data(100.0, rows=8, row_length=256, return_mask=True)
    assert int(mask.sum()) == round(1e-3 * x.numel()) and torch.equal(x, X.outlier_data(100.0, rows=8, row_length=256))
    base = X.outlier_data(1.0, rows=8, row_length=256)
    assert torch.equal(x[~mask], base[~mask]) and torch.equal(x[mask], base[mask] * 100.0)
    p = L.outlier_parts(100.0, schemes=("mxfp4",), rows=8, row_length=256)["mxfp4"]
    from mxlib import reference as R

    dq = R.quant_dequant(x, "mxfp4", scale_mode="even")
    rest = ~mask & (x != 0)
    assert p["flushed"] == pytest.approx(float((dq[rest] == 0).sum()) / int(rest.sum()), rel=1e-6)
    assert p["global_db"] == X.outlier_scale_sqnr(100.0, schemes=("mxfp4",), rows=8, row_length=256)["mxfp4"]
    rows = L.outlier_parts_sweep([1, 100], schemes=("mxfp4", "nvfp4"), rows=8, row_length=256)
    assert set(rows[0]) == {"outlier_scale"} | {
        f"{s}_{k}" for s in ("mxfp4", "nvfp4") for k in ("global_db", "rest_db", "flushed")
    }


def test_teaching_figures_hold_data():
    line = C.number_line_figure("e2m1")
    values = sorted(v for tr in line.data[:2] for v in tr.x)
    assert values == sorted({-v for v in E2M1} | set(E2M1))  # 15 values, one zero
    bits = C.bit_layout_figure(("e2m1", "e4m3", "e8m0"))
    labels = [tr.text for tr in bits.data if tr.mode == "text"]
    assert [list(t) for t in labels] == [list("SEEM"), list("SEEEEMMM"), list("EEEEEEEE")]
    block = C.mx_block_figure()
    assert [len(tr.text) for tr in block.data if tr.mode == "text"] == [1, 32, 1, 16, 1]
    rows = [
        dict(block_size=b, scale=s, sqnr_db=20.0 + i)
        for i, (b, s) in enumerate([(16, "e4m3"), (16, "e8m0"), (32, "e4m3"), (32, "e8m0")])
    ]
    assert len(C.scale_format_grid_figure(rows).data) == 2
    fig = C.outlier_parts_figure(
        L.outlier_parts_sweep([1, 10], schemes=("mxfp4", "nvfp4"), rows=4, row_length=256), ["mxfp4", "nvfp4"]
    )
    styles = {(tr.line.color, tr.line.dash) for tr in fig.data}
    assert len(fig.data) == 6 and len(styles) == 2  # one hue and dash per scheme, the same in all three panels


def test_moe_layer_figure_draws_the_layer_with_its_shapes():
    fig = C.moe_layer_figure(hidden_size=64, moe_intermediate_size=32, num_experts=8, top_k=2)
    labels = list(fig.data[0].text)
    for part in ("router", "top-k", "a1 QDQ", "GEMM1", "w13[e]", "SiLU(gate) * up", "a2 QDQ", "GEMM2", "w2[e]"):
        assert any(part in t for t in labels), (part, labels)
    assert sum("QDQ" in t for t in labels) == 2
    texts = [a.text for a in fig.layout.annotations if a.text]
    # the arrows carry the shapes of the sizes asked for: [T, H], [T*top_k, 2*I], [T*top_k, I], router_logits [T, E]
    assert {"[T, 64]", "[T*2, 2*32]", "[T*2, 32]", "router_logits [T, 8]"} <= set(texts), texts
    assert "E = 8 experts, top_k = 2" in fig.layout.title.text
    assert len(fig.data) == 1 + 5  # the boxes' labels, and one legend entry per kind of box


def test_e4m3_code_map_labels_are_exact_and_subnormals_outlined():
    fig = figures.e4m3_code_map_figure()
    text = fig.data[1].text
    for code in range(256):
        want = float(np.array([code], dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)[0])
        label = text[code >> 4][code & 15]
        if math.isnan(want):
            assert label == "NaN"
            continue
        got = float(eval(label.replace("·", "*").replace("^", "**")))  # noqa: S307 (labels of our own figure)
        assert got == want and len(label) <= 11, (hex(code), label, want)
    rects = [(s.y0, s.y1, s.x0, s.x1) for s in fig.layout.shapes]
    assert rects == [(-0.5, 0.5, 0.5, 7.5), (7.5, 8.5, 0.5, 7.5)]  # rows 0 and 8, columns 1-7


def test_expert_loss_heatmap_colours_noise_grey():
    rows = [dict(point="a2", layer=0, expert=e, db_lost_max=v) for e, v in enumerate([0.1, -0.3, 0.6, 0.2])]
    hm = figures.expert_loss_heatmap(rows, 1, 4).data[0]
    assert hm.zmin == -0.75 and hm.zmax == 6.0  # noise-only data: no hot colour
    edge = hm.colorscale[1][0]
    assert hm.colorscale[0][1] == hm.colorscale[1][1] and edge == pytest.approx(1.5 / 6.75)
    rows.append(dict(point="a2", layer=0, expert=3, db_lost_max=12.0))
    assert figures.expert_loss_heatmap(rows, 1, 4).data[0].zmax == 12.0


def test_workbook_runner_defaults_to_the_full_preset():
    from mxlib.workbook import runner

    assert runner.WORKBOOK_MODEL_PRESET == "qwen3-30b-a3b"


def test_draw_means_average_numbers_and_keep_names():
    rows = [dict(scheme="mxfp4", sqnr=18.0, n=2), dict(scheme="mxfp4", sqnr=19.0, n=4)]
    assert L.draw_means(rows) == dict(scheme="mxfp4", sqnr=18.5, n=3.0)
    assert rows[0] == dict(scheme="mxfp4", sqnr=18.0, n=2)  # nothing passed in is changed
    with pytest.raises(ValueError, match="rows"):
        L.draw_means([])
    with pytest.raises(ValueError, match="rows"):
        L.draw_means([dict(a=1.0), dict(b=1.0)])
    assert L.draw_means([dict(seed=0, x=1.0), dict(seed=1, x=2.0)], keys=["x"]) == dict(x=1.5)
    with pytest.raises(ValueError, match="keys"):
        L.draw_means(rows, keys=["sqnr_db"])
