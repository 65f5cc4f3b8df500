"""Interop: the MX and weight-only layouts against checkpoints made by their real producers.

The fixtures ``tests/fixtures/interop/<tool>_<scheme>/`` were made by ``tools/interop/make_fixtures.py``
(versions in each ``meta.json`` and in ``tools/interop/README.md``) from the tiny seeded Qwen3-MoE
that ``tests/test_interop.py`` uses, with attention left bf16:

- ``llmc_mxfp4`` / ``llmc_mxfp4a16``: llm-compressor 0.14.0.1 presets ``MXFP4`` / ``MXFP4A16``
  (compressed-tensors 0.19.0 ``mxfp4-pack-quantized``: mxlib's ``compressed-tensors-mxfp4``).
- ``llmc_mxfp8`` / ``llmc_mxfp8a16``: presets ``MXFP8`` / ``MXFP8A16`` (``mxfp8-quantized``: mxlib's
  ``compressed-tensors-mxfp8``).
- ``modelopt_w4a16_nvfp4``: nvidia-modelopt 0.47.0 ``W4A16_NVFP4_CFG`` (``quant_algo: W4A16_NVFP4``).
- ``modelopt_mxfp8``: ``MXFP8_DEFAULT_CFG`` (``quant_algo: MXFP8``: ``modelopt-mxfp8``).
- ``quark_w_mxfp4_a_mxfp8``: amd-quark 0.13 with MXFP4 weights and dynamic MXFP8 activations (Quark's
  ``OCP_MXFP4Spec`` / ``OCP_MXFP8E4M3Spec``, registered with ``LLMTemplate.register_scheme``: the
  template lists no such scheme). Quark 0.13 cannot export MXFP8 weights (its ``real_quantize_fp8_e4m3``
  takes only per-tensor and per-channel scales: "Unsupported QuantSchema: per_group for quant_dtype:
  fp8_e4m3"), so there is no Quark ``w_mxfp8_a_mxfp8`` fixture.

Each holds ``dequant.*`` (the tool's own dequantization), ``weight.*`` (the bf16 weights of layer 0
expert 0 the tool quantized), ``qdq.x`` / ``qdq.y`` (the tool's activation QDQ, where it quantizes
activations), ``logits.bf16`` and, where the tool's fake-quantized forward runs on the CPU,
``logits.tool`` (ModelOpt's needs CUDA: none for the ModelOpt fixtures).

Checked: the config reads as the expected layout and scheme; mxlib.reference's dequantization of the
checkpoint bytes and the loaded experts equal the tool's dequantization bit for bit; mxlib's writer
path (the layout's ``quantize_experts`` or the factory's, then ``expert_tensors``) turns the tool's
bf16 weights into the checkpoint's tensors byte for byte (scales and global scales included); mxlib's
activation QDQ with the scale rule the reader chose equals the tool's; mxlib's logits are within the
stated SQNR of the tool's (and closer to them than the tool is to bf16).

Stated differences, each tested:

- compressed-tensors MXFP8 scales: compressed-tensors rounds the block amax at e2m1's mantissa width
  for FP8 too, which is ``rceil`` except where the amax is ``448 * 2**k`` exactly: there it takes the
  scale twice as large. The writer reproduces the tool's rule (``quantize_ct_mxfp8``); the loaded
  experts QDQ activations with ``rceil`` (equal to the tool's QDQ on the fixed input).
- Quark writes a negative weight that rounds to zero as e2m1 code 0 (+0), mxlib as code 8 (-0): the
  writer comparison for Quark treats the two codes as equal and counts them.
"""

from __future__ import annotations

import json
import shutil
from functools import cache

import pytest
import torch
from safetensors.torch import load_file

from mxlib import reference as R
from mxlib.checkpoints import LAYOUTS, CheckpointError, load_quantized_qwen3_moe, read_quant_config
from mxlib.checkpoints.layouts.compressed_tensors_mxfp8 import ct_mxfp8_scale, quantize_ct_mxfp8
from mxlib.moe.factory import quantize_expert_weights
from mxlib.moe.schemes import MOE_SCHEMES

from _util import INTEROP, assert_same_bits, interop_fixture, stored_tensors

FIXTURES = INTEROP
PROJS = ("gate_proj", "up_proj", "down_proj")

# fixture -> (layout name, mxlib scheme, weight element, activation scale rule the reader gives)
EXPECTED = {
    "llmc_mxfp4": ("compressed-tensors-mxfp4", "w_mxfp4_a_mxfp4", "e2m1", "even"),
    "llmc_mxfp4a16": ("compressed-tensors-mxfp4", "w_mxfp4", "e2m1", None),
    "llmc_mxfp8": ("compressed-tensors-mxfp8", "w_mxfp8_a_mxfp8", "e4m3", "rceil"),
    "llmc_mxfp8a16": ("compressed-tensors-mxfp8", "w_mxfp8", "e4m3", None),
    "modelopt_w4a16_nvfp4": ("modelopt", "w4a16_nvfp4", "nvfp4", None),
    "modelopt_mxfp8": ("modelopt-mxfp8", "w_mxfp8_a_mxfp8", "e4m3", "rceil"),
    "quark_w_mxfp4_a_mxfp8": ("quark", "w_mxfp4_a_mxfp8", "e2m1", "even"),
}
ACTIVATION_ELEMENT = {"w_mxfp4_a_mxfp4": "e2m1", "w_mxfp8_a_mxfp8": "e4m3", "w_mxfp4_a_mxfp8": "e4m3"}

# fixture -> (the least SQNR vs the tool's fake-quantized logits or None, vs bf16 logits), in dB: a few dB
# under what was measured (LOGITS_SQNR_DB).
LOGITS_MIN_SQNR_DB = {
    "llmc_mxfp4": (36.0, 25.0),
    "llmc_mxfp4a16": (42.0, 28.0),
    "llmc_mxfp8": (40.0, 32.0),
    "llmc_mxfp8a16": (42.0, 32.0),
    "modelopt_w4a16_nvfp4": (None, 28.0),
    "modelopt_mxfp8": (None, 32.0),
    "quark_w_mxfp4_a_mxfp8": (38.0, 28.0),
}
# Measured on the CPU, torch experts backend: (mxlib vs the tool's logits, mxlib vs bf16, the tool's
# logits vs bf16); None: no tool logits (ModelOpt's fake quantization is CUDA only).
LOGITS_SQNR_DB = {
    "llmc_mxfp4": (39.9, 27.6, 27.6),
    "llmc_mxfp4a16": (45.7, 30.9, 31.0),
    "llmc_mxfp8": (43.9, 35.3, 35.3),
    "llmc_mxfp8a16": (46.1, 35.8, 35.8),
    "modelopt_w4a16_nvfp4": (None, 31.0, None),
    "modelopt_mxfp8": (None, 35.3, None),
    "quark_w_mxfp4_a_mxfp8": (41.6, 30.8, 30.8),
}

ALL = [n for n in EXPECTED if (FIXTURES / n / "meta.json").exists()]


_fixture = cache(interop_fixture)


@cache
def _checkpoint(name):
    return stored_tensors(FIXTURES / name / "checkpoint")


@cache
def _loaded(name):
    return load_quantized_qwen3_moe(FIXTURES / name / "checkpoint", backend="torch")


def _sqnr_db(x, ref):
    x, ref = x.double(), ref.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (x - ref).pow(2).sum()))


def _names(results, prefix):
    return sorted(k[len(prefix) :] for k in results if k.startswith(prefix))


def _weight_bytes(t):
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _mxlib_dequant(name, tensors, module, dtype):
    element = EXPECTED[name][2]
    if element == "nvfp4":
        w, s, s2 = (tensors[f"{module}.{k}"] for k in ("weight", "weight_scale", "weight_scale_2"))
        return R.dequantize_to_dtype(w, s, s2, dtype)
    packed = tensors.get(f"{module}.weight_packed", tensors.get(f"{module}.weight"))
    return R.dequantize_mx(_weight_bytes(packed), tensors[f"{module}.weight_scale"], element, 32, dtype)


# ----------------------------------------------------------------------------- config


def test_fixtures_present_and_small():
    missing = sorted(set(EXPECTED) - set(ALL))
    assert not missing, f"missing fixtures: {missing}"
    for name in ALL:
        for path in (FIXTURES / name).rglob("*"):
            if path.is_file():
                assert path.stat().st_size < 2_000_000, f"{path} is {path.stat().st_size} bytes (limit 2 MB)"
        meta, _ = _fixture(name)
        pkg = {"llmcompressor": "compressed-tensors", "nvidia-modelopt": "nvidia-modelopt", "amd-quark": "amd-quark"}
        assert meta["versions"]["torch"] and meta["versions"][pkg[meta["tool"]]], f"{name}: versions not recorded"


@pytest.mark.parametrize("name", ALL)
def test_config_reads_as_layout(name):
    layout, scheme, _, mode = EXPECTED[name]
    info = read_quant_config(FIXTURES / name / "checkpoint")
    assert (info.format, info.scheme.name, info.activation_scale_mode) == (layout, scheme, mode), name


# ----------------------------------------------------------------------------- weights


@pytest.mark.parametrize("name", ALL)
def test_dequant_reference_equals_tool(name):
    """mxlib.reference on the checkpoint's bytes == the tool's dequantization, bit for bit."""
    _, results = _fixture(name)
    tensors = _checkpoint(name)
    zsf = name == "modelopt_w4a16_nvfp4"
    seen = 0
    for prefix in ("dequant.", "dequant_fp32.", "dequant_import."):
        for module in _names(results, prefix):
            tool = results[prefix + module]
            assert_same_bits(_mxlib_dequant(name, tensors, module, tool.dtype), tool, f"{name} {prefix}{module}", zsf)
            seen += 1
    assert seen >= 9, f"{name}: {seen} dequantized weights recorded"


@pytest.mark.parametrize("name", ALL)
def test_loader_experts_equal_tool_dequant(name):
    """The loaded model's emulation experts hold exactly the tool's dequantized weights."""
    _, results = _fixture(name)
    model, _ = _loaded(name)
    for module in _names(results, "dequant."):
        parts = module.split(".")
        layer, expert, proj = int(parts[2]), int(parts[5]), parts[6]
        w13, w2 = model.model.layers[layer].mlp.experts.experts.dequantized_expert(expert)
        i = w2.shape[1]
        mine = {"gate_proj": w13[:i], "up_proj": w13[i:], "down_proj": w2}[proj]
        tool = results[f"dequant.{module}"]
        assert_same_bits(mine, tool.to(mine.dtype), f"{name} {module}", zero_sign_free=name == "modelopt_w4a16_nvfp4")


def _writer_tensors(name, results):
    """What mxlib's writer stores for layer 0 expert 0 from the tool's bf16 weights (the writer's path:
    the layout's own ``quantize_experts``, else the factory's, then ``expert_tensors``)."""
    layout = LAYOUTS[EXPECTED[name][0]]
    scheme = MOE_SCHEMES[EXPECTED[name][1]]
    base = "model.layers.0.mlp.experts.0"
    w = {p: results[f"weight.{base}.{p}"] for p in PROJS}
    w13 = torch.cat([w["gate_proj"], w["up_proj"]])[None]
    w2 = w["down_proj"][None]
    weights = layout.quantize_experts(w13, w2, scheme)
    if weights is None:
        weights = quantize_expert_weights(w13, w2, scheme)
    return layout.expert_tensors(scheme, weights, None, None, "model.layers.0.mlp.experts")


@pytest.mark.parametrize("name", ALL)
def test_writer_equals_tool_tensors(name):
    """From the same bf16 weights mxlib's writer stores the tool's tensors, byte for byte: codes, E8M0 or
    e4m3 block scales and (ModelOpt NVFP4) the gate/up-shared ``weight_scale_2``. Quark alone writes a
    negative value that rounds to zero as +0 (e2m1 code 0 where mxlib writes code 8)."""
    _, results = _fixture(name)
    tensors = _checkpoint(name)
    mine = _writer_tensors(name, results)
    assert mine, name
    for key, t in mine.items():
        tool = tensors[key]
        assert t.dtype == tool.dtype and t.shape == tool.shape, f"{name} {key}: {t.dtype} {list(t.shape)} vs {tool}"
        if t.dtype == torch.float32:  # ModelOpt's weight_scale_2, a scalar
            a, b = t.reshape(-1).view(torch.int32), tool.reshape(-1).view(torch.int32)
        else:
            a, b = _weight_bytes(t).reshape(-1), _weight_bytes(tool).reshape(-1)
        if name.startswith("quark_") and key.endswith(".weight"):
            ca, cb = R.unpack_codes(a[None], "e2m1")[0], R.unpack_codes(b[None], "e2m1")[0]
            neg_zero = (ca == 8) & (cb == 0)
            assert neg_zero.any(), f"{name} {key}: the -0 / +0 difference is expected here"
            ca = torch.where(neg_zero, 0, ca)
            assert torch.equal(ca, cb), f"{name} {key}: {int((ca != cb).sum())} codes differ beyond the sign of zero"
            continue
        assert torch.equal(a, b), f"{name} {key}: {int((a != b).sum())} of {a.numel()} bytes differ"


def test_ct_mxfp8_scale_rule_differs_from_rceil_only_at_448():
    """compressed-tensors' MXFP8 scale equals ``rceil`` except on blocks whose amax is ``448 * 2**k``
    exactly, where it is one binade larger: checked on the tool's own bytes."""
    _, results = _fixture("llmc_mxfp8")
    tensors = _checkpoint("llmc_mxfp8")
    differing = 0
    for p in PROJS:
        module = f"model.layers.0.mlp.experts.0.{p}"
        w = results[f"weight.{module}"]
        tool = tensors[f"{module}.weight_scale"]
        _, rceil = R.quantize_mx(w, "e4m3", 32, "rceil")
        amax = w.float().reshape(w.shape[0], -1, 32).abs().amax(-1)
        significand = amax / torch.exp2(torch.floor(torch.log2(amax)))
        at_1_75 = significand == 1.75
        assert torch.equal(tool != rceil, at_1_75), f"{module}: the scales differ off the 448 * 2**k blocks"
        assert torch.equal(tool[at_1_75].int(), rceil[at_1_75].int() + 1), module
        assert torch.equal(ct_mxfp8_scale(amax), tool), module
        differing += int(at_1_75.sum())
    assert differing > 0, "no 448 * 2**k block in the fixture: the difference is not exercised"


def test_ct_mxfp8_codes_need_no_saturation():
    """Under compressed-tensors' rule a block's largest element is at most 448 after scaling: the worst
    case, the largest bf16 significand under 1.75 (1.7421875), scales to 446 and rounds to 448; 1.75
    itself goes up a binade (scale 2**-7) and lands on 224."""
    x = torch.zeros(1, 32)
    x[0, 0] = 1.75 - 2.0**-7
    codes, scale = quantize_ct_mxfp8(x.to(torch.bfloat16))
    assert int(scale) == 127 - 8 and float(R.decode_element(codes[0, :1], "e4m3")[0]) == 448.0
    x[0, 0] = 1.75
    codes, scale = quantize_ct_mxfp8(x)
    assert int(scale) == 127 - 7 and float(R.decode_element(codes[0, :1], "e4m3")[0]) == 224.0


# ----------------------------------------------------------------------------- activations and logits


@pytest.mark.parametrize("name", [n for n in ALL if EXPECTED[n][3] is not None])
def test_activation_qdq_equals_tool(name):
    """mxlib.reference's MX QDQ with the rule the reader gives the loaded experts == the tool's QDQ,
    bit for bit (the sign of zero included)."""
    _, results = _fixture(name)
    x, y = results["qdq.x"], results["qdq.y"]
    element = ACTIVATION_ELEMENT[EXPECTED[name][1]]
    mine = R.quant_dequant_mx(x.to(y.dtype), element, 32, EXPECTED[name][3], dtype=y.dtype)
    assert_same_bits(mine, y, f"{name} qdq")


@pytest.mark.parametrize("name", [n for n in ALL if EXPECTED[n][3] is None])
def test_weight_only_has_no_activation_qdq(name):
    _, results = _fixture(name)
    assert "qdq.y" not in results
    model, info = _loaded(name)
    assert info.scheme.weight_only and info.scheme.activation is None


@pytest.mark.parametrize("name", ALL)
def test_logits_agree(name):
    """mxlib's emulated forward against the tool's fake-quantized forward (where recorded) and bf16."""
    _, results = _fixture(name)
    model, _ = _loaded(name)
    with torch.no_grad():
        logits = model(input_ids=results["tokens.eval"]).logits.float()
    min_tool, min_bf16 = LOGITS_MIN_SQNR_DB[name]
    vs_bf16 = _sqnr_db(logits, results["logits.bf16"])
    assert vs_bf16 >= min_bf16, f"{name}: SQNR vs bf16 logits {vs_bf16:.1f} dB < {min_bf16} dB"
    if min_tool is None:
        assert "logits.tool" not in results, f"{name}: the tool's logits are recorded: give them a minimum"
        return
    vs_tool = _sqnr_db(logits, results["logits.tool"])
    assert vs_tool >= min_tool, f"{name}: SQNR vs the tool's logits {vs_tool:.1f} dB < {min_tool} dB"
    tool_vs_bf16 = _sqnr_db(results["logits.tool"], results["logits.bf16"])
    assert vs_tool > tool_vs_bf16, f"{name}: {vs_tool:.1f} dB to the tool, tool to bf16 {tool_vs_bf16:.1f} dB"


def test_quark_mxfp4_mxfp8_fp32_matches_tool_logits():
    """Run in fp32 (as Quark's CPU forward is), mxlib's emulation gives Quark's logits up to fp32 summation
    order (bound 1e-5 relative, as tests/test_interop.py's Quark fp32 test)."""
    name = "quark_w_mxfp4_a_mxfp8"
    _, results = _fixture(name)
    model, _ = load_quantized_qwen3_moe(FIXTURES / name / "checkpoint", backend="torch", activation_dtype=torch.float32)
    for p in model.parameters():
        p.data = p.data.float()
    with torch.no_grad():
        logits = model(input_ids=results["tokens.eval"]).logits.float()
    ref = results["logits.tool"]
    rel = float((logits.double() - ref.double()).norm() / ref.double().norm())
    assert rel < 1e-5, f"{name} fp32 logits: relative error {rel:.3g} against Quark's"


# ----------------------------------------------------------------------------- producers reading mxlib's checkpoints

# tools/interop/mxlib_roundtrip.py: mxlib's writer made these (one layer, attention bf16); each tool's
# reader read them back (tool_read.safetensors, meta.json). ModelOpt has no reader of its HF exports.
# Quark's importer matches exclude entries as exact names or fnmatch globs, not ``re:`` patterns: mxlib's
# Quark layout names every bf16 module exactly, as Quark's own export does, and Quark reads the checkpoint
# as written (test_quark_reads_mxlib_checkpoint_as_written).
ROUNDTRIP = {
    "mxlib_compressed-tensors-mxfp4_w_mxfp4_a_mxfp4": ("compressed-tensors-mxfp4", "w_mxfp4_a_mxfp4", "e2m1"),
    "mxlib_compressed-tensors-mxfp8_w_mxfp8_a_mxfp8": ("compressed-tensors-mxfp8", "w_mxfp8_a_mxfp8", "e4m3"),
    "mxlib_quark_w_mxfp4_a_mxfp8": ("quark", "w_mxfp4_a_mxfp8", "e2m1"),
}
ROUNDTRIP_PRESENT = [n for n in ROUNDTRIP if (FIXTURES / n / "meta.json").exists()]


def _mxlib_written(name):
    tensors = {}
    for path in sorted((FIXTURES / name / "checkpoint").glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def test_roundtrip_fixtures_present():
    assert sorted(ROUNDTRIP_PRESENT) == sorted(ROUNDTRIP), "run tools/interop/mxlib_roundtrip.py (write, then read)"


@pytest.mark.parametrize("name", ROUNDTRIP_PRESENT)
def test_tool_reads_mxlib_checkpoint(name):
    """The tool's own reader dequantizes mxlib's checkpoint to exactly what mxlib.reference does; mxlib reads
    it as the layout and scheme it was written in."""
    layout, scheme, element = ROUNDTRIP[name]
    info = read_quant_config(FIXTURES / name / "checkpoint")
    assert (info.format, info.scheme.name) == (layout, scheme)
    meta = json.loads((FIXTURES / name / "meta.json").read_text())
    assert (meta["layout"], meta["scheme"]) == (layout, scheme)
    tool = load_file(str(FIXTURES / name / "tool_read.safetensors"))
    tensors = _mxlib_written(name)
    assert len(tool) == 6, sorted(tool)
    for key, t in tool.items():
        module = key[len("dequant.") :]
        packed = tensors.get(f"{module}.weight_packed", tensors.get(f"{module}.weight"))
        mine = R.dequantize_mx(_weight_bytes(packed), tensors[f"{module}.weight_scale"], element, 32, t.dtype)
        assert_same_bits(mine, t, f"{name} {module}")


@pytest.mark.parametrize("name", ROUNDTRIP_PRESENT)
def test_roundtrip_checkpoint_is_the_writers(name):
    """The committed mxlib checkpoint is what the writer makes today from the recorded bf16 weights."""
    layout, scheme, _ = ROUNDTRIP[name]
    weights = load_file(str(FIXTURES / name / "weights.safetensors"))
    lay, sch = LAYOUTS[layout], MOE_SCHEMES[scheme]
    base = "model.layers.0.mlp.experts.0"
    w13 = torch.cat([weights[f"weight.{base}.gate_proj"], weights[f"weight.{base}.up_proj"]])[None]
    w2 = weights[f"weight.{base}.down_proj"][None]
    ew = lay.quantize_experts(w13, w2, sch) or quantize_expert_weights(w13, w2, sch)
    tensors = _mxlib_written(name)
    mine = lay.expert_tensors(sch, ew, None, None, "model.layers.0.mlp.experts")
    assert mine
    for key, t in mine.items():
        assert torch.equal(_weight_bytes(t), _weight_bytes(tensors[key])), f"{name} {key}"


def test_quark_reads_mxlib_checkpoint_as_written():
    """Quark 0.13's importer reads mxlib's Quark checkpoint unchanged and rebuilds exactly the experts as
    quantized modules (``quantized_modules``), the exclude list's bf16 modules left plain; the list holds
    exact module names only, those of Quark's own export of the same model (layer 0 and lm_head of
    ``quark_w_mxfp4_a_mxfp8``, a two-layer export)."""
    name = "mxlib_quark_w_mxfp4_a_mxfp8"
    meta = json.loads((FIXTURES / name / "meta.json").read_text())
    exclude = json.loads((FIXTURES / name / "checkpoint" / "config.json").read_text())["quantization_config"]["exclude"]
    assert meta["exclude_as_read"] == exclude
    experts = [f"model.layers.0.mlp.experts.{e}.{p}" for e in range(8) for p in ("gate_proj", "up_proj", "down_proj")]
    assert meta["quantized_modules"] == sorted(experts)
    quark = json.loads((FIXTURES / "quark_w_mxfp4_a_mxfp8" / "checkpoint" / "config.json").read_text())
    quark_exclude = [n for n in quark["quantization_config"]["exclude"] if not n.startswith("model.layers.1.")]
    assert exclude == quark_exclude
    for n in ROUNDTRIP_PRESENT:
        assert "error_as_written" not in json.loads((FIXTURES / n / "meta.json").read_text()), n


@pytest.mark.parametrize("name, attention", [("quark_w_mxfp4_a_mxfp4", False), ("quark_w_mxfp4_a_mxfp4_attn", True)])
def test_quark_exclude_is_quarks_export(tmp_path, name, attention):
    """mxlib's writer, on a model of the config Quark exported, writes Quark's own ``exclude`` list (the
    same names in the same order), with attention bf16 or quantized."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from mxlib.checkpoints import write_quantized_checkpoint

    cfg = json.loads((FIXTURES / name / "checkpoint" / "config.json").read_text())
    quark_exclude = cfg.pop("quantization_config")["exclude"]
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "cfg")).to(torch.bfloat16)
    path = write_quantized_checkpoint(
        model, "w_mxfp4_a_mxfp4", tmp_path / "ckpt", layout="quark", quantize_attention=attention
    )
    written = json.loads((path / "config.json").read_text())["quantization_config"]["exclude"]
    assert written == quark_exclude
    assert read_quant_config(path).exclude == quark_exclude


def test_modelopt_w4a16_blocks_of_32_refused(tmp_path):
    """ModelOpt's ``NVFP4_MLP_WEIGHT_ONLY_CFG`` exports ``W4A16_NVFP4`` in blocks of 32 (``group_size: 32``):
    not NVFP4's 16, refused naming the field (the real export's config, group_size edited)."""
    folder = shutil.copytree(FIXTURES / "modelopt_w4a16_nvfp4" / "checkpoint", tmp_path / "ckpt")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 32
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"group_0\.weights\.group_size: NVFP4 uses 16, found 32"):
        read_quant_config(folder)
