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

from _util import assert_bits_equal, needs_interpreter, stored_tensors
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


@needs_interpreter
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
    a1, per_pair, _ = ex.quantize_input(x, ti, "torch")
    assert_bits_equal(a1, x)
    assert not per_pair
    act = torch.randn(5, I).to(torch.bfloat16)
    assert_bits_equal(ex.quantize_intermediate(act, torch.zeros(5, dtype=torch.long), "torch"), act)
    assert ex.a1_qdq().fmt is None and ex.a2_qdq().fmt is None
    assert ex.a13_gscale is None and ex.a2_gscale is None  # no activation scale is read


@needs_interpreter
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


# ----------------------------------------------------------------------------- checkpoints (ModelOpt's layout)


@pytest.fixture(scope="module")
def tiny_model():
    from mxlib.models.calibration import calibrate
    from mxlib.models.qwen3 import dummy_qwen3_moe, qwen3_30b_a3b_config

    from _util import TINY_QWEN3

    model = dummy_qwen3_moe(qwen3_30b_a3b_config(num_hidden_layers=2, **TINY_QWEN3), seed=4, expert_spread=0.5)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    return model, calibrate(model, ids), ids


def _stored(path):
    return stored_tensors(path)


@pytest.mark.parametrize("quantize_attention", [False, True])
def test_modelopt_w4a16_checkpoint_roundtrip(tiny_model, tmp_path, quantize_attention):
    import json

    from mxlib import checkpoints as C
    from mxlib.models.qwen3 import expert_weights

    model, cal, ids = tiny_model
    path = C.write_quantized_checkpoint(
        model, "w4a16_nvfp4", tmp_path / "ckpt", cal, quantize_attention=quantize_attention
    )
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    legacy = json.loads((path / "hf_quant_config.json").read_text())["quantization"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "W4A16_NVFP4" == legacy["quant_algo"]
    group = qc["config_groups"]["group_0"]
    assert group["weights"] == {"type": "float", "num_bits": 4, "group_size": 16, "dynamic": False}
    assert "input_activations" not in group  # weight-only: ModelOpt's input quantizers are disabled
    stored = _stored(path)
    assert not any(k.endswith("input_scale") for k in stored)
    w13, _ = expert_weights(model, 1)
    i = w13.shape[1] // 2
    gate, up = w13[2, :i], w13[2, i:]
    p, s, g2 = modelopt_nvfp4_quantize(torch.cat([gate, up]).float())  # one weight_scale_2 for gate and up
    base = "model.layers.1.mlp.experts.2"
    assert torch.equal(stored[f"{base}.gate_proj.weight"], p[:i]) and torch.equal(
        stored[f"{base}.up_proj.weight"], p[i:]
    )
    assert_bits_equal(stored[f"{base}.gate_proj.weight_scale"], s[:i])
    assert stored[f"{base}.gate_proj.weight_scale_2"].shape == () and stored[f"{base}.gate_proj.weight_scale_2"] == g2
    if quantize_attention:
        assert stored["model.layers.0.self_attn.q_proj.weight"].dtype == torch.uint8
        assert "model.layers.0.self_attn.q_proj.input_scale" not in stored
    loaded, info = C.load_quantized_qwen3_moe(path, backend="torch")
    assert info.scheme is W4A16_NVFP4 and info.format == "modelopt"
    ex = loaded.model.layers[1].mlp.experts
    ex = getattr(ex, "experts", ex)
    assert isinstance(ex, Nvfp4WeightOnlyEmulationTritonExperts)
    loaded.save_pretrained(tmp_path / "again")
    again = _stored(tmp_path / "again")
    assert set(again) == set(stored)
    for k in stored:
        assert_bits_equal(again[k], stored[k], k)


def test_modelopt_w4a16_stray_input_scale_and_bad_algo(tiny_model, tmp_path):
    import json

    from safetensors.torch import load_file, save_file

    from mxlib import checkpoints as C

    model, cal, ids = tiny_model
    path = C.write_quantized_checkpoint(model, "w4a16_nvfp4", tmp_path / "ckpt", cal)
    ref, _ = C.load_quantized_qwen3_moe(path, backend="torch")
    for f in path.glob("*.safetensors"):  # an input_scale left in a weight-only checkpoint is not read
        t = load_file(str(f))
        extra = {
            k.replace(".weight_scale_2", ".input_scale"): torch.tensor(float("nan"))
            for k in t
            if k.endswith("weight_scale_2")
        }
        save_file({**t, **extra}, str(f), metadata={"format": "pt"})
    other, _ = C.load_quantized_qwen3_moe(path, backend="torch")
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, other(ids).logits)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["quant_algo"] = "NVFP4_AWQ"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        C.CheckpointError,
        match=r"quant_algo: supported \['FP8', 'FP8_PER_CHANNEL_PER_TOKEN', 'MXFP8', 'NVFP4', 'W4A16_NVFP4'\], "
        r"found 'NVFP4_AWQ'",
    ):
        C.load_quantized_qwen3_moe(path)
