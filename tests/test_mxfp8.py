"""MXFP8 MoE schemes: ``w_mxfp8_a_mxfp8`` (W8A8), ``w_mxfp8`` (W8A16, what vLLM's MXFP8 emulation computes)
and ``w_mxfp4_a_mxfp8`` (FlashInfer's MXFP4 x MXFP8 pairing).

Oracles: vLLM's ``dequant_mxfp8_to_bf16`` transcribed (``fp32(e4m3) * exp2(e8m0 - 127)``, one bf16 cast),
``oracles.mx_qdq`` (ml_dtypes casts, E8M0 ``even`` rule from ``math.frexp``) and ``oracles.moe_fp64``.
Every backend (``torch``, ``triton``, ``fused``: the generic dequantize-GEMM kernel for FP8 weights, the
FP4 kernel for MXFP4 weights) gives the same bits (Triton interpreter on the CPU, small shapes).
"""

import ml_dtypes
import numpy as np
import pytest
import torch

import mxlib.reference as R
from mxlib.formats import BLOCK_SCHEMES
from mxlib.moe import ExpertWeights, fused_topk
from mxlib.moe.factory import make_emulation_experts, quantize_expert_weights
from mxlib.moe.schemes import MOE_SCHEMES, SCHEME_ALIASES, get_moe_scheme

from _util import assert_bits_equal, needs_interpreter
from oracles import moe_fp64, mx_qdq

E, H, I, M, TOPK = 4, 128, 128, 6, 2
MXFP8 = BLOCK_SCHEMES["mxfp8_e4m3"]
NEW = ("w_mxfp8", "w_mxfp8_a_mxfp8", "w_mxfp4_a_mxfp8")


@pytest.fixture(scope="module")
def layer():
    g = torch.Generator().manual_seed(8)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(M, H, generator=g).to(torch.bfloat16)
    x[0, :32] *= 300.0  # one block near e4m3's top: the shared exponent moves
    tw, ti = fused_topk(torch.randn(M, E, generator=g), TOPK)
    return w13, w2, x, tw, ti


def vllm_dequant_mxfp8_to_bf16(x_fp8: torch.Tensor, scales_u8: torch.Tensor) -> torch.Tensor:
    """vLLM's ``mxfp8_utils.dequant_mxfp8_to_bf16``, transcribed: fp32 values times ``exp2(scale - 127)``
    per 32-element block, one cast to bf16."""
    xf = x_fp8.to(torch.float32)
    blocks = xf.view(*xf.shape[:-1], xf.shape[-1] // 32, 32)
    descale = torch.exp2(scales_u8.to(torch.float32) - 127.0)
    return (blocks * descale.unsqueeze(-1)).view(xf.shape).to(torch.bfloat16)


def oracle_mxfp8_qdq(x: torch.Tensor) -> torch.Tensor:
    """MXFP8 (e4m3, blocks of 32, E8M0 ``even``) QDQ by ml_dtypes, back in bf16."""
    q = mx_qdq(x.float().numpy(), "e4m3", 32, "even")
    return torch.from_numpy(q).to(torch.bfloat16)


# ----------------------------------------------------------------------------- the table


def test_scheme_table_names_what_each_quantizes():
    s = {n: get_moe_scheme(n) for n in NEW}
    assert s["w_mxfp8"].weight is MXFP8 and s["w_mxfp8"].activation is None
    assert s["w_mxfp8_a_mxfp8"].weight is MXFP8 and s["w_mxfp8_a_mxfp8"].activation is MXFP8
    assert s["w_mxfp4_a_mxfp8"].weight is BLOCK_SCHEMES["mxfp4"] and s["w_mxfp4_a_mxfp8"].activation is MXFP8
    assert [s[n].precision for n in NEW] == ["W8A16", "W8A8", "W4A8"]
    assert s["w_mxfp8"].weight_only and not s["w_mxfp8_a_mxfp8"].weight_only
    assert all(n in MOE_SCHEMES for n in NEW)
    assert get_moe_scheme("w_mx_fp8_a_mx_fp8") is s["w_mxfp8_a_mxfp8"]  # Quark's older name
    assert SCHEME_ALIASES["w_mx_fp8_a_mx_fp8"] == "w_mxfp8_a_mxfp8"


def test_bare_mxfp8_is_refused_naming_both_meanings():
    with pytest.raises(ValueError, match="w_mxfp8_a_mxfp8.*W8A8.*w_mxfp8.*W8A16"):
        get_moe_scheme("mxfp8")


# ----------------------------------------------------------------------------- weights and activations


@needs_interpreter
@pytest.mark.parametrize("scheme", ["w_mxfp8", "w_mxfp8_a_mxfp8"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_weights_dequantize_as_vllm_does(layer, scheme, backend):
    w13, w2, *_ = layer
    q = quantize_expert_weights(w13, w2, scheme, ops=R)
    assert q.w13_weight.dtype == torch.uint8 and q.w13_weight.shape == (E, 2 * I, H)  # one byte per element
    assert q.w13_weight_scale.shape == (E, 2 * I, H // 32)
    ex = make_emulation_experts(scheme, q, backend=backend)
    d13, d2 = ex.dequantized_weights()
    want13 = vllm_dequant_mxfp8_to_bf16(q.w13_weight.view(torch.float8_e4m3fn), q.w13_weight_scale)
    want2 = vllm_dequant_mxfp8_to_bf16(q.w2_weight.view(torch.float8_e4m3fn), q.w2_weight_scale)
    assert_bits_equal(d13, want13)
    assert_bits_equal(d2, want2)
    # and the stored weights are the MXFP8 QDQ (E8M0 even, as Quark exports) of the bf16 ones
    assert_bits_equal(d13, oracle_mxfp8_qdq(w13))


def test_e4m3_bytes_decode_as_ml_dtypes():
    codes = torch.arange(256, dtype=torch.uint8)
    got = R.decode_element(codes, "e4m3").numpy()
    want = codes.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(got, want)  # NaN at 0x7F and 0xFF in both


@needs_interpreter
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_activation_qdq_w8a8_quantizes_w8a16_does_not(layer, backend):
    w13, w2, x, tw, ti = layer
    q = quantize_expert_weights(w13, w2, "w_mxfp8", ops=R)
    w8a8 = make_emulation_experts("w_mxfp8_a_mxfp8", q, backend=backend)
    w8a16 = make_emulation_experts("w_mxfp8", q, backend=backend)
    a1, per_pair, _ = w8a8.quantize_input(x, ti, backend)
    assert not per_pair
    assert_bits_equal(a1, oracle_mxfp8_qdq(x))
    assert not torch.equal(a1, x)
    assert w8a8.quant_dtype == "mxfp8_e4m3" and w8a16.quant_dtype is None  # vLLM's quant_dtype -> None
    same, _, _ = w8a16.quantize_input(x, ti, backend)
    assert_bits_equal(same, x)
    act = torch.randn(7, I).to(torch.bfloat16)
    assert_bits_equal(w8a8.quantize_intermediate(act, torch.zeros(7, dtype=torch.long), backend), oracle_mxfp8_qdq(act))
    assert_bits_equal(w8a16.quantize_intermediate(act, torch.zeros(7, dtype=torch.long), backend), act)


# ----------------------------------------------------------------------------- the MoE


def _oracle_moe(scheme, q, w13, w2, x, tw, ti):
    """float64 MoE on oracle-dequantized weights and oracle-QDQ'd activations."""
    s = get_moe_scheme(scheme)
    if s.weight is MXFP8:
        d13 = vllm_dequant_mxfp8_to_bf16(q.w13_weight.view(torch.float8_e4m3fn), q.w13_weight_scale)
        d2 = vllm_dequant_mxfp8_to_bf16(q.w2_weight.view(torch.float8_e4m3fn), q.w2_weight_scale)
    else:  # MXFP4 weights: the same QDQ oracle on the bf16 weights (E8M0 even)
        d13 = torch.from_numpy(mx_qdq(w13.float().numpy(), "e2m1", 32, "even")).to(torch.bfloat16)
        d2 = torch.from_numpy(mx_qdq(w2.float().numpy(), "e2m1", 32, "even")).to(torch.bfloat16)
    if s.activation is None:
        return moe_fp64(x, d13, d2, tw, ti, store_dtype=torch.bfloat16)
    return moe_fp64(
        oracle_mxfp8_qdq(x), d13, d2, tw, ti, store_dtype=torch.bfloat16, a2_fn=lambda a, e: oracle_mxfp8_qdq(a)
    )


@needs_interpreter
@pytest.mark.parametrize("scheme", NEW)
def test_moe_against_float64_and_backends_bit_equal(layer, scheme):
    w13, w2, x, tw, ti = layer
    q = quantize_expert_weights(w13, w2, scheme, ops=R)
    ref = _oracle_moe(scheme, q, w13, w2, x, tw, ti)
    outs = {}
    for backend in ("torch", "triton", "fused"):
        ex = make_emulation_experts(scheme, q, backend=backend)
        outs[backend] = ex(x, tw, ti)
        err = ((outs[backend].double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (scheme, backend, err)  # bf16 GEMM roundings only (measured ~2e-3)
    assert_bits_equal(outs["triton"], outs["torch"])
    assert_bits_equal(outs["fused"], outs["torch"])


def test_fused_paths(layer):
    """MXFP4 weights with MXFP8 activations run the FP4 kernel (a1 QDQ in its A-tile load); MXFP8 weights
    run the generic dequantize-GEMM kernel."""
    w13, w2, *_ = layer
    fp4 = make_emulation_experts("w_mxfp4_a_mxfp8", quantize_expert_weights(w13, w2, "mxfp4", ops=R), backend="fused")
    assert fp4.fp4_kernel_applies() and fp4.fp4_weights() is not None
    assert fp4.a1_qdq().fmt is MXFP8 and fp4.a2_qdq().fmt is MXFP8
    fp8 = make_emulation_experts("w_mxfp8_a_mxfp8", quantize_expert_weights(w13, w2, MXFP8, ops=R), backend="fused")
    assert not fp8.fp4_kernel_applies() and fp8.fp4_weights() is None
    assert fp8.packed_weights()[0].nbits == 8


def test_w8a16_and_w8a8_differ_by_the_activation_qdq_only(layer):
    w13, w2, x, tw, ti = layer
    q = quantize_expert_weights(w13, w2, MXFP8, ops=R)
    a = make_emulation_experts("w_mxfp8", q, backend="torch")(x, tw, ti)
    b = make_emulation_experts("w_mxfp8_a_mxfp8", q, backend="torch")(x, tw, ti)
    assert not torch.equal(a, b)
    exact = moe_fp64(x, w13, w2, tw, ti)
    err = {k: ((v.double() - exact).norm() / exact.norm()).item() for k, v in (("w8a16", a), ("w8a8", b))}
    # quantizing activations costs; e4m3 (3 mantissa bits): a few % each (measured 5.2% and 7.3%)
    assert err["w8a16"] < err["w8a8"] < 0.1, err


# ----------------------------------------------------------------------------- bad input


def test_bad_input_is_named(layer):
    w13, w2, *_ = layer
    q4 = quantize_expert_weights(w13, w2, "mxfp4", ops=R)
    with pytest.raises(ValueError, match="weights: quantized as mxfp4.*w_mxfp8.*mxfp8_e4m3"):
        make_emulation_experts("w_mxfp8", q4)
    q = quantize_expert_weights(w13, w2, MXFP8, ops=R)
    bad = q.w13_weight_scale.clone()
    bad[1, 2, 3] = 0xFF
    nan_scale = ExpertWeights(MXFP8, q.w13_weight, bad, q.w2_weight, q.w2_weight_scale)
    with pytest.raises(ValueError, match="w13_weight_scale"):
        make_emulation_experts("w_mxfp8_a_mxfp8", nan_scale)
    short = ExpertWeights(MXFP8, q.w13_weight[..., :64], q.w13_weight_scale, q.w2_weight, q.w2_weight_scale)
    with pytest.raises(ValueError, match="w13_weight_scale: expected shape"):
        make_emulation_experts("w_mxfp8_a_mxfp8", short)


# ----------------------------------------------------------------------------- checkpoints (Quark's layout)


@pytest.fixture(scope="module")
def tiny_model():
    from mxlib.models.calibration import calibrate
    from mxlib.models.qwen3 import dummy_qwen3_moe, qwen3_30b_a3b_config

    from _util import TINY_QWEN3

    model = dummy_qwen3_moe(qwen3_30b_a3b_config(num_hidden_layers=2, **TINY_QWEN3), seed=2, expert_spread=0.5)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    return model, calibrate(model, ids), ids


# Quark's OCP_MXFP8E4M3Spec: dtype fp8_e4m3, per_group, group_size 32, e8m0 scales, scale rule even
QUARK_MXFP8 = {"dtype": "fp8_e4m3", "qscheme": "per_group", "group_size": 32, "scale_format": "e8m0"}


@pytest.mark.parametrize("scheme", NEW)
def test_quark_checkpoint_roundtrip(tiny_model, tmp_path, scheme):
    import json

    from safetensors.torch import load_file

    from mxlib import checkpoints as C
    from mxlib.models.qwen3 import expert_weights

    model, cal, ids = tiny_model
    path = C.write_quantized_checkpoint(model, scheme, tmp_path / "ckpt", cal, quantize_attention=True)
    g = json.loads((path / "config.json").read_text())["quantization_config"]["global_quant_config"]
    s = get_moe_scheme(scheme)
    w, a = g["weight"], g["input_tensors"]
    if s.weight is MXFP8:
        assert {k: w[k] for k in QUARK_MXFP8} == QUARK_MXFP8 and w["is_dynamic"] is False
    else:
        assert w["dtype"] == "fp4"
    if s.activation is None:
        assert a is None
    else:
        assert {k: a[k] for k in QUARK_MXFP8} == QUARK_MXFP8 and a["is_dynamic"] is True
        assert a["scale_calculation_mode"] == "even"
    stored = {}
    for f in path.glob("*.safetensors"):
        stored.update(load_file(str(f)))
    w13, _ = expert_weights(model, 0)
    i = w13.shape[1] // 2
    gate = stored["model.layers.0.mlp.experts.1.gate_proj.weight"]
    want_dtype = torch.float8_e4m3fn if s.weight is MXFP8 else torch.uint8
    assert gate.dtype == want_dtype and stored["model.layers.0.self_attn.q_proj.weight"].dtype == want_dtype
    if s.weight is MXFP8:  # the stored e4m3 values times their E8M0 scales: the ml_dtypes QDQ of the weights
        sc = stored["model.layers.0.mlp.experts.1.gate_proj.weight_scale"]
        assert_bits_equal(vllm_dequant_mxfp8_to_bf16(gate, sc), oracle_mxfp8_qdq(w13[1, :i]))
    assert not any(k.endswith("input_scale") for k in stored)  # dynamic or no activation scales
    loaded, info = C.load_quantized_qwen3_moe(path, backend="torch")
    assert info.scheme is s and info.format == "quark"
    ex = loaded.model.layers[0].mlp.experts
    ex = getattr(ex, "experts", ex)
    assert ex.scheme is s and ex.weight_scheme is s.weight
    assert i == ex.intermediate_size
    loaded.save_pretrained(tmp_path / "again")
    again = {}
    for f in (tmp_path / "again").glob("*.safetensors"):
        again.update(load_file(str(f)))
    assert set(again) == set(stored)
    for k in stored:  # bit for bit, dtype included
        assert again[k].dtype == stored[k].dtype, k
        assert_bits_equal(again[k], stored[k], k)


def test_quark_mxfp8_checkpoint_bad_input(tiny_model, tmp_path):
    import json

    from safetensors.torch import load_file, save_file

    from mxlib import checkpoints as C

    model, cal, _ = tiny_model
    path = C.write_quantized_checkpoint(model, "w_mxfp8_a_mxfp8", tmp_path / "ckpt", cal)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["global_quant_config"]["weight"]["qscheme"] = "per_tensor"  # Quark's FP8 W8A8
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        C.CheckpointError, match="input_tensors: FP8 activations are read static per_tensor or dynamic per_channel"
    ):
        C.load_quantized_qwen3_moe(path)
    cfg["quantization_config"]["global_quant_config"]["weight"]["qscheme"] = "per_group"
    (path / "config.json").write_text(json.dumps(cfg))
    name = "model.layers.1.mlp.experts.0.down_proj.weight"
    for f in path.glob("*.safetensors"):
        t = load_file(str(f))
        if name in t:
            t[name] = t[name].float()
            save_file(t, str(f), metadata={"format": "pt"})
    with pytest.raises(
        C.CheckpointError, match=f"tensor '{name}': expected dtype torch.float8_e4m3fn, found torch.float32"
    ):
        C.load_quantized_qwen3_moe(path)


def test_quark_mxfp8_weights_stored_as_uint8_read_too(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    from mxlib import checkpoints as C

    model, cal, ids = tiny_model
    path = C.write_quantized_checkpoint(model, "w_mxfp8", tmp_path / "ckpt", cal)
    ref, _ = C.load_quantized_qwen3_moe(path, backend="torch")
    for f in path.glob("*.safetensors"):
        t = load_file(str(f))
        save_file(
            {k: v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v for k, v in t.items()},
            str(f),
            metadata={"format": "pt"},
        )
    other, _ = C.load_quantized_qwen3_moe(path, backend="torch")
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, other(ids).logits)


# ----------------------------------------------------------------------------- ModelOpt's MXFP8 layout


def test_modelopt_mxfp8_checkpoint(tiny_model, tmp_path):
    """ModelOpt's MXFP8: float8_e4m3fn weights with ``rceil`` E8M0 scales (``MXFP8QTensor``: 2**ceil(log2(amax / 448))),
    no input_scale; activations QDQ'd with the same rule; read from config.json or hf_quant_config.json alone."""
    import json

    from safetensors.torch import load_file

    from mxlib import checkpoints as C
    from mxlib.models.qwen3 import expert_weights

    from oracles import mx_scale_exponent

    model, cal, ids = tiny_model
    path = C.write_quantized_checkpoint(model, "w_mxfp8_a_mxfp8", tmp_path / "ckpt", cal, layout="modelopt-mxfp8")
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    legacy = json.loads((path / "hf_quant_config.json").read_text())["quantization"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "MXFP8" == legacy["quant_algo"]
    stored = {}
    for f in path.glob("*.safetensors"):
        stored.update(load_file(str(f)))
    assert not any(k.endswith(("input_scale", "weight_scale_2")) for k in stored)
    _, w2 = expert_weights(model, 1)
    base = "model.layers.1.mlp.experts.3.down_proj"
    wt, sc = stored[f"{base}.weight"], stored[f"{base}.weight_scale"]
    assert wt.dtype == torch.float8_e4m3fn and sc.dtype == torch.uint8
    amax = w2[3].float().reshape(w2.shape[1], -1, 32).abs().amax(-1)
    want = torch.tensor([[mx_scale_exponent(float(a), "e4m3", "rceil") + 127 for a in row] for row in amax])
    assert torch.equal(sc, want.to(torch.uint8))
    want_w = torch.from_numpy(mx_qdq(w2[3].float().numpy(), "e4m3", 32, "rceil")).to(torch.bfloat16)
    assert_bits_equal(vllm_dequant_mxfp8_to_bf16(wt, sc), want_w)
    info = C.read_quant_config(path)
    assert info.format == "modelopt-mxfp8" and info.scheme.name == "w_mxfp8_a_mxfp8"
    assert info.activation_scale_mode == "rceil"
    loaded, _ = C.load_quantized_qwen3_moe(path, backend="torch")
    ex = loaded.model.layers[1].mlp.experts
    ex = getattr(ex, "experts", ex)
    x = torch.randn(3, ex.hidden_size).to(torch.bfloat16)
    a1, _, _ = ex.quantize_input(x, torch.zeros(3, 2, dtype=torch.long), "torch")
    assert_bits_equal(a1, torch.from_numpy(mx_qdq(x.float().numpy(), "e4m3", 32, "rceil")).to(torch.bfloat16))
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]  # hf_quant_config.json alone, as older ModelOpt exports
    (path / "config.json").write_text(json.dumps(cfg))
    assert C.read_quant_config(path).format == "modelopt-mxfp8"
    legacy_file = json.loads((path / "hf_quant_config.json").read_text())
    legacy_file["quantization"]["group_size"] = 16
    (path / "hf_quant_config.json").write_text(json.dumps(legacy_file))
    with pytest.raises(C.CheckpointError, match="quantization_config.group_size: MXFP8 uses 32, found 16"):
        C.read_quant_config(path)
    with pytest.raises(ValueError, match="modelopt-mxfp8"):
        C.write_quantized_checkpoint(model, "w_mxfp8", tmp_path / "wo", cal, layout="modelopt-mxfp8")


def test_vllm_emulated_scheme_is_w8a16_for_mxfp8_checkpoints(layer):
    from mxlib.moe.schemes import vllm_emulated_scheme

    assert vllm_emulated_scheme("w_mxfp8_a_mxfp8") is get_moe_scheme("w_mxfp8")
    assert vllm_emulated_scheme("w_mxfp8_a_mxfp8").precision == "W8A16"
    for other in ("w_mxfp8", "w_mxfp4_a_mxfp8", "nvfp4", "w_mxfp4_a_mxfp4"):
        assert vllm_emulated_scheme(other) is get_moe_scheme(other)
    w13, w2, x, tw, ti = layer
    q = quantize_expert_weights(w13, w2, MXFP8, ops=R)
    vllm_like = make_emulation_experts(vllm_emulated_scheme("w_mxfp8_a_mxfp8"), q, backend="torch")(x, tw, ti)
    d13 = vllm_dequant_mxfp8_to_bf16(q.w13_weight.view(torch.float8_e4m3fn), q.w13_weight_scale)
    d2 = vllm_dequant_mxfp8_to_bf16(q.w2_weight.view(torch.float8_e4m3fn), q.w2_weight_scale)
    ref = moe_fp64(x, d13, d2, tw, ti, store_dtype=torch.bfloat16)  # bf16 activations, as vLLM runs it
    assert ((vllm_like.double() - ref).norm() / ref.norm()).item() < 1e-2
