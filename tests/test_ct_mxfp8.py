"""compressed-tensors ``mxfp8-quantized`` (presets MXFP8A16 -> ``w_mxfp8``, MXFP8 -> ``w_mxfp8_a_mxfp8``):
written, read back, every stored tensor against an independent oracle, bad configs and tensors named.

Oracles: ml_dtypes' e4m3 cast, and compressed-tensors' own scale rule transcribed from its source
(``round_to_power_2`` on the bf16 amax at e2m1's mantissa width, then ``127 + floor(log2) - 8``, in Python
integers and ``math``). The producer's own exports are checked in ``tests/test_interop_formats.py``.
"""

import json
import math
import shutil

import ml_dtypes
import numpy as np
import pytest
import torch

from mxlib import checkpoints as C
from mxlib import reference as R
from mxlib.checkpoints.layouts.compressed_tensors_mxfp8 import ct_mxfp8_scale
from mxlib.models.qwen3 import expert_weights
from mxlib.moe import OCP_MXQuantizationEmulationTritonExperts

from _util import edited_checkpoint, stored_tensors, tiny_calibrated

LAYOUT = "compressed-tensors-mxfp8"
SCHEMES = ["w_mxfp8", "w_mxfp8_a_mxfp8"]


@pytest.fixture(scope="module")
def tiny():
    return tiny_calibrated(4, tokens=16)


def ct_scale_byte(block_amax_bf16: float) -> int:
    """compressed-tensors' ``generate_mx_scales(amax, num_bits=8)`` of one bf16 block amax, transcribed."""
    bits = int(torch.tensor(block_amax_bf16, dtype=torch.bfloat16).view(torch.int16).item()) & 0xFFFF
    bits = (bits + (1 << (7 - 1 - 1))) & (((1 << 9) - 1) << 7)  # round_to_power_2: e2m1's mantissa width
    p2 = torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float().item()
    if p2 == 0:
        return 0  # torch.log2(0) = -inf, clamped to the uint8 range
    return min(max(int(127 + math.floor(math.log2(p2)) - 8), 0), 255)


def oracle_mxfp8(w: torch.Tensor):
    """``(weight codes, weight_scale)`` of a bf16 ``[out, in]`` weight: the transcribed rule, ml_dtypes' e4m3."""
    blocks = w.float().reshape(w.shape[0], -1, 32)
    scale = np.array([[ct_scale_byte(float(v)) for v in row] for row in blocks.abs().amax(-1)], dtype=np.int64)
    scaled = blocks.numpy() / np.exp2(scale - 127.0)[..., None]
    assert np.abs(scaled).max() <= 448.0
    codes = scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).reshape(w.shape)
    return torch.from_numpy(codes.copy()), torch.from_numpy(scale.astype(np.uint8))


def test_scale_rule_against_the_transcription():
    """``ct_mxfp8_scale`` == the transcribed rule on every bf16 significand of two binades, zero and tiny
    values; and it differs from ``rceil`` only at ``448 * 2**k``."""
    sig = torch.arange(128, dtype=torch.int32)
    bits = torch.cat([(127 << 7) | sig, (120 << 7) | sig, torch.tensor([0, 1, 0x80])])  # 1..2, 2**-7.., 0, tiny
    amax = bits.to(torch.int16).view(torch.bfloat16).abs()
    want = torch.tensor([ct_scale_byte(float(v)) for v in amax], dtype=torch.uint8)
    got = ct_mxfp8_scale(amax)
    assert torch.equal(got, want)
    rceil = R.e8m0_scale(amax.float(), "e4m3", "rceil")
    at_448 = (amax.float() / 448) == torch.exp2(torch.floor(torch.log2(amax.float() / 448)))
    assert torch.equal(got != rceil, at_448 & (amax > 0)), "differs from rceil off 448 * 2**k"
    assert int((got != rceil).sum()) == 2  # 448 * 2**-8 and 448 * 2**-15 in these binades
    assert int(ct_mxfp8_scale(torch.tensor([float("nan"), float("inf")]))[0]) == 0xFF


@pytest.mark.parametrize("scheme", SCHEMES)
def test_config_and_every_tensor(tiny, tmp_path, scheme):
    model, cal, _ = tiny
    path = C.write_quantized_checkpoint(model, scheme, tmp_path / "ckpt", cal, layout=LAYOUT)
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "mxfp8-quantized"
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and group["format"] == "mxfp8-quantized"
    w = group["weights"]
    assert (w["num_bits"], w["type"], w["strategy"], w["group_size"], w["dynamic"]) == (8, "float", "group", 32, False)
    assert w["scale_dtype"] == "torch.uint8" and w["symmetric"] is True
    a = group["input_activations"]
    if scheme == "w_mxfp8":
        assert a is None  # MXFP8A16
    else:
        assert (a["num_bits"], a["strategy"], a["group_size"], a["dynamic"]) == (8, "group", 32, True)  # MXFP8
    assert "re:.*mlp.gate$" in qc["ignore"] and "lm_head" in qc["ignore"]
    stored = stored_tensors(path)
    assert not any("global_scale" in k or "input_scale" in k for k in stored)
    w13, w2 = expert_weights(model, 1)
    i = w2.shape[2]
    for e in (0, 3):
        for proj, wt in (("gate_proj", w13[e, :i]), ("up_proj", w13[e, i:]), ("down_proj", w2[e])):
            base = f"model.layers.1.mlp.experts.{e}.{proj}"
            weight, scale = stored[f"{base}.weight"], stored[f"{base}.weight_scale"]
            assert weight.dtype == torch.float8_e4m3fn and weight.shape == wt.shape
            assert scale.dtype == torch.uint8 and scale.shape == (wt.shape[0], wt.shape[1] // 32)
            want_w, want_s = oracle_mxfp8(wt)
            assert torch.equal(scale, want_s), base
            assert torch.equal(weight.view(torch.uint8), want_w), base


@pytest.mark.parametrize("scheme", SCHEMES)
def test_load_and_resave(tiny, tmp_path, scheme):
    model, cal, ids = tiny
    path = C.write_quantized_checkpoint(model, scheme, tmp_path / "ct", cal, layout=LAYOUT, quantize_attention=True)
    info = C.read_quant_config(path)
    assert info.format == LAYOUT and info.scheme.name == scheme
    assert info.activation_scale_mode == (None if scheme == "w_mxfp8" else "rceil")
    loaded, _ = C.load_quantized_qwen3_moe(path, backend="torch")
    ex = loaded.model.layers[0].mlp.experts
    ex = getattr(ex, "experts", ex)
    assert isinstance(ex, OCP_MXQuantizationEmulationTritonExperts) and ex.scheme.name == scheme
    stored = stored_tensors(path)
    d13, _ = ex.dequantized_expert(2)
    gate = "model.layers.0.mlp.experts.2.gate_proj"
    codes = stored[f"{gate}.weight"].float()  # torch's own e4m3 decode, then 2**(byte - 127) per 32
    scale = torch.exp2(stored[f"{gate}.weight_scale"].float() - 127).repeat_interleave(32, dim=1)
    assert torch.equal(d13[: codes.shape[0]], (codes * scale).to(torch.bfloat16))
    assert "model.layers.0.self_attn.q_proj.weight_scale" in stored  # quantized attention
    with torch.no_grad():
        assert torch.isfinite(loaded(ids).logits).all()
    loaded.save_pretrained(tmp_path / "again")
    again = stored_tensors(tmp_path / "again")
    assert set(again) == set(stored) and all(torch.equal(again[k], stored[k]) for k in stored)


def _edited(tiny, tmp_path, edit_config=None, edit_tensor=None, scheme="w_mxfp8_a_mxfp8"):
    return edited_checkpoint(tiny, tmp_path / "bad", LAYOUT, scheme, edit_config, edit_tensor)


def _group(q):
    return q["config_groups"]["group_0"]


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda q: _group(q)["weights"].update(num_bits=4), r"group_0\.weights\.num_bits: MXFP8 uses 8, found 4"),
        (lambda q: _group(q)["weights"].update(group_size=16), r"weights\.group_size: MXFP8 uses 32, found 16"),
        (lambda q: _group(q)["weights"].update(strategy="channel"), r"weights\.strategy: MXFP8 uses 'group'"),
        (lambda q: _group(q)["weights"].update(dynamic=True), r"weights\.dynamic: expected false, found True"),
        (lambda q: _group(q)["weights"].update(scale_dtype="torch.bfloat16"), r"weights\.scale_dtype"),
        (
            lambda q: _group(q)["input_activations"].update(dynamic=False),
            r"input_activations\.dynamic: MXFP8 activations are dynamic",
        ),
        (lambda q: _group(q).update(format="float-quantized"), r"group_0\.format: expected 'mxfp8-quantized'"),
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
    weight = name.replace("weight_scale", "weight")
    as_u8 = _edited(tiny, tmp_path / "b", edit_tensor=lambda k, v: v.view(torch.uint8) if k == weight else v)
    with pytest.raises(
        C.CheckpointError, match=f"tensor '{weight}': expected dtype torch.float8_e4m3fn, found torch.uint8"
    ):
        C.load_quantized_qwen3_moe(as_u8)
    short = _edited(tiny, tmp_path / "c", edit_tensor=lambda k, v: v[:, :-1].contiguous() if k == name else v)
    with pytest.raises(C.CheckpointError, match=rf"tensor '{name}': expected shape \[32, 2\], found \[32, 1\]"):
        C.load_quantized_qwen3_moe(short)


def test_layout_stores_only_its_schemes(tiny, tmp_path):
    model, cal, _ = tiny
    for scheme in ("nvfp4", "w_mxfp4", "w_mxfp4_a_mxfp8"):
        with pytest.raises(ValueError, match=LAYOUT):
            C.write_quantized_checkpoint(model, scheme, tmp_path / scheme, cal, layout=LAYOUT)
    # the NVFP4 and MXFP4 compressed-tensors layouts still read their own formats beside this one
    for layout, scheme in (("compressed-tensors", "nvfp4"), ("compressed-tensors-mxfp4", "w_mxfp4")):
        path = C.write_quantized_checkpoint(model, scheme, tmp_path / layout, cal, layout=layout)
        assert C.read_quant_config(path).format == layout
        shutil.rmtree(path)
