"""Checkpoint layouts of the real producers, on checkpoints mxlib writes itself.

- compressed-tensors NVFP4 (llm-compressor's ``nvfp4-pack-quantized``): written and read, encode
  global scales used as stored; the dequantized experts equal an independent transcription of
  compressed-tensors' ``decompress`` bit for bit;
- scalar scales stored as bf16 / fp16 (Quark's ``_a_fp8`` input_scale) widen exactly; other dtypes
  are refused naming the tensor;
- a Quark export made without ``preprocess_for_quantization`` (fused, unquantized experts) is
  refused with an error that says so;
- quantized attention (ModelOpt's default NVFP4 export, llm-compressor's NVFP4, Quark with attention
  not excluded) loads as ``EmulatedLinear``, checked against a float64 reference built from the same
  dequantized weights and QDQ'd inputs, and its Triton twin gives the same bits.

A tiny Qwen3-MoE (hidden 64, 4 experts, 2 layers) keeps this fast.
"""

import dataclasses
import json

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from mxlib import checkpoints as C
from mxlib import kernels as K
from mxlib import reference as R
from mxlib.checkpoints.layouts.compressed_tensors_nvfp4 import quantize_nvfp4_encode
from mxlib.checkpoints.scalars import widen_scale
from mxlib.models.qwen3 import expert_weights
from mxlib.moe import Nvfp4QuantizationEmulationTritonExperts, get_moe_scheme
from mxlib.moe.factory import make_emulated_linear, quantize_linear_weight
from mxlib.moe.linear import EmulatedLinear, LinearWeights, linear_input_amax

from _util import KERNEL_DEVICE, TINY_QWEN3, OnKernelDevice, tiny_calibrated

TINY = TINY_QWEN3
ATTN = [f"model.layers.{layer}.self_attn.{p}" for layer in range(2) for p in C.ATTENTION_PROJS]


@pytest.fixture(scope="module")
def tiny():
    model, cal, ids = tiny_calibrated(3)
    return model, cal, linear_input_amax(model, ids, ATTN), ids


def _write(tiny, tmp_path, scheme, layout=None, attention=False, name="ckpt"):
    model, cal, amax, _ = tiny
    return C.write_quantized_checkpoint(
        model, scheme, tmp_path / name, cal, layout=layout, quantize_attention=attention, linear_input_amax=amax
    )


def _tensors(path):
    idx = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for fname in sorted(set(idx.values())):
        out.update(load_file(str(path / fname)))
    return out, idx


def _rewrite(path, change):
    """Apply ``change(tensors) -> tensors`` to a single-shard checkpoint (and its index)."""
    tensors, idx = _tensors(path)
    (fname,) = set(idx.values())
    tensors = change(dict(tensors))
    save_file(tensors, str(path / fname), metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: fname for k in tensors}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


# ----------------------------------------------------------------------------- oracles (independent of mxlib)

_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def ct_decompress(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Hand transcription of compressed-tensors 0.19 ``NVFP4PackedCompressor.decompress_weight``:
    unpack (low nibble first) to bf16 e2m1 values, ``scale = weight_scale / weight_global_scale``
    (fp8 / fp32 promotes to fp32), ``x_q.to(fp32) * scale``, cast to bf16 (the unpacked dtype)."""
    p = packed.numpy()
    codes = np.stack([p & 0x0F, p >> 4], axis=-1).reshape(p.shape[0], -1)
    vals = _E2M1[codes].astype(ml_dtypes.bfloat16).astype(np.float32)
    s = scale.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    s = (s / np.float32(global_scale.reshape(()).item())).astype(np.float32)
    out = vals.reshape(p.shape[0], -1, 16) * s[:, :, None]
    return torch.from_numpy(
        out.astype(np.float32).reshape(p.shape[0], -1).astype(ml_dtypes.bfloat16).view(np.int16)
    ).view(torch.bfloat16)


def _bits_equal(a: torch.Tensor, b: torch.Tensor, what: str):
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    iv = {torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float16: torch.int16}[a.dtype]
    bad = a.view(iv) != b.view(iv)
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} differ, first at {bad.nonzero()[0].tolist()}"


# ----------------------------------------------------------------------------- compressed-tensors NVFP4


def test_compressed_tensors_written_like_llm_compressor(tiny, tmp_path):
    path = _write(tiny, tmp_path, "nvfp4", layout="compressed-tensors")
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "nvfp4-pack-quantized"
    group = qc["config_groups"]["group_0"]
    for part in ("weights", "input_activations"):
        assert group[part]["strategy"] == "tensor_group" and group[part]["group_size"] == 16
        assert group[part]["num_bits"] == 4 and group[part]["type"] == "float"
    assert group["input_activations"]["dynamic"] == "local" and group["weights"]["dynamic"] is False
    tensors, _ = _tensors(path)
    model = tiny[0]
    for layer in range(2):
        w13, w2 = expert_weights(model, layer)
        for e in range(4):
            base = f"model.layers.{layer}.mlp.experts.{e}"
            g = {p: tensors[f"{base}.{p}.weight_global_scale"] for p in ("gate_proj", "up_proj", "down_proj")}
            ins = {p: tensors[f"{base}.{p}.input_global_scale"] for p in ("gate_proj", "up_proj", "down_proj")}
            for p in g:
                assert g[p].dtype == torch.float32 and g[p].shape == (1,)
                assert ins[p].dtype == torch.float32 and ins[p].shape == (1,)
                # encode scales, bf16 values, as llm-compressor writes them
                assert torch.equal(g[p].to(torch.bfloat16).float(), g[p])
                assert tensors[f"{base}.{p}.weight_packed"].dtype == torch.uint8
                assert tensors[f"{base}.{p}.weight_scale"].dtype == torch.float8_e4m3fn
                assert f"{base}.{p}.weight" not in tensors
            assert torch.equal(g["gate_proj"], g["up_proj"]) and torch.equal(ins["gate_proj"], ins["up_proj"])
            amax13 = w13[e].abs().amax().float()
            want = torch.tensor(2688.0 / amax13.item(), dtype=torch.float32).to(torch.bfloat16).float()
            assert g["gate_proj"].item() == want.item()


def test_compressed_tensors_experts_equal_decompress(tiny, tmp_path):
    """The loaded experts hold compressed-tensors' own dequantization (hand transcription), bit for bit."""
    path = _write(tiny, tmp_path, "nvfp4", layout="compressed-tensors")
    tensors, _ = _tensors(path)
    model, info = C.load_quantized_qwen3_moe(path, backend="torch")
    assert info.format == "compressed-tensors"
    for layer in range(2):
        experts = model.model.layers[layer].mlp.experts.experts
        assert isinstance(experts, Nvfp4QuantizationEmulationTritonExperts) and experts.global_scale_kind == "encode"
        for e in range(4):
            w13, w2 = experts.dequantized_expert(e)
            i = w2.shape[1]
            for proj, mine in (("gate_proj", w13[:i]), ("up_proj", w13[i:]), ("down_proj", w2)):
                base = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
                want = ct_decompress(
                    tensors[f"{base}.weight_packed"],
                    tensors[f"{base}.weight_scale"],
                    tensors[f"{base}.weight_global_scale"],
                )
                _bits_equal(mine, want, base)
        # activation global scale: the smallest encode scale (the largest decode one), as stored
        stored = torch.stack(
            [tensors[f"model.layers.{layer}.mlp.experts.{e}.down_proj.input_global_scale"] for e in range(4)]
        ).reshape(-1)
        assert experts.a2_gscale[0].item() == stored.min().item()


def test_encode_global_scale_used_as_stored():
    """``block / gs`` differs from ``block * (1 / gs)`` for some scales: the encode path divides."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, 64, generator=gen)
    found = 0
    for gs_value in torch.linspace(2000.0, 4000.0, 257):
        gs = gs_value.to(torch.bfloat16).float()
        packed, scale, g = quantize_nvfp4_encode(x, gs)
        mine = R.dequantize_to_dtype(packed, scale, g, torch.float32, global_scale_kind="encode")
        want = ct_decompress(packed, scale, g)
        _bits_equal(mine.to(torch.bfloat16), want, f"gs={gs.item()}")
        via_decode = R.dequantize_to_dtype(packed, scale, 1.0 / g, torch.float32)
        found += int(not torch.equal(via_decode, mine))
    assert found, "no scale where the decode conversion differs: the test could not fail"


def test_encode_dequantize_triton_twin():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 32, 64, generator=gen)
    parts = [quantize_nvfp4_encode(x[e]) for e in range(3)]
    packed = torch.stack([p[0] for p in parts])
    scale = torch.stack([p[1] for p in parts])
    g = torch.stack([p[2] for p in parts])
    for dtype in (torch.bfloat16, torch.float32):
        ref = R.dequantize_to_dtype(packed, scale, g, dtype, global_scale_kind="encode")
        tri = OnKernelDevice(K).dequantize_to_dtype(packed, scale, g, dtype, global_scale_kind="encode")
        _bits_equal(tri, ref, f"triton twin {dtype}")
    with pytest.raises(ValueError, match="global_scale_kind"):
        R.dequantize_to_dtype(packed, scale, g, torch.bfloat16, global_scale_kind="inverse")


def test_compressed_tensors_bad_config(tiny, tmp_path):
    path = _write(tiny, tmp_path, "nvfp4", layout="compressed-tensors")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"]["dynamic"] = True
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(C.CheckpointError, match="input_activations.dynamic.*'local'"):
        C.read_quant_config(path)
    cfg["quantization_config"]["format"] = "int-quantized"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(C.CheckpointError, match="format.*nvfp4-pack-quantized.*int-quantized"):
        C.read_quant_config(path)


def test_writer_layout_choice_errors(tiny, tmp_path):
    model, cal, _, _ = tiny
    with pytest.raises(ValueError, match="layout: compressed-tensors does not store scheme w_mxfp4_a_mxfp4"):
        C.write_quantized_checkpoint(model, "w_mxfp4_a_mxfp4", tmp_path / "x", cal, layout="compressed-tensors")
    with pytest.raises(ValueError, match="layout: expected one of"):
        C.write_quantized_checkpoint(model, "nvfp4", tmp_path / "x", cal, layout="gguf")
    with pytest.raises(ValueError, match="linear_input_amax"):
        C.write_quantized_checkpoint(model, "nvfp4", tmp_path / "x", cal, quantize_attention=True)
    assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------- scalar scales


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scalar_input_scale_widened_exactly(tiny, tmp_path, dtype):
    """Quark stores its _a_fp8 input_scale as a bf16 scalar: it loads, widened exactly."""
    path = _write(tiny, tmp_path, "w_mxfp4_a_fp8")
    narrow = {}

    def to_narrow(t):
        for k in [k for k in t if k.endswith(".input_scale")]:
            t[k] = t[k].to(dtype)
            narrow[k] = t[k]
        return t

    _rewrite(path, to_narrow)
    model, _ = C.load_quantized_qwen3_moe(path, backend="torch")
    for layer in range(2):
        experts = model.model.layers[layer].mlp.experts.experts
        down = torch.stack([narrow[f"model.layers.{layer}.mlp.experts.{e}.down_proj.input_scale"] for e in range(4)])
        want = torch.from_numpy(down.float().numpy().astype(np.float64).max().astype(np.float32).reshape(1))
        assert experts.a2_scale.dtype == torch.float32 and torch.equal(experts.a2_scale, want)


@pytest.mark.parametrize(
    "bad, match",
    [
        (torch.tensor(0.1, dtype=torch.float64), "float64 scale 0.1 is not an fp32 value"),
        (torch.tensor(3, dtype=torch.int32), "found torch.int32"),
        (torch.tensor(0.5).to(torch.float8_e4m3fn), "found torch.float8_e4m3fn"),
    ],
)
def test_scalar_scale_refused(tiny, tmp_path, bad, match):
    path = _write(tiny, tmp_path, "w_mxfp4_a_fp8")
    name = "model.layers.1.mlp.experts.2.up_proj.input_scale"

    def put(t):
        t[name] = bad
        return t

    _rewrite(path, put)
    with pytest.raises(C.CheckpointError, match=f"{name}.*{match}"):
        C.load_quantized_qwen3_moe(path, backend="torch")


def test_widen_scale_float64_round_trip():
    t = torch.tensor([0.5, 3.0, 2.0**-20], dtype=torch.float64)
    assert widen_scale(t, "s").dtype == torch.float32 and torch.equal(widen_scale(t, "s").double(), t)


# ----------------------------------------------------------------------------- Quark without preprocessing


def test_fused_unquantized_experts_refused(tiny, tmp_path):
    """amd-quark run without preprocess_for_quantization writes transformers' fused bf16 experts."""
    path = _write(tiny, tmp_path, "w_mxfp4_a_mxfp4")
    model = tiny[0]

    def fuse(t):
        t = {k: v for k, v in t.items() if ".mlp.experts." not in k}
        for layer in range(2):
            w13, w2 = expert_weights(model, layer)
            t[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = w13.contiguous()
            t[f"model.layers.{layer}.mlp.experts.down_proj"] = w2.contiguous()
        return t

    _rewrite(path, fuse)
    with pytest.raises(
        C.CheckpointError,
        match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj.*fused and "
        r"unquantized.*amd-quark.*preprocess_for_quantization",
    ):
        C.load_quantized_qwen3_moe(path, backend="torch")


# ----------------------------------------------------------------------------- quantized attention


ATTN_CASES = [
    ("nvfp4", "modelopt"),
    ("nvfp4", "compressed-tensors"),
    ("w_mxfp4_a_mxfp4", "quark"),
    ("w_mxfp6_e2m3_a_fp8", "quark"),
]


def _qdq_oracle(lin: EmulatedLinear, tensors, name, x):
    """The input QDQ from the checkpoint's own scale, through mxlib.reference."""
    if "input_global_scale" in "".join(k for k in tensors if k.startswith(name)):
        return R.ref_nvfp4_quant_dequant(x, tensors[f"{name}.input_global_scale"].float())
    if lin.scheme.weight.has_global_scale:
        return R.ref_nvfp4_quant_dequant(x, 1.0 / tensors[f"{name}.input_scale"].float())
    if f"{name}.input_scale" in tensors:
        return R.quant_dequant_fp8_per_tensor(x, tensors[f"{name}.input_scale"].float())
    act = lin.scheme.activation
    return R.quant_dequant_mx(x, act.element.name, act.block_size, "even")


def _weight_oracle(lin: EmulatedLinear, tensors, name):
    if f"{name}.weight_packed" in tensors:
        return ct_decompress(
            tensors[f"{name}.weight_packed"], tensors[f"{name}.weight_scale"], tensors[f"{name}.weight_global_scale"]
        )
    if lin.scheme.weight.has_global_scale:
        return R.dequantize_to_dtype(
            tensors[f"{name}.weight"],
            tensors[f"{name}.weight_scale"],
            tensors[f"{name}.weight_scale_2"],
            torch.bfloat16,
        )
    fmt = lin.scheme.weight
    return R.dequantize_mx(
        tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"], fmt.element.name, fmt.block_size, torch.bfloat16
    )


@pytest.mark.parametrize("scheme, layout", ATTN_CASES)
def test_quantized_attention_loads_and_matches_float64(tiny, tmp_path, scheme, layout):
    path = _write(tiny, tmp_path, scheme, layout=layout, attention=True)
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    ignore = json.dumps(qc.get("ignore") or qc.get("exclude"))
    assert "self_attn" not in ignore and "lm_head" in ignore
    tensors, _ = _tensors(path)
    assert all(f"{n}.weight_scale" in tensors for n in ATTN)
    model, _ = C.load_quantized_qwen3_moe(path, backend="torch")
    modules = dict(model.named_modules())
    gen = torch.Generator().manual_seed(2)
    for name in ATTN:
        lin = modules[name]
        assert isinstance(lin, EmulatedLinear), name
        x = (torch.randn(5, lin.in_features, generator=gen) * 3).to(torch.bfloat16)
        w = _weight_oracle(lin, tensors, name)
        _bits_equal(lin.dequantized_weight(), w, f"{name} weight")
        xq = _qdq_oracle(lin, tensors, name, x)
        _bits_equal(lin.quantize_input(x), xq, f"{name} input QDQ")
        out = lin(x)
        ref = xq.double() @ w.double().T
        assert out.dtype == torch.bfloat16 and out.shape == (5, lin.out_features)
        # the bf16 matmul: fp32 accumulation, one rounding to bf16
        torch.testing.assert_close(out.double(), ref, rtol=2.0**-8, atol=1e-6 * float(ref.abs().max()))
    ids = tiny[3]
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
        ref_logits = tiny[0](input_ids=ids).logits.float()
    sqnr = 10 * torch.log10(ref_logits.pow(2).sum() / (logits - ref_logits).pow(2).sum())
    assert torch.isfinite(logits).all() and sqnr > 5.0, f"{scheme}/{layout}: {sqnr:.1f} dB vs bf16"


@pytest.mark.parametrize("scheme", ["nvfp4", "w_mxfp4_a_mxfp4", "w_mxfp6_e2m3_a_fp8"])
def test_emulated_linear_triton_twin(scheme):
    """The Triton backend (interpreter on the CPU) gives the torch backend's bits."""
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(48, 64, generator=gen) * 0.05
    weights = quantize_linear_weight(w, scheme, ops=R)
    scale = None
    from mxlib.moe.schemes import get_moe_scheme

    s = get_moe_scheme(scheme)
    if s.static_activation_scale:
        scale = torch.tensor([4.0 / s.activation.scale_divisor])
    x = (torch.randn(3, 7, 64, generator=gen)).to(torch.bfloat16)
    a = make_emulated_linear(scheme, weights, scale, backend="torch")(x)
    on = lambda t: None if t is None else t.to(KERNEL_DEVICE)  # noqa: E731  (compiled kernels need cuda)
    wd = dataclasses.replace(
        weights,
        weight=on(weights.weight),
        weight_scale=on(weights.weight_scale),
        weight_scale_2=on(weights.weight_scale_2),
    )
    b = make_emulated_linear(scheme, wd, on(scale), backend="triton")(on(x)).cpu()
    assert a.shape == (3, 7, 48)
    _bits_equal(b, a, f"{scheme} triton vs torch")


def test_emulated_linear_bad_input():
    gen = torch.Generator().manual_seed(9)
    weights = quantize_linear_weight(torch.randn(32, 64, generator=gen), "nvfp4", ops=R)
    with pytest.raises(ValueError, match="nvfp4: activations with a static scale need input_scale"):
        make_emulated_linear("nvfp4", weights)
    with pytest.raises(ValueError, match="weights: quantized as nvfp4, scheme w_mxfp4_a_mxfp4 stores mxfp4"):
        make_emulated_linear("w_mxfp4_a_mxfp4", weights)
    with pytest.raises(ValueError, match="weight_scale: expected torch.float8_e4m3fn"):
        EmulatedLinear(
            get_moe_scheme("nvfp4"),
            LinearWeights(
                weights.scheme, weights.weight, weights.weight_scale.view(torch.uint8), weights.weight_scale_2
            ),
            torch.tensor([0.01]),
        )
    lin = make_emulated_linear("nvfp4", weights, torch.tensor([0.01]))
    with pytest.raises(ValueError, match=r"x: expected \[\.\.\., 64\]"):
        lin(torch.zeros(2, 32, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="x: expected dtype torch.bfloat16"):
        lin(torch.zeros(2, 64))
    with pytest.raises(ValueError, match="input_scale"):
        make_emulated_linear("nvfp4", weights, torch.tensor([0.0]))
