"""Interop: mixed-precision checkpoints made by AMD Quark itself, against mxlib.

The fixtures ``tests/fixtures/interop/quark_mixed_*`` were made by ``tools/interop/make_fixtures.py`` with
amd-quark 0.13 (torch 2.13 CPU, transformers 5.24; versions and command in each ``meta.json``) from the tiny
seeded Qwen3-MoE of ``tools/interop/_common.py``, with ``LLMTemplate.get("qwen3_moe").get_config(scheme="mxfp4",
exclude_layers=["*.gate"], ...)``:

- ``quark_mixed_w_mxfp4_a_mxfp4_fp8_attn``: ``layer_config={"*.self_attn.*": "fp8", "lm_head": "fp8"}``, so
  ``quantization_config.layer_quant_config`` holds the two name patterns and the routed experts fall through
  to ``global_quant_config``;
- ``quark_mixed_w_mxfp4_a_mxfp4_fp8_linear_type``: ``layer_type_config={nn.Linear: "fp8"}`` with
  ``layer_config={"*.mlp.experts.*": "mxfp4"}``: ``layer_type_quant_config`` keyed ``"Linear"`` (Quark writes the
  class's name), the experts claimed by the name pattern first.

Two more recipes: the first with ``kv_cache_scheme="fp8"`` (``_fp8_attn_kv_fp8``: refused, the emulation has no
quantized KV cache) and ``layer_config={"*self_attn*": "ptpc_fp8", "lm_head": "ptpc_fp8"}`` (``_ptpc_fp8_attn``:
per-channel FP8 weights, dynamic per-token FP8 inputs; tested at the end of this file).

The first two store the routed experts in MXFP4 (W4A4, dynamic ``even`` E8M0 activation scales: ``weight`` U8
``[out, in/2]``, ``weight_scale`` U8 ``[out, in/32]``), every other Linear but the routers (``q/k/v/o_proj``,
``lm_head``) in FP8 e4m3 per tensor (W8A8, static activations: ``weight`` F8_E4M3 ``[out, in]``, ``weight_scale``
and ``input_scale`` **bf16** ``[]``), and the routers bf16 (``exclude`` lists them by name). The two exports hold
the same tensors; only the config differs.

What Quark writes that differs from its own fake quantization: its export quantizes a per-tensor FP8 weight
with ``real_quantize_fp8_e4m3_per_tensor_with_scale``, ``(weight / scale).to(float8_e4m3fn)`` on the bf16 weight
and bf16 scale, so the quotient is rounded to bf16 before it is rounded to e4m3; its fake quantization (the
forward that gave ``logits.tool``) divides the fp32 weight in fp32. 440 of layer 0 ``q_proj``'s 16384 codes differ
by one e4m3 step. The checkpoint is the oracle for the on-disk form: mxlib reads what was written, as Quark's own
importer does (``dequant_import.*``), and its fp32 forward equals Quark's fp32 forward run with the exported FP8
weights (``logits.tool_export_codes``), bit for bit on the machine that made the fixtures.

Checked per fixture: the precision groups mxlib reads are the ones Quark's matching rule gives (exclude, then
``layer_quant_config`` by fnmatch in order, then ``layer_type_quant_config`` by class, then
``global_quant_config``: ``quark.torch.export.main_export.quant_config_parser.get_layer_quant_config``); every
recorded dequantization and activation QDQ bit-equal; the logits; the inspector's groups and byte shares against
shares counted here from the safetensors headers; ``what_ran`` / ``assert_runs_as``; save -> the same tensors byte
for byte and the same ``quantization_config``; an unsupported group refused naming the module.
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
from mxlib.checkpoints.precision import EXPERT_CLASSES
from mxlib.models.what_ran import RanMismatch, assert_runs_as
from mxlib.moe.linear import EmulatedLinear

from _util import assert_bits_equal, assert_same_bits, stored_tensors

FIXTURES = Path(__file__).parent / "fixtures" / "interop"
NAMES = ["quark_mixed_w_mxfp4_a_mxfp4_fp8_attn", "quark_mixed_w_mxfp4_a_mxfp4_fp8_linear_type"]
ATTN_PROJS = ("q_proj", "k_proj", "v_proj", "o_proj")
# the schemes of Quark's tensor configs, by (weight dtype, weight qscheme, input dtype, input qscheme, dynamic)
QUARK_SCHEMES = {
    ("fp4", "per_group", "fp4", "per_group", True): "w_mxfp4_a_mxfp4",
    ("fp8_e4m3", "per_tensor", "fp8_e4m3", "per_tensor", False): "w_fp8_a_fp8",
}
# the SQNR (dB) of mxlib's default (bf16) logits: minimum, measured when the fixtures were made. Against Quark's
# fp32 forward of the exported weights the gap is bf16 rounding order (transformers' eager attention and mxlib's
# experts in bf16, Quark's forward in fp32), far above the 20.2 dB of that forward against bf16; against Quark's
# forward of its fake-quantized weights (logits.tool) the attention weights' 440-code difference adds to it.
SQNR_MIN_DB = {"tool_export_codes": (22.0, 24.4), "tool": (20.0, 22.7), "bf16": (18.0, 20.5)}


@cache
def _fixture(name):
    folder = FIXTURES / name
    meta = json.loads((folder / "meta.json").read_text())
    results = load_file(str(folder / "tool_results.safetensors"))
    cfg = json.loads((folder / "checkpoint" / "config.json").read_text())
    return folder / "checkpoint", meta, results, cfg


@cache
def _loaded(name, fp32=False):
    ckpt = _fixture(name)[0]
    if not fp32:
        return C.load_quantized_moe(ckpt, backend="torch")
    model, info = C.load_quantized_moe(ckpt, backend="torch", activation_dtype=torch.float32)
    for p in model.parameters():  # Quark's reference forward ran in fp32
        p.data = p.data.float()
    return model, info


def _header(path: Path) -> dict:
    """A safetensors file's header, read here from its bytes (8-byte little-endian length, then JSON)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        head = json.loads(f.read(n))
    head.pop("__metadata__", None)
    return head


def _modules(ckpt: Path) -> dict[str, dict[str, dict]]:
    """``{module: {tensor suffix: header entry}}`` of every tensor of the checkpoint."""
    out: dict[str, dict[str, dict]] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        for k, v in _header(f).items():
            module, _, suffix = k.rpartition(".")
            out.setdefault(module, {})[suffix] = v
    return out


def _is_linear(module: str) -> bool:
    """The Qwen3-MoE modules that are ``nn.Linear`` (what Quark quantizes): the projections, the routers,
    ``lm_head``; not the embedding or the norms."""
    return module.endswith("_proj") or module.endswith(".mlp.gate") or module == "lm_head"


def _quark_group(qc: dict, module: str) -> str | None:
    """The group Quark's own rule gives a module (module docstring), None for an unquantized one."""
    if not _is_linear(module) or any(fnmatch.fnmatch(module, p) for p in qc["exclude"]):
        return None
    for pattern in qc["layer_quant_config"]:
        if fnmatch.fnmatch(module, pattern):
            return pattern
    if "Linear" in qc["layer_type_quant_config"]:
        return "Linear"
    return "global_quant_config"


def _group_config(qc: dict, group: str) -> dict:
    if group == "global_quant_config":
        return qc["global_quant_config"]
    where = "layer_quant_config" if group in qc["layer_quant_config"] else "layer_type_quant_config"
    return qc[where][group]


def _quark_scheme(qc: dict, group: str) -> str:
    g = _group_config(qc, group)
    w, a = g["weight"], g["input_tensors"]
    return QUARK_SCHEMES[(w["dtype"], w["qscheme"], a["dtype"], a["qscheme"], a["is_dynamic"])]


def _sqnr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (x - ref).pow(2).sum()))


def _reference_dequant(tensors: dict, module: str) -> torch.Tensor:
    """mxlib.reference's dequantization of one module's stored tensors, fp32, by what the tensors are."""
    w, s = tensors[f"{module}.weight"], tensors[f"{module}.weight_scale"]
    if w.dtype == torch.float8_e4m3fn:
        return R.dequantize_fp8_weight(w, s, torch.float32)
    return R.dequantize_mx(w, s, "e2m1", 32, torch.float32)


# ----------------------------------------------------------------------------- the fixtures


@pytest.mark.parametrize("name", NAMES)
def test_fixture_is_the_tools_export(name):
    ckpt, meta, results, cfg = _fixture(name)
    assert meta["tool"] == "amd-quark" and meta["versions"]["amd-quark"] == "0.13"
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "quark" and qc["version"] == "0.13"
    # the per-layer and per-type configs are the ones the recipe asked for, lm_head is not excluded
    assert list(qc["layer_quant_config"]) == list(meta["layer_config"])
    assert list(qc["layer_type_quant_config"]) == list(meta.get("layer_type_config") or {})
    assert qc["exclude"] == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    for path in ckpt.parent.rglob("*"):
        if path.is_file():
            assert path.stat().st_size < 2_000_000, f"{path} is {path.stat().st_size} bytes (limit 2 MB)"
    for key in ("logits.bf16", "logits.tool", "logits.tool_export_codes", "qdq.x", "qdq.y"):
        assert key in results, key


# ----------------------------------------------------------------------------- precision groups


@pytest.mark.parametrize("name", NAMES)
def test_precision_groups_match_the_tools_config(name):
    """Every module's group and scheme as mxlib reads them == Quark's rule on the tool's config; the tensors each
    module stores are those of its scheme."""
    ckpt, _, _, cfg = _fixture(name)
    qc = cfg["quantization_config"]
    info = C.read_quant_config(ckpt)
    pm = info.precision
    assert pm is not None and pm.producer == "quark" and info.format == "quark"
    assert info.scheme.name == "w_mxfp4_a_mxfp4"  # the experts' scheme
    modules = _modules(ckpt)
    seen: dict[str | None, int] = {}
    for module, tensors in modules.items():
        want = _quark_group(qc, module)
        seen[want] = seen.get(want, 0) + 1
        classes = EXPERT_CLASSES if ".mlp.experts." in module else ("Linear", "Module")
        got = pm.group_of(module, classes) if _is_linear(module) else None
        assert got == want, f"{module}: mxlib group {got!r}, Quark's rule {want!r}"
        desc = pm.description(module, classes) if want is not None else None
        if want is None:
            assert desc is None and tensors["weight"]["dtype"] in ("BF16", "F32"), module
            continue
        scheme = _quark_scheme(qc, want)
        assert desc.scheme.name == scheme, f"{module}: {desc.scheme.name} != {scheme}"
        w, s = tensors["weight"], tensors["weight_scale"]
        if scheme == "w_fp8_a_fp8":
            assert desc.format == "quark-fp8"
            assert (w["dtype"], s["dtype"], s["shape"]) == ("F8_E4M3", "BF16", []), module
            assert (tensors["input_scale"]["dtype"], tensors["input_scale"]["shape"]) == ("BF16", []), module
        else:
            assert desc.format == "quark" and set(tensors) == {"weight", "weight_scale"}, module
            out, half = w["shape"]
            assert (w["dtype"], s["dtype"], s["shape"]) == ("U8", "U8", [out, 2 * half // 32]), module
    fp8 = "Linear" if "Linear" in qc["layer_type_quant_config"] else "*.self_attn.*"
    experts = "*.mlp.experts.*" if "*.mlp.experts.*" in qc["layer_quant_config"] else "global_quant_config"
    assert seen[experts] == 2 * 8 * 3  # 2 layers x 8 experts x 3 projections
    assert seen[fp8] == 2 * 4 + (fp8 == "Linear")  # q/k/v/o_proj of 2 layers (+ lm_head by its class)
    if fp8 != "Linear":
        assert seen["lm_head"] == 1
    # and the loaded model runs each module in its group's scheme
    model, _ = _loaded(name)
    mods = dict(model.named_modules())
    assert isinstance(mods["lm_head"], EmulatedLinear) and mods["lm_head"].scheme.name == "w_fp8_a_fp8"
    for layer in range(2):
        for p in ATTN_PROJS:
            assert mods[f"model.layers.{layer}.self_attn.{p}"].scheme.name == "w_fp8_a_fp8"
        assert not isinstance(mods[f"model.layers.{layer}.mlp.gate"], EmulatedLinear)


# ----------------------------------------------------------------------------- weights


@pytest.mark.parametrize("name", NAMES)
def test_dequant_equals_tools_reader_and_fake_quant(name):
    """mxlib.reference on the checkpoint bytes and the loaded (fp32) model's modules == Quark's importer's
    dequantization (``dequant_import.*``: every group) and Quark's fake quantization (``dequant.*``) of the
    experts and lm_head, bit for bit. The attention projections' fake quantization differs from the export
    (next test)."""
    ckpt, _, results, _ = _fixture(name)
    tensors = stored_tensors(ckpt)
    model, _ = _loaded(name, fp32=True)
    mods = dict(model.named_modules())

    def loaded(module):
        if isinstance(mods.get(module), EmulatedLinear):
            return mods[module].dequantized_weight()
        parts = module.split(".")
        w13, w2 = mods[".".join(parts[:5])].experts.dequantized_expert(int(parts[5]))
        i = w2.shape[1]
        return {"gate_proj": w13[:i], "up_proj": w13[i:], "down_proj": w2}[parts[6]]

    imported = sorted(k.split(".", 1)[1] for k in results if k.startswith("dequant_import."))
    assert "lm_head" in imported and "model.layers.0.self_attn.q_proj" in imported
    for module in imported:
        tool = results[f"dequant_import.{module}"]
        assert_same_bits(_reference_dequant(tensors, module), tool, f"{name} {module} (reference vs import)")
        assert_same_bits(loaded(module), tool, f"{name} {module} (loaded vs import)")
    fake = sorted(k.split(".", 1)[1] for k in results if k.startswith("dequant."))
    for module in fake:
        if ".self_attn." in module:
            continue
        tool = results[f"dequant.{module}"]
        assert_same_bits(_reference_dequant(tensors, module), tool, f"{name} {module} (reference vs fake quant)")
        assert_same_bits(loaded(module), tool, f"{name} {module} (loaded vs fake quant)")
    # the other attention projections: the loaded weights are the stored e4m3 codes times the bf16 scale
    # (decoded here by torch's own float8 dtype)
    for layer in range(2):
        for p in ATTN_PROJS:
            module = f"model.layers.{layer}.self_attn.{p}"
            want = tensors[f"{module}.weight"].float() * tensors[f"{module}.weight_scale"].float()
            assert_same_bits(loaded(module), want, f"{name} {module} (loaded vs stored)")


@pytest.mark.parametrize("name", NAMES)
def test_quark_fp8_export_rounds_the_quotient_to_bf16(name):
    """What Quark writes for a per-tensor FP8 weight: e4m3(bf16(w / s)) of the bf16 weight ``w`` it quantized and
    its bf16 ``weight_scale`` ``s`` (``real_quantize_fp8_e4m3_per_tensor_with_scale``), computed here with torch;
    its fake quantization, the weights of ``logits.tool``, is e4m3(fp32(w) / fp32(s)) * s. The two differ where
    the bf16 quotient lands on a tie (or across one) of the e4m3 grid: 440 of layer 0 q_proj's 16384 codes."""
    ckpt, _, results, _ = _fixture(name)
    tensors = stored_tensors(ckpt)
    differ = {}
    for module in ("model.layers.0.self_attn.q_proj", "lm_head"):
        w, s = results[f"weight.{module}"], tensors[f"{module}.weight_scale"]
        assert w.dtype == torch.bfloat16 and s.dtype == torch.bfloat16
        codes = tensors[f"{module}.weight"]
        export_rule = torch.clamp(w / s, -448, 448).to(torch.float8_e4m3fn)  # bf16 / bf16 -> bf16
        assert torch.equal(codes.view(torch.uint8), export_rule.view(torch.uint8)), module
        fake_rule = torch.clamp(w.float() / s.float(), -448, 448).to(torch.float8_e4m3fn)
        assert_same_bits(fake_rule.float() * s.float(), results[f"dequant.{module}"], f"{module} fake quant")
        differ[module] = int((fake_rule.view(torch.uint8) != codes.view(torch.uint8)).sum())
        # where they differ, by one e4m3 step, on either side
        steps = (fake_rule.float() - codes.float()).abs() / codes.float().abs().clamp(min=2**-9)
        assert float(steps.max()) <= 0.25, module
    assert differ == {"model.layers.0.self_attn.q_proj": 440, "lm_head": 0}


# ----------------------------------------------------------------------------- activations


@pytest.mark.parametrize("name", NAMES)
def test_activation_qdq_equals_tool(name):
    """Quark's input quantizers on the fixed ``[4, 256]`` input (fp32, its CPU path) == mxlib's: the experts'
    dynamic MXFP4 (``even``) by mxlib.reference, each FP8 group's static per-tensor QDQ by the loaded module's own
    ``quantize_input`` with the checkpoint's bf16 ``input_scale`` (which is the quantizer's scale, bit for bit).
    Equal but for the sign of zero (Quark's QDQ gives +0.0 for a negative input that rounds to zero)."""
    ckpt, _, results, _ = _fixture(name)
    tensors = stored_tensors(ckpt)
    x = results["qdq.x"].float()
    mine = R.quant_dequant_mx(x, "e2m1", 32, "even", dtype=torch.float32)
    assert_same_bits(mine, results["qdq.y"], f"{name} experts' MXFP4 QDQ", zero_sign_free=True)
    model, _ = _loaded(name, fp32=True)
    mods = dict(model.named_modules())
    for module in ("model.layers.0.self_attn.q_proj", "lm_head"):
        assert_bits_equal(results[f"qdq.{module}.scale"], tensors[f"{module}.input_scale"], f"{module} input_scale")
        mine = mods[module].quantize_input(x)
        assert_same_bits(mine, results[f"qdq.{module}.y"], f"{name} {module} FP8 QDQ", zero_sign_free=True)
        ref = R.quant_dequant_fp8_per_tensor(x, tensors[f"{module}.input_scale"].float(), dtype=torch.float32)
        assert_same_bits(ref, results[f"qdq.{module}.y"], f"{name} {module} reference FP8 QDQ", zero_sign_free=True)


# ----------------------------------------------------------------------------- logits


@pytest.mark.parametrize("name", NAMES)
def test_fp32_forward_equals_quarks_forward_of_its_export(name):
    """Run in fp32, mxlib's emulation of the checkpoint gives Quark's fp32 fake-quantized forward with the exported
    FP8 weights (``logits.tool_export_codes``) up to the order of fp32 sums (bit-equal where the fixtures were
    made; the bound 1e-5 relative is that of ``test_interop.py``'s fp32 comparison). Quark's forward with its
    fake-quantized (not exported) attention weights, ``logits.tool``, is 7% away: the 440-code difference of the
    previous test, carried through MXFP4 activation rounding and the router's top-2."""
    _, _, results, _ = _fixture(name)
    model, _ = _loaded(name, fp32=True)
    with torch.no_grad():
        logits = model(input_ids=results["tokens.eval"]).logits.float()
    ref = results["logits.tool_export_codes"]
    rel = float((logits.double() - ref.double()).norm() / ref.double().norm())
    assert rel < 1e-5, f"{name}: relative error {rel:.3g} against Quark's forward of its export"
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))
    fake = results["logits.tool"]
    rel_fake = float((logits.double() - fake.double()).norm() / fake.double().norm())
    assert rel_fake > 1e-3, f"{name}: {rel_fake:.3g}: expected the fake-quantized weights' forward to differ"


@pytest.mark.parametrize("name", NAMES)
def test_logits_agree(name):
    """mxlib's default (bf16 activations) forward against Quark's forward of its export and against bf16, and
    closer to Quark's quantized forward than that forward is to bf16."""
    _, _, results, _ = _fixture(name)
    model, _ = _loaded(name)
    with torch.no_grad():
        logits = model(input_ids=results["tokens.eval"]).logits.float()
    for key, (minimum, measured) in SQNR_MIN_DB.items():
        got = _sqnr_db(logits, results[f"logits.{key}"])
        assert got >= minimum, f"{name}: SQNR vs logits.{key} {got:.1f} dB < {minimum} dB (measured {measured})"
    tool_vs_bf16 = _sqnr_db(results["logits.tool_export_codes"], results["logits.bf16"])
    assert _sqnr_db(logits, results["logits.tool_export_codes"]) > tool_vs_bf16


# ----------------------------------------------------------------------------- the inspector


@pytest.mark.parametrize("name", NAMES)
def test_inspector_lists_groups_and_byte_shares(name):
    """``inspect_checkpoint`` lists each precision group with its scheme, its quantized modules and its bytes; the
    counts and shares are computed here from the safetensors headers and Quark's rule."""
    ckpt, _, _, cfg = _fixture(name)
    qc = cfg["quantization_config"]
    want: dict[str, list] = {}
    total = 0
    for module, tensors in _modules(ckpt).items():
        nbytes = sum(t["data_offsets"][1] - t["data_offsets"][0] for t in tensors.values())
        total += nbytes
        group = _quark_group(qc, module)
        row = want.setdefault(group or "unquantized", [0, 0])
        row[0] += group is not None
        row[1] += nbytes
    report = C.inspect_checkpoint(ckpt)
    assert report.layout_ok, report.problems
    got = {r["group"]: [r["modules"], r["bytes"]] for r in report.precision_groups}
    assert got == want
    for r in report.precision_groups:
        assert r["share"] == pytest.approx(r["bytes"] / total, rel=1e-12), r["group"]
        if r["group"] != "unquantized":
            assert r["scheme"] == _quark_scheme(qc, r["group"]), r["group"]
    text = report.table()
    assert "precision groups (share of the checkpoint's bytes)" in text
    for r in report.precision_groups:
        assert r["group"] in text and f"{100 * r['share']:.2f}%" in text


# ----------------------------------------------------------------------------- what ran


@pytest.mark.parametrize("name", NAMES)
def test_what_ran_and_a_planted_mismatch(name, monkeypatch):
    """Each module ran in its group's scheme with its activation QDQ'd once; a planted silent weight-only fallback
    (``lm_head``'s input QDQ skipped) and a one-scheme expectation are refused, naming the module."""
    _, _, results, cfg = _fixture(name)
    model, info = C.load_quantized_moe(_fixture(name)[0], backend="torch")
    ids = results["tokens.eval"]
    report = assert_runs_as(model, info, ids)
    ran = {r.module: (r.scheme, r.precision, r.a1_passes) for r in report}
    assert ran["lm_head"] == ("w_fp8_a_fp8", "W8A8", 1.0)
    for layer in range(2):
        assert ran[f"model.layers.{layer}.mlp.experts"] == ("w_mxfp4_a_mxfp4", "W4A4", 1.0)
        assert report[f"model.layers.{layer}.mlp.experts"].a2_passes == 1.0
        for p in ATTN_PROJS:
            assert ran[f"model.layers.{layer}.self_attn.{p}"] == ("w_fp8_a_fp8", "W8A8", 1.0)
    assert len(ran) == 2 + 2 * 4 + 1
    with pytest.raises(RanMismatch, match=r"self_attn.q_proj: ran w_fp8_a_fp8 \(W8A8\), the checkpoint asks w_mxfp4"):
        assert_runs_as(model, "w_mxfp4_a_mxfp4", report=report)
    monkeypatch.setattr(model.lm_head, "quantize_input", lambda x2, ops=None: x2)
    with pytest.raises(RanMismatch, match=r"lm_head: .*not quantized \(a silent weight-only fallback: ran W8A16\)"):
        assert_runs_as(model, info, ids)


# ----------------------------------------------------------------------------- saving


@pytest.mark.parametrize("name", NAMES)
def test_save_round_trips_byte_for_byte(name, tmp_path):
    """save_pretrained writes the tool's tensors bit for bit (names, dtypes, bf16 scales, shapes) under the tool's
    ``quantization_config``; save -> load -> save gives identical files."""
    ckpt, _, _, cfg = _fixture(name)
    model, _ = C.load_quantized_moe(ckpt, backend="torch")
    model.save_pretrained(tmp_path / "first")
    src, saved = stored_tensors(ckpt), stored_tensors(tmp_path / "first")
    assert sorted(src) == sorted(saved)
    for k in src:
        assert_bits_equal(saved[k], src[k], k)
    saved_cfg = json.loads((tmp_path / "first" / "config.json").read_text())
    assert saved_cfg["quantization_config"] == cfg["quantization_config"]
    again, _ = C.load_quantized_moe(tmp_path / "first", backend="torch")
    again.save_pretrained(tmp_path / "second")
    first = sorted(p.name for p in (tmp_path / "first").iterdir())
    assert first == sorted(p.name for p in (tmp_path / "second").iterdir())
    for f in first:
        assert (tmp_path / "first" / f).read_bytes() == (tmp_path / "second" / f).read_bytes(), f


# ----------------------------------------------------------------------------- refusals


def _edited(name, tmp_path, edit) -> Path:
    folder = tmp_path / "edited"
    shutil.copytree(_fixture(name)[0], folder)
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg["quantization_config"])
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


def test_unsupported_attention_group_is_refused(tmp_path):
    """The attention group turned into MXFP8 with 32x32 weight blocks (``qscheme: per_block``, a per-layer spec of
    MXFP4 releases the emulation does not run): refused naming the first module of the group."""

    def blocks(qc):
        w = qc["layer_quant_config"]["*.self_attn.*"]["weight"]
        w.update(qscheme="per_block", block_size=[32, 32], scale_format="e8m0", group_size=None)

    with pytest.raises(
        C.CheckpointError,
        match=r"module 'model.layers.0.self_attn.q_proj' is in precision group '\*.self_attn.\*' .*"
        r"layer_quant_config\['\*.self_attn.\*'\].weight",
    ):
        C.load_quantized_moe(_edited(NAMES[0], tmp_path, blocks), backend="torch")


def test_unsupported_lm_head_and_type_groups_are_refused(tmp_path):
    """lm_head's group in int8 (fixture 1), and the ``Linear`` type group in int8 (fixture 2): each refused naming
    the module and its group."""

    def int8(cfg):
        cfg["weight"]["dtype"] = "int8"

    with pytest.raises(C.CheckpointError, match=r"module 'lm_head' is in precision group 'lm_head' .*'int8'"):
        C.load_quantized_moe(_edited(NAMES[0], tmp_path / "a", lambda qc: int8(qc["layer_quant_config"]["lm_head"])))
    with pytest.raises(
        C.CheckpointError, match=r"module 'model.layers.0.self_attn.q_proj' is in precision group 'Linear' .*'int8'"
    ):
        C.load_quantized_moe(
            _edited(NAMES[1], tmp_path / "b", lambda qc: int8(qc["layer_type_quant_config"]["Linear"]))
        )


# ----------------------------------------------------------------------------- mxlib's writer


# the tensor-config keys that carry semantics (the rest, e.g. Quark's max_input_numel or zero_point_type, do not)
SPEC_KEYS = (
    "dtype",
    "qscheme",
    "ch_axis",
    "group_size",
    "is_dynamic",
    "symmetric",
    "round_method",
    "scale_format",
    "scale_calculation_mode",
    "observer_cls",
)


def test_mxlib_writer_writes_quarks_mixed_form(tmp_path):
    """``write_mixed_checkpoint(model, "quark", ...)`` with MXFP4 experts, FP8 attention and an FP8 ``lm_head`` writes
    the tool's form: the same ``layer_quant_config`` patterns, ``exclude`` names and semantic keys of every tensor
    config, and per module the same tensors in the same dtypes (the FP8 ``weight_scale`` / ``input_scale`` bf16, as
    Quark's export stores them)."""
    from mxlib.moe.linear import linear_input_amax

    from _util import tiny_calibrated

    model, cal, ids = tiny_calibrated(5, tokens=16, layers=2, ids_seed=1)
    linears = [f"model.layers.{layer}.self_attn.{p}" for layer in range(2) for p in ATTN_PROJS] + ["lm_head"]
    amax = linear_input_amax(model, ids, linears)
    path = C.write_mixed_checkpoint(
        model, "quark", tmp_path / "w", "w_mxfp4_a_mxfp4", "w_fp8_a_fp8", "w_fp8_a_fp8", cal, linear_input_amax=amax
    )
    ckpt, _, _, cfg = _fixture(NAMES[0])
    tool = cfg["quantization_config"]
    mine = json.loads((path / "config.json").read_text())["quantization_config"]
    assert list(mine["layer_quant_config"]) == list(tool["layer_quant_config"])
    assert mine["exclude"] == tool["exclude"] and mine["quant_method"] == tool["quant_method"]
    for group in ("global_quant_config", *tool["layer_quant_config"]):
        for part in ("weight", "input_tensors"):
            a, b = _group_config(mine, group)[part], _group_config(tool, group)[part]
            assert {k: a.get(k) for k in SPEC_KEYS} == {k: b.get(k) for k in SPEC_KEYS}, (group, part)

    def kinds(folder):  # (kind of module, tensor suffix) -> stored dtype
        out = {}
        for module, tensors in _modules(folder).items():
            kind = module.split(".")[-1] if _is_linear(module) else "other"
            kind = "expert " + kind if ".mlp.experts." in module else kind
            for suffix, t in tensors.items():
                out[(kind, suffix)] = t["dtype"]
        return out

    want = kinds(ckpt)
    got = kinds(path)
    assert sorted(got) == sorted(want)
    assert {k: (got[k], want[k]) for k in want if got[k] != want[k]} == {}


@pytest.mark.parametrize("name", [NAMES[0], "quark_mixed_w_mxfp4_a_mxfp4_ptpc_fp8_attn"])
def test_mxlib_fp8_writer_is_quarks_export_byte_for_byte(name):
    """From the bf16 weights Quark quantized (``weight.<module>``), the ``quark-fp8`` layout's writer gives the
    stored codes and the stored bf16 ``weight_scale`` byte for byte, per tensor (``fp8``) and per channel
    (``ptpc_fp8``)."""
    from mxlib.checkpoints.layouts import LAYOUTS
    from mxlib.moe.schemes import get_moe_scheme

    ckpt, _, results, _ = _fixture(name)
    tensors = stored_tensors(ckpt)
    lay = LAYOUTS["quark-fp8"]
    per_token = "ptpc" in name
    scheme = get_moe_scheme("w_fp8_a_fp8_per_token" if per_token else "w_fp8_a_fp8")
    for module in ("model.layers.0.self_attn.q_proj", "lm_head"):
        q = lay.quantize_linear(results[f"weight.{module}"], scheme)
        written = lay.linear_tensors(scheme, q, None if per_token else torch.tensor(1.0), module)
        for suffix in ("weight", "weight_scale"):
            got, want = written[f"{module}.{suffix}"], tensors[f"{module}.{suffix}"]
            assert got.dtype == want.dtype and got.shape == want.shape, (module, suffix, got.dtype, want.dtype)
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), (module, suffix)


# ----------------------------------------------------------------------------- an FP8 KV cache: refused

KV = "quark_mixed_w_mxfp4_a_mxfp4_fp8_attn_kv_fp8"


def test_fp8_kv_cache_is_refused():
    """``kv_cache_scheme="fp8"`` (the first fixture's recipe plus Quark's FP8 KV cache) stores the same tensors plus
    ``k_proj.output_scale`` / ``v_proj.output_scale`` (bf16 ``[]``) under ``kv_cache_quant_config``, and Quark's own
    forward quantizes those outputs (its logits move). mxlib does not emulate a quantized KV cache: it refuses the
    checkpoint, naming the field, rather than load it with the KV-cache quantization dropped."""
    ckpt, meta, results, cfg = _fixture(KV)
    qc = cfg["quantization_config"]
    assert meta["versions"]["amd-quark"] == "0.13" and list(qc["kv_cache_quant_config"]) == ["*k_proj", "*v_proj"]
    base_ckpt, _, base_results, _ = _fixture(NAMES[0])
    kv, base = stored_tensors(ckpt), stored_tensors(base_ckpt)
    extra = sorted(set(kv) - set(base))
    assert extra == [f"model.layers.{la}.self_attn.{p}.output_scale" for la in range(2) for p in ("k_proj", "v_proj")]
    assert all(kv[k].dtype == torch.bfloat16 and kv[k].shape == () for k in extra)
    for k in base:
        assert_bits_equal(kv[k], base[k], k)
    moved = (results["logits.tool"] - base_results["logits.tool"]).abs().max()
    assert float(moved) > 1e-2, "Quark's forward should quantize the k/v outputs"
    with pytest.raises(
        C.CheckpointError,
        match=r"kv_cache_quant_config: the checkpoint quantizes the KV cache \(the outputs of \['\*k_proj', "
        r"'\*v_proj'\]: \*k_proj dtype='fp8_e4m3' qscheme='per_tensor'",
    ):
        C.load_quantized_moe(ckpt, backend="torch")
    report = C.inspect_checkpoint(ckpt)
    assert not report.layout_ok and any("kv_cache_quant_config" in p for p in report.problems)


def test_output_and_softmax_quantization_are_refused(tmp_path):
    """``output_tensors`` in a layer config and ``softmax_quant_spec`` (Quark's ``attention_scheme="fp8"``) are refused
    naming the field, as the KV cache is."""
    fp8 = _fixture(NAMES[0])[3]["quantization_config"]["layer_quant_config"]["lm_head"]["input_tensors"]

    def outputs(qc):
        qc["layer_quant_config"]["*.self_attn.*"]["output_tensors"] = dict(fp8)

    with pytest.raises(
        C.CheckpointError,
        match=r"layer_quant_config\['\*.self_attn.\*'\].output_tensors: the checkpoint quantizes layer outputs "
        r"\(dtype='fp8_e4m3' qscheme='per_tensor' is_dynamic=False\)",
    ):
        C.load_quantized_moe(_edited(NAMES[0], tmp_path / "a", outputs), backend="torch")
    with pytest.raises(C.CheckpointError, match=r"softmax_quant_spec: the checkpoint quantizes the attention softmax"):
        C.load_quantized_moe(
            _edited(NAMES[0], tmp_path / "b", lambda qc: qc.update(softmax_quant_spec=dict(fp8))), backend="torch"
        )


# ----------------------------------------------------------------------------- PTPC FP8 attention

PTPC = "quark_mixed_w_mxfp4_a_mxfp4_ptpc_fp8_attn"


def test_ptpc_fp8_attention_reads_as_per_token_fp8():
    """``layer_config={"*self_attn*": "ptpc_fp8", "lm_head": "ptpc_fp8"}`` (the template's PTPC FP8, as Quark's MXFP4
    + FP8-attention model cards apply it): per-output-channel FP8 weights (``weight_scale`` bf16 ``[out]``, the codes
    again e4m3 of the bf16 quotient) and dynamic inputs ``per_channel`` with ``ch_axis: 1``, no ``input_scale``.
    mxlib reads the group as ``w_fp8_a_fp8_per_token`` and its weights bit-equal to Quark's importer; its per-token
    QDQ equals Quark's input quantizer on the rows as one sequence (a batch of one), where ``ch_axis`` 1 is the token
    axis. Quark's quantizer on a 2-D ``[rows, hidden]`` input takes a scale per hidden column instead (and on a
    ``[batch, seq, hidden]`` input one per position across the batch): per token only for a batch of one."""
    ckpt, meta, results, cfg = _fixture(PTPC)
    qc = cfg["quantization_config"]
    g = qc["layer_quant_config"]["*self_attn*"]
    assert (g["weight"]["qscheme"], g["weight"]["ch_axis"]) == ("per_channel", 0)
    assert (g["input_tensors"]["qscheme"], g["input_tensors"]["ch_axis"], g["input_tensors"]["is_dynamic"]) == (
        "per_channel",
        1,
        True,
    )
    pm = C.read_quant_config(ckpt).precision
    for module in ("model.layers.1.self_attn.o_proj", "lm_head"):
        assert pm.description(module, ("Linear", "Module")).scheme.name == "w_fp8_a_fp8_per_token", module
    modules = _modules(ckpt)
    for module in ("model.layers.0.self_attn.k_proj", "lm_head"):
        t = modules[module]
        assert set(t) == {"weight", "weight_scale"}, module
        assert (t["weight"]["dtype"], t["weight_scale"]["dtype"]) == ("F8_E4M3", "BF16")
        assert t["weight_scale"]["shape"] == [t["weight"]["shape"][0]], module
    tensors = stored_tensors(ckpt)
    model, _ = _loaded(PTPC, fp32=True)
    mods = dict(model.named_modules())
    x = results["qdq.x"].float()
    for module in ("model.layers.0.self_attn.q_proj", "lm_head"):
        tool = results[f"dequant_import.{module}"]
        assert_same_bits(_reference_dequant(tensors, module), tool, f"{module} (reference vs import)")
        assert_same_bits(mods[module].dequantized_weight(), tool, f"{module} (loaded vs import)")
        w, s = results[f"weight.{module}"], tensors[f"{module}.weight_scale"]
        export_rule = torch.clamp(w / s[:, None], -448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(tensors[f"{module}.weight"].view(torch.uint8), export_rule.view(torch.uint8)), module
        assert_same_bits(mods[module].quantize_input(x), results[f"qdq.{module}.y_tokens"], f"{module} per token")
        scale = x.abs().amax(dim=0, keepdim=True) / 448  # Quark's ch_axis 1 on [rows, hidden]: per column
        per_column = torch.clamp(x / scale, -448, 448).to(torch.float8_e4m3fn).float() * scale
        assert_same_bits(per_column, results[f"qdq.{module}.y"], f"{module} Quark's 2-D quantizer, per column")


def test_ptpc_fp8_fp32_forward_equals_quarks_per_sequence_forward(tmp_path):
    """mxlib's fp32 forward (per-token QDQ, as vLLM runs ``per_channel`` dynamic FP8 inputs) equals Quark's fp32 forward
    of the exported weights run one sequence at a time, up to the order of fp32 sums (bit-equal where the fixture
    was made); the checkpoint saves back byte for byte; what ran is W8A8 per token for each FP8 module."""
    ckpt, _, results, cfg = _fixture(PTPC)
    model, _ = _loaded(PTPC, fp32=True)
    with torch.no_grad():
        logits = model(input_ids=results["tokens.eval"]).logits.float()
    ref = results["logits.tool_export_codes_per_sequence"]
    rel = float((logits.double() - ref.double()).norm() / ref.double().norm())
    assert rel < 1e-5, f"relative error {rel:.3g} against Quark's per-sequence forward of its export"
    model, info = C.load_quantized_moe(ckpt, backend="torch")
    report = assert_runs_as(model, info, results["tokens.eval"])
    assert report["lm_head"].scheme == "w_fp8_a_fp8_per_token" and report["lm_head"].precision == "W8A8"
    assert report["model.layers.1.self_attn.v_proj"].scale_strategy == "dynamic per token"
    model.save_pretrained(tmp_path / "saved")
    src, saved = stored_tensors(ckpt), stored_tensors(tmp_path / "saved")
    assert sorted(src) == sorted(saved)
    for k in src:
        assert_bits_equal(saved[k], src[k], k)
    saved_qc = json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]
    assert saved_qc == cfg["quantization_config"]
