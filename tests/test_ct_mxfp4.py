"""compressed-tensors ``mxfp4-pack-quantized`` (presets MXFP4A16 -> ``w_mxfp4``, MXFP4 -> ``w_mxfp4_a_mxfp4``):
written, read back, every stored tensor against an independent oracle, bad configs and tensors named.

Oracles: ml_dtypes' e2m1 cast, the E8M0 ``even`` exponent from ``math.frexp`` (``oracles.mx_scale_exponent``),
compressed-tensors' own scale rule transcribed (``round_to_power_2`` on the bf16 amax, then
``127 + floor(log2) - 2``), and its ``unpack_fp4_from_uint8`` / ``maybe_convert_from_mxfp4_exp``
dequantization transcribed.
"""

import json
import math
import shutil

import ml_dtypes
import numpy as np
import pytest
import torch

from mxlib import checkpoints as C
from mxlib.models.qwen3 import expert_weights
from mxlib.moe import OCP_MXQuantizationEmulationTritonExperts

from _util import edited_checkpoint, stored_tensors, tiny_calibrated
from oracles import mx_scale_exponent

LAYOUT = "compressed-tensors-mxfp4"
SCHEMES = ["w_mxfp4", "w_mxfp4_a_mxfp4"]


@pytest.fixture(scope="module")
def tiny():
    return tiny_calibrated(3, tokens=16)


def ct_scale_byte(block_amax_bf16: float) -> int:
    """compressed-tensors' ``generate_mxfp4_scales`` of one bf16 block amax, transcribed (bf16 bits)."""
    bits = int(torch.tensor(block_amax_bf16, dtype=torch.bfloat16).view(torch.int16).item()) & 0xFFFF
    bits = (bits + (1 << (7 - 1 - 1))) & (((1 << 9) - 1) << 7)  # round_to_power_2
    p2 = torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float().item()
    return int(127 + math.floor(math.log2(p2)) - 2)


def oracle_mxfp4(w: torch.Tensor):
    """``(weight_packed, weight_scale)`` of a bf16 ``[out, in]`` weight: ml_dtypes codes, frexp scales."""
    x = w.float().numpy().reshape(w.shape[0], -1, 32)
    exps = np.array([[mx_scale_exponent(float(np.abs(b).max()), "e2m1", "even") for b in row] for row in x])
    scaled = x / np.exp2(exps)[..., None]
    codes = np.clip(scaled, -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8).reshape(w.shape) & 0xF
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return torch.from_numpy(packed.astype(np.uint8)), torch.from_numpy((exps + 127).astype(np.uint8))


def ct_dequant(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' ``unpack_fp4_from_uint8`` and E8M0 ``2 ** (scale - 127)`` per 32, in fp32."""
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    flat = packed.flatten()
    codes = torch.stack((flat & 0x0F, (flat & 0xF0) >> 4), dim=1).flatten()
    vals = lut[(codes & 0x07).long()] * torch.where((codes & 0x08).bool(), -1.0, 1.0)
    vals = vals.reshape(packed.shape[0], -1, 32)
    return (vals * (2.0 ** (scale.to(torch.int32) - 127).float())[..., None]).reshape(packed.shape[0], -1)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_config_and_every_tensor(tiny, tmp_path, scheme):
    model, cal, _ = tiny
    path = C.write_quantized_checkpoint(model, scheme, tmp_path / "ckpt", cal, layout=LAYOUT)
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "mxfp4-pack-quantized"
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and group["format"] == "mxfp4-pack-quantized"
    w = group["weights"]
    assert (w["num_bits"], w["type"], w["strategy"], w["group_size"], w["dynamic"]) == (4, "float", "group", 32, False)
    assert w["scale_dtype"] == "torch.uint8" and w["symmetric"] is True
    a = group["input_activations"]
    if scheme == "w_mxfp4":
        assert a is None  # MXFP4A16
    else:
        assert (a["num_bits"], a["strategy"], a["group_size"], a["dynamic"]) == (4, "group", 32, True)  # MXFP4
    assert "re:.*mlp.gate$" in qc["ignore"] and "lm_head" in qc["ignore"]
    stored = stored_tensors(path)
    assert not any("global_scale" in k or "input_scale" in k for k in stored)  # no global, no static scale
    w13, w2 = expert_weights(model, 1)
    i = w2.shape[2]
    for e in (0, 3):
        for proj, wt in (("gate_proj", w13[e, :i]), ("up_proj", w13[e, i:]), ("down_proj", w2[e])):
            base = f"model.layers.1.mlp.experts.{e}.{proj}"
            packed, scale = stored[f"{base}.weight_packed"], stored[f"{base}.weight_scale"]
            assert packed.dtype == torch.uint8 and packed.shape == (wt.shape[0], wt.shape[1] // 2)
            assert scale.dtype == torch.uint8 and scale.shape == (wt.shape[0], wt.shape[1] // 32)
            want_p, want_s = oracle_mxfp4(wt)
            assert torch.equal(scale, want_s), base
            assert torch.equal(packed, want_p), base
            blocks = wt.float().reshape(wt.shape[0], -1, 32).abs().amax(-1)
            ct = torch.tensor([[ct_scale_byte(float(v)) for v in row] for row in blocks], dtype=torch.uint8)
            assert torch.equal(scale, ct), base  # compressed-tensors' own scale rule agrees


@pytest.mark.parametrize("scheme", SCHEMES)
def test_load_resave_and_same_arithmetic_as_quark(tiny, tmp_path, scheme):
    model, cal, ids = tiny
    path = C.write_quantized_checkpoint(model, scheme, tmp_path / "ct", cal, layout=LAYOUT, quantize_attention=True)
    info = C.read_quant_config(path)
    assert info.format == LAYOUT and info.scheme.name == scheme
    assert info.activation_scale_mode == (None if scheme == "w_mxfp4" else "even")
    loaded, _ = C.load_quantized_qwen3_moe(path, backend="torch")
    ex = loaded.model.layers[0].mlp.experts
    ex = getattr(ex, "experts", ex)
    assert isinstance(ex, OCP_MXQuantizationEmulationTritonExperts) and ex.scheme.name == scheme
    stored = stored_tensors(path)
    d13, _ = ex.dequantized_expert(2)
    gate = "model.layers.0.mlp.experts.2.gate_proj"
    want = ct_dequant(stored[f"{gate}.weight_packed"], stored[f"{gate}.weight_scale"]).to(torch.bfloat16)
    assert torch.equal(d13[: want.shape[0]], want)  # the bits compressed-tensors' decompression gives
    quark = C.write_quantized_checkpoint(model, scheme, tmp_path / "quark", cal, quantize_attention=True)
    other, _ = C.load_quantized_qwen3_moe(quark, backend="torch")
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, other(ids).logits)  # same codes and scales, another layout
    loaded.save_pretrained(tmp_path / "again")
    again = stored_tensors(tmp_path / "again")
    assert set(again) == set(stored) and all(torch.equal(again[k], stored[k]) for k in stored)


def _edited(tiny, tmp_path, edit_config=None, edit_tensor=None, scheme="w_mxfp4_a_mxfp4"):
    return edited_checkpoint(tiny, tmp_path / "bad", LAYOUT, scheme, edit_config, edit_tensor)


def _group(q):
    return q["config_groups"]["group_0"]


@pytest.mark.parametrize(
    "edit,message",
    [
        (
            lambda q: _group(q)["weights"].update(group_size=16),
            r"group_0\.weights\.group_size: MXFP4 uses 32, found 16",
        ),
        (lambda q: _group(q)["weights"].update(strategy="tensor_group"), r"weights\.strategy: MXFP4 uses 'group'"),
        (lambda q: _group(q)["weights"].update(dynamic=True), r"weights\.dynamic: expected false, found True"),
        (lambda q: _group(q)["weights"].update(scale_dtype="torch.float8_e4m3fn"), r"weights\.scale_dtype"),
        (
            lambda q: _group(q)["input_activations"].update(dynamic=False),
            r"input_activations\.dynamic: MXFP4 activations are dynamic",
        ),
        (
            lambda q: _group(q).update(format="nvfp4-pack-quantized"),
            r"group_0\.format: expected 'mxfp4-pack-quantized'",
        ),
        (
            # two groups targeting every Linear: a mixed-precision config whose modules each match two groups
            lambda q: q["config_groups"].update(group_1={**_group(q), "input_activations": None}),
            r"matched by the targets of config_groups \['group_0', 'group_1'\] equally specifically",
        ),
        (lambda q: q.update(quantization_status="frozen"), "quantization_status: expected 'compressed'"),
    ],
)
def test_bad_configs_name_the_field(tiny, tmp_path, edit, message):
    path = _edited(tiny, tmp_path, edit_config=edit)
    with pytest.raises(C.CheckpointError, match=message):
        C.load_quantized_qwen3_moe(path)


def test_bad_tensors_name_the_tensor(tiny, tmp_path):
    name = "model.layers.1.mlp.experts.2.up_proj.weight_scale"

    def nan_scale(k, v):
        if k == name:
            v = v.clone()
            v[0, 0] = 0xFF
        return v

    with pytest.raises(C.CheckpointError, match=rf"tensor '{name}': invalid E8M0 block scale .*0xFF"):
        C.load_quantized_qwen3_moe(_edited(tiny, tmp_path / "a", edit_tensor=nan_scale))
    as_fp8 = _edited(tiny, tmp_path / "b", edit_tensor=lambda k, v: v.view(torch.float8_e4m3fn) if k == name else v)
    with pytest.raises(C.CheckpointError, match=f"tensor '{name}': expected dtype torch.uint8, found torch.float8"):
        C.load_quantized_qwen3_moe(as_fp8)
    packed = name.replace("weight_scale", "weight_packed")
    short = _edited(tiny, tmp_path / "c", edit_tensor=lambda k, v: v[:, :-1].contiguous() if k == packed else v)
    with pytest.raises(C.CheckpointError, match=rf"tensor '{packed}': expected shape \[32, 32\], found \[32, 31\]"):
        C.load_quantized_qwen3_moe(short)


def test_layout_stores_only_its_schemes(tiny, tmp_path):
    model, cal, _ = tiny
    for scheme in ("nvfp4", "w_mxfp6_e2m3", "w_mxfp4_a_fp8"):
        with pytest.raises(ValueError, match=LAYOUT):
            C.write_quantized_checkpoint(model, scheme, tmp_path / scheme, cal, layout=LAYOUT)
    # the NVFP4 compressed-tensors layout still reads its own format beside this one
    path = C.write_quantized_checkpoint(model, "nvfp4", tmp_path / "nv", cal, layout="compressed-tensors")
    assert C.read_quant_config(path).format == "compressed-tensors"
    shutil.rmtree(path)
