"""What ran: the executed semantics of loaded models, counted in one forward, and the check that refuses a mismatch.

Every checkpoint layout mxlib reads is written by mxlib's writer from a tiny Qwen3-MoE (gpt-oss's native MXFP4
from the tiny gpt-oss), loaded, and checked against its own config; then mismatches are planted in one experts
instance (a1 or a2 QDQ skipped, a1 QDQ'd twice, vLLM's W8A16 emulation of a W8A8 checkpoint, a linear input left
unquantized) and the check must name them.
"""

import dataclasses
import json

import pytest
import torch

from mxlib import checkpoints as C
from mxlib.models.what_ran import RanMismatch, RanRow, WhatRan, assert_runs_as, what_ran
from mxlib.moe import factory as F
from mxlib.moe.base import QuantizedA1, TransformersExperts
from mxlib.moe.linear import EmulatedLinear, linear_input_amax
from mxlib.moe.schemes import get_moe_scheme, vllm_emulated_scheme

from _util import needs_interpreter, tiny_calibrated

ATTN = [f"model.layers.{layer}.self_attn.{p}" for layer in range(2) for p in C.ATTENTION_PROJS]

# (layout, scheme, quantize attention): every layout the Qwen3 family writes, each with a scheme it stores
LAYOUT_CASES = [
    ("modelopt", "nvfp4", True),
    ("modelopt", "w4a16_nvfp4", False),
    ("quark", "w_mxfp4_a_fp8", True),
    ("quark", "w_mxfp6_e2m3", False),
    ("quark", "w_mxfp4_a_mxfp6_e3m2", False),
    ("compressed-tensors", "nvfp4", True),
    ("compressed-tensors-mxfp4", "w_mxfp4_a_mxfp4", False),
    ("modelopt-mxfp8", "w_mxfp8_a_mxfp8", False),
    ("compressed-tensors-mxfp8", "w_mxfp8", False),
]


@pytest.fixture(scope="module")
def tiny():
    model, cal, ids = tiny_calibrated(3)
    return model, cal, linear_input_amax(model, ids, ATTN)


@pytest.fixture(scope="module")
def written(tiny, tmp_path_factory):
    """``(layout, scheme, attention) -> checkpoint folder``, written once per case."""
    model, cal, amax = tiny
    root, made = tmp_path_factory.mktemp("what_ran"), {}

    def get(layout, scheme, attention):
        key = (layout, scheme, attention)
        if key not in made:
            made[key] = C.write_quantized_checkpoint(
                model,
                scheme,
                root / f"{layout}-{scheme}-{attention}",
                cal,
                layout=layout,
                quantize_attention=attention,
                linear_input_amax=amax,
            )
        return made[key]

    return get


def _experts(model, layer):
    return model.model.layers[layer].mlp.experts.experts


@pytest.mark.parametrize("layout,scheme,attention", LAYOUT_CASES)
def test_every_layout_runs_as_its_checkpoint_asks(written, layout, scheme, attention):
    model, info = C.load_quantized_moe(written(layout, scheme, attention))
    report = assert_runs_as(model, info)
    s = get_moe_scheme(scheme)
    experts = [r for r in report if r.kind == "experts"]
    linears = [r for r in report if r.kind == "linear"]
    assert [r.module for r in experts] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert [r.layer for r in experts] == [0, 1]
    assert len(linears) == (len(ATTN) if attention else 0)
    want = 0 if s.activation is None else 1
    for r in report:
        assert (r.scheme, r.precision, r.weight_format) == (s.name, s.precision, s.weight.name)
        assert r.activation_format == ("none" if s.activation is None else s.activation.name)
        assert r.a1_passes == want and r.forwards == 1
        assert r.backend == "torch"
    for r in experts:
        assert r.a2_passes == want and r.kernel == "torch_moe"
    for r in linears:
        assert r.a2_passes is None and r.kernel == "linear"
    text = report.table()
    assert text.splitlines()[0].split()[:3] == ["module", "scheme", "precision"]
    assert all(r.module in text for r in report) and json.dumps(report.to_dicts())


def test_gpt_oss_layout_runs_as_its_checkpoint_asks(tmp_path):
    from mxlib.models.calibration import calibrate as cal_
    from mxlib.models.gpt_oss import dummy_gpt_oss, gpt_oss_20b_config
    from mxlib.models.presets import GPT_OSS_PRESETS

    cfg = gpt_oss_20b_config(2, **GPT_OSS_PRESETS["gpt-oss-tiny"])
    model = dummy_gpt_oss(cfg, seed=0)
    ids = torch.randint(0, cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    path = C.write_quantized_checkpoint(model, "w_mxfp4", tmp_path / "gptoss", cal_(model, ids))
    loaded, info = C.load_quantized_moe(path)
    assert info.format == "gpt-oss-mxfp4"
    report = assert_runs_as(loaded, info, input_ids=ids)
    assert [(r.scheme, r.precision, r.a1_passes, r.a2_passes) for r in report] == [("w_mxfp4", "W4A16", 0, 0)] * 2


# ----------------------------------------------------------------------------- planted mismatches


@pytest.fixture
def nvfp4_model(written):
    return C.load_quantized_moe(written("modelopt", "nvfp4", True))


def test_a_skipped_a1_qdq_is_a_weight_only_fallback(nvfp4_model, monkeypatch):
    model, info = nvfp4_model
    ex = _experts(model, 1)
    monkeypatch.setattr(ex, "quantize_input", lambda a1, topk_ids, backend: QuantizedA1(a1))
    with pytest.raises(RanMismatch, match=r"layers\.1\.mlp\.experts: a1 .* weight-only fallback") as err:
        assert_runs_as(model, info)
    assert len(err.value.problems) == 1  # layer 0 and the linear layers still run as asked
    report = what_ran(model)
    assert report["model.layers.1.mlp.experts"].a1_passes == 0 and report["model.layers.0.mlp.experts"].a1_passes == 1
    assert report["model.layers.1.self_attn.q_proj"].scale_strategy == "static"


def test_a_double_a1_qdq_is_caught(nvfp4_model, monkeypatch):
    model, info = nvfp4_model
    ex = _experts(model, 0)
    once = ex.quantize_input

    def twice(a1, topk_ids, backend):
        return once(once(a1, topk_ids, backend).a1, topk_ids, backend)  # vLLM's slip: the input quantized again

    monkeypatch.setattr(ex, "quantize_input", twice)
    with pytest.raises(RanMismatch, match=r"layers\.0\.mlp\.experts: a1 .* quantized 2 times \(a double QDQ\)"):
        assert_runs_as(model, info)
    assert "quantize_input" in ex.__dict__  # the planted method is left as it was found
    assert ex.__dict__["quantize_input"] is twice


def test_a_skipped_a2_qdq_and_a_skipped_linear_qdq_are_caught(nvfp4_model, monkeypatch):
    model, info = nvfp4_model
    monkeypatch.setattr(_experts(model, 0), "quantize_intermediate", lambda a2, row_experts, backend: a2)
    q_proj = model.model.layers[1].self_attn.q_proj
    assert isinstance(q_proj, EmulatedLinear)
    monkeypatch.setattr(q_proj, "quantize_input", lambda x2, ops=None: x2)
    with pytest.raises(RanMismatch) as err:
        assert_runs_as(model, info)
    problems = "\n".join(err.value.problems)
    assert "layers.0.mlp.experts: a2 (gated activation output" in problems and "weight-only fallback" in problems
    assert "layers.1.self_attn.q_proj: a1 (linear input" in problems and len(err.value.problems) == 2


def test_vllms_w8a16_emulation_of_a_w8a8_checkpoint_is_refused(written):
    model, info = C.load_quantized_moe(written("modelopt-mxfp8", "w_mxfp8_a_mxfp8", False))
    asked = info.scheme
    ran = vllm_emulated_scheme(asked)  # W8A16: what vLLM's Mxfp8EmulationTritonExperts computes
    assert ran.name == "w_mxfp8"
    for layer in range(2):
        old = _experts(model, layer)
        weights = F.quantize_expert_weights(*(w.float() for w in old.dequantized_weights()), ran)
        model.model.layers[layer].mlp.experts = TransformersExperts(F.make_emulation_experts(ran, weights))
    with pytest.raises(RanMismatch, match=r"ran w_mxfp8 \(W8A16\), the checkpoint asks w_mxfp8_a_mxfp8 \(W8A8\)"):
        assert_runs_as(model, info)
    assert_runs_as(model, ran)  # and it is exactly what it says it is


def test_bf16_experts_pass_only_where_the_checkpoint_excludes_them(written, tiny):
    from mxlib.models.qwen3 import expert_weights
    from mxlib.moe.base import TritonExperts

    model, info = C.load_quantized_moe(written("compressed-tensors-mxfp4", "w_mxfp4_a_mxfp4", False))
    w13, w2 = expert_weights(tiny[0], 0)
    model.model.layers[0].mlp.experts = TransformersExperts(TritonExperts(w13, w2, backend="torch"))
    report = what_ran(model)
    assert [(r.scheme, r.precision, r.a1_passes) for r in report] == [
        ("bf16", "W16A16", 0),
        ("w_mxfp4_a_mxfp4", "W4A4", 1),
    ]
    with pytest.raises(
        RanMismatch, match=r"layers\.0\.mlp\.experts: ran bf16 experts, the checkpoint asks w_mxfp4_a_mxfp4"
    ):
        assert_runs_as(model, info, report=report)
    # a checkpoint whose exclude list names layer 0's experts (as the loader reads it) asks for exactly this
    excluded = dataclasses.replace(info, exclude=[*info.exclude, "model.layers.0.mlp.experts.*"])
    assert_runs_as(model, excluded, report=report)


# ----------------------------------------------------------------------------- an experts module alone


def _alone(scheme, backend="torch", **kw):
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(4, 64, 64, generator=g) * 0.05, torch.randn(4, 64, 32, generator=g) * 0.05
    s = get_moe_scheme(scheme)
    weights = F.quantize_expert_weights(w13, w2, s)
    a1, a2 = F.input_scales_from_amax(s, torch.tensor([4.0, 1.0, 2.0, 3.0]), torch.tensor([1.0, 0.5, 0.25, 1.0]))
    return F.make_emulation_experts(s, weights, a1, a2, backend=backend, **kw)


def test_an_experts_module_alone_and_a1_per_pair():
    report = assert_runs_as(_alone("nvfp4"), "nvfp4")
    (row,) = report.rows
    assert (row.module, row.layer, row.a1_passes, row.a2_passes) == ("experts", None, 1, 1)
    assert "per token" in row.a1_where
    # per-expert activation scales: a1 is QDQ'd once per (token, expert) pair, still one pass
    per_pair = assert_runs_as(_alone("nvfp4", scale_strategy="per_expert"), "nvfp4").rows[0]
    assert per_pair.a1_passes == 1 and "pair" in per_pair.a1_where and per_pair.scale_strategy == "per_expert"
    variant = assert_runs_as(_alone("nvfp4_ue5m3"), "nvfp4_ue5m3").rows[0]
    assert (variant.weight_format, variant.a1_passes, variant.a2_passes, variant.scale_strategy) == (
        "nvfp4_ue5m3",
        1,
        1,
        "none",
    )
    with pytest.raises(RanMismatch, match="ran nvfp4 \\(W4A4\\), the checkpoint asks w4a16_nvfp4 \\(W4A16\\)"):
        assert_runs_as(_alone("nvfp4"), "w4a16_nvfp4")
    with pytest.raises(ValueError, match="holds no mxlib experts"):
        what_ran(torch.nn.Linear(2, 2))


@needs_interpreter
@pytest.mark.parametrize("backend,kernel", [("triton", "fused_moe_kernel"), ("fused", "fused_dequant_moe")])
@pytest.mark.parametrize("scheme", ["nvfp4", "w_mxfp4_a_mxfp4"])
def test_triton_backends_report_their_kernel_and_count_in_kernel_qdq(backend, kernel, scheme):
    row = assert_runs_as(_alone(scheme, backend=backend), scheme).rows[0]
    assert (row.backend, row.a1_passes, row.a2_passes) == (backend, 1, 1)
    assert row.kernel == kernel


def test_report_rows_are_dataclasses_and_render():
    report = what_ran(_alone("w_mxfp4_a_fp8"))
    assert isinstance(report, WhatRan) and isinstance(report.rows[0], RanRow) and len(report) == 1
    assert report.rows[0].scale_strategy == "static max" and report.rows[0].precision == "W4A8"
    assert "w_mxfp4_a_fp8" in str(report) and "a1 / a2: QDQ passes" in report.table()


@needs_interpreter
def test_fp4_kernel_counts_its_fused_a1_and_a2():
    g = torch.Generator().manual_seed(1)
    w13, w2 = torch.randn(2, 256, 128, generator=g) * 0.05, torch.randn(2, 128, 128, generator=g) * 0.05
    s = get_moe_scheme("nvfp4")
    a1, a2 = F.input_scales_from_amax(s, torch.tensor([4.0, 1.0]), torch.tensor([1.0, 0.5]))
    ex = F.make_emulation_experts(s, F.quantize_expert_weights(w13, w2, s), a1, a2, backend="fused")
    x = torch.randn(2, 128, generator=g).bfloat16()
    row = assert_runs_as(ex, s, x, torch.full((2, 1), 1.0), torch.tensor([[0], [1]], dtype=torch.int32)).rows[0]
    assert (row.kernel, row.a1_passes, row.a2_passes) == ("fused_fp4_moe", 1, 1)


def test_cli_inspect_ran(written, tmp_path, capsys):
    from mxlib import cli

    path = written("modelopt", "nvfp4", True)
    assert cli.main(["inspect", "--ran", str(path), "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "what ran" in out and "model.layers.1.mlp.experts" in out and "runs as the checkpoint asks" in out
    ran = json.loads((tmp_path / "r.json").read_text())["ran"]
    assert ran["ok"] and ran["problems"] == [] and len(ran["rows"]) == 2 + len(ATTN)
    assert {(r["a1_passes"], r["precision"]) for r in ran["rows"]} == {(1, "W4A4")}
