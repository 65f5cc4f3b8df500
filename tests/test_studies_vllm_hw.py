"""``mxlib.studies.unification.vllm_vs_hardware_study`` and its float64 MoE, on the ``tiny`` preset.

Oracles built here, sharing no arithmetic with mxlib: weights decoded from the packed bytes with
ml_dtypes (e2m1 codes, ue4m3 / E8M0 scales) and multiplied in float64; NVFP4 activation codes from
the line-by-line vLLM transcription in tests/oracles.py, their value ``e2m1 * s / gs`` formed in
float64; OCP MX activations from ``oracles.mx_qdq`` (exact: power-of-two scales); the MoE as a loop
over (token, expert) pairs.
"""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from mxlib.analysis import sqnr_db
from mxlib.moe import fused_topk
from mxlib.moe.factory import make_emulation_experts, quantize_expert_weights
from mxlib.studies import steps as W
from mxlib.studies import unification as S

import oracles
from _util import assert_bits_equal

E, H, I, K = 4, 64, 32, 2


# ----------------------------------------------------------------------------- oracles


def decode_weights(packed: torch.Tensor, scale: torch.Tensor, block_size: int, g=None) -> torch.Tensor:
    """float64 ``[E, n, k]`` from FP4 bytes (even element in the low nibble) with ml_dtypes."""
    p = packed.numpy()
    codes = np.stack((p & 0xF, p >> 4), axis=-1).reshape(*p.shape[:-1], -1).astype(np.uint8)
    values = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    sb = scale.view(torch.uint8).numpy()
    sv = sb.view(ml_dtypes.float8_e4m3fn if scale.dtype == torch.float8_e4m3fn else ml_dtypes.float8_e8m0fnu)
    w = values.reshape(*sb.shape, block_size) * sv.astype(np.float64)[..., None]
    w = w.reshape(values.shape)
    if g is not None:
        w = w * g.double().numpy()[:, None, None]
    return torch.from_numpy(w)


def exact_nvfp4(x: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """vLLM's NVFP4 activation codes and block scales (tests/oracles.py's transcription), value in float64."""
    m, n = x.shape
    xb = x.reshape(m, n // 16, 16)
    amax = xb.abs().amax(dim=-1, keepdim=True).float()
    s = torch.clamp(gs * (amax * (1 / 6.0)), -448, 448).to(torch.float8_e4m3fn).float()
    q = oracles._vllm_get_reciprocal(s * oracles._vllm_get_reciprocal(gs))
    codes = oracles._vllm_cast_to_fp4(torch.clamp(xb.float() * q, -6.0, 6.0))
    return (codes.double() * s.double() / gs.double()).reshape(m, n)


def exact_mxfp4(x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(oracles.mx_qdq(x.float().numpy(), "e2m1", 32, "even")).double()


def make_layer(scheme: str, m: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, H, generator=g).to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) * 0.05).to(torch.bfloat16)
    tw, ti = fused_topk(torch.randn(m, E, generator=g), K)
    q = quantize_expert_weights(w13, w2, scheme)
    in13 = torch.full((E,), float(x.float().abs().amax()) / 2688)
    in2 = torch.full((E,), 0.1 / 2688)
    ex = {n: make_emulation_experts(scheme, q, in13, in2, backend="torch", numerics=n) for n in ("vllm", "hardware")}
    return x, tw, ti, q, ex


# ----------------------------------------------------------------------------- the float64 MoE


def test_exact_weights_match_ml_dtypes_decode():
    for scheme, bs in (("nvfp4", 16), ("w_mxfp4_a_mxfp4", 32)):
        _, _, _, q, ex = make_layer(scheme)
        for which in ("w13", "w2"):
            g = getattr(q, f"{which}_weight_scale_2")
            want = decode_weights(getattr(q, f"{which}_weight"), getattr(q, f"{which}_weight_scale"), bs, g)
            assert_bits_equal(S.exact_block_weights(ex["hardware"], which), want, f"{scheme} {which}")


def test_exact_activation_qdq_matches_oracles():
    x, _, _, _, ex = make_layer("nvfp4")
    a1q = ex["vllm"].a1_qdq()
    assert_bits_equal(S.exact_activation_qdq(x, a1q), exact_nvfp4(x, a1q.scale.reshape(1)))
    # vLLM's bf16 operand is this value rounded once: within half a bf16 ulp (2**-8 relative)
    seed = oracles.vllm_nvfp4_qdq(x, a1q.scale.reshape(1)).double()
    exact = exact_nvfp4(x, a1q.scale.reshape(1))
    assert ((seed - exact).abs() <= exact.abs() * 2.0**-8).all()
    assert (seed != exact).any()  # ... and not always equal (the rounding the hardware mode avoids)
    x, _, _, _, ex = make_layer("w_mxfp4_a_mxfp4")
    assert_bits_equal(S.exact_activation_qdq(x, ex["vllm"].a1_qdq()), exact_mxfp4(x))


def test_exact_activation_qdq_rejects_fp8():
    _, _, _, q, _ = make_layer("w_mxfp4")
    ex = make_emulation_experts("w_mxfp4_a_fp8", q, torch.full((E,), 0.01), torch.full((E,), 0.01), backend="torch")
    with pytest.raises(ValueError, match="per-tensor FP8"):
        S.exact_activation_qdq(torch.ones(2, H, dtype=torch.bfloat16), ex.a1_qdq())


@pytest.mark.parametrize("scheme", ["nvfp4", "w_mxfp4_a_mxfp4"])
def test_fp64_moe_matches_pairwise_oracle(scheme):
    x, tw, ti, q, ex = make_layer(scheme)
    bs = 16 if scheme == "nvfp4" else 32
    w13 = decode_weights(q.w13_weight, q.w13_weight_scale, bs, q.w13_weight_scale_2)
    w2 = decode_weights(q.w2_weight, q.w2_weight_scale, bs, q.w2_weight_scale_2)
    if scheme == "nvfp4":
        g1, g2 = ex["vllm"].a1_qdq().scale.reshape(1), ex["vllm"].a2_qdq().scale.reshape(1)
        a1, a2 = (lambda v: exact_nvfp4(v, g1)), (lambda v: exact_nvfp4(v, g2))
    else:
        a1 = a2 = exact_mxfp4
    want = oracles.moe_fp64(a1(x), w13, w2, tw, ti, store_dtype=torch.bfloat16, a2_fn=lambda act, e: a2(act))
    a1q, a2q = ex["vllm"].a1_qdq(), ex["vllm"].a2_qdq()
    w13x, w2x = S.exact_block_weights(ex["vllm"], "w13"), S.exact_block_weights(ex["vllm"], "w2")
    got, a2_in = S.fp64_moe(
        x, w13x, w2x, tw, ti, lambda v: S.exact_activation_qdq(v, a1q), lambda v, e: S.exact_activation_qdq(v, a2q)
    )
    assert got.dtype == torch.float64 and a2_in.shape == (x.shape[0] * K, I)
    # the same bf16 roundings and codes; only the float64 summation order differs
    assert ((got - want).norm() / want.norm()).item() < 1e-12
    # without the two bf16 roundings: the same function up to them and the a2 decisions they move
    unrounded, a2_64 = S.fp64_moe(
        x,
        w13x,
        w2x,
        tw,
        ti,
        lambda v: S.exact_activation_qdq(v, a1q),
        lambda v, e: S.exact_activation_qdq(v, a2q),
        round_dtype=None,
    )
    assert a2_64.dtype == torch.float64 and 20.0 < sqnr_db(unrounded, got) < math.inf

    seed, hw = (ex[n](x, tw, ti) for n in ("vllm", "hardware"))
    if scheme == "nvfp4":
        # the hardware mode computes this function up to fp32 accumulation and the output's bf16
        # rounding; vLLM also rounds every dequantized operand to bf16
        assert sqnr_db(hw, want) > 45.0, sqnr_db(hw, want)
        assert sqnr_db(hw, want) > sqnr_db(seed, want) + 10.0, (sqnr_db(hw, want), sqnr_db(seed, want))
    else:  # OCP MX: the same operands in both modes, bit for bit the same output
        assert_bits_equal(seed, hw)
        assert sqnr_db(hw, want) > 45.0, sqnr_db(hw, want)


# ----------------------------------------------------------------------------- the study


@pytest.fixture(scope="module")
def tiny():
    model = W.dummy_model(2, seed=0, model_preset="tiny")
    cal = W.calibrate_model(model, 64, 0)
    ids = W.random_token_ids(16, 1, model.config.vocab_size)
    return {s: S.vllm_vs_hardware_study(model, s, ids, cal) for s in ("nvfp4", "w_mxfp4_a_mxfp4")}, model, ids


def test_study_nvfp4(tiny):
    res = tiny[0]["nvfp4"]
    assert res["scheme"] == "nvfp4" and res["num_tokens"] == 16 and [r["layer"] for r in res["layers"]] == [0, 1]
    for r in res["layers"]:
        # hardware: close to float64 on the same operands; vLLM: its operand rounding, amplified by a2's requantization
        assert r["hw_vs_ref_sqnr_db"] > 45.0 and r["hw_vs_ref_sqnr_db"] > r["vllm_vs_ref_sqnr_db"] + 10.0, r
        assert 20.0 < r["vllm_vs_hw_sqnr_db"] < 45.0, r
        assert r["a2_input_hw_vs_ref_sqnr_db"] > r["a2_input_vllm_vs_ref_sqnr_db"] + 10.0, r
        assert 0.0 < r["a2_changed"] < r["a2_input_changed"] < 1.0, r
        # negative control: against the float64 MoE on vLLM's bf16 operands, vLLM's is the closer one
        assert r["control_vllm_sqnr_db"] > r["control_hw_sqnr_db"] + 10.0, r
        assert math.isclose(r["vllm_vs_ref_rel_error"], 10 ** (-r["vllm_vs_ref_sqnr_db"] / 20), rel_tol=1e-9)
    # layer 0 sees the same input in both whole-model runs: the local and the whole-model comparisons agree
    assert res["layers"][0]["e2e_vllm_vs_hw_sqnr_db"] == res["layers"][0]["vllm_vs_hw_sqnr_db"]
    lg = res["logits"]
    assert 0.0 < lg["max_abs_diff"] and math.isfinite(lg["vllm_vs_hw_sqnr_db"]) and 0.0 <= lg["top1_agreement"] <= 1.0


def test_study_mx_modes_equal(tiny):
    res = tiny[0]["w_mxfp4_a_mxfp4"]
    for r in res["layers"]:
        assert r["vllm_vs_hw_sqnr_db"] == math.inf and r["e2e_vllm_vs_hw_sqnr_db"] == math.inf, r
        assert r["a2_changed"] == 0.0 and r["a2_input_changed"] == 0.0, r
        assert r["vllm_vs_ref_sqnr_db"] == r["hw_vs_ref_sqnr_db"] > 45.0, r
    lg = res["logits"]
    assert lg["max_abs_diff"] == 0.0 and lg["top1_agreement"] == 1.0 and lg["vllm_vs_hw_sqnr_db"] == math.inf
    assert lg["vllm_vs_bf16_sqnr_db"] == lg["hw_vs_bf16_sqnr_db"]


def test_study_rejects_bad_input(tiny):
    _, model, ids = tiny
    with pytest.raises(ValueError, match="calibration: nvfp4 needs static input scales"):
        S.vllm_vs_hardware_study(model, "nvfp4", ids)
    with pytest.raises(ValueError, match="scheme: w_mxfp4_a_fp8 has per-tensor FP8 activations"):
        S.vllm_vs_hardware_study(model, "w_mxfp4_a_fp8", ids)
    with pytest.raises(ValueError, match="which: expected 'w13' or 'w2'"):
        S.exact_block_weights(None, "w3")


def test_vllm_vs_hardware_figure(tiny):
    pytest.importorskip("plotly")
    from mxlib.workbook import figures

    fig = figures.vllm_vs_hardware_figure(list(tiny[0].values()))
    names = [t.name for t in fig.data]
    assert any("(equal: +inf)" in n for n in names)  # MX vLLM vs hardware: no point, said in the legend
    for t in fig.data:
        ys = [y for y in t.y if y is not None]
        assert all(math.isfinite(y) for y in ys)
        if t.type == "scatter" and "(equal: +inf)" not in t.name:
            assert ys, t.name
    bars = [t for t in fig.data if t.type == "bar"]
    assert len(bars) == 3 and bars[0].text[1] == "equal"
