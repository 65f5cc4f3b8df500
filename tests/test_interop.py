"""Interop: checkpoints made by the real producers, and the producers' own numbers, against mxlib.

The fixtures under ``tests/fixtures/interop/<tool>_<scheme>/`` were made by
``tools/interop/make_fixtures.py`` in each tool's own virtual environment (versions in each
``meta.json`` and in ``tools/interop/README.md``): nvidia-modelopt 0.47.0, amd-quark 0.13 and
llmcompressor 0.14.0.1 / compressed-tensors 0.19.0, on torch 2.13 CPU. Each holds the tool's
export of one tiny seeded Qwen3-MoE (2 layers, hidden 128, 8 experts, top-2, expert
intermediate 128, vocab 512) and the tool's own results:

- ``dequant.<module>``: expert weights dequantized by the tool's own function (ModelOpt
  ``NVFP4QTensor.dequantize``; compressed-tensors ``NVFP4PackedCompressor.decompress``; Quark's
  weight quantizer applied to the bf16 weight, the values its export encodes). mxlib must
  reproduce them bit for bit, from the checkpoint's bytes (``mxlib.reference``) and through the
  loader's experts.
- ``qdq.x`` / ``qdq.y``: the tool's activation QDQ of a fixed ``[4, 256]`` input with outliers,
  a tiny block and a zero block. mxlib's reference function with the matching scale rule must
  give the same values exactly.
- ``logits.bf16``: the unquantized model's logits on a fixed ``[2, 16]`` token batch, and
  ``logits.tool``: the tool's fake-quantized forward on the same batch where it runs on the CPU.

What cannot be checked, and why:

- ModelOpt's fake-quantized forward needs CUDA (its NVFP4 dynamic block quantizer asserts
  ``amax.is_cuda``), so the ModelOpt fixtures have no ``logits.tool``: for them only the
  agreement with the bf16 logits is checked (a lower bound, not a tool comparison).
- Quark's MX fake quantization of bf16 tensors calls a CUDA/HIP-only kernel; its fp32 path is
  pure PyTorch. Its ``logits.tool`` were therefore made with the quantized model cast to fp32,
  and its ``qdq.y`` and ``dequant.*`` are fp32 results of that path.

"Bit for bit" is literal (compared as integers), with one documented exception: the sign of
zero. ModelOpt's dequantize decodes e2m1 code 8 (-0) as +0.0, and ModelOpt's and Quark's
activation QDQ give +0.0 for a negative value that rounds to zero; mxlib gives -0.0 in both.

Tolerances (SQNR in dB of mxlib's logits against the reference; the measured values are in
``LOGITS_SQNR_DB`` next to each minimum): the gap to a tool's own forward is rounding order
(transformers' eager experts round SiLU-and-mul, router weights and the running sum to bf16;
mxlib accumulates in fp32; Quark's reference forward ran in fp32).

Every fixture loads (bf16 scalar scales widened, quantized attention emulated by
``EmulatedLinear``, the compressed-tensors layout with its encode scales as stored); the Quark export
made without preprocessing is refused with an error naming the cause. The Quark MX fixtures run in
fp32 reproduce Quark's fp32 logits bit for bit.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from mxlib import reference as R
from mxlib.checkpoints import CheckpointError, load_quantized_qwen3_moe
from mxlib.moe.linear import EmulatedLinear

from _util import assert_same_bits

FIXTURES = Path(__file__).parent / "fixtures" / "interop"

# fixture -> what mxlib needs to load it, or None if it loads today
LOADER_MISSING = {
    "modelopt_nvfp4_experts": None,
    "modelopt_nvfp4_default": None,  # attention q/k/v/o_proj emulated (mxlib.moe.linear)
    "quark_w_mxfp4_a_mxfp4": None,
    "quark_w_mxfp6_e2m3_a_mxfp6_e2m3": None,
    "quark_w_mxfp4_a_fp8": None,  # bf16 input_scale widened to fp32 exactly
    "quark_w_mxfp4_a_mxfp4_attn": None,  # attention emulated
    "llmc_nvfp4_experts": None,  # compressed-tensors NVFP4 layout, encode scales as stored
    "llmc_nvfp4": None,  # compressed-tensors NVFP4 layout and emulated attention
}
NOPREPROCESS = "quark_w_mxfp4_a_mxfp4_nopreprocess"

# fixture -> (the least SQNR vs the tool's own fake-quantized logits or None, vs bf16 logits), in dB.
# The minimums sit a few dB under what was measured (LOGITS_SQNR_DB). For fixtures mxlib cannot load
# yet they are set from the tool's own agreement with bf16 (a correct emulation of the tool
# lands near it); ModelOpt's default config quantizes attention like llmc_nvfp4 and
# quark_w_mxfp4_a_mxfp4_attn, whose tool forwards are 11.8 and 10.4 dB from bf16, so its minimum
# is 8 dB. quark_w_mxfp4_a_fp8 was measured with its bf16 input_scales widened to fp32 by hand
# (what the loader fix will do): 39.6 dB to Quark, 30.8 dB to bf16. Quark's fp32 reference
# forward itself is 45.8 dB from the bf16 forward with nothing quantized (the nopreprocess
# fixture), which bounds how close any bf16 emulation can get to Quark's logits.
LOGITS_MIN_SQNR_DB = {
    "modelopt_nvfp4_experts": (None, 25.0),
    "modelopt_nvfp4_default": (None, 8.0),
    "quark_w_mxfp4_a_mxfp4": (30.0, 24.0),
    "quark_w_mxfp6_e2m3_a_mxfp6_e2m3": (36.0, 31.0),
    "quark_w_mxfp4_a_fp8": (35.0, 27.0),
    "quark_w_mxfp4_a_mxfp4_attn": (14.0, 8.0),
    "llmc_nvfp4_experts": (32.0, 25.0),
    "llmc_nvfp4": (15.0, 9.0),
}
# With quantized attention, 4-bit activation QDQ in every projection turns small rounding-order
# differences into code flips, so bf16 emulation sits further from the tool (16.5 and 18.2 dB);
# the Quark MX fixtures run in fp32 reproduce Quark's fp32 logits up to fp32 summation order, attention
# included (test_quark_fp32_emulation_matches_tool_logits): the whole gap is bf16 rounding order. llm-compressor's
# activation QDQ rounds the block amax / 6 to bf16 (compressed_tensors_nvfp4_quant_dequant); mxlib
# emulates vLLM's fp32 rule, which is what vLLM serves these checkpoints with.
# Measured on the CPU, mxlib torch experts backend: (mxlib vs the tool's logits, mxlib vs bf16,
# the tool's logits vs bf16); None: not measurable (no tool logits, or mxlib cannot load it yet).
LOGITS_SQNR_DB = {
    "modelopt_nvfp4_experts": (None, 28.8, None),
    "modelopt_nvfp4_default": (None, 12.7, None),
    "quark_w_mxfp4_a_mxfp4": (34.1, 27.6, 27.8),
    "quark_w_mxfp6_e2m3_a_mxfp6_e2m3": (40.8, 35.0, 35.0),
    "quark_w_mxfp4_a_fp8": (39.6, 30.8, 30.8),  # input_scale widened to fp32 by hand
    "quark_w_mxfp4_a_mxfp4_attn": (16.5, 10.7, 10.4),
    "quark_w_mxfp4_a_mxfp4_nopreprocess": (None, None, 45.8),  # nothing quantized: fp32 vs bf16 forward
    "llmc_nvfp4_experts": (36.4, 28.9, 29.0),
    "llmc_nvfp4": (18.2, 11.9, 11.8),  # 22.0 dB with compressed-tensors' activation rule in attention
}

MX_ELEMENT = {"fp4": "e2m1", "fp6_e2m3": "e2m3", "fp6_e3m2": "e3m2"}
PROJS = ("gate_proj", "up_proj", "down_proj")


def _present(names):
    return [n for n in names if (FIXTURES / n / "meta.json").exists()]


ALL = _present(list(LOADER_MISSING))


def _xfail_unless_loads(name):
    reason = LOADER_MISSING[name]
    marks = [pytest.mark.xfail(strict=True, raises=CheckpointError, reason=reason)] if reason else []
    return pytest.param(name, marks=marks, id=name)


@cache
def _fixture(name):
    folder = FIXTURES / name
    meta = json.loads((folder / "meta.json").read_text())
    results = load_file(str(folder / "tool_results.safetensors"))
    return folder, meta, results


@cache
def _checkpoint(name):
    folder = FIXTURES / name / "checkpoint"
    cfg = json.loads((folder / "config.json").read_text())
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return cfg, tensors


@cache
def _loaded(name):
    model, info = load_quantized_qwen3_moe(FIXTURES / name / "checkpoint", backend="torch")
    return model, info


def _sqnr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (x - ref).pow(2).sum()))


def _dequant_names(results, prefix="dequant."):
    return sorted(k[len(prefix) :] for k in results if k.startswith(prefix))


def _mxlib_dequant(fmt_cfg, tensors, module, dtype):
    """mxlib.reference's dequantization of one checkpoint module, by layout."""
    qc = fmt_cfg["quantization_config"]
    method = qc["quant_method"]
    if method == "modelopt":
        return R.dequantize_to_dtype(
            tensors[f"{module}.weight"], tensors[f"{module}.weight_scale"], tensors[f"{module}.weight_scale_2"], dtype
        )
    if method == "quark":
        element = MX_ELEMENT[qc["global_quant_config"]["weight"]["dtype"]]
        return R.dequantize_mx(tensors[f"{module}.weight"], tensors[f"{module}.weight_scale"], element, 32, dtype)
    if method == "compressed-tensors":
        # compressed-tensors stores the *encode* global scale and divides by it: used as stored
        encode = tensors[f"{module}.weight_global_scale"].float().reshape(())
        return R.dequantize_to_dtype(
            tensors[f"{module}.weight_packed"],
            tensors[f"{module}.weight_scale"],
            encode,
            dtype,
            global_scale_kind="encode",
        )
    raise AssertionError(method)


# ----------------------------------------------------------------------------- fixture sanity


def test_fixtures_present_and_small():
    names = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
    missing = (set(LOADER_MISSING) | {NOPREPROCESS}) - set(names)
    assert not missing, f"missing fixtures: {sorted(missing)}"
    for path in FIXTURES.rglob("*"):
        if path.is_file():
            assert path.stat().st_size < 2_000_000, f"{path} is {path.stat().st_size} bytes (limit 2 MB)"
    for name in names:
        meta = json.loads((FIXTURES / name / "meta.json").read_text())
        assert meta["versions"]["torch"] and meta["versions"]["transformers"], name
        tool_pkg = {"nvidia-modelopt": "nvidia-modelopt", "amd-quark": "amd-quark", "llmcompressor": "llmcompressor"}
        assert meta["versions"][tool_pkg[meta["tool"]]], f"{name}: no tool version recorded"


# ----------------------------------------------------------------------------- weights


@pytest.mark.parametrize("name", ALL)
def test_dequant_reference_equals_tool(name):
    """mxlib.reference on the checkpoint bytes == the tool's dequantization, bit for bit."""
    _, meta, results = _fixture(name)
    cfg, tensors = _checkpoint(name)
    names = _dequant_names(results)
    assert names, f"{name}: no dequantized weights recorded"
    zsf = meta["tool"] == "nvidia-modelopt"
    for module in names:
        tool = results[f"dequant.{module}"]
        mine = _mxlib_dequant(cfg, tensors, module, tool.dtype)
        assert_same_bits(mine, tool, f"{name} {module}", zero_sign_free=zsf)
    for module in _dequant_names(results, "dequant_import."):  # Quark's importer reading its own export back
        tool = results[f"dequant_import.{module}"]
        assert_same_bits(_mxlib_dequant(cfg, tensors, module, tool.dtype), tool, f"{name} {module} (import)")
    for module in _dequant_names(results, "dequant_fp32."):
        tool = results[f"dequant_fp32.{module}"]
        assert_same_bits(
            _mxlib_dequant(cfg, tensors, module, torch.float32), tool, f"{name} {module} (fp32)", zero_sign_free=zsf
        )


@pytest.mark.parametrize("name", [_xfail_unless_loads(n) for n in ALL])
def test_loader_experts_equal_tool_dequant(name):
    """The loaded model's emulation experts (and emulated linear layers) hold exactly the tool's
    dequantized weights."""
    _, meta, results = _fixture(name)
    model, _ = _loaded(name)
    modules = dict(model.named_modules())
    for module in _dequant_names(results):
        if isinstance(modules.get(module), EmulatedLinear):  # a quantized attention projection
            mine = modules[module].dequantized_weight()
            tool = results[f"dequant.{module}"]
            assert_same_bits(
                mine, tool.to(mine.dtype), f"{name} {module}", zero_sign_free=meta["tool"] == "nvidia-modelopt"
            )
            continue
        parts = module.split(".")
        layer, expert, proj = int(parts[2]), int(parts[5]), parts[6]
        w13, w2 = model.model.layers[layer].mlp.experts.experts.dequantized_expert(expert)
        i = w2.shape[1]
        mine = {"gate_proj": w13[:i], "up_proj": w13[i:], "down_proj": w2}[proj]
        tool = results[f"dequant.{module}"]
        assert_same_bits(
            mine, tool.to(mine.dtype), f"{name} {module}", zero_sign_free=meta["tool"] == "nvidia-modelopt"
        )


# ----------------------------------------------------------------------------- activation QDQ


def _mxlib_qdq(name, meta, results, cfg, tensors):
    qc = cfg["quantization_config"]
    x, y = results["qdq.x"], results["qdq.y"]
    if qc["quant_method"] == "modelopt":
        # ModelOpt's NVFP4QTensor.quantize with the checkpoint's input_scale as its decode scale:
        # mxlib's ModelOpt-export rule (quantize_nvfp4), then dequantize_to_dtype
        scale_2 = results["qdq.scale_2"].float()
        packed, block_scale, g = R.quantize_nvfp4(x, weight_scale_2=scale_2)
        return R.dequantize_to_dtype(packed, block_scale, g, y.dtype)
    if qc["quant_method"] == "compressed-tensors":
        # compressed-tensors' own rule (block amax / 6 in the activation dtype), not vLLM's
        return R.compressed_tensors_nvfp4_quant_dequant(x.to(y.dtype), results["qdq.input_global_scale"].float())
    a = qc["global_quant_config"]["input_tensors"]
    if a["dtype"] == "fp8_e4m3":
        return R.quant_dequant_fp8_per_tensor(x.to(y.dtype), results["qdq.scale"].float(), dtype=y.dtype)
    return R.quant_dequant_mx(
        x.to(y.dtype), MX_ELEMENT[a["dtype"]], 32, a.get("scale_calculation_mode") or "even", dtype=y.dtype
    )


@pytest.mark.parametrize("name", ALL)
def test_activation_qdq_equals_tool(name):
    """mxlib.reference's QDQ with the tool's scale rule == the tool's activation QDQ, exactly.

    Bit for bit except the sign of zero: a negative input that rounds to zero gives -0.0 in
    mxlib and +0.0 in ModelOpt's and Quark's QDQ (30 and 84 such values on this input)."""
    _, meta, results = _fixture(name)
    cfg, tensors = _checkpoint(name)
    mine = _mxlib_qdq(name, meta, results, cfg, tensors)
    assert_same_bits(mine, results["qdq.y"], f"{name} qdq", zero_sign_free=True)


# ----------------------------------------------------------------------------- logits


@pytest.mark.parametrize("name", [_xfail_unless_loads(n) for n in ALL])
def test_logits_agree(name):
    """mxlib's emulated forward against the tool's fake-quantized forward (where recorded) and bf16."""
    _, meta, results = _fixture(name)
    model, _ = _loaded(name)
    with torch.no_grad():
        logits = model(input_ids=results["tokens.eval"]).logits.float()
    min_tool, min_bf16 = LOGITS_MIN_SQNR_DB[name]
    vs_bf16 = _sqnr_db(logits, results["logits.bf16"])
    assert vs_bf16 >= min_bf16, f"{name}: SQNR vs bf16 logits {vs_bf16:.1f} dB < {min_bf16} dB"
    if "logits.tool" in results:
        vs_tool = _sqnr_db(logits, results["logits.tool"])
        assert vs_tool >= min_tool, f"{name}: SQNR vs the tool's logits {vs_tool:.1f} dB < {min_tool} dB"
        # mxlib must be closer to the tool's quantized forward than the tool is to bf16
        tool_vs_bf16 = _sqnr_db(results["logits.tool"], results["logits.bf16"])
        assert vs_tool > tool_vs_bf16, f"{name}: {vs_tool:.1f} dB to the tool, tool to bf16 {tool_vs_bf16:.1f} dB"
    else:
        assert min_tool is None, f"{name}: expected the tool's logits in the fixture"


# Quark MX fixtures whose fake-quantized fp32 forward mxlib reproduces to fp32 rounding (the _a_fp8 one differs:
# Quark's fp8 fake quantization uses each expert's own input_scale where vLLM and mxlib take the max).
FP32_EXACT = _present(["quark_w_mxfp4_a_mxfp4", "quark_w_mxfp4_a_mxfp4_attn", "quark_w_mxfp6_e2m3_a_mxfp6_e2m3"])


@pytest.mark.parametrize("name", FP32_EXACT)
def test_quark_fp32_emulation_matches_tool_logits(name):
    """Run in fp32 (as Quark's reference forward was), mxlib's emulation gives Quark's logits up to the
    order of fp32 sums: the quantized operands are bit-equal (the dequant and QDQ tests above), and an
    fp32 matmul's reduction order depends on the CPU's BLAS kernel (on the machine that made the fixture
    the logits were equal bit for bit; on an AMD EPYC they differ by 2e-7 relative, 132 dB). The bound,
    1e-5 relative, is far below any quantization effect (an MX QDQ changes the logits by about 1e-1)."""
    _, meta, results = _fixture(name)
    model, _ = load_quantized_qwen3_moe(FIXTURES / name / "checkpoint", backend="torch", activation_dtype=torch.float32)
    for p in model.parameters():
        p.data = p.data.float()
    with torch.no_grad():
        logits = model(input_ids=results["tokens.eval"]).logits.float()
    ref = results["logits.tool"]
    assert logits.shape == ref.shape and logits.dtype == ref.dtype
    rel = float((logits.double() - ref.double()).norm() / ref.double().norm())
    assert rel < 1e-5, f"{name} fp32 logits: relative error {rel:.3g} against Quark's"
    assert torch.equal(logits.argmax(-1), ref.argmax(-1)), f"{name}: top-1 tokens differ from Quark's"


# ----------------------------------------------------------------------------- Quark without preprocessing


@pytest.mark.skipif(not (FIXTURES / NOPREPROCESS / "meta.json").exists(), reason="fixture not made")
def test_quark_without_preprocessing_is_flagged():
    """The export has fused, unquantized experts under a Quark fp4 config (Quark reported success)."""
    cfg, tensors = _checkpoint(NOPREPROCESS)
    assert cfg["quantization_config"]["quant_method"] == "quark"
    assert "model.layers.0.mlp.experts.gate_up_proj" in tensors
    assert tensors["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.bfloat16
    assert not any(".mlp.experts.0." in k for k in tensors)


@pytest.mark.skipif(not (FIXTURES / NOPREPROCESS / "meta.json").exists(), reason="fixture not made")
def test_quark_without_preprocessing_clear_error():
    with pytest.raises(CheckpointError, match=r"(?i)fused.*unquantized|unquantized.*fused") as err:
        load_quantized_qwen3_moe(FIXTURES / NOPREPROCESS / "checkpoint", backend="torch")
    assert "preprocess" in str(err.value)
