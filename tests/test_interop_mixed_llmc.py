"""Mixed-precision compressed-tensors checkpoints made by llm-compressor itself, against mxlib.

The fixtures ``tests/fixtures/interop/llmc_mixed_*/`` were made by ``tools/interop/make_fixtures.py llmc`` (the
``MIXED`` schemes of ``tools/interop/_llmc.py``) with llmcompressor 0.14.0.1 / compressed-tensors 0.19.0 on torch
2.13 CPU: one ``oneshot`` of the tiny seeded Qwen3-MoE whose ``QuantizationModifier`` has two ``config_groups``,
each ``preset_name_to_scheme(preset, targets)``:

* ``llmc_mixed_fp8_nvfp4``: NVFP4 for the routed experts and ``lm_head`` (``re:.*mlp\\.experts\\.\\d+\\.(gate|up|
  down)_proj$``, ``lm_head``), FP8 (static per-tensor weights and activations) for ``re:.*self_attn\\.(q|k|v|o)
  _proj$``;
* ``llmc_mixed_mxfp8_mxfp4``: MXFP4 for the experts, MXFP8 for the attention projections and ``lm_head``;
* ``llmc_mixed_fp8dyn_nvfp4``: NVFP4 for the experts, ``FP8_DYNAMIC`` (per-channel weights, dynamic per-token
  activations) for the attention projections and ``lm_head``.

What the tool wrote (the oracle for the on-disk form): ``format: "mixed-precision"`` with a ``format`` per group;
the groups renumbered in the order their first module appears in the model (``QuantizationConfig.from_pretrained``),
so the attention group is ``group_0`` and the experts' ``group_1`` whatever the recipe's order; ``ignore`` the
routers by name; the FP8 groups' ``weight_scale`` (``[1]``, or ``[out, 1]`` per channel) and ``input_scale``
(``[1]``) **bf16** (the scale in the weight's dtype, ``scale_dtype: null``). ``meta.json``'s ``presets`` records
which preset the tool attached to each module.

``tool_results.safetensors`` holds the tool's own numbers: ``dequant.<module>`` (its compressors' ``decompress``:
``NVFP4PackedCompressor``, ``FloatQuantizationCompressor``, ``MXFP4PackedCompressor``,
``MXFP8QuantizationCompressor``), ``qdq.{x,y}.<module>`` (``forward_quantize`` of a ``[1, 4, in]`` input with the
module's calibrated scales), ``logits.tool`` (its fake-quantized forward) and ``logits.bf16``, and
``weight.<module>``, the bf16 weights it quantized.

Where mxlib's emulation follows vLLM rather than the tool (activation QDQ of the NVFP4 and FP8 inputs; the tool's
own rule is the oracle then), the tests say so and count the values that differ.
"""

from __future__ import annotations

import json
import shutil
import struct
from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mxlib import checkpoints as C
from mxlib import reference as R
from mxlib.checkpoints.layouts import LAYOUTS
from mxlib.models.what_ran import RanMismatch, WhatRan, assert_runs_as
from mxlib.moe.factory import quantize_expert_weights
from mxlib.moe.linear import EmulatedLinear

from _util import assert_bits_equal

FIXTURES = Path(__file__).parent / "fixtures" / "interop"
NAMES = ("llmc_mixed_fp8_nvfp4", "llmc_mixed_mxfp8_mxfp4", "llmc_mixed_fp8dyn_nvfp4")
# the tool's preset -> (compressed-tensors format the tool writes for it, mxlib's scheme, mxlib's layout)
PRESET = {
    "NVFP4": ("nvfp4-pack-quantized", "nvfp4", "compressed-tensors"),
    "FP8": ("float-quantized", "w_fp8_a_fp8", "compressed-tensors-fp8"),
    "FP8_DYNAMIC": ("float-quantized", "w_fp8_a_fp8_per_token", "compressed-tensors-fp8"),
    "MXFP4": ("mxfp4-pack-quantized", "w_mxfp4_a_mxfp4", "compressed-tensors-mxfp4"),
    "MXFP8": ("mxfp8-quantized", "w_mxfp8_a_mxfp8", "compressed-tensors-mxfp8"),
}
# the experts' preset of each fixture (the headline scheme of the checkpoint)
EXPERTS_PRESET = {
    "llmc_mixed_fp8_nvfp4": "NVFP4",
    "llmc_mixed_mxfp8_mxfp4": "MXFP4",
    "llmc_mixed_fp8dyn_nvfp4": "NVFP4",
}
# mxlib's logits against the tool's fake-quantized forward and against bf16: minimums in dB, a few dB under what
# was measured on the CPU with the torch experts backend (MEASURED_DB: mxlib vs tool, mxlib vs bf16, tool vs bf16)
MIN_DB = {
    "llmc_mixed_fp8_nvfp4": (15.0, 12.0),
    "llmc_mixed_mxfp8_mxfp4": (26.0, 18.0),
    "llmc_mixed_fp8dyn_nvfp4": (21.0, 19.0),
}
MEASURED_DB = {
    "llmc_mixed_fp8_nvfp4": (17.7, 14.6, 14.6),
    "llmc_mixed_mxfp8_mxfp4": (29.3, 21.1, 20.9),
    "llmc_mixed_fp8dyn_nvfp4": (24.0, 22.0, 21.7),
}
ATTN = [f"model.layers.{layer}.self_attn.{p}_proj" for layer in range(2) for p in "qkvo"]


@cache
def _fixture(name):
    folder = FIXTURES / name
    meta = json.loads((folder / "meta.json").read_text())
    return folder / "checkpoint", meta, load_file(str(folder / "tool_results.safetensors"))


@cache
def _tensors(name):
    return load_file(str(FIXTURES / name / "checkpoint" / "model.safetensors"))


def _loaded(name):
    return C.load_quantized_moe(FIXTURES / name / "checkpoint", backend="torch")


def _qc(name):
    return json.loads((_fixture(name)[0] / "config.json").read_text())["quantization_config"]


def _tool_group(name, module):
    """The config group the tool put ``module`` in: the group whose ``format`` is that of the preset the tool
    attached to the module (meta.json ``presets``, read from the tool's modules after ``oneshot``)."""
    fmt = PRESET[_fixture(name)[1]["presets"][module]][0]
    hits = [g for g, body in _qc(name)["config_groups"].items() if body["format"] == fmt]
    assert len(hits) == 1, (name, module, hits)
    return hits[0]


def _header(path: Path) -> dict:
    """The safetensors header, read here from the file's bytes (8-byte length, then JSON)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def _sqnr_db(x, ref):
    x, ref = x.double(), ref.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (x - ref).pow(2).sum()))


def _names(results, prefix):
    return sorted(k[len(prefix) :] for k in results if k.startswith(prefix))


# ----------------------------------------------------------------------------- the tool's form


@pytest.mark.parametrize("name", NAMES)
def test_fixture_is_the_tools_mixed_form(name):
    ckpt, meta, _ = _fixture(name)
    assert meta["tool"] == "llmcompressor" and meta["versions"]["llmcompressor"] == "0.14.0.1"
    assert meta["versions"]["compressed-tensors"] == "0.19.0"
    for path in ckpt.parent.rglob("*"):
        assert not path.is_file() or path.stat().st_size < 2_000_000, path
    qc = _qc(name)
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "mixed-precision"
    assert qc["ignore"] == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    # the tool numbers its groups by the model's module order: attention (layer 0's self_attn) first
    assert _tool_group(name, "model.layers.0.self_attn.q_proj") == "group_0"
    assert _tool_group(name, "model.layers.0.mlp.experts.0.gate_proj") == "group_1"
    assert len(meta["presets"]) == 2 * 8 * 3 + len(ATTN) + 1  # experts, attention, lm_head


@pytest.mark.parametrize("name", NAMES)
def test_precision_groups_are_the_tools(name):
    """Every module's group, scheme and layout as mxlib reads the config equal the group the tool attached it to;
    every module the tool left unquantized is unquantized for mxlib (the routers by ``ignore``, the rest by no
    target)."""
    ckpt, meta, _ = _fixture(name)
    info = C.read_quant_config(ckpt)
    pm = info.precision
    assert pm is not None and pm.producer == "compressed-tensors" and list(pm.groups) == ["group_0", "group_1"]
    modules = {k.rsplit(".", 1)[0] for k in _header(ckpt / "model.safetensors")}
    assert set(meta["presets"]) <= modules
    for module in sorted(modules):
        preset = meta["presets"].get(module)
        classes = ("Linear", "Module") if module.endswith("proj") or module.endswith("gate") else ("Module",)
        group = pm.group_of(module, classes)
        if preset is None:
            assert group is None, f"{module}: the tool left it bf16, mxlib reads group {group}"
            continue
        assert group == _tool_group(name, module), module
        desc = pm.description(module, classes)
        assert (desc.scheme.name, desc.format) == PRESET[preset][1:], module
    # the checkpoint's headline scheme is the experts' (whatever the group order)
    assert info.scheme.name == PRESET[EXPERTS_PRESET[name]][1]


# ----------------------------------------------------------------------------- weights


def _mxlib_dequant(desc, tensors, module, dtype):
    """mxlib.reference's dequantization of one module's stored tensors, by the layout mxlib reads it with."""
    t = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == module}
    if desc.format == "compressed-tensors":
        g = t["weight_global_scale"].float().reshape(())
        return R.dequantize_to_dtype(t["weight_packed"], t["weight_scale"], g, dtype, global_scale_kind="encode")
    if desc.format == "compressed-tensors-fp8":
        return R.dequantize_fp8_weight(t["weight"], t["weight_scale"], dtype)
    element = desc.scheme.weight.element.name
    packed = t.get("weight_packed", t.get("weight"))
    packed = packed if packed.dtype == torch.uint8 else packed.view(torch.uint8)
    return R.dequantize_mx(packed, t["weight_scale"], element, 32, dtype)


@pytest.mark.parametrize("name", NAMES)
def test_dequant_equals_tool(name):
    """mxlib.reference on the checkpoint's bytes, and the loaded model's modules, hold exactly the tool's
    dequantized weights: experts (3 of 16), layer 0's attention projections, ``lm_head``."""
    ckpt, _, results = _fixture(name)
    pm = C.read_quant_config(ckpt).precision
    tensors = _tensors(name)
    model, _ = _loaded(name)
    modules = _names(results, "dequant.")
    assert len(modules) == 9 + 4 + 1, modules
    groups = set()
    for module in modules:
        tool = results[f"dequant.{module}"]
        desc = pm.description(module)
        groups.add(pm.group_of(module))
        assert_bits_equal(_mxlib_dequant(desc, tensors, module, tool.dtype), tool, f"{name} {module} (reference)")
        if ".experts." in module:
            parts = module.split(".")
            w13, w2 = model.model.layers[int(parts[2])].mlp.experts.experts.dequantized_expert(int(parts[5]))
            i = w2.shape[1]
            mine = {"gate_proj": w13[:i], "up_proj": w13[i:], "down_proj": w2}[parts[6]]
        else:
            mine = model.get_submodule(module).dequantized_weight()
        assert_bits_equal(mine, tool, f"{name} {module} (loaded)")
    assert groups == {"group_0", "group_1"}


@pytest.mark.parametrize("name", NAMES)
def test_writer_equals_tool_tensors(name):
    """From the bf16 weights the tool quantized, each group's layout writes the tool's tensors byte for byte
    (codes, block or per-tensor scales, global scales, their dtypes): layer 0 expert 0, layer 0's q_proj,
    ``lm_head``. Static input scales are the tool's calibration, passed through as stored."""
    ckpt, _, results = _fixture(name)
    pm = C.read_quant_config(ckpt).precision
    tensors = _tensors(name)
    written = {}
    base = "model.layers.0.mlp.experts.0"
    desc = pm.description(f"{base}.gate_proj")
    layout, scheme = LAYOUTS[desc.format], desc.scheme
    w = {p: results[f"weight.{base}.{p}"] for p in C.PROJS}
    w13, w2 = torch.cat([w["gate_proj"], w["up_proj"]])[None], w["down_proj"][None]
    weights = layout.quantize_experts(w13, w2, scheme)
    if weights is None:  # the MX layouts quantize with the factory's arithmetic
        weights = quantize_expert_weights(w13, w2, scheme)
    ins = {}
    if scheme.static_activation_scale:  # the stored encode scales, as they are (the calibration is the tool's)
        ins = {p: tensors[f"{base}.{p}.input_global_scale"].reshape(1) for p in C.PROJS}
        written.update(layout.expert_tensors(scheme, weights, ins["gate_proj"], ins["down_proj"], base[:-2]))
    else:
        written.update(layout.expert_tensors(scheme, weights, None, None, base[:-2]))
    for module in ("model.layers.0.self_attn.q_proj", "lm_head"):
        d = pm.description(module)
        lay = LAYOUTS[d.format]
        stored_in = tensors.get(f"{module}.input_scale", tensors.get(f"{module}.input_global_scale"))
        written.update(
            lay.linear_tensors(d.scheme, lay.quantize_linear(results[f"weight.{module}"], d.scheme), stored_in, module)
        )
    assert len(written) >= 8
    for key, mine in written.items():
        tool = tensors[key]
        assert mine.dtype == tool.dtype and mine.shape == tool.shape, (
            f"{key}: {mine.dtype} {list(mine.shape)} vs {tool.dtype} {list(tool.shape)}"
        )
        assert_bits_equal(mine, tool, f"{name} {key}")


# ----------------------------------------------------------------------------- activations


def _ct_fp8_qdq(x, input_scale):
    """compressed-tensors 0.19's static FP8 QDQ (``_quantize_dequantize`` with a bf16 ``input_scale``): the
    division ``x / scale`` in bf16 (one bf16 rounding), then e4m3 (RNE, saturating at 448), then ``* scale`` in
    bf16. vLLM (and mxlib's emulation) multiply by ``1 / scale`` in fp32 instead: the two differ where the bf16
    quotient lands on an e4m3 tie."""
    s = input_scale.to(torch.bfloat16)
    return torch.clamp(x / s, -448.0, 448.0).to(torch.float8_e4m3fn).to(torch.bfloat16) * s


def _ct_fp8_token_qdq(x):
    """compressed-tensors 0.19's dynamic per-token FP8 QDQ of ``[tokens, k]`` rows (``compute_dynamic_scales_and_zp``
    with strategy ``token``, then ``_quantize_dequantize``): per row ``scale = bf16(amax / 448)`` (bf16's eps for a
    zero row), then as ``_ct_fp8_qdq``. vLLM's per-token rule keeps the scale in fp32 (``max(amax / 448, 1 / (448 *
    512))``), so most values of a row differ by the scale's bf16 rounding."""
    s = x.abs().amax(-1, keepdim=True) / torch.tensor(448.0, dtype=x.dtype)
    s = torch.where(s == 0, torch.finfo(x.dtype).eps, s)
    return torch.clamp(x / s, -448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype) * s


# what vLLM's rules (mxlib's emulation) give differently from the tool's on the fixed [4, 128] input (outliers, a tiny
# and a zero block): values of 512 per module
VLLM_VS_TOOL = {
    "llmc_mixed_fp8_nvfp4": {
        "lm_head": 16,
        "model.layers.0.mlp.experts.0.gate_proj": 0,
        "model.layers.0.self_attn.q_proj": 22,
    },
    "llmc_mixed_mxfp8_mxfp4": {},
    "llmc_mixed_fp8dyn_nvfp4": {
        "lm_head": 121,
        "model.layers.0.mlp.experts.0.gate_proj": 0,
        "model.layers.0.self_attn.q_proj": 121,
    },
}


@pytest.mark.parametrize("name", NAMES)
def test_activation_qdq_against_tool(name):
    """The tool's activation QDQ of each group's input (``forward_quantize`` of ``[1, 4, in]``, as the model's
    ``[batch, seq, hidden]`` activations, with the calibrated scales):

    * MX (dynamic E8M0): the loaded module's own QDQ (attention, ``lm_head``) or mxlib.reference with the E8M0 rule
      the reader gives the group (experts) equals the tool's, bit for bit;
    * NVFP4: ``reference.compressed_tensors_nvfp4_quant_dequant`` equals the tool's bit for bit; the emulation
      runs vLLM's fp32 rule, which differs on a few values (counted: ``VLLM_VS_TOOL``);
    * FP8, static or per token: the tool's bf16 rules (``_ct_fp8_qdq``, ``_ct_fp8_token_qdq``) equal the tool's
      bit for bit, and the loaded module's QDQ (vLLM's rules) differs on the values counted in ``VLLM_VS_TOOL``.
    """
    ckpt, meta, results = _fixture(name)
    pm = C.read_quant_config(ckpt).precision
    model, _ = _loaded(name)
    modules = _names(results, "qdq.y.")
    assert sorted(meta["qdq"]["modules"]) == modules and len(modules) == 3
    differ = {}
    for module in modules:
        x, y = results[f"qdq.x.{module}"], results[f"qdq.y.{module}"]
        assert x.shape == y.shape == (1, 4, 128), x.shape
        x, y = x[0], y[0]
        desc = pm.description(module)
        act = desc.scheme.activation
        mine = None if ".experts." in module else model.get_submodule(module).quantize_input(x)
        if desc.scheme.name == "nvfp4":
            igs = results[f"qdq.input_global_scale.{module}"]
            assert_bits_equal(igs, _tensors(name)[f"{module}.input_global_scale"], f"{module} input_global_scale")
            assert_bits_equal(R.compressed_tensors_nvfp4_quant_dequant(x, igs), y, f"{name} {module} (tool's rule)")
            mine = R.ref_nvfp4_quant_dequant(x, igs) if mine is None else mine
        elif desc.scheme.name == "w_fp8_a_fp8":
            s = results[f"qdq.input_scale.{module}"]
            assert_bits_equal(s.to(torch.bfloat16), _tensors(name)[f"{module}.input_scale"], f"{module} input_scale")
            assert_bits_equal(_ct_fp8_qdq(x, s), y, f"{name} {module} (tool's rule)")
        elif desc.scheme.name == "w_fp8_a_fp8_per_token":
            assert f"qdq.input_scale.{module}" not in results  # dynamic: no stored scale
            assert_bits_equal(_ct_fp8_token_qdq(x), y, f"{name} {module} (tool's rule)")
        else:
            if mine is None:
                mine = R.quant_dequant_mx(x, act.element.name, 32, desc.activation_scale_mode, dtype=y.dtype)
            assert_bits_equal(mine, y, f"{name} {module}")
            continue
        differ[module] = int((mine.view(torch.int16) != y.view(torch.int16)).sum())
    assert differ == VLLM_VS_TOOL[name], differ


# ----------------------------------------------------------------------------- logits


@pytest.mark.parametrize("name", NAMES)
def test_logits_against_tool(name):
    """mxlib's emulated forward against the tool's fake-quantized one and bf16 (minimums in MIN_DB, measured in
    MEASURED_DB); closer to the tool than the tool is to bf16. The gap: the activation rules (vLLM's, above) and
    rounding order (transformers' eager experts round to bf16 per expert, mxlib accumulates in fp32)."""
    _, _, results = _fixture(name)
    model, _ = _loaded(name)
    with torch.no_grad():
        logits = model(input_ids=results["tokens.eval"]).logits.float()
    vs_tool, vs_bf16 = _sqnr_db(logits, results["logits.tool"]), _sqnr_db(logits, results["logits.bf16"])
    tool_bf16 = _sqnr_db(results["logits.tool"], results["logits.bf16"])
    min_tool, min_bf16 = MIN_DB[name]
    assert vs_tool >= min_tool, f"{name}: {vs_tool:.1f} dB from the tool's logits < {min_tool}"
    assert vs_bf16 >= min_bf16, f"{name}: {vs_bf16:.1f} dB from bf16 < {min_bf16}"
    assert vs_tool > tool_bf16, f"{name}: {vs_tool:.1f} dB to the tool, the tool to bf16 {tool_bf16:.1f} dB"


def test_attention_fp8_rule_explains_part_of_the_gap():
    """With compressed-tensors' own static FP8 rule in the attention projections (``_ct_fp8_qdq``), mxlib's logits
    move at least 2 dB closer to the tool's (measured: 17.7 -> 20.7 dB): that part of the gap is the FP8 QDQ
    rule, not a misread tensor."""
    name = "llmc_mixed_fp8_nvfp4"
    _, _, results = _fixture(name)
    model, _ = _loaded(name)
    ids, tool = results["tokens.eval"], results["logits.tool"]
    with torch.no_grad():
        before = _sqnr_db(model(input_ids=ids).logits.float(), tool)
    for module in ATTN:
        lin = model.get_submodule(module)
        assert isinstance(lin, EmulatedLinear) and lin.scheme.name == "w_fp8_a_fp8"
        lin.quantize_input = lambda x2, ops=None, s=lin.input_qdq_scale: _ct_fp8_qdq(x2, s)
    with torch.no_grad():
        after = _sqnr_db(model(input_ids=ids).logits.float(), tool)
    assert after >= before + 2.0, f"{before:.1f} -> {after:.1f} dB"


# ----------------------------------------------------------------------------- inspector, what ran


@pytest.mark.parametrize("name", NAMES)
def test_inspector_groups_and_byte_shares(name):
    """``inspect_checkpoint`` lists the two groups and the unquantized rest, each with the modules and bytes counted
    here from the safetensors header (data offsets) and the tool's own module -> preset record."""
    ckpt, meta, _ = _fixture(name)
    report = C.inspect_checkpoint(ckpt)
    assert report.layout_ok, report.problems
    assert report.scheme == PRESET[EXPERTS_PRESET[name]][1]
    want: dict[str, list] = {}
    quantized = set()
    for key, entry in _header(ckpt / "model.safetensors").items():
        module = key.rsplit(".", 1)[0]
        preset = meta["presets"].get(module)
        group = "unquantized" if preset is None else _tool_group(name, module)
        row = want.setdefault(group, [None if preset is None else PRESET[preset][1], set(), 0])
        if preset is not None:
            row[1].add(module)
            quantized.add(module)
        row[2] += entry["data_offsets"][1] - entry["data_offsets"][0]
    total = sum(r[2] for r in want.values())
    got = {r["group"]: r for r in report.precision_groups}
    assert sorted(got) == sorted(want)
    for group, (scheme, modules, nbytes) in want.items():
        r = got[group]
        assert (r["scheme"], r["modules"], r["bytes"]) == (scheme, len(modules), nbytes), (group, r)
        assert r["share"] == pytest.approx(nbytes / total, rel=1e-12)
    assert len(quantized) == len(meta["presets"])
    text = report.table()
    for group in want:
        assert group in text


@pytest.mark.parametrize("name", NAMES)
def test_what_ran_and_a_planted_mismatch(name):
    """``assert_runs_as(model, info)`` passes with each module checked against its own group; a planted silent
    weight-only fallback (q_proj's input QDQ skipped), a planted double QDQ (o_proj's) and the whole checkpoint
    asked as the experts' scheme are each refused, naming the module."""
    ckpt, _, results = _fixture(name)
    model, info = _loaded(name)
    ids = results["tokens.eval"]
    report = assert_runs_as(model, info, ids)
    ran = {r.module: r.scheme for r in report}
    pm = info.precision
    assert ran["model.layers.1.mlp.experts"] == pm.description("model.layers.1.mlp.experts.0.up_proj").scheme.name
    assert ran["model.layers.0.self_attn.q_proj"] == pm.description("model.layers.0.self_attn.q_proj").scheme.name
    assert ran["lm_head"] == pm.description("lm_head").scheme.name
    # the planted mismatches, in the model itself
    q = model.get_submodule("model.layers.0.self_attn.q_proj")
    o = model.get_submodule("model.layers.1.self_attn.o_proj")
    q_in, o_in = q.quantize_input, o.quantize_input
    q.quantize_input = lambda x2, ops=None: x2
    o.quantize_input = lambda x2, ops=None: o_in(o_in(x2, ops), ops)
    try:
        with pytest.raises(RanMismatch) as err:
            assert_runs_as(model, info, ids)
    finally:
        q.quantize_input, o.quantize_input = q_in, o_in
    text = str(err.value)
    assert "model.layers.0.self_attn.q_proj: a1" in text and "silent weight-only fallback" in text
    assert "model.layers.1.self_attn.o_proj: a1" in text and "quantized 2 times (a double QDQ)" in text
    assert "lm_head" not in text and "experts" not in text
    # one scheme asked for the whole checkpoint: the attention group is named as a mismatch
    experts = info.scheme
    with pytest.raises(
        RanMismatch, match=rf"model.layers.0.self_attn.q_proj: ran \S+ \(W8A8\), the checkpoint asks {experts.name}"
    ):
        assert_runs_as(model, experts.name, report=report)
    # a report whose row says the module ran in another scheme is refused too
    rows = [replace(r, scheme="w_mxfp4_a_mxfp4") if r.module == "lm_head" else r for r in report]
    with pytest.raises(RanMismatch, match=r"lm_head: ran w_mxfp4_a_mxfp4"):
        assert_runs_as(model, info, report=WhatRan(rows))


# ----------------------------------------------------------------------------- round trip, refusal


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_byte_for_byte(name, tmp_path):
    """save -> load -> save: identical files; the saved tensors are the tool's, bit for bit (names, dtypes, shapes);
    the saved ``quantization_config`` is the tool's, unchanged; the reloaded model gives the same logits."""
    ckpt, _, results = _fixture(name)
    model, _ = _loaded(name)
    model.save_pretrained(tmp_path / "first")
    again, info = C.load_quantized_moe(tmp_path / "first", backend="torch")
    again.save_pretrained(tmp_path / "second")
    files = sorted(p.name for p in (tmp_path / "first").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "second").iterdir())
    for f in files:
        assert (tmp_path / "first" / f).read_bytes() == (tmp_path / "second" / f).read_bytes(), f
    src = _tensors(name)
    saved = {}
    for shard in sorted((tmp_path / "first").glob("*.safetensors")):
        saved.update(load_file(str(shard)))
    assert sorted(saved) == sorted(src)
    for k in src:
        assert_bits_equal(saved[k], src[k], k)
    cfg = json.loads((tmp_path / "first" / "config.json").read_text())
    assert cfg["quantization_config"] == _qc(name)
    assert info.precision is not None and list(info.precision.groups) == ["group_0", "group_1"]
    ids = results["tokens.eval"]
    with torch.no_grad():
        assert_bits_equal(again(input_ids=ids).logits, model(input_ids=ids).logits, "logits after save and load")


@pytest.mark.parametrize("name", NAMES)
def test_unsupported_group_is_refused_naming_the_module(name, tmp_path):
    """The attention group edited (in a copy) to FP8 with 128x128 weight blocks (the ``FP8_BLOCK`` preset), which
    the emulation does not run: loading refuses naming the first attention module, its group and the field."""
    ckpt = _fixture(name)[0]
    path = tmp_path / "ckpt"
    shutil.copytree(ckpt, path)
    cfg = json.loads((path / "config.json").read_text())
    group = cfg["quantization_config"]["config_groups"]["group_0"]
    group["format"] = "float-quantized"
    group["weights"] = {**group["weights"], "num_bits": 8, "strategy": "block", "block_structure": [128, 128]}
    group["weights"].update(group_size=None, scale_dtype=None, zp_dtype=None)
    group["input_activations"] = {
        **group["input_activations"],
        **dict(num_bits=8, strategy="group", group_size=128, dynamic=True, scale_dtype=None, zp_dtype=None),
    }
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    with pytest.raises(
        C.CheckpointError,
        match=r"module 'model.layers.0.self_attn.q_proj' is in precision group 'group_0' .*config_groups.group_0"
        r".weights: .*strategy='block'",
    ):
        C.load_quantized_moe(path, backend="torch")
    report = C.inspect_checkpoint(path)
    assert any("group_0" in p or "self_attn.q_proj" in p for p in report.problems), report.problems
