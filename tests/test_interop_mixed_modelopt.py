"""Interop: ModelOpt ``MIXED_PRECISION`` checkpoints made by nvidia-modelopt itself, read by mxlib.

The fixtures ``tests/fixtures/interop/modelopt_mixed_*/`` were made by ``tools/interop/make_fixtures.py`` with
nvidia-modelopt 0.47.0 (``mtq.quantize`` then ``export_hf_checkpoint``; versions and the ``quant_cfg`` in each
``meta.json``) from the tiny seeded Qwen3-MoE of ``tools/interop/_common.py``:

- ``modelopt_mixed_fp8_nvfp4``: routed experts NVFP4, ``self_attn`` q/k/v/o_proj FP8 per tensor, ``lm_head``
  NVFP4 (the quantizer attributes of ``NVFP4_DEFAULT_CFG`` and ``FP8_DEFAULT_CFG``);
- ``modelopt_mixed_mxfp8_nvfp4``: routed experts NVFP4, attention MXFP8 (``MXFP8_DEFAULT_CFG``), ``lm_head`` bf16.

What the tool wrote (the oracle for the on-disk form): ``hf_quant_config.json`` ``quantization.quant_algo:
"MIXED_PRECISION"`` with ``quantized_layers`` and no ``exclude_modules``; ``config.json``'s
``quantization_config`` with one ``config_groups`` entry per distinct layer config (the layer names as
``targets``) and the same ``quantized_layers``. The routed experts are named once per layer as the fused experts
module (``model.layers.L.mlp.experts: {"quant_algo": "NVFP4", "group_size": 16}``) while their tensors are
stored per expert beneath it (``model.layers.L.mlp.experts.E.gate_proj.weight``); MXFP8 entries carry
``group_size: 32``; the modules are listed in the model's order (attention before experts). FP8 layers store
``weight F8_E4M3 [out, in]``, ``weight_scale F32 []`` (per layer) and ``input_scale F32 []`` (shared by q/k/v).

Checked: the precision groups mxlib reads equal those of the tool's ``quant_cfg``; each module's weight
dequantizes to the tool's own dequantization bit for bit; the activation QDQ of each group equals the tool's;
the inspector's groups and byte shares equal those counted here from the safetensors headers; ``what_ran`` /
``assert_runs_as`` pass and refuse a planted mismatch; ``save_pretrained`` writes the tool's tensors back bit for
bit with the same quantization config; a module whose entry names an unsupported ``quant_algo`` is refused by
name.

Stated differences, each tested:

- ModelOpt's ``FP8QTensor.dequantize(dtype=bfloat16)`` multiplies in bf16 (``bf16(e4m3) * bf16(weight_scale)``:
  the scale rounded to bf16 first); mxlib (as vLLM, which applies the fp32 scale) forms ``fp32(e4m3) * fp32
  (weight_scale)`` and rounds once. The tool's fp32 dequantization is bit-equal to mxlib's; in bf16 they differ.
- ModelOpt's exported FP8 codes are ``(weight / weight_scale).to(float8_e4m3fn)`` with a bf16 weight and a
  0-d fp32 scale: torch forms the quotient in fp32 and rounds it to bf16, then to e4m3
  (``modelopt/torch/export/quant_utils.py``, ``to_quantized_weight``). mxlib's ModelOpt FP8 writer does the same
  (byte-equal); an fp32 quotient rounded once gives other codes for some values. ``FP8QTensor.quantize`` of a bf16
  activation rounds the same way, and its ``dequantize`` multiplies in bf16; ModelOpt's fake quantization
  (``tensor_quant.fp8_eager``, what its calibrated quantizers run) works in fp32 and is bit-equal to mxlib's FP8
  QDQ (vLLM's ``scaled_fp8_quant`` arithmetic).
- No tool logits: ModelOpt's NVFP4 and MXFP8 fake quantization is CUDA-only (``tensor_quant.py``,
  ``_dynamic_block_quantize_impl``: "amax must be a CUDA tensor for dynamic block quantization"; MX scales go to
  the ``modelopt_cuda_ext_mx`` extension). mxlib's logits are checked against the bf16 logits with an SQNR bound.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
import struct
from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mxlib import checkpoints as C
from mxlib import reference as R
from mxlib.checkpoints.layouts import LAYOUTS
from mxlib.checkpoints.saving import _scheme_of
from mxlib.models.what_ran import RanMismatch, assert_runs_as
from mxlib.moe.emulation import QuantizedExperts
from mxlib.moe.factory import quantize_expert_weights
from mxlib.moe.linear import EmulatedLinear
from mxlib.moe.schemes import get_moe_scheme

from _util import INTEROP, assert_bits_equal, assert_same_bits, interop_fixture, stored_tensors, tiny_calibrated

FIXTURES = INTEROP
NAMES = ["modelopt_mixed_fp8_nvfp4", "modelopt_mixed_mxfp8_nvfp4"]
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
LAYERS, EXPERTS = 2, 8

# the group name mxlib gives each of the tool's quantizer configs (quant_algo, with group_size where written)
# and the scheme it reads it as
GROUP_SCHEME = {"NVFP4 g16": "nvfp4", "FP8": "w_fp8_a_fp8", "MXFP8 g32": "w_mxfp8_a_mxfp8"}
# least SQNR of mxlib's logits vs the bf16 logits, dB: a couple of dB under what was measured (16.1 and 22.3 dB on
# the CPU, torch experts backend; the tool's experts-only export modelopt_nvfp4_experts: 28.8 dB). The NVFP4
# lm_head costs most: the bf16 logits are the quantity it quantizes last.
MIN_SQNR_DB = {"modelopt_mixed_fp8_nvfp4": 14.0, "modelopt_mixed_mxfp8_nvfp4": 20.0}
EXPERTS_ONLY = "modelopt_nvfp4_experts"  # the tool's NVFP4_EXPERTS_ONLY_CFG export of the same model


_fixture = cache(interop_fixture)


@cache
def _checkpoint(name):
    return stored_tensors(FIXTURES / name / "checkpoint")


@cache
def _loaded(name):
    return C.load_quantized_moe(FIXTURES / name / "checkpoint", backend="torch")


def _group_of_quantizer(cfg: dict) -> str:
    """The ModelOpt ``quant_algo`` (with ``group_size``) a quantizer config of the tool's ``quant_cfg`` exports."""
    bits, blocks = tuple(cfg["num_bits"]), cfg.get("block_sizes")
    if bits == (2, 1) and blocks and blocks.get("-1") == 16 and tuple(blocks["scale_bits"]) == (4, 3):
        return "NVFP4 g16"
    if bits == (4, 3) and blocks and blocks.get("-1") == 32 and tuple(blocks["scale_bits"]) == (8, 0):
        return "MXFP8 g32"
    if bits == (4, 3) and not blocks and cfg.get("axis") is None:
        return "FP8"
    raise AssertionError(f"no ModelOpt quant_algo known here for {cfg}")


def _planned_group(meta: dict, module: str) -> str | None:
    """The group of a module with a 2-D weight under the tool's own ``quant_cfg`` (``meta.json``): the last entry
    whose ``quantizer_name`` pattern matches ``<module>.weight_quantizer`` decides, as ``mtq.quantize`` applies
    them in order. The routers (transformers 5's ``TopKRouter``) and the embedding are matched by ``*`` only."""
    decided = None
    for entry in meta["quant_cfg"]["quant_cfg"]:
        if fnmatch.fnmatch(f"{module}.weight_quantizer", entry["quantizer_name"]):
            decided = None if entry.get("enable") is False else _group_of_quantizer(entry["cfg"])
    return decided


def _headers(path: Path) -> dict[str, dict]:
    """A safetensors file's header read here (8-byte little-endian length, then JSON): name -> entry."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def _two_d(header: dict, module: str) -> bool:
    """Whether ``module`` stores a 2-D ``weight`` (a linear layer, the embedding or a router; not a norm)."""
    entry = header.get(f"{module}.weight")
    return entry is not None and len(entry["shape"]) == 2


def _two_d_modules(name: str) -> list[str]:
    """The modules of the checkpoint storing a 2-D ``weight``."""
    header = _headers(FIXTURES / name / "checkpoint" / "model.safetensors")
    return sorted(k[: -len(".weight")] for k in header if k.endswith(".weight") and _two_d(header, k[:-7]))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _sqnr_db(x, ref):
    x, ref = x.double(), ref.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (x - ref).pow(2).sum()))


# ----------------------------------------------------------------------------- the tool's form


@pytest.mark.parametrize("name", NAMES)
def test_fixture_is_the_tools_mixed_export(name):
    """The fixture holds what nvidia-modelopt wrote (module docstring): both config files ``MIXED_PRECISION`` with
    the same ``quantized_layers``, no exclude list, the experts named by their module, per-expert tensors."""
    meta, _ = _fixture(name)
    assert meta["tool"] == "nvidia-modelopt" and meta["versions"]["nvidia-modelopt"] == "0.47.0"
    folder = FIXTURES / name / "checkpoint"
    legacy = json.loads((folder / "hf_quant_config.json").read_text())
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    q = legacy["quantization"]
    assert q["quant_algo"] == qc["quant_algo"] == "MIXED_PRECISION" and "exclude_modules" not in q
    assert qc["quant_method"] == "modelopt" and qc["ignore"] == []
    assert q["quantized_layers"] == qc["quantized_layers"]
    # the fused experts module is named, the per-expert projections are not
    layers = q["quantized_layers"]
    assert layers[f"model.layers.{LAYERS - 1}.mlp.experts"] == {"quant_algo": "NVFP4", "group_size": 16}
    assert not any(".experts." in k for k in layers)
    assert _checkpoint(name)["model.layers.0.mlp.experts.7.down_proj.weight"].dtype == torch.uint8
    # every config group's targets are the quantized_layers names of one layer config
    targets = sorted(t for g in qc["config_groups"].values() for t in g["targets"])
    assert targets == sorted(layers)


@pytest.mark.parametrize("name", NAMES)
def test_precision_groups_are_the_tools_config(name):
    """Every module storing a weight is in the group the tool's ``quant_cfg`` gives it (None: bf16), each group
    read as its scheme; the experts' group describes the checkpoint."""
    meta, _ = _fixture(name)
    info = C.read_quant_config(FIXTURES / name / "checkpoint")
    pm = info.precision
    assert pm is not None and pm.producer == "modelopt" and info.scheme.name == "nvfp4"
    seen = set()
    for module in _two_d_modules(name):
        want = _planned_group(meta, module)
        assert pm.group_of(module) == want, module
        if want is not None:
            assert pm.description(module).scheme.name == GROUP_SCHEME[want], module
            seen.add(want)
    attn = "FP8" if name == "modelopt_mixed_fp8_nvfp4" else "MXFP8 g32"
    assert seen == {"NVFP4 g16", attn} and sorted(pm.groups) == sorted(seen)
    assert (pm.group_of("lm_head") is not None) == (name == "modelopt_mixed_fp8_nvfp4")


@pytest.mark.parametrize("name", NAMES)
def test_loaded_modules_run_their_groups_scheme(name):
    """The loaded model: NVFP4 emulation experts in every layer, each attention projection and ``lm_head`` an
    ``EmulatedLinear`` in its group's scheme where the tool quantized it, ``lm_head`` bf16 where it did not."""
    meta, _ = _fixture(name)
    model, _ = _loaded(name)
    modules = dict(model.named_modules())
    for layer in range(LAYERS):
        experts = modules[f"model.layers.{layer}.mlp.experts"].experts
        assert isinstance(experts, QuantizedExperts) and _scheme_of(experts).name == "nvfp4"
        for p in ATTN:
            n = f"model.layers.{layer}.self_attn.{p}"
            assert isinstance(modules[n], EmulatedLinear), n
            assert modules[n].scheme.name == GROUP_SCHEME[_planned_group(meta, n)], n
    head = _planned_group(meta, "lm_head")
    assert isinstance(model.lm_head, EmulatedLinear) == (head is not None)
    if head is not None:
        assert model.lm_head.scheme.name == GROUP_SCHEME[head]


# ----------------------------------------------------------------------------- weights


def _mine(name, module, dtype=torch.bfloat16):
    """The loaded model's dequantized weight of a module in the activation dtype (bf16): an ``EmulatedLinear``'s
    ``dequantized_weight``, an expert projection's rows of ``dequantized_expert``. ``dtype`` fp32: mxlib.reference's
    dequantization of the bytes the loaded layer holds (FP8: ``dequantize_fp8_weight``)."""
    model, _ = _loaded(name)
    modules = dict(model.named_modules())
    if isinstance(modules.get(module), EmulatedLinear):
        lin = modules[module]
        if dtype == lin.activation_dtype:
            return lin.dequantized_weight()
        assert lin.scheme.name == "w_fp8_a_fp8", f"{module}: {dtype} is read here for FP8 layers only"
        return R.dequantize_fp8_weight(lin.weight, lin.weight_scale, dtype)
    assert dtype == torch.bfloat16, f"{module}: the experts dequantize to the activation dtype"
    parts = module.split(".")
    layer, expert, proj = int(parts[2]), int(parts[5]), parts[6]
    w13, w2 = model.model.layers[layer].mlp.experts.experts.dequantized_expert(expert)
    i = w2.shape[1]
    return {"gate_proj": w13[:i], "up_proj": w13[i:], "down_proj": w2}[proj]


def _reference_fp32(ckpt, module):
    """mxlib.reference's fp32 dequantization of a module's stored bytes, by its tensors (NVFP4, MXFP8 or FP8)."""
    w, s = ckpt[f"{module}.weight"], ckpt[f"{module}.weight_scale"]
    if f"{module}.weight_scale_2" in ckpt:
        return R.dequantize_to_dtype(w, s, ckpt[f"{module}.weight_scale_2"], torch.float32)
    if s.dtype == torch.uint8:
        return R.dequantize_mx(w.view(torch.uint8), s, "e4m3", 32, torch.float32)
    return R.dequantize_fp8_weight(w, s, torch.float32)


@pytest.mark.parametrize("name", NAMES)
def test_dequantized_weights_equal_the_tools(name):
    """Each recorded module of each group (experts 0, 5 of layer 0 and 3 of layer 1; q/k/v/o_proj of layer 0;
    ``lm_head`` where quantized): the loaded model's weight equals ModelOpt's own dequantization bit for bit
    (NVFP4: ``NVFP4QTensor.dequantize``, which decodes e2m1 code 8 as +0 where mxlib gives -0; MXFP8:
    ``MXFP8QTensor.dequantize``; FP8: ``FP8QTensor.dequantize`` in fp32, see the module docstring for bf16)."""
    meta, results = _fixture(name)
    ckpt = _checkpoint(name)
    names = meta["dequant"]["names"]
    assert any(".experts." in n for n in names) and any("self_attn" in n for n in names)
    for module in names:
        tool = results[f"dequant.{module}"]
        fp8 = (
            ckpt[f"{module}.weight"].dtype == torch.float8_e4m3fn
            and ckpt[f"{module}.weight_scale"].dtype == torch.float32
        )
        if fp8:
            tool32 = results[f"dequant_fp32.{module}"]
            assert_same_bits(_mine(name, module, torch.float32), tool32, f"{name} {module} fp32")
            # mxlib's bf16 weight is the tool's fp32 one rounded once
            assert_same_bits(_mine(name, module, torch.bfloat16), tool32.to(torch.bfloat16), f"{name} {module}")
            # the tool's bf16 one: bf16(e4m3) * bf16(scale), in bf16
            w, s = ckpt[f"{module}.weight"], ckpt[f"{module}.weight_scale"]
            assert_same_bits(w.to(torch.bfloat16) * s.to(torch.bfloat16), tool, f"{name} {module} (tool bf16)")
            continue
        assert_same_bits(_mine(name, module, torch.bfloat16), tool, f"{name} {module}", zero_sign_free=True)
    # the tool's fp32 dequantizations (layer 0 expert 0, the attention projections) against mxlib.reference's
    fp32 = [k[len("dequant_fp32.") :] for k in results if k.startswith("dequant_fp32.")]
    assert any(".experts." in n for n in fp32) and any("self_attn" in n for n in fp32)
    for module in fp32:
        tool = results[f"dequant_fp32.{module}"]
        assert_same_bits(_reference_fp32(ckpt, module), tool, f"{name} {module} fp32", zero_sign_free=True)


def test_fp8_bf16_dequantization_differs_only_by_the_bf16_scale():
    """The tool's bf16 FP8 dequantization differs from mxlib's in some values of some layers (the scale rounded to
    bf16 first); never more than one bf16 ulp."""
    name = "modelopt_mixed_fp8_nvfp4"
    _, results = _fixture(name)
    differ = 0
    for p in ATTN:
        module = f"model.layers.0.self_attn.{p}"
        mine, tool = _mine(name, module, torch.bfloat16), results[f"dequant.{module}"]
        bad = mine.view(torch.int16) != tool.view(torch.int16)
        differ += int(bad.sum())
        ulps = (mine.view(torch.int16).int() - tool.view(torch.int16).int()).abs()
        assert int(ulps.max()) <= 1, module
    assert differ > 0, "no difference: the bf16 rounding of the scale is not exercised"


def test_writer_equals_the_tools_tensors():
    """From the bf16 weights the tool quantized (``weight.*``: layer 0 expert 0, layer 0 q_proj) mxlib's writer
    path stores the tool's tensors byte for byte: NVFP4 codes, e4m3 block scales and the gate/up-shared
    ``weight_scale_2``; FP8 codes and the per-layer ``weight_scale`` (``amax / 448``). ModelOpt rounds the FP8
    quotient ``w / weight_scale`` to bf16 before e4m3 (``quantize_fp8_weight``'s ``quotient_dtype``): an fp32
    quotient gives other codes for some values."""
    name = "modelopt_mixed_fp8_nvfp4"
    _, results = _fixture(name)
    ckpt = _checkpoint(name)
    layout, scheme = LAYOUTS["modelopt"], get_moe_scheme("nvfp4")
    base = "model.layers.0.mlp.experts.0"
    w = {p: results[f"weight.{base}.{p}"] for p in ("gate_proj", "up_proj", "down_proj")}
    w13, w2 = torch.cat([w["gate_proj"], w["up_proj"]])[None], w["down_proj"][None]
    weights = layout.quantize_experts(w13, w2, scheme) or quantize_expert_weights(w13, w2, scheme)
    ins = [ckpt[f"{base}.{p}.input_scale"].reshape(1) for p in ("gate_proj", "down_proj")]  # calibrated, as stored
    mine = layout.expert_tensors(scheme, weights, *ins, "model.layers.0.mlp.experts")
    module = "model.layers.0.self_attn.q_proj"
    fp8, fp8_scheme = LAYOUTS["modelopt-fp8"], get_moe_scheme("w_fp8_a_fp8")
    lw = fp8.quantize_linear(results[f"weight.{module}"], fp8_scheme)
    mine.update(fp8.linear_tensors(fp8_scheme, lw, ckpt[f"{module}.input_scale"], module))
    assert {f"{base}.gate_proj.weight", f"{module}.weight", f"{module}.weight_scale"} <= set(mine)
    for key, t in mine.items():
        tool = ckpt[key]
        assert t.dtype == tool.dtype and t.shape == tool.shape, f"{key}: {t.dtype} {list(t.shape)} vs {tool.dtype}"
        assert_bits_equal(t, tool, key)
    fp32_codes, scale = R.quantize_fp8_weight(results[f"weight.{module}"])
    assert float(scale) == float(ckpt[f"{module}.weight_scale"])
    assert int((fp32_codes != ckpt[f"{module}.weight"].view(torch.uint8)).sum()) > 0


# ----------------------------------------------------------------------------- activations


@pytest.mark.parametrize("name", NAMES)
def test_activation_qdq_equals_the_tools(name):
    """Each group's activation QDQ on the fixed input against the tool's: NVFP4 experts (and ``lm_head``) with
    the checkpoint's ``input_scale`` (``NVFP4QTensor.quantize`` then ``dequantize``: mxlib's ModelOpt-export rule
    ``quantize_nvfp4`` then ``dequantize_to_dtype``), MXFP8 attention (``MXFP8QTensor``: the loaded layer's own
    QDQ, E8M0 ``rceil``), FP8 attention (the tool's calibrated ``input_quantizer``: the loaded layer's own QDQ).
    Bit for bit except the sign of zero (the tools give +0 for a negative value that rounds to zero)."""
    _, results = _fixture(name)
    model, _ = _loaded(name)
    x = results["qdq.x"]
    for key in ("qdq", "qdq_lm_head"):
        if f"{key}.y" not in results:
            continue
        packed, block_scale, g = R.quantize_nvfp4(x, weight_scale_2=results[f"{key}.scale_2"].float())
        mine = R.dequantize_to_dtype(packed, block_scale, g, torch.bfloat16)
        assert_same_bits(mine, results[f"{key}.y"], f"{name} {key}", zero_sign_free=True)
    q = model.model.layers[0].self_attn.q_proj
    if "qdq_attn.y_fake" in results:  # FP8: the checkpoint's input_scale, as the tool calibrated it
        assert float(q.input_qdq_scale) == float(results["qdq_attn.scale"])
        tool = results["qdq_attn.y_fake"]
    else:
        tool = results["qdq_attn.y"]
    mine = q.quantize_input(x)
    assert_same_bits(mine, tool, f"{name} attention qdq", zero_sign_free=True)


def test_fp8_tensor_qdq_rounds_through_bf16():
    """``FP8QTensor.quantize`` of the bf16 input rounds the fp32 quotient to bf16 before e4m3 (as the weight export
    does) and ``dequantize`` multiplies in bf16: ``bf16(e4m3(bf16(x / s))) * bf16(s)``, formed here from fp32
    operations; it differs from the tool's fake quantization (which mxlib equals)."""
    _, results = _fixture("modelopt_mixed_fp8_nvfp4")
    x, s = results["qdq.x"], results["qdq_attn.scale"]
    q = (x.float() / s.float()).to(torch.bfloat16).to(torch.float8_e4m3fn)
    here = (q.float() * s.to(torch.bfloat16).float()).to(torch.bfloat16)
    assert_same_bits(here, results["qdq_attn.y"], "FP8QTensor qdq")
    assert not torch.equal(results["qdq_attn.y"], results["qdq_attn.y_fake"])


# ----------------------------------------------------------------------------- logits


@pytest.mark.parametrize("name", NAMES)
def test_logits(name):
    """No tool logits (its NVFP4 / MXFP8 fake quantization is CUDA-only, as ``meta.json``'s note says); mxlib's
    logits are finite and within ``MIN_SQNR_DB`` of the bf16 logits."""
    meta, results = _fixture(name)
    assert "logits.tool" not in results and any("CUDA" in n for n in meta["notes"]), meta["notes"]
    model, _ = _loaded(name)
    out = _logits(model, results["tokens.eval"])
    assert torch.isfinite(out).all()
    sqnr = _sqnr_db(out, results["logits.bf16"])
    assert sqnr >= MIN_SQNR_DB[name], f"{name}: SQNR vs bf16 {sqnr:.1f} dB < {MIN_SQNR_DB[name]} dB"


@pytest.mark.parametrize("name", NAMES)
def test_logits_equal_the_per_module_reference(name):
    """The tool's experts-only export of the same model (``modelopt_nvfp4_experts``: the same calibration, its
    expert tensors these fixtures' bit for bit) loaded alone, its attention projections and ``lm_head`` replaced by
    the mixed model's modules: the mixed model's logits, bit for bit. Each group runs as its own single-scheme
    checkpoint does."""
    ckpt, ref_ckpt = _checkpoint(name), load_file(str(FIXTURES / EXPERTS_ONLY / "checkpoint" / "model.safetensors"))
    experts = [k for k in ref_ckpt if ".mlp.experts." in k]
    assert len(experts) == LAYERS * EXPERTS * 3 * 4
    for k in experts:
        assert_bits_equal(ckpt[k], ref_ckpt[k], k)
    model, _ = _loaded(name)
    ref, _ = C.load_quantized_moe(FIXTURES / EXPERTS_ONLY / "checkpoint", backend="torch")
    for layer in range(LAYERS):
        for p in ATTN:
            setattr(ref.model.layers[layer].self_attn, p, getattr(model.model.layers[layer].self_attn, p))
    ref.lm_head = model.lm_head
    ids = _fixture(name)[1]["tokens.eval"]
    assert_bits_equal(_logits(model, ids), _logits(ref, ids), f"{name} vs the per-module reference")


# ----------------------------------------------------------------------------- inspector


@pytest.mark.parametrize("name", NAMES)
def test_inspect_lists_groups_and_byte_shares(name):
    """``inspect_checkpoint``'s precision groups: modules and bytes per group counted here from the safetensors
    header (the data offsets), each module in the group of the tool's ``quant_cfg``; shares of all tensor bytes."""
    meta, _ = _fixture(name)
    folder = FIXTURES / name / "checkpoint"
    header = _headers(folder / "model.safetensors")
    want: dict[str, list[int]] = {}
    for tensor, entry in header.items():
        module = tensor.rsplit(".", 1)[0]
        begin, end = entry["data_offsets"]
        group = _planned_group(meta, module) if _two_d(header, module) else None
        if group is None and entry["dtype"] in ("U8", "F8_E4M3"):
            raise AssertionError(f"{tensor}: a quantized tensor outside the tool's plan")
        row = want.setdefault(group or "unquantized", [0, 0])
        row[1] += end - begin
    for module in {t.rsplit(".", 1)[0] for t in header}:
        g = _planned_group(meta, module) if _two_d(header, module) else None
        if g is not None:
            want[g][0] += 1
    total = sum(b for _, b in want.values())
    report = C.inspect_checkpoint(folder)
    assert report.layout_ok, report.problems
    got = {r["group"]: (r["modules"], r["bytes"]) for r in report.precision_groups}
    assert got == {g: tuple(v) for g, v in want.items()}
    for r in report.precision_groups:
        assert r["share"] == want[r["group"]][1] / total, r["group"]
        assert r["scheme"] == GROUP_SCHEME.get(r["group"])
    assert report.scheme == "nvfp4" and not any("no static activation scale" in n for n in report.notes)
    text = report.table()
    for r in report.precision_groups:
        assert r["group"] in text and f"{100 * r['share']:.2f}%" in text


# ----------------------------------------------------------------------------- what ran


@pytest.mark.parametrize("name", NAMES)
def test_what_ran(name):
    """``assert_runs_as`` passes on the loaded model (each module in its group's scheme, one QDQ per activation
    point) and names the attention when asked for the experts' scheme alone."""
    meta, results = _fixture(name)
    model, info = _loaded(name)
    report = assert_runs_as(model, info, results["tokens.eval"][:1, :4])
    ran = {r.module: r for r in report}
    for module, row in ran.items():
        probe = f"{module}.0.gate_proj" if module.endswith(".experts") else module
        assert row.scheme == GROUP_SCHEME[_planned_group(meta, probe)], module
        assert row.a1_passes == 1 and row.a2_passes in (None, 1), module
    assert len(ran) == LAYERS * (1 + len(ATTN)) + (1 if "lm_head" in ran else 0)
    # asked as one scheme (the experts'), the attention is named as a mismatch
    attn = ran["model.layers.0.self_attn.q_proj"].scheme
    with pytest.raises(RanMismatch, match=rf"self_attn.q_proj: ran {attn} \(W8A8\), the checkpoint asks nvfp4"):
        assert_runs_as(model, "nvfp4", report=report)


# ----------------------------------------------------------------------------- saving


@pytest.mark.parametrize("name", NAMES)
def test_save_round_trips_byte_for_byte(name, tmp_path):
    """save -> the tool's tensors (names, dtypes, shapes, bits) and the same quantization config, ModelOpt's
    ``hf_quant_config.json`` included; loaded again, the same logits; saved again, identical files."""
    folder = FIXTURES / name / "checkpoint"
    model, _ = _loaded(name)
    model.save_pretrained(tmp_path / "first")
    src, saved = _checkpoint(name), stored_tensors(tmp_path / "first")
    assert sorted(saved) == sorted(src)
    for k in src:
        assert saved[k].dtype == src[k].dtype and saved[k].shape == src[k].shape, k
        assert_bits_equal(saved[k], src[k], k)
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert json.loads((tmp_path / "first" / "config.json").read_text())["quantization_config"] == qc
    legacy = json.loads((folder / "hf_quant_config.json").read_text())
    assert json.loads((tmp_path / "first" / "hf_quant_config.json").read_text()) == legacy
    again, _ = C.load_quantized_moe(tmp_path / "first", backend="torch")
    ids = _fixture(name)[1]["tokens.eval"]
    assert_bits_equal(_logits(again, ids), _logits(model, ids), "logits after save and load")
    again.save_pretrained(tmp_path / "second")
    for p in sorted((tmp_path / "first").iterdir()):
        assert p.read_bytes() == (tmp_path / "second" / p.name).read_bytes(), p.name


# ----------------------------------------------------------------------------- writing the tool's form


@pytest.fixture(scope="module")
def tiny():
    """mxlib's tiny Qwen3-MoE (2 layers: the fixtures' module names), calibrated, with its linear input amax."""
    from mxlib.moe.linear import linear_input_amax

    model, cal, ids = tiny_calibrated(5, layers=LAYERS)
    names = [f"model.layers.{layer}.self_attn.{p}" for layer in range(LAYERS) for p in ATTN] + ["lm_head"]
    return model, cal, linear_input_amax(model, ids, names)


@pytest.mark.parametrize("name", NAMES)
def test_write_mixed_checkpoint_writes_the_tools_config(name, tiny, tmp_path):
    """``write_mixed_checkpoint(model, "modelopt", ...)`` with the fixture's plan writes the tool's configs: the same
    ``quantized_layers`` in the same order (the experts by their layer's experts module, MXFP8 with
    ``group_size`` 32), the same ``config_groups`` and no exclude list; only the producer's version differs."""
    model, cal, amax = tiny
    attention = "w_fp8_a_fp8" if name == "modelopt_mixed_fp8_nvfp4" else "w_mxfp8_a_mxfp8"
    lm_head = "nvfp4" if name == "modelopt_mixed_fp8_nvfp4" else None
    path = C.write_mixed_checkpoint(model, "modelopt", tmp_path / "w", "nvfp4", attention, lm_head, cal, amax)
    folder = FIXTURES / name / "checkpoint"
    for fname, key in (("config.json", "quantization_config"), ("hf_quant_config.json", None)):
        mine, tool = (json.loads((f / fname).read_text()) for f in (path, folder))
        mine, tool = (mine[key], tool[key]) if key else (mine, tool)
        assert mine.pop("producer")["name"] == tool.pop("producer")["name"] == "modelopt"
        assert mine == tool, fname
        layers = mine["quantized_layers"] if key else mine["quantization"]["quantized_layers"]
        assert list(layers) == list(tool["quantized_layers"] if key else tool["quantization"]["quantized_layers"])
    loaded, info = C.load_quantized_moe(path, backend="torch")
    assert_runs_as(loaded, info)


# ----------------------------------------------------------------------------- refusals


def _edited_copy(name, tmp_path, edit) -> Path:
    """A copy of the fixture checkpoint with ``edit(quantized_layers)`` applied to both config files."""
    folder = tmp_path / name
    shutil.copytree(FIXTURES / name / "checkpoint", folder)
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg["quantization_config"]["quantized_layers"])
    (folder / "config.json").write_text(json.dumps(cfg))
    legacy = json.loads((folder / "hf_quant_config.json").read_text())
    edit(legacy["quantization"]["quantized_layers"])
    (folder / "hf_quant_config.json").write_text(json.dumps(legacy))
    return folder


@pytest.mark.parametrize("name", NAMES)
def test_unsupported_module_is_refused_by_name(name, tmp_path):
    def awq(layers):
        layers["model.layers.1.self_attn.o_proj"] = {"quant_algo": "W4A8_AWQ", "group_size": 128}

    with pytest.raises(
        C.CheckpointError,
        match=r"module 'model.layers.1.self_attn.o_proj' is in precision group 'W4A8_AWQ g128' .*found 'W4A8_AWQ'",
    ):
        C.load_quantized_moe(_edited_copy(name, tmp_path / "a", awq), backend="torch")

    def experts(layers):
        layers["model.layers.0.mlp.experts"] = {"quant_algo": "NVFP4_AWQ", "group_size": 16}

    with pytest.raises(
        C.CheckpointError,
        match=r"module 'model.layers.0.mlp.experts.0.gate_proj' is in precision group 'NVFP4_AWQ g16'",
    ):
        C.load_quantized_moe(_edited_copy(name, tmp_path / "b", experts), backend="torch")


def test_quotient_dtype_argument():
    """``quantize_fp8_weight``'s ``quotient_dtype``: fp32 is the default rounding, an int dtype is refused by name;
    the ModelOpt layout rounds through bf16 per tensor only (per channel ModelOpt divides by an ``[out, 1]`` fp32
    tensor: one rounding)."""
    w = (torch.randn(16, 64, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    assert all(
        torch.equal(a, b)
        for a, b in zip(R.quantize_fp8_weight(w), R.quantize_fp8_weight(w, quotient_dtype=torch.float32))
    )
    with pytest.raises(TypeError, match="quotient_dtype: expected bfloat16, float16, float32 or None, got torch.int8"):
        R.quantize_fp8_weight(w, quotient_dtype=torch.int8)
    per_channel = LAYOUTS["modelopt-fp8"].quantize_linear(w, get_moe_scheme("w_fp8_a_fp8_per_token"))
    codes, scale = R.quantize_fp8_weight(w, per_channel=True)
    assert torch.equal(per_channel.weight, codes) and torch.equal(per_channel.weight_scale, scale)
