"""mxlib.workbook.explorers (the plain functions behind the widgets) and mxlib.studies.probes, against ml_dtypes,
hand grids and oracles."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from mxlib.formats import NVFP4_FLUSH_RATIO, NVFP4_SUBNORMAL_RATIO
from mxlib.studies import probes
from mxlib.workbook import checks
from mxlib.workbook import explorers as X

from oracles import FORMATS, mx_qdq, mx_scale_exponent, vllm_nvfp4_qdq

# Hand-written positive grids (OCP MX v1.0 section 5.3, tables 1 and 2).
E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


@pytest.mark.parametrize(
    "value, below, above, rounded, code, bits, tie, saturated",
    [
        (2.6, 2.0, 3.0, 3.0, 0x5, "0 10 1", False, False),
        (2.5, 2.0, 3.0, 2.0, 0x4, "0 10 0", True, False),  # tie to the even code
        (5.0, 4.0, 6.0, 4.0, 0x6, "0 11 0", True, False),
        (0.25, 0.0, 0.5, 0.0, 0x0, "0 00 0", True, False),
        (0.3, 0.0, 0.5, 0.5, 0x1, "0 00 1", False, False),  # subnormal
        (-1.7, -2.0, -1.5, -1.5, 0xB, "1 01 1", False, False),
        (7.0, 6.0, None, 6.0, 0x7, "0 11 1", False, True),  # saturates
        (-100.0, None, -6.0, -6.0, 0xF, "1 11 1", False, True),
    ],
)
def test_value_info_e2m1_hand(value, below, above, rounded, code, bits, tie, saturated):
    info = X.value_info(value, "e2m1")
    assert (info["below"], info["above"], info["rounded"], info["code"]) == (below, above, rounded, code)
    assert info["bits"] == bits and info["tie"] is tie and info["saturated"] is saturated
    assert info["error"] == rounded - info["value"]


@pytest.mark.parametrize("element", list(FORMATS))
def test_value_info_matches_ml_dtypes(element):
    mld, fmax, _, mbits = FORMATS[element]
    rng = np.random.default_rng(0)
    values = np.concatenate(
        [rng.standard_normal(200) * fmax / 3, rng.standard_normal(50) * fmax * 2, rng.standard_normal(50) * 2.0**-8]
    ).astype(np.float32)
    nbits = {"e2m1": 4, "e2m3": 6, "e3m2": 6}.get(element, 8)
    all_codes = np.arange(2**nbits, dtype=np.uint8).view(mld).astype(np.float32)
    grid = np.array(sorted({float(v) for v in all_codes if np.isfinite(v)}))
    for v in values:
        info = X.value_info(float(v), element)
        expected = np.clip(v, -fmax, fmax).astype(mld)
        assert info["rounded"] == float(expected.astype(np.float32)), (element, v)
        assert info["code"] == int(np.array(expected).view(np.uint8)), (element, v)
        lower = grid[grid <= v]
        upper = grid[grid >= v]
        assert info["below"] == (float(lower.max()) if lower.size else None)
        assert info["above"] == (float(upper.min()) if upper.size else None)
        assert info["below"] is None or info["below"] <= info["rounded"] or info["saturated"]


def test_bit_fields_decode_formulas():
    # e4m3 1.0 = 0 0111 000; smallest subnormal 0x01 = 2^-6 * 1/8; 0x7F is NaN
    assert X.bit_fields(0x38, "e4m3")["bits"] == "0 0111 000"
    sub = X.bit_fields(0x01, "e4m3")
    assert sub["kind"] == "subnormal" and sub["formula"].endswith(repr(2.0**-9))
    assert X.bit_fields(0x7F, "e4m3")["kind"] == "nan"
    assert X.bit_fields(0x7C, "e5m2")["kind"] == "inf"
    assert X.bit_fields(0x8, "e2m1")["kind"] == "zero"
    with pytest.raises(ValueError, match="code"):
        X.bit_fields(16, "e2m1")
    with pytest.raises(ValueError, match="value"):
        X.value_info(math.inf, "e2m1")


@pytest.mark.parametrize(
    "scheme, element",
    [("mxfp4", "e2m1"), ("mxfp6_e2m3", "e2m3"), ("mxfp6_e3m2", "e3m2"), ("mxfp8_e4m3", "e4m3"), ("mxfp8_e5m2", "e5m2")],
)
@pytest.mark.parametrize("scale_mode", ["floor", "even", "rceil"])
def test_block_info_mx_against_oracle(scheme, element, scale_mode):
    g = torch.Generator().manual_seed(1)
    for trial in range(20):
        block = torch.randn(32, generator=g) * 2.0 ** (trial - 10)
        info = X.block_info(block, scheme, scale_mode)
        e = mx_scale_exponent(float(block.abs().max()), element, scale_mode)
        assert info["scale_byte"] == e + 127 and info["scale"] == 2.0**e
        expected = mx_qdq(block.numpy(), element, 32, scale_mode)
        np.testing.assert_array_equal(np.array(info["dequant"], dtype=np.float32), expected)
        assert info["clipped"] == [abs(v) > FORMATS[element][1] for v in info["scaled"]]


def test_block_info_worked_example_e4m3():
    # REFERENCE.md: an e4m3 block with amax 960 holding 957: floor -> 2^1, 957/2 saturates to 448, 896;
    # rceil -> 2^ceil(log2(960/448)) = 2^2, 957/4 = 239.25 -> 240, 960.
    block = [960.0, 957.0] + [1.0] * 30
    floor = X.block_info(block, "mxfp8_e4m3", "floor")
    rceil = X.block_info(block, "mxfp8_e4m3", "rceil")
    assert floor["scale_byte"] == 128 and floor["dequant"][1] == 896.0 and floor["clipped"][1]
    assert rceil["scale_byte"] == 129 and rceil["dequant"][1] == 960.0 and not any(rceil["clipped"])


def test_block_info_mxfp4_codes_and_packing_by_hand():
    # amax 6 -> scale 2^0 under every rule for e2m1 (6 = 1.5 * 2^2; even: mantissa 1.5 < 1.75)
    block = [6.0, -0.5, 1.0, 2.6] + [0.0] * 28
    info = X.block_info(block, "mxfp4", "floor")
    assert info["scale_byte"] == 127
    assert info["codes"][:4] == [0x7, 0x9, 0x2, 0x5]
    assert info["packed_hex"].split()[:2] == ["97", "52"]  # even element in the low nibble
    assert info["dequant"][:4] == [6.0, -0.5, 1.0, 3.0]


def test_block_info_nvfp4_against_vllm_transcription():
    g = torch.Generator().manual_seed(2)
    for trial in range(10):
        block = torch.randn(16, generator=g) * 3.0**trial
        gs = torch.tensor(2688.0 / 7.0)
        info = X.block_info(block, "nvfp4", global_scale=float(gs))
        expected = vllm_nvfp4_qdq(block.reshape(1, 16), gs.reshape(1))
        assert torch.equal(torch.tensor(info["dequant"]), expected.reshape(-1))
        pre = np.float32(gs.item()) * (np.float32(block.abs().max().item()) * np.float32(1 / 6))
        assert info["scale"] == float(np.float32(min(pre, np.float32(448.0))).astype(ml_dtypes.float8_e4m3fn))
        assert info["scale_byte"] == int(np.array(ml_dtypes.float8_e4m3fn(info["scale"])).view(np.uint8))


def test_block_info_errors():
    with pytest.raises(ValueError, match="block_size=32"):
        X.block_info([1.0] * 16, "mxfp4")
    with pytest.raises(ValueError, match="scale_mode"):
        X.block_info([1.0] * 32, "mxfp4", "ceil")


def test_expert_scale_ratio_thresholds():
    assert NVFP4_SUBNORMAL_RATIO == 2.0**-6 / 448 and NVFP4_FLUSH_RATIO == 2.0**-10 / 448
    base = X.expert_scale_ratio(1.0)
    assert all(r["sqnr_unified_db"] == r["sqnr_per_expert_db"] for r in base)  # equal amax: one scale
    # A power-of-two ratio scales the data exactly: per-expert scales give exactly the same SQNR.
    for k in (4, 12, 16, 20):
        rows = X.expert_scale_ratio(2.0**-k)
        assert rows[1]["amax"] == 2.0**-k
        assert rows[1]["sqnr_per_expert_db"] == base[1]["sqnr_per_expert_db"]
    # Above the subnormal threshold the largest unified block scale is normal (>= 2^-6).
    above = X.expert_scale_ratio(4 * NVFP4_SUBNORMAL_RATIO)[1]
    assert above["max_block_scale"] >= 2.0**-6
    # Below it every block scale is subnormal or zero, and the unified SQNR is lower.
    below = X.expert_scale_ratio(NVFP4_SUBNORMAL_RATIO / 2)[1]
    assert below["max_block_scale"] < 2.0**-6 and below["subnormal_blocks"] + below["flushed_blocks"] == 1.0
    assert below["sqnr_unified_db"] < base[1]["sqnr_unified_db"] - 1  # 18.5 vs 20.4 dB at seed 0
    # Below the flush threshold every block of the small expert becomes zero: SQNR exactly 0 dB.
    flushed = X.expert_scale_ratio(NVFP4_FLUSH_RATIO / 2)[1]
    assert flushed["flushed_blocks"] == 1.0 and flushed["sqnr_unified_db"] == 0.0
    sweep = X.expert_scale_ratio_sweep([1.0, 2.0**-10])
    assert [r["ratio"] for r in sweep] == [1.0, 2.0**-10]
    with pytest.raises(ValueError, match="ratio"):
        X.expert_scale_ratio(2.0)


def test_outlier_scale_sqnr_against_oracle():
    kw = dict(rows=8, row_length=256, outlier_fraction=0.01, seed=3)
    x = X.outlier_data(100.0, **kw)
    base = X.outlier_data(1.0, **kw)
    changed = x != base
    assert int(changed.sum()) == round(0.01 * 8 * 256)  # only the outliers move
    got = X.outlier_scale_sqnr(100.0, schemes=("mxfp4", "mxfp8_e4m3"), scale_mode="floor", **kw)
    for scheme, element in (("mxfp4", "e2m1"), ("mxfp8_e4m3", "e4m3")):
        ref = x.double().numpy()
        q = mx_qdq(x.numpy(), element, 32, "floor").astype(np.float64)
        expected = 10 * math.log10((ref**2).sum() / ((q - ref) ** 2).sum())
        assert got[scheme] == pytest.approx(expected, rel=1e-12)
    rows = X.outlier_scale_sweep([1.0, 1000.0], **kw)
    assert rows[1]["nvfp4"] > rows[1]["mxfp4"]  # 16-element blocks with finer scales isolate the outliers


def test_scale_bytes_and_exercise_checker():
    # amax 7 = 1.75 * 2^2 with e2m1 (emax 2): floor 2^0 (7 clips to 6), even and rceil 2^1
    assert X.scale_bytes(7.0, "e2m1") == {"floor": 127, "even": 128, "rceil": 128}
    assert X.scale_bytes(6.0, "e2m1") == {"floor": 127, "even": 127, "rceil": 127}
    assert checks.floor_clips_rceil_does_not([7.0] + [0.0] * 31)
    assert not checks.floor_clips_rceil_does_not([6.0] + [0.0] * 31)


def test_rows_table_shows_every_row():
    pytest.importorskip("IPython")
    html = X.rows_table([{"a": i, "b": i / 3} for i in range(100)]).data
    assert html.count("<tr>") == 101 and "..." not in html
    with pytest.raises(ValueError, match="rows"):
        X.rows_table([])


def test_widgets_construct():
    pytest.importorskip("ipywidgets")
    for make in (X.value_explorer_widget, X.block_explorer_widget, X.expert_scale_ratio_widget, X.outlier_scale_widget):
        w = make()
        assert len(w.children) >= 2, make.__name__  # controls and the output area


def test_stored_shapes():
    assert probes.stored_shapes("nvfp4", 768, 2048) == {
        "weight": ((768, 1024), "U8"),
        "weight_scale": ((768, 128), "F8_E4M3"),
    }
    assert probes.stored_shapes("w_mxfp4_a_mxfp4", 768, 2048) == {
        "weight": ((768, 1024), "U8"),
        "weight_scale": ((768, 64), "U8"),
    }
    assert probes.stored_shapes("mxfp6_e3m2", 2048, 768)["weight"][0] == (2048, 576)
    with pytest.raises(ValueError, match="block_size=32"):
        probes.stored_shapes("mxfp4", 8, 48)


@pytest.mark.parametrize("scheme", ["nvfp4", "w_mxfp4_a_mxfp4"])
def test_stored_block_decodes_what_reference_dequantizes(scheme, tmp_path):
    from safetensors import safe_open

    from mxlib import reference as R
    from mxlib.studies import steps as W

    model = W.dummy_model(1, seed=0, model_preset="tiny")
    ckpt = W.prepare_checkpoint(scheme, model, seed=0, calib_tokens=16, cache_dir=tmp_path)
    info = probes.stored_block(ckpt, layer=0, expert=3, proj="down_proj", row=5, block=1 if scheme == "nvfp4" else 0)
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    files = list(ckpt.glob("*.safetensors"))
    t = {}
    for f in files:
        with safe_open(str(f), "pt") as h:
            t.update({k: h.get_tensor(k) for k in h.keys() if k.startswith(name)})
    if scheme == "nvfp4":
        row = R.dequantize_to_dtype(t[name][5:6], t[name + "_scale"][5:6], t[name + "_scale_2"].float(), torch.float32)[
            0
        ]
        want = row[16:32]
    else:
        row = R.dequantize_mx(t[name][5:6], t[name + "_scale"][5:6], "e2m1", 32, torch.float32)[0]
        want = row[0:32]  # tiny: down_proj's input (moe intermediate 32) is one MX block
    assert torch.equal(torch.tensor(info["values"]), want)
    assert len(info["codes"]) == len(want) and info["tensor"] == name
    with pytest.raises(ValueError, match="row"):
        probes.stored_block(ckpt, row=10**6)


def test_swapped_nibbles_scrambles_and_restores():
    m = torch.nn.Module()
    m.register_buffer("w13_weight", torch.tensor([[0x12, 0xAB]], dtype=torch.uint8))
    m.register_buffer("w2_weight", torch.tensor([[0xF0]], dtype=torch.uint8))
    with probes.swapped_nibbles(torch.nn.Sequential(m)) as n:
        assert n == 1 and m.w13_weight.tolist() == [[0x21, 0xBA]] and m.w2_weight.tolist() == [[0x0F]]
    assert m.w13_weight.tolist() == [[0x12, 0xAB]] and m.w2_weight.tolist() == [[0xF0]]
    with pytest.raises(ValueError, match="no module"):
        probes.swapped_nibbles(torch.nn.Linear(2, 2))


def test_captured_output_records_and_unhooks():
    lin = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    with probes.captured_output(lin) as outs:
        y = lin(x)
        lin(x)
    lin(x)  # after the block: not recorded
    assert len(outs) == 2 and torch.equal(outs[0], y.detach()) and not outs[0].requires_grad


def test_rows_table_wraps_only_long_text():
    pytest.importorskip("IPython")
    html = X.rows_table([{"name": "w_mxfp6_e3m2_a_mxfp6_e3m2", "why": "a long reason " * 10}]).data
    name_cell, why_cell = html.split("<tbody>")[1].split("<td ")[1:3]
    assert "nowrap" in name_cell and "w_mxfp6_e3m2_a_mxfp6_e3m2" in name_cell
    assert "white-space:normal" in why_cell and "text-align:left" in why_cell
