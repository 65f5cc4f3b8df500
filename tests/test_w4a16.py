"""Weight-only NVFP4 (``w4a16_nvfp4``, W4A16: what vLLM's Marlin and Humming NVFP4 MoE backends compute on
Hopper) beside W4A4 ``nvfp4``.

Oracles: vLLM's ``dequantize_to_dtype`` transcribed (``oracles.vllm_dequantize_to_dtype``), ModelOpt's NVFP4
quantization transcribed (``oracles.modelopt_nvfp4_quantize``) and ``oracles.moe_fp64``. ``torch``, ``triton``
and ``fused`` (the FP4 kernel, bf16 activations, no activation QDQ) give the same bits (Triton interpreter).
"""

import pytest
import torch

import mxlib.reference as R
from mxlib.formats import NVFP4
from mxlib.moe import fused_topk
from mxlib.moe.factory import input_scales_from_amax, make_emulation_experts, quantize_expert_weights
from mxlib.moe.schemes import SCHEME_ALIASES, W4A16_NVFP4, get_moe_scheme
from mxlib.moe.weight_only import Nvfp4WeightOnlyEmulationTritonExperts

from _util import assert_bits_equal
from oracles import modelopt_nvfp4_quantize, moe_fp64, vllm_dequantize_to_dtype

E, H, I, M, TOPK = 4, 128, 128, 6, 2


@pytest.fixture(scope="module")
def layer():
    g = torch.Generator().manual_seed(16)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(M, H, generator=g).to(torch.bfloat16)
    tw, ti = fused_topk(torch.randn(M, E, generator=g), TOPK)
    return w13, w2, x, tw, ti


def test_scheme_names():
    s = get_moe_scheme("w4a16_nvfp4")
    assert s is W4A16_NVFP4 and s.weight is NVFP4 and s.activation is None
    assert s.precision == "W4A16" and get_moe_scheme("nvfp4").precision == "W4A4"
    assert not s.static_activation_scale and not s.is_ocp_mx
    for alias in ("W4A16_NVFP4", "NVFP4A16", "nvfp4_w4a16", "w_nvfp4"):
        assert get_moe_scheme(alias) is s and SCHEME_ALIASES[alias] == "w4a16_nvfp4"
    assert input_scales_from_amax(s, torch.ones(E), torch.ones(E)) == (None, None)


def test_weights_are_modelopt_nvfp4_and_dequantize_as_vllm(layer):
    w13, w2, *_ = layer
    q = quantize_expert_weights(w13, w2, "w4a16_nvfp4", ops=R)
    for e in range(E):  # ModelOpt's arithmetic: one weight_scale_2 per expert for gate and up
        p, s, g = modelopt_nvfp4_quantize(w13[e].float())
        assert_bits_equal(q.w13_weight[e], p)
        assert_bits_equal(q.w13_weight_scale[e], s)
        assert_bits_equal(q.w13_weight_scale_2[e].reshape(()), g.reshape(()).float())
    for backend in ("torch", "triton"):
        ex = make_emulation_experts("w4a16_nvfp4", q, backend=backend)
        assert isinstance(ex, Nvfp4WeightOnlyEmulationTritonExperts) and ex.quant_dtype is None
        d13, d2 = ex.dequantized_weights()
        want13 = vllm_dequantize_to_dtype(q.w13_weight, q.w13_weight_scale, q.w13_weight_scale_2, torch.bfloat16)
        want2 = vllm_dequantize_to_dtype(q.w2_weight, q.w2_weight_scale, q.w2_weight_scale_2, torch.bfloat16)
        assert_bits_equal(d13, want13)
        assert_bits_equal(d2, want2)


def test_activations_are_not_quantized(layer):
    w13, w2, x, tw, ti = layer
    q = quantize_expert_weights(w13, w2, NVFP4, ops=R)
    ex = make_emulation_experts("w4a16_nvfp4", q, backend="torch")
    a1, per_pair = ex.quantize_input(x, ti, "torch")
    assert_bits_equal(a1, x)
    assert not per_pair
    act = torch.randn(5, I).to(torch.bfloat16)
    assert_bits_equal(ex.quantize_intermediate(act, torch.zeros(5, dtype=torch.long), "torch"), act)
    assert ex.a1_qdq().fmt is None and ex.a2_qdq().fmt is None
    assert ex.a13_gscale is None and ex.a2_gscale is None  # no activation scale is read


@pytest.mark.parametrize("numerics", ["vllm", "hardware"])
def test_moe_against_float64_and_backends_bit_equal(layer, numerics):
    w13, w2, x, tw, ti = layer
    q = quantize_expert_weights(w13, w2, NVFP4, ops=R)
    d13 = vllm_dequantize_to_dtype(q.w13_weight, q.w13_weight_scale, q.w13_weight_scale_2, torch.bfloat16)
    d2 = vllm_dequantize_to_dtype(q.w2_weight, q.w2_weight_scale, q.w2_weight_scale_2, torch.bfloat16)
    ref = moe_fp64(x, d13, d2, tw, ti, store_dtype=torch.bfloat16)
    backends = ("torch", "triton", "fused") if numerics == "vllm" else ("torch", "fused")
    outs = {}
    for backend in backends:
        ex = make_emulation_experts("w4a16_nvfp4", q, backend=backend, numerics=numerics)
        outs[backend] = ex(x, tw, ti)
        err = ((outs[backend].double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (numerics, backend, err)  # bf16 roundings (hardware: global scale on fp32 output)
    for backend in backends[1:]:
        assert_bits_equal(outs[backend], outs["torch"])
    if numerics == "vllm":
        fused = make_emulation_experts("w4a16_nvfp4", q, backend="fused")
        assert fused.fp4_weights() is not None  # the FP4 kernel ran, no activation QDQ in it


def test_w4a16_beside_w4a4(layer):
    """Same weights, same bits of dequantized weights; W4A4 adds the activation QDQ and its error."""
    w13, w2, x, tw, ti = layer
    q = quantize_expert_weights(w13, w2, NVFP4, ops=R)
    h = torch.einsum("mh,enh->emn", x.float(), w13.float())
    a2_amax = (torch.nn.functional.silu(h[..., :I]) * h[..., I:]).abs().amax()  # calibrated over all tokens
    in13, in2 = input_scales_from_amax("nvfp4", x.float().abs().amax().expand(E), a2_amax.expand(E))
    w4a4 = make_emulation_experts("nvfp4", q, in13, in2, backend="torch")
    w4a16 = make_emulation_experts("w4a16_nvfp4", q, backend="torch")
    for a, b in zip(w4a4.dequantized_weights(), w4a16.dequantized_weights()):
        assert_bits_equal(a, b)
    exact = moe_fp64(x, w13, w2, tw, ti)
    err = {}
    for name, ex in (("w4a4", w4a4), ("w4a16", w4a16)):
        err[name] = ((ex(x, tw, ti).double() - exact).norm() / exact.norm()).item()
    assert err["w4a16"] < err["w4a4"] < 0.3, err


def test_bad_input_is_named(layer):
    w13, w2, x, tw, ti = layer
    q = quantize_expert_weights(w13, w2, "mxfp4", ops=R)
    with pytest.raises(ValueError, match="weights: quantized as mxfp4, scheme w4a16_nvfp4 stores nvfp4"):
        make_emulation_experts("w4a16_nvfp4", q)
    qn = quantize_expert_weights(w13, w2, NVFP4, ops=R)
    with pytest.raises(ValueError, match="numerics='hardware' runs on the 'torch' backend"):
        make_emulation_experts("w4a16_nvfp4", qn, backend="triton", numerics="hardware")(x, tw, ti)
    bad = qn.w2_weight_scale_2.clone()
    bad[1] = float("nan")
    qn.w2_weight_scale_2 = bad
    with pytest.raises(ValueError, match="w2_weight_scale_2"):
        make_emulation_experts("w4a16_nvfp4", qn)
